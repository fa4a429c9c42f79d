"""Run outputs: ``config.json``, ``metrics.jsonl``, ``summary.json``, ``curves.png`` and one console line
per round.

:class:`RecordingStrategy` wraps any Flower strategy and watches what crosses the wire (bytes each way,
per-client metrics, failures, dropped replies) without the method strategies knowing about files.
:class:`PollenServer` closes each round after its evaluation and writes the summary at the end.
The files are the interface for benchmarks and tests: they read these, never console output.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from flwr.common import Parameters
from flwr.server import Server
from flwr.server.strategy import Strategy

from pollen.strategies.validation import client_label


def parameters_nbytes(parameters: Parameters | None) -> int:
    """Serialised payload size: what actually travels for these arrays."""
    return 0 if parameters is None else sum(len(t) for t in parameters.tensors)


def _clean(metrics: dict | None) -> dict[str, Any]:
    """Metrics as JSON-safe plain values (NaN/inf become None)."""
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, bytes):
            v = v.hex()
        out[str(k)] = v
    return out


class RunRecorder:
    """Collects one record per round and writes the run's files under ``run_dir``."""

    def __init__(self, run_dir: Path, config: dict[str, Any], num_rounds: int, echo: bool = True):
        self.run_dir = Path(run_dir)
        self.config = config
        self.num_rounds = num_rounds
        self.echo = echo
        self.rounds: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.started = time.perf_counter()
        self.initial: dict[str, Any] | None = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (self.run_dir / "metrics.jsonl").write_text("")
        self._print(f"[pollen] method={config.get('method')} task={config.get('task')} "
                    f"rounds={num_rounds} -> {self.run_dir}")

    def _print(self, line: str) -> None:
        if self.echo:
            print(line, flush=True)

    # round lifecycle -----------------------------------------------------------------------
    def round(self, server_round: int) -> dict[str, Any]:
        if self.current is None or self.current["round"] != server_round:
            self.current = {"round": server_round, "_t0": time.perf_counter(), "bytes-down": 0,
                            "bytes-up": 0, "fit-clients": {}, "evaluate-clients": {},
                            "fit": {}, "evaluate": {}, "server-evaluate": {}, "rejected": [],
                            "failures": 0}
        return self.current

    def record_initial(self, metrics: dict[str, Any]) -> None:
        self.initial = _clean(metrics)

    def end_round(self, server_round: int) -> None:
        rec = self.round(server_round)
        rec["wall-time-s"] = round(time.perf_counter() - rec.pop("_t0"), 4)
        rec["elapsed-s"] = round(time.perf_counter() - self.started, 4)
        self.rounds.append(rec)
        self.current = None
        with (self.run_dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
        self._print(self.round_line(rec))

    def round_line(self, rec: dict[str, Any]) -> str:
        parts = [f"[pollen] round {rec['round']}/{self.num_rounds}"]
        acc = _headline_accuracy(rec)
        if acc is not None:
            name, mean, std = acc
            parts.append(f"{name} {mean:.4f}" + (f" ± {std:.4f}" if std is not None else ""))
        loss = rec["fit"].get("train-loss")
        if loss is not None:
            parts.append(f"train-loss {loss:.4f}")
        parts.append(f"down {_fmt_bytes(rec['bytes-down'])} up {_fmt_bytes(rec['bytes-up'])}")
        if rec["rejected"] or rec["failures"]:
            parts.append(f"rejected {len(rec['rejected'])} failed {rec['failures']}")
        parts.append(f"{rec['wall-time-s']:.1f}s")
        return " | ".join(parts)

    # end of run ----------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        final = self.rounds[-1] if self.rounds else {}
        summary = {
            "method": self.config.get("method"),
            "task": self.config.get("task"),
            "rounds": len(self.rounds),
            "wall-time-s": round(time.perf_counter() - self.started, 3),
            "bytes-down-total": sum(r["bytes-down"] for r in self.rounds),
            "bytes-up-total": sum(r["bytes-up"] for r in self.rounds),
            "rejected-total": sum(len(r["rejected"]) for r in self.rounds),
            "failures-total": sum(r["failures"] for r in self.rounds),
            "initial": self.initial,
            "final": {"evaluate": final.get("evaluate", {}), "server-evaluate": final.get("server-evaluate", {}),
                      "fit": final.get("fit", {}), "evaluate-clients": final.get("evaluate-clients", {})},
        }
        acc = _headline_accuracy(final) if final else None
        if acc is not None:
            summary["final-accuracy"] = {"metric": acc[0], "mean": acc[1], "std": acc[2]}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        plot_curves(self.rounds, self.run_dir / "curves.png", title=f"{summary['method']} on {summary['task']}")
        self._print(f"[pollen] done in {summary['wall-time-s']:.1f}s; summary: {self.run_dir / 'summary.json'}")
        return summary


def _headline_accuracy(rec: dict[str, Any]) -> tuple[str, float, float | None] | None:
    """The accuracy a person wants on the console: server-side if any, else client mean ± std."""
    for source in ("server-evaluate", "evaluate"):
        metrics = rec.get(source) or {}
        for key in sorted(metrics):
            if key.endswith("accuracy") and metrics[key] is not None:
                std = metrics.get(f"{key}-client-std")
                mean = metrics.get(f"{key}-client-mean", metrics[key])
                return key, float(mean), (float(std) if std is not None else None)
    return None


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


def plot_curves(rounds: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Accuracy metrics (left) and train loss (right) against the round number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["round"] for r in rounds]
    keys = sorted({(src, k) for r in rounds for src in ("evaluate", "server-evaluate")
                   for k in (r.get(src) or {}) if k.endswith("accuracy")})
    for src, key in keys:
        ys = [(r.get(src) or {}).get(f"{key}-client-mean", (r.get(src) or {}).get(key)) for r in rounds]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax_acc.plot(*zip(*pts), marker="o", ms=3, label=key if src == "evaluate" else f"{key} (server)")
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("accuracy")
    if keys:
        ax_acc.legend(fontsize=8)
    losses = [(x, r["fit"].get("train-loss")) for x, r in zip(xs, rounds)]
    losses = [(x, y) for x, y in losses if y is not None]
    if losses:
        ax_loss.plot(*zip(*losses), marker="o", ms=3, color="tab:red")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("train loss (client mean)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _record_failures(rec: dict[str, Any], stage: str, failures) -> None:
    """Count failed client calls and keep why (a ClientApp exception arrives as its message)."""
    rec["failures"] += len(failures)
    for failure in failures:
        if isinstance(failure, BaseException):
            reason = f"{type(failure).__name__}: {failure}"
        else:  # (proxy, result) with a non-OK status
            proxy, res = failure
            reason = f"node {proxy.cid}: {getattr(res.status, 'message', res.status)}"
        rec.setdefault("failure-reasons", []).append({"stage": stage, "reason": reason[-2000:]})


class RecordingStrategy(Strategy):
    """Delegates everything to ``inner`` and records payload sizes, client metrics and rejections."""

    def __init__(self, inner: Strategy, recorder: RunRecorder):
        self.inner = inner
        self.recorder = recorder

    def __repr__(self) -> str:
        return f"Recording({self.inner!r})"

    def __getattr__(self, name: str):  # expose the wrapped strategy's own attributes
        return getattr(self.inner, name)

    def initialize_parameters(self, client_manager):
        return self.inner.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):
        instructions = self.inner.configure_fit(server_round, parameters, client_manager)
        rec = self.recorder.round(server_round)
        rec["bytes-down"] += sum(parameters_nbytes(ins.parameters) for _, ins in instructions)
        rec["sampled"] = len(instructions)
        return instructions

    def aggregate_fit(self, server_round, results, failures):
        rec = self.recorder.round(server_round)
        rec["bytes-up"] += sum(parameters_nbytes(res.parameters) for _, res in results)
        _record_failures(rec, "fit", failures)
        for proxy, res in results:
            rec["fit-clients"][client_label(res.metrics, proxy.cid)] = {
                **_clean(res.metrics), "num-examples": res.num_examples,
                "bytes-up": parameters_nbytes(res.parameters)}
        params, metrics = self.inner.aggregate_fit(server_round, results, failures)
        rec["fit"] = _clean(metrics)
        take = getattr(self.inner, "take_rejections", None)
        if take is not None:
            rec["rejected"].extend(r.as_dict() for r in take())
        return params, metrics

    def configure_evaluate(self, server_round, parameters, client_manager):
        instructions = self.inner.configure_evaluate(server_round, parameters, client_manager)
        rec = self.recorder.round(server_round)
        rec["bytes-down"] += sum(parameters_nbytes(ins.parameters) for _, ins in instructions)
        return instructions

    def aggregate_evaluate(self, server_round, results, failures):
        rec = self.recorder.round(server_round)
        _record_failures(rec, "evaluate", failures)
        for proxy, res in results:
            rec["evaluate-clients"][client_label(res.metrics, proxy.cid)] = {
                **_clean(res.metrics), "loss": res.loss, "num-examples": res.num_examples}
        loss, metrics = self.inner.aggregate_evaluate(server_round, results, failures)
        rec["evaluate"] = {**_clean(metrics), **({"loss": loss} if loss is not None else {})}
        return loss, metrics

    def evaluate(self, server_round, parameters):
        res = self.inner.evaluate(server_round, parameters)
        if res is not None:
            loss, metrics = res
            merged = {**_clean(metrics), "loss": loss}
            if server_round == 0:
                self.recorder.record_initial(merged)
            else:
                self.recorder.round(server_round)["server-evaluate"] = merged
        return res


class PollenServer(Server):
    """Flower's server loop, closing each round's record after evaluation and summarising at the end."""

    def __init__(self, *, client_manager, strategy: RecordingStrategy):
        super().__init__(client_manager=client_manager, strategy=strategy)
        self.recorder = strategy.recorder

    def evaluate_round(self, server_round, timeout):
        res = super().evaluate_round(server_round, timeout)
        self.recorder.end_round(server_round)
        return res

    def fit(self, num_rounds, timeout):
        history, elapsed = super().fit(num_rounds, timeout)
        self.recorder.finish()
        return history, elapsed
