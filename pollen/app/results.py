"""Run outputs: ``config.json``, ``metrics.jsonl``, ``summary.json``, ``curves.png`` and one console line
per round.

The strategies keep a :class:`~pollen.strategies.base.RoundReport` of what crossed the wire (bytes
each way, per-client metrics, failures, rejected replies); the ServerApp hands it to
:meth:`RunRecorder.record_report` when the round ends. The files are the interface for benchmarks and
tests: they read these, never console output. ``summary.json`` says whether the run ``completed``,
``failed`` or was ``interrupted``, why (``failure-reason``) and its ``last-round``; the ServerApp writes
it when the run ends, and the launcher (or its watchdog) writes it with :func:`write_stopped_summary`
on every path where the ServerApp could not: Ctrl-C, SIGTERM, a timeout, a dead SuperLink, a killed
launcher.

The order at the end of a run is the seam for everything optional: :meth:`RunRecorder.finish` writes
``summary.json`` first, then runs each step of ``RunRecorder.after_summary`` (the plot, then whatever is
added there, e.g. a tracker's upload) — a step that fails is a WARNING and never changes the run's status
— and prints the closing line (``...; summary: <path>``) last, which tells the launcher that nothing more
will be written. A full disk must not cost the summary either: every run folder keeps a small reserve file
(:func:`reserve_summary_space`) that :func:`write_summary` gives back when a write fails for lack of space,
and if even that is not enough it writes the summary's essentials alone (status, reason, last round).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pollen import RUNS_DIR
from pollen.app.checkpoints import CheckpointError, atomic_write, write_json
from pollen.app.tracking import Tracker, round_scalars
from pollen.log import LOGGER
from pollen.strategies.base import RoundReport

STATUSES = ("completed", "failed", "interrupted")
RESERVE = ".summary-reserve"  # <run>/.summary-reserve: room kept for summary.json on a disk that fills up
RESERVE_BYTES = 1 << 20  # a summary of 1,000 clients' final metrics is ~0.2 MB
ESSENTIALS = ("status", "failure-reason", "last-round", "flower-run-id", "method", "task", "num-server-rounds",
              "run-dir")


def run_directory(cfg, run_id: int | str) -> Path:
    """``resume-from`` when continuing a run, else ``out-dir/<run-name>`` (the launcher names runs
    ``YYYYMMDD-HHMMSS-<method>-<task>``), else ``out-dir/<run-id>`` (``flwr run`` without the launcher).
    ``out-dir`` empty: ``$POLLEN_OUT_DIR`` or ``./runs``. Pass absolute paths: relative ones
    resolve against the working directory of the SuperLink (server) or SuperNode (clients)."""
    if cfg.resume_from:
        return Path(cfg.resume_from).expanduser().resolve()
    base = cfg.out_dir or os.environ.get("POLLEN_OUT_DIR") or RUNS_DIR
    return Path(base).expanduser().resolve() / (cfg.run_name or str(run_id))


def last_round(run_dir: Path) -> int:
    """The last round ``metrics.jsonl`` closed (0: none)."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    rounds = []
    for line in lines:
        try:
            rounds.append(int(json.loads(line)["round"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(rounds, default=0)


def reserve_summary_space(run_dir: Path) -> None:
    """Keep :data:`RESERVE_BYTES` of the run folder's file system for ``summary.json``: a file of that size,
    allocated now, that :func:`write_summary` deletes when the disk is full. A disk already too full to hold
    it is a WARNING; the run goes on (and fails at its first write, with a reason)."""
    path = Path(run_dir) / RESERVE
    try:
        with open(path, "wb") as fh:
            try:
                os.posix_fallocate(fh.fileno(), 0, RESERVE_BYTES)
            except (AttributeError, OSError):  # no fallocate here: real bytes take the room as well
                fh.write(bytes(RESERVE_BYTES))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        path.unlink(missing_ok=True)
        LOGGER.warning("cannot keep %d bytes for summary.json in %s: %s", RESERVE_BYTES, run_dir, err.strerror or err)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, whole or not at all: the launcher ends its wait on it (``AppEnd``). On a full disk
    the folder's reserve is given back and the write tried again, then once more with only the
    :data:`ESSENTIALS` (so a status and its reason survive a disk with no room for final metrics); the
    reserve goes once a summary is written. ``CheckpointError`` when not even that fits."""
    path = Path(path)
    attempts = [summary, summary, {k: summary.get(k) for k in ESSENTIALS}]
    for attempt, content in enumerate(attempts):
        try:
            atomic_write(path, (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
            break
        except CheckpointError:
            if attempt == len(attempts) - 1:
                raise
            if attempt == 0:
                (path.parent / RESERVE).unlink(missing_ok=True)
    (path.parent / RESERVE).unlink(missing_ok=True)


def write_stopped_summary(run_dir: Path, status: str, reason: str, flower_run_id: int | None = None,
                          since: float | None = None) -> dict[str, Any] | None:
    """``summary.json`` of a run that ended where its ServerApp could not write one (interrupted, killed,
    a dead SuperLink). One the ServerApp wrote after ``since`` (epoch seconds) is kept when it says
    ``completed`` or the same status: it knows more (a ServerApp stopped mid-run may call itself
    ``failed``; the launcher knows it was interrupted). Returns what was written (``None``: nothing; a
    summary that cannot be written at all is a WARNING here: its callers are on their way out already)."""
    if status not in STATUSES:
        raise ValueError(f"summary status {status!r}: expected one of {STATUSES}")
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if since is not None and path.stat().st_mtime >= since:
            if json.loads(path.read_text()).get("status") in ("completed", status):
                return None
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((run_dir / "config.json").read_text())
    summary = {"status": status, "failure-reason": reason, "last-round": last_round(run_dir),
               "flower-run-id": flower_run_id, "method": config.get("method"), "task": config.get("task"),
               "num-server-rounds": config.get("num-server-rounds"), "run-dir": str(run_dir)}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_summary(path, summary)
    except (OSError, CheckpointError) as err:
        LOGGER.warning("summary.json of %s not written (%s): %s", run_dir, status, err)
        return None
    return summary



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
    """Collects one record per round and writes the run's files under ``run_dir``.

    ``after_summary`` holds the optional steps of the run's end, each a ``(name, step(summary))`` run after
    ``summary.json`` is written (the plot first); append to it to feed something else (a tracker) from the
    finished summary. A step that raises is logged as a WARNING naming it; the summary stands.
    """

    def __init__(self, run_dir: Path, config: dict[str, Any], num_rounds: int, echo: bool = True,
                 resume_after: int = 0, flower_run_id: int | None = None, tracker: Tracker | None = None,
                 dp_terms: dict[str, str] | None = None):
        self.run_dir = Path(run_dir)
        self.tracker = tracker if tracker is not None else Tracker()  # fed after the files (pollen.app.tracking)
        # under DP: what the ε of every round protects (dp-unit, dp-neighbour), on each round and the summary
        self.dp_terms = dict(dp_terms or {})
        # the optional end of the run, after summary.json: the plot, then the tracker (which uploads it)
        self.after_summary: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
            ("curves.png", self._plot), ("the tracker", lambda summary: self.tracker.finish(summary, self.run_dir))]
        self.flower_run_id = flower_run_id
        self.first_round = resume_after + 1
        self.config = config
        self.num_rounds = num_rounds
        self.echo = echo
        self.rounds: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.started = time.perf_counter()
        self.initial: dict[str, Any] | None = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        reserve_summary_space(self.run_dir)
        metrics = self.run_dir / "metrics.jsonl"
        if resume_after > 0 and metrics.exists():  # keep the rounds the checkpoint covers, drop the rest
            kept = [line for line in metrics.read_text().splitlines()
                    if line.strip() and json.loads(line)["round"] <= resume_after]
            self.rounds = [json.loads(line) for line in kept]
            metrics.write_text("".join(line + "\n" for line in kept))
        else:
            write_json(self.run_dir / "config.json", config)  # with its sidecar: predict and --resume verify it
            metrics.write_text("")
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
                            "failures": 0, **self.dp_terms}
        return self.current

    def record_initial(self, metrics: dict[str, Any]) -> None:
        self.initial = _clean(metrics)

    def record_report(self, report: RoundReport, server_evaluate: dict[str, Any] | None = None) -> None:
        """Close round ``report.round`` from the strategy's report (and server-side metrics)."""
        rec = self.round(report.round)
        rec["_t0"] = min(rec["_t0"], report.started)
        rec["bytes-down"] += report.bytes_down
        rec["bytes-up"] += report.bytes_up
        rec["sampled"] = report.sampled
        rec["accepted"] = report.accepted
        rec["fit-clients"].update({k: _clean(v) for k, v in report.fit_clients.items()})
        rec["evaluate-clients"].update({k: _clean(v) for k, v in report.evaluate_clients.items()})
        rec["fit"] = _clean(report.fit)
        rec["evaluate"] = _clean(report.evaluate)
        rec["rejected"].extend(report.rejected)
        if report.spread:  # how the accepted train replies spread around the round's median (pollen.strategies.spread)
            rec["spread"] = report.spread
        if report.dropped_metrics:  # a bad reported metric left out while its reply counted (absent when none)
            rec.setdefault("dropped-metrics", []).extend(
                {**d, "value": None if d["value"] is None else repr(d["value"])} for d in report.dropped_metrics)
        rec["failures"] += len(report.failures)
        if report.network:  # the simulated network's round: its clock, who was missing and why
            rec["network"] = report.network
        if report.secure:  # a secure round's stages: bytes each way, who dropped out at which stage
            rec["secure-aggregation"] = report.secure
        if report.failures:
            rec.setdefault("failure-reasons", []).extend(
                {"stage": f["stage"], "client": f["client"], "code": f["code"], "reason": f["reason"]}
                for f in report.failures)
        if server_evaluate:
            rec["server-evaluate"] = _clean(server_evaluate)
        self.end_round(report.round)

    def end_round(self, server_round: int) -> None:
        rec = self.round(server_round)
        rec["wall-time-s"] = round(time.perf_counter() - rec.pop("_t0"), 4)
        rec["elapsed-s"] = round(time.perf_counter() - self.started, 4)
        self.current = None
        with (self.run_dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
        self.rounds.append(rec)  # a round is closed once it is on disk (the summary's last-round)
        self._print(self.round_line(rec))
        self.tracker.log_round(server_round, round_scalars(rec))

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
        missing = (rec.get("network") or {}).get("missing") or []
        if missing:
            parts.append(f"missing {len(missing)} (" + ", ".join(
                f"{sum(m['why'] == why for m in missing)} {why}" for why in ("dropped", "late", "unused")
                if any(m["why"] == why for m in missing)) + ")")
        if rec.get("dropped-metrics"):
            parts.append(f"dropped metrics {len(rec['dropped-metrics'])}")
        parts.append(f"{rec['wall-time-s']:.1f}s")
        parts.append(self.progress(rec["round"]))
        return " | ".join(parts)

    def progress(self, server_round: int) -> str:
        """``elapsed 12s, ETA 40s``: the mean of this process's rounds so far, times the rounds left."""
        elapsed = time.perf_counter() - self.started
        done = server_round - self.first_round + 1
        left = self.num_rounds - server_round
        eta = f", ETA {_fmt_seconds(elapsed / done * left)}" if done > 0 and left > 0 else ""
        return f"elapsed {_fmt_seconds(elapsed)}{eta}"

    # end of run ----------------------------------------------------------------------------
    def finish(self, status: str = "completed", reason: str | None = None,
               files: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` (with ``status`` and, for a failed run, ``failure-reason``), then run the
        optional ``after_summary`` steps (the plot, ...), then print the closing line."""
        final = self.rounds[-1] if self.rounds else {}
        summary = {
            "status": status,
            "failure-reason": reason,
            "last-round": self.rounds[-1]["round"] if self.rounds else 0,
            "flower-run-id": self.flower_run_id,
            "run-dir": str(self.run_dir),
            "files": files or {},
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
        spent = privacy_spent(self.rounds, **self.dp_terms)
        if spent:
            summary["privacy"] = spent
        write_summary(self.run_dir / "summary.json", summary)  # first: whatever fails after, the status stands
        for name, step in self.after_summary:
            try:
                step(summary)
            except Exception as err:  # noqa: BLE001 - optional: a WARNING, never the run's status
                LOGGER.warning("%s: not written (%s: %s); summary.json is, with status %s", name,
                               type(err).__name__, err, status)
        # The closing line, last: a launcher that reads it knows the ServerApp has nothing left to write.
        if status == "completed":
            self._print(f"[pollen] done in {summary['wall-time-s']:.1f}s; summary: {self.run_dir / 'summary.json'}")
        else:
            self._print(f"[pollen] run {status}: {reason}; summary: {self.run_dir / 'summary.json'}")
        return summary


    def _plot(self, summary: dict[str, Any]) -> None:
        plot_curves(self.rounds, self.run_dir / "curves.png", title=f"{summary['method']} on {summary['task']}")


def privacy_spent(rounds: list[dict[str, Any]], **dp_terms: str) -> dict[str, Any]:
    """Each client's largest reported ε (a client's ledger only grows, and counts every release it ever
    made, resumes included) and the largest of them: a privacy report quotes the worst client, not the
    mean. A client that stopped releasing reports its ε in its error reason. Empty when no client
    reported ``dp-epsilon``.

    ``dp_terms`` (``dp-unit``, ``dp-neighbour``) say what the ε protects. Only a ``record`` or ``client``
    unit gives the run's headline ``dp-epsilon-max``; a ``row-given-model`` figure is reported under its
    own name (``dp-epsilon-row-given-model-max``) and the headline is ``None``. Beside a replace-one ε,
    the add/remove one (``dp-epsilon-add-remove-max``), named."""
    from pollen.privacy.accounting import HEADLINE_UNITS
    from pollen.privacy.budget import DELTA, EPSILON, EPSILON_ADD_REMOVE, epsilon_in_refusal

    spent: dict[str, dict[str, float]] = {EPSILON: {}, EPSILON_ADD_REMOVE: {}}
    delta = None

    def note(name: str, client: str, value: float) -> None:
        spent[name][client] = max(spent[name].get(client, 0.0), value)

    for rec in rounds:  # fit then evaluate: a noised evaluation is a release too (dp-evaluate)
        for client, metrics in [*rec.get("fit-clients", {}).items(), *rec.get("evaluate-clients", {}).items()]:
            for name in spent:
                if isinstance(metrics.get(name), (int, float)):
                    note(name, client, float(metrics[name]))
            delta = metrics.get(DELTA, delta)
        for failure in rec.get("failure-reasons", []):
            stopped = epsilon_in_refusal(str(failure.get("reason", "")))
            if stopped is not None:
                note(EPSILON, *stopped)
    last = spent[EPSILON]
    if not last:
        return {}
    unit = dp_terms.get("dp-unit")
    out: dict[str, Any] = {**dp_terms, "dp-delta": delta}
    if unit is None or unit in HEADLINE_UNITS:
        out.update({"dp-epsilon-max": max(last.values()), "dp-epsilon-per-client": dict(sorted(last.items()))})
    else:
        out.update({"dp-epsilon-max": None, f"dp-epsilon-{unit}-max": max(last.values()),
                    f"dp-epsilon-{unit}-per-client": dict(sorted(last.items())),
                    "no-headline": f"dp-unit {unit!r} is no guarantee for a record or a client (docs/privacy.md)"})
    if spent[EPSILON_ADD_REMOVE]:
        beside = spent[EPSILON_ADD_REMOVE]
        out.update({f"{EPSILON_ADD_REMOVE}-max": max(beside.values()),
                    f"{EPSILON_ADD_REMOVE}-per-client": dict(sorted(beside.items()))})
    return out


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


def _fmt_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _fmt_bytes(n: float) -> str:
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
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=100)
    finally:
        plt.close(fig)
    atomic_write(path, image.getvalue())  # a full disk leaves the previous plot, never half a PNG
