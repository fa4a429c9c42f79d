"""Stragglers and dropouts: what a network that misbehaves costs FedAvg and FedProto on MNIST.

Every run is Pollen's own ServerApp and real ClientApps in this process (``pollen.testing.InProcessGrid``: the
messages ``flwr run`` carries, no Ray), on MNIST 3-way 100-shot (the FedProto preset's task and training
settings, ``conf/fedproto-mnist-n3.toml``, except batches of 16 at a learning rate of 0.04 instead of 4 at 0.01:
a quarter of the steps, sized for a shared 2-core machine) with 10 clients and 10 rounds, with the simulated
network of ``docs/stragglers.md``: every client's simulated time is its examples × ``client-sample-time``
(10 ms), times a lognormal jitter (σ = 0.25) each round; a slow client takes 4 × as long. The arms:

- ``client-dropout`` 0 / 20 / 40 %;
- ``client-slow-fraction`` 0 / 20 %;
- no deadline (the server waits for every reply: Flower's own 3,600 s reply timeout for a client that
  dropped), or ``round-timeout`` = 6 s (twice a normal client's nominal 3 s: a slow client misses it).

Measured per run: the clients' mean accuracy each round (``evaluate.accuracy-client-mean``: every client is
evaluated every round, evaluation is not subject to the network) and the simulated clock. Reported per
method and arm, paired by seed: the final accuracy and its difference to the perfect network (dropout 0,
slow 0, no deadline), and the simulated time to a target accuracy: 95 % of the perfect network's final
accuracy at the same seed. The verdicts use ``bench.kit.verdict`` (2 s.e. of the paired differences).

One result file per finished run (``bench/results/stragglers/<arm>-seed<k>.json``), skipped when started
again, so a stopped study resumes; the report (``bench/results/stragglers.{md,json,png}``) is rewritten from
the files::

    nohup nice -n 5 python -m bench.stragglers --seeds 0 &    # one worker per seed; a cell is run once
    nohup nice -n 5 python -m bench.stragglers --seeds 1 &
    python -m bench.stragglers --report          # only rewrite the report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.kit import (
    RESULTS,
    RunFiles,
    default_data_root,
    emphasis,
    fmt_mean_sd,
    fmt_paired,
    preset,
    pyplot,
    read_metrics,
    run_study,
    save_figure,
    table,
    verdict,
    write_atomic,
    write_json,
)

FOLDER = RESULTS / "stragglers"
REPORT_MD, REPORT_JSON, REPORT_PNG = RESULTS / "stragglers.md", RESULTS / "stragglers.json", RESULTS / "stragglers.png"
METHODS = ("fedavg", "fedproto")
DROPOUTS = (0.0, 0.2, 0.4)
SLOW_FRACTIONS = (0.0, 0.2)
DEADLINES = (0.0, 6.0)  # 0: none
TARGET_SHARE = 0.95  # time to 95 % of the perfect network's final accuracy, same method and seed
# what every run shares: the study's setting (a result file of another setting is refused, not mixed in)
SETTING: dict[str, Any] = {
    "preset": "fedproto-mnist-n3", "clients": 10, "num-server-rounds": 10, "batch-size": 16, "lr": 0.04,
    "client-sample-time": 0.01,
    "client-time-spread": 0.25, "client-slowdown": 4.0, "metric": "accuracy-client-mean",
}


def arm_name(method: str, dropout: float, slow: float, deadline: float) -> str:
    return f"{method}-drop{round(dropout * 100)}-slow{round(slow * 100)}-" + (
        f"deadline{deadline:g}" if deadline else "wait")


def arms() -> list[tuple[str, str, float, float, float]]:
    """Every arm: (name, method, dropout, slow fraction, deadline), the perfect network of each method first."""
    return [(arm_name(m, d, s, t), m, d, s, t) for m in METHODS for d in DROPOUTS for s in SLOW_FRACTIONS
            for t in DEADLINES]


def run_config(method: str, dropout: float, slow: float, deadline: float, seed: int, out_dir: Path,
               data_root: str) -> dict[str, Any]:
    base = {k: v for k, v in preset(SETTING["preset"]).items() if not k.startswith("proto-") or method == "fedproto"}
    return {**base, "method": method, "seed": seed, "num-server-rounds": SETTING["num-server-rounds"],
            "batch-size": SETTING["batch-size"], "lr": SETTING["lr"],
            "data-root": data_root, "out-dir": str(out_dir), "device": "cpu", "torch-threads": 1,
            "checkpoint-every": 0, "min-available-clients": SETTING["clients"],
            "max-empty-rounds": SETTING["num-server-rounds"],  # a round everyone dropped out of is no failure here
            "client-dropout": dropout, "client-slow-fraction": slow, "round-timeout": deadline,
            "client-slowdown": SETTING["client-slowdown"], "client-time-spread": SETTING["client-time-spread"],
            "client-sample-time": SETTING["client-sample-time"]}


def run_one(method: str, dropout: float, slow: float, deadline: float, seed: int, data_root: str) -> dict[str, Any]:
    """One whole run through Pollen's ServerApp and ClientApps; its per-round curve and network record."""
    from flwr.app import Context, RecordDict

    from pollen.app import client_app, server_app
    from pollen.testing import InProcessGrid, clientapp_node

    with tempfile.TemporaryDirectory(prefix="pollen-stragglers-") as tmp:
        rc = run_config(method, dropout, slow, deadline, seed, Path(tmp), data_root)
        n = SETTING["clients"]
        grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, n, state_dir=f"{tmp}/node-{p}")
                              for p in range(n)})
        started = time.perf_counter()
        server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
        wall = time.perf_counter() - started
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        rounds = read_metrics(Path(tmp) / "1")
        summary = json.loads((Path(tmp) / "1" / "summary.json").read_text())
    missing = [m for r in rounds for m in r["network"]["missing"]] if rounds and "network" in rounds[0] else []
    return {
        "status": summary["status"],
        "accuracy": [r["evaluate"].get(SETTING["metric"]) for r in rounds],
        "clock": [(r.get("network") or {}).get("sim-clock-s", 0.0) for r in rounds],
        "accepted": [r["accepted"] for r in rounds],
        "dropped": sum(m["why"] == "dropped" for m in missing), "late": sum(m["why"] == "late" for m in missing),
        "wall-s": round(wall, 1), "commit": commit,
    }


