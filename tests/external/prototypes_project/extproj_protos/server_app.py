"""ServerApp: Pollen's PrototypeStrategy driven by Flower's own ``Strategy.start`` loop."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pollen.strategies import PrototypeStrategy

app = ServerApp()


def _arrays(record: ArrayRecord) -> dict:
    out = {}
    for key, arr in record.items():
        value = arr.numpy()
        out[key] = {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.tolist()}
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, nodes = int(cfg["num-server-rounds"]), int(cfg["min-nodes"])
    strategy = PrototypeStrategy(num_classes=int(cfg["num-classes"]), embed_dim=int(cfg["embed-dim"]),
                                 min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes,
                                 num_rounds=rounds)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=rounds)
    report = {
        "run-id": context.run_id,
        "arrays": _arrays(result.arrays),
        "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "reports": {r: {k: v for k, v in dataclasses.asdict(rep).items() if k != "started"}
                    for r, rep in strategy.reports.items()},
    }
    path = Path(str(cfg["report-path"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
