"""How far honest replies stray from their round's median: the measurement behind ``outlier-factor``.

The spread rule (``pollen.strategies.spread``) refuses a train reply whose size is more than
``outlier-factor`` × its round's median size. Its default must leave honest runs untouched, non-IID
and round 1 included, while refusing ×10 of an honest update. This study runs honest federations of
every family in process (Pollen's ServerApp and real ClientApps, ``pollen.testing``) with the rule
observing only (``outlier-factor = 0``) and records each round's largest ratio per measure from
``metrics.jsonl`` (``spread``). The settings are the README commands' and the regression runs' shapes,
some shortened (fewer rounds or samples: said in each run's note), plus strongly non-IID and DP runs.

One result file per finished run (``bench/results/honest_spread/<name>.json``), skipped when present, so a
stopped study resumes::

    python -m bench.honest_spread               # run what is missing, then write the table
    python -m bench.honest_spread --report      # only the table, from the files
    python -m bench.honest_spread --only fedavg-uci-5   # one run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.kit import RESULTS, ROOT, default_data_root, read_json, table, write_atomic, write_json
from pollen.strategies.spread import DEFAULT_OUTLIER_FACTOR

OUT = RESULTS / "honest_spread"
FEW_THREADS = {"torch-threads": 1, "device": "cpu"}

# name -> (run config, nodes, note); every run observes only (outlier-factor = 0)
RUNS: dict[str, tuple[dict[str, Any], int, str]] = {
    "fedavg-uci-5": ({"method": "fedavg"}, 5, "`make run` (all defaults, 10 rounds)"),
    "fedavg-uci-5-alpha0.1": ({"method": "fedavg", "dirichlet-alpha": 0.1, "num-server-rounds": 20}, 5,
                              "`make run`, Dirichlet α = 0.1 (strongly non-IID), 20 rounds"),
    "fedprox-uci-10-alpha0.1": ({"method": "fedprox", "dirichlet-alpha": 0.1, "num-server-rounds": 20}, 10,
                                "FedProx, 10 clients, α = 0.1, 20 rounds"),
    "fedavg-regression": ({"method": "fedavg", "max-train-samples": 96, "batch-size": 16, "num-server-rounds": 2,
                           "seed": 3}, 3, "tests/test_run_regression.py's fedavg run"),
    "fedproto-regression": ({"method": "fedproto", "task": "mnist-shot", "shot-ways": 2, "shot-shots": 12,
                             "shot-stdev": 0, "shot-test-per-class": 4, "batch-size": 4, "lr": 0.05,
                             "num-server-rounds": 2, "seed": 3}, 3, "tests/test_run_regression.py's fedproto run"),
    "fccl-regression": ({"method": "fccl", "task": "digits-offline", "model": "cnn_mnist",
                         "fccl-public": "photo_patches", "fccl-public-size": 40, "fccl-public-batch-size": 20,
                         "fccl-train-sizes": "24,24,24,24", "fccl-solo-epochs": 1, "fccl-local-epochs": "1",
                         "fccl-test-size": 20, "fccl-batch-size": 12, "num-server-rounds": 2, "seed": 3}, 4,
                        "tests/test_run_regression.py's fccl run"),
    "fedavg-readme-30r": ({"method": "fedavg", "task": "mnist-shot", "batch-size": 4, "lr": 0.01,
                           "num-server-rounds": 30}, 20, "README FedAvg command, first 30 of 100 rounds"),
    "fedproto-readme-30r": ({"method": "fedproto", "task": "mnist-shot", "batch-size": 4, "lr": 0.01,
                             "num-server-rounds": 30, "proto-evaluate-every": 10}, 20,
                            "README FedProto command, first 30 of 100 rounds"),
    "bd-fedproto-readme-20r": ({"method": "bd-fedproto", "task": "mnist-shot", "batch-size": 4, "lr": 0.01,
                                "num-server-rounds": 20, "proto-evaluate-every": 10}, 20,
                               "README FedProto command with method='bd-fedproto', first 20 of 100 rounds"),
    "fedproto-heter-n5": ({"method": "fedproto", "task": "mnist-shot", "shot-ways": 5, "shot-shots": 30,
                           "batch-size": 4, "lr": 0.01, "num-server-rounds": 20, "proto-model-heter": True}, 5,
                          "FedProto, 5 clients with heterogeneous models, 5-way 30-shot, 20 rounds"),
    "fccl-readme-5r": ({"method": "fccl", "task": "digits-offline", "model-width": 0.25,
                        "fccl-train-sizes": "300,80,2000,1800", "fccl-local-epochs": "40,35,3,4",
                        "fccl-solo-epochs": 30, "fccl-batch-size": 32, "fccl-public": "fashion_mnist",
                        "fccl-public-size": 1000, "fccl-public-batch-size": 250, "fccl-test-size": 300,
                        "num-server-rounds": 5}, 4, "README FCCL command, first 5 of 10 rounds"),
    "glfc-readme-short": ({"method": "glfc", "task": "mnist-fmnist-cil", "num-server-rounds": 20,
                           "glfc-rounds-per-task": 5, "glfc-clients-per-round": 4, "glfc-max-per-class": 100,
                           "glfc-memory-size": 60, "glfc-eval-per-class": 200, "glfc-proxy-iterations": 20,
                           "glfc-proxy-keep": 5, "glfc-oracle-boundary": True, "model": "resnet18",
                           "model-width": 0.125, "local-epochs": 2, "lr": 0.5, "momentum": 0.0,
                           "weight-decay": 1e-5}, 10,
                          "README GLFC command with 5 rounds per task (4 tasks: 4 transitions, 20 rounds)"),
    "glfc-uci-cil": ({"method": "glfc", "task": "uci-digits-cil", "glfc-tasks": 3, "glfc-classes-per-task": 3,
                      "glfc-rounds-per-task": 2, "num-server-rounds": 6, "glfc-initial-clients": 5,
                      "glfc-new-clients": 0,
                      "glfc-clients-per-round": 5, "glfc-max-per-class": 20, "glfc-memory-size": 20,
                      "glfc-oracle-boundary": True, "glfc-proxy-iterations": 3, "glfc-proxy-keep": 2,
                      "glfc-eval-per-class": 20, "model-width": 0.125, "local-epochs": 1, "lr": 0.5,
                      "momentum": 0.0}, 5,
                     "GLFC, tests/test_hostile_nodes.py's shape with 2 rounds per task (3 tasks, 6 rounds)"),
    "fedproto-dp-payload": ({"method": "fedproto", "task": "mnist-shot", "shot-ways": 3, "shot-shots": 30,
                             "batch-size": 4, "lr": 0.01, "num-server-rounds": 10, "dp-mode": "payload",
                             "dp-noise-multiplier": 1.0, "dp-evaluate": "unprotected"}, 5,
                            "FedProto 5 clients under dp-mode = payload, σ = 1"),
}


def run_one(name: str, data_root: str) -> dict[str, Any]:
    """One honest run in process; the per-round ``spread`` of its ``metrics.jsonl``."""
    from flwr.app import Context, RecordDict

    from pollen.app import client_app, server_app
    from pollen.testing import InProcessGrid, clientapp_node

    config, nodes, note = RUNS[name]
    with tempfile.TemporaryDirectory(prefix="pollen-spread-") as tmp:
        rc = {**FEW_THREADS, "data-root": data_root, "min-available-clients": nodes, **config,
              "outlier-factor": 0.0, "out-dir": tmp}
        grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, nodes) for p in range(nodes)})
        began = time.perf_counter()
        server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
        wall = time.perf_counter() - began
        rows = [json.loads(x) for x in (Path(tmp) / "1" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        summary = json.loads((Path(tmp) / "1" / "summary.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"name": name, "note": note, "run-config": {k: v for k, v in rc.items() if k not in ("out-dir",
                                                                                             "data-root")},
            "nodes": nodes, "commit": commit, "wall-s": round(wall, 1), "status": summary.get("status"),
            "rounds": [{"round": r["round"], "accepted": r.get("accepted"), "spread": r.get("spread", {})}
                       for r in rows]}


def largest(result: dict[str, Any]) -> dict[str, tuple[float, int, int]]:
    """``{measure: (largest ratio, its round, fewest replies)}`` over the run's rounds."""
    out: dict[str, tuple[float, int, int]] = {}
    for r in result["rounds"]:
        for measure, s in r["spread"].items():
            ratio = s.get("max-ratio")
            if ratio is None:
                continue
            best = out.get(measure)
            if best is None or ratio > best[0]:
                out[measure] = (ratio, r["round"], s["replies"])
    return out