# ---------------------------------------------------------------------------------------------------------------
# the report

def time_to(curve: list[float | None], clock: list[float], target: float) -> float | None:
    """The simulated clock at the end of the first round whose accuracy reaches ``target`` (None: never)."""
    for acc, at in zip(curve, clock):
        if acc is not None and acc >= target:
            return at
    return None


def summarize(records: list[dict]) -> dict[str, Any]:
    """Per method and arm: final accuracies and times to target by seed, paired against the perfect network."""
    by = {(r["arm"], r["seed"]): r for r in records}
    out: dict[str, Any] = {}
    for name, method, dropout, slow, deadline in arms():
        perfect = arm_name(method, 0.0, 0.0, 0.0)
        seeds = sorted(s for (a, s) in by if a == name)
        row: dict[str, Any] = {"method": method, "dropout": dropout, "slow": slow, "deadline": deadline,
                               "seeds": seeds, "final": {}, "time-to-target": {}, "dropped": {}, "late": {}}
        for seed in seeds:
            rec = by[(name, seed)]
            row["final"][seed] = rec["accuracy"][-1]
            row["dropped"][seed], row["late"][seed] = rec["dropped"], rec["late"]
            base = by.get((perfect, seed))
            if base is not None:
                target = TARGET_SHARE * base["accuracy"][-1]
                row["time-to-target"][seed] = time_to(rec["accuracy"], rec["clock"], target)
        paired = [s for s in seeds if (perfect, s) in by]
        row["delta-final"] = {s: row["final"][s] - by[(perfect, s)]["accuracy"][-1] for s in paired}
        if deadline:  # the same network without a deadline, paired by seed
            waiting = arm_name(method, dropout, slow, 0.0)
            both = [s for s in seeds if (waiting, s) in by]
            row["vs-wait"] = {s: row["final"][s] - by[(waiting, s)]["accuracy"][-1] for s in both}
        out[name] = row
    return out


def _fmt_time(values: list[float | None]) -> str:
    reached = [v for v in values if v is not None]
    if not values:
        return "–"
    text = fmt_mean_sd(reached, 1) + " s" if reached else "not reached"
    return text + (f" ({len(values) - len(reached)} of {len(values)} not reached)" if reached and
                   len(reached) < len(values) else "")


