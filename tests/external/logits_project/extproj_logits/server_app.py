"""ServerApp: Pollen's LogitAveraging driven by Flower's ``Strategy.start`` loop."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pollen.strategies import LogitAveraging

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, nodes = int(cfg["num-server-rounds"]), int(cfg["min-nodes"])
    strategy = LogitAveraging(num_public=int(cfg["public-size"]), num_classes=int(cfg["num-classes"]),
                              min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes,
                              num_rounds=rounds)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=rounds)
    report = {
        "arrays": {k: {"dtype": str(a.numpy().dtype), "shape": list(a.shape), "values": a.numpy().tolist()}
                   for k, a in result.arrays.items()},
        "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "reports": {r: {k: v for k, v in dataclasses.asdict(rep).items() if k != "started"}
                    for r, rep in strategy.reports.items()},
    }
    path = Path(str(cfg["report-path"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