def report() -> str:
    rows = []
    for name in RUNS:
        result = read_json(OUT / f"{name}.json")
        if result is None:
            continue
        for measure, (ratio, rnd, replies) in sorted(largest(result).items()):
            rows.append([name, result["note"], measure, f"{ratio:.2f}", rnd, replies, result["status"],
                         f"`{result['commit']}`"])
    lines = ["# Honest replies against their round's median (`python -m bench.honest_spread`)", "",
             "The largest ratio of a reply's size to its round's median size, over all rounds of honest runs "
             "(in process, the spread rule observing only). A reply above `outlier-factor` (default "
             f"{DEFAULT_OUTLIER_FACTOR:g}) × its round's median is refused; runs not listed were not measured.", "",
             *table(["run", "setting", "measure", "largest ratio", "round", "replies", "status", "commit"], rows),
             ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only rewrite the table from the files")
    parser.add_argument("--only", action="append", default=[], help="run only this name (repeatable)")
    parser.add_argument("--data-root", default=default_data_root())
    args = parser.parse_args(argv)
    if not args.report:
        for name in args.only or list(RUNS):
            path = OUT / f"{name}.json"
            if path.exists():
                continue
            print(f"[honest_spread] {name} ...", flush=True)
            result = run_one(name, args.data_root)
            write_json(path, result)
            print(f"[honest_spread] {name}: {largest(result)} ({result['wall-s']} s)", flush=True)
    write_atomic(OUT / "README.md", report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