def report(records: list[dict]) -> str:
    rows = summarize(records)
    seeds = sorted({r["seed"] for r in records})
    lines = ["# Stragglers and dropouts: FedAvg and FedProto on MNIST", "",
             "<!-- Written by `python -m bench.stragglers` from bench/results/stragglers/*.json. -->", "",
             f"MNIST 3-way 100-shot, {SETTING['clients']} clients, {SETTING['num-server-rounds']} rounds, the "
             "FedProto preset's training settings (`conf/fedproto-mnist-n3.toml`) except batches of "
             f"{SETTING['batch-size']} at learning rate {SETTING['lr']} (the preset: 4 at 0.01), Pollen's ServerApp "
             "and real ClientApps in one process. Simulated network (docs/stragglers.md): a client's time is its "
             f"examples × {SETTING['client-sample-time'] * 1000:g} ms × a lognormal jitter (σ = "
             f"{SETTING['client-time-spread']}), × {SETTING['client-slowdown']:g} for a slow client; without a "
             "deadline the server waits for every reply (3,600 s, Flower's reply timeout, for a client that "
             "dropped). Accuracy: the clients' mean, each on its own test classes, after the last round. "
             f"Seeds: {', '.join(map(str, seeds)) or 'none yet'}; Δ and verdicts are paired by seed "
             "(`bench.kit.verdict`: 2 s.e.).", ""]
    for method in METHODS:
        lines += [f"## {'FedAvg' if method == 'fedavg' else 'FedProto'}", ""]
        body = []
        for name, m, dropout, slow, deadline in arms():
            if m != method or not rows[name]["seeds"]:
                continue
            row = rows[name]
            finals = list(row["final"].values())
            delta = list(row["delta-final"].values())
            perfect = (dropout, slow, deadline) == (0.0, 0.0, 0.0)
            vs_wait = list(row.get("vs-wait", {}).values())
            dropped, late = (sum(row[k].values()) / len(finals) for k in ("dropped", "late"))
            missing = f"{dropped:.1f} / {late:.1f}"
            body.append([f"{dropout:.0%}", f"{slow:.0%}", f"{deadline:g} s" if deadline else "none",
                         fmt_mean_sd([f * 100 for f in finals]),
                         "–" if perfect else f"{fmt_paired([d * 100 for d in delta])} ({emphasis(verdict(delta))})",
                         f"{fmt_paired([d * 100 for d in vs_wait])} ({emphasis(verdict(vs_wait))})" if vs_wait else "–",
                         _fmt_time(list(row["time-to-target"].values())),
                         missing])
        lines += table(["dropout", "slow", "deadline", "final accuracy %", "Δ vs perfect network (pp)",
                        "Δ deadline vs none (pp)", f"simulated time to {TARGET_SHARE:.0%} of perfect",
                        "dropped / late per run"], body) + [""]
    lines += ["Verdict: *supported* = the arm's accuracy is higher (Δ > 0 at 2 s.e.), *contradicted* = lower. "
              "Time to target: mean ± s.d. over the seeds that reached it.", ""]
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METHODS), figsize=(12, 4.5), sharey=True)
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r)
    for ax, method in zip(axes, METHODS):
        for name, m, dropout, slow, deadline in arms():
            runs = by_arm.get(name)
            if m != method or not runs or (dropout, slow) not in ((0.0, 0.0), (0.2, 0.2), (0.4, 0.2)):
                continue
            seed0 = sorted(runs, key=lambda r: r["seed"])[0]
            xs = [max(c, 1e-1) for c in seed0["clock"]]
            ys = [a * 100 if a is not None else None for a in seed0["accuracy"]]
            ax.plot(xs, ys, marker="o", ms=2, ls="-" if deadline else "--",
                    label=f"drop {dropout:.0%} slow {slow:.0%} " + (f"deadline {deadline:g}s" if deadline else "wait"))
        ax.set_xscale("log")
        ax.set_xlabel("simulated time (s, log)")
        ax.set_title(f"{method} (seed {min(r['seed'] for r in records)})")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("clients' mean accuracy (%)")
    save_figure(fig, path, dpi=100)


def write_report(files: RunFiles) -> None:
    records = files.load(SETTING)
    write_atomic(REPORT_MD, report(records))
    write_json(REPORT_JSON, {"setting": SETTING, "summary": summarize(records), "runs": records})
    if records:
        plot(records, REPORT_PNG)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--report", action="store_true", help="only rewrite the report from the result files")
    args = p.parse_args(argv)
    files = RunFiles(FOLDER)
    FOLDER.mkdir(parents=True, exist_ok=True)
    if not args.report:
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("POLLEN_DATA_ROOT", args.data_root)
        cells = [(name, seed) for seed in args.seeds for name, m, *_ in arms() if m in args.methods]
        spec = {name: rest for name, *rest in arms()}

        def run(name: str, seed: int) -> dict:
            method, dropout, slow, deadline = spec[name]
            rec = run_one(method, dropout, slow, deadline, seed, args.data_root)
            return {"setting": SETTING, "arm": name, "seed": seed, "method": method, "dropout": dropout,
                    "slow": slow, "deadline": deadline, **rec}

        return run_study("stragglers", files, cells, SETTING, run, report=lambda: write_report(files),
                         said=lambda rec: f"final {rec['accuracy'][-1]} in {rec['wall-s']} s, dropped {rec['dropped']} "
                                          f"late {rec['late']}")
    write_report(files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
