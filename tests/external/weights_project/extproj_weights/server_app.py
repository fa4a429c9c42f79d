"""ServerApp: Pollen's WeightAveraging (FedAvg) from a plain ``@app.main()``; the global state of every
round is captured through Flower's ``evaluate_fn`` hook."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pollen.strategies import WeightAveraging

from extproj_weights.task import initial_state

app = ServerApp()


def _arrays(record: ArrayRecord) -> dict:
    return {k: {"dtype": str(a.numpy().dtype), "shape": list(a.numpy().shape), "values": a.numpy().tolist()}
            for k, a in record.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, nodes = int(cfg["num-server-rounds"]), int(cfg["min-nodes"])
    strategy = WeightAveraging(min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes,
                               num_rounds=rounds)
    per_round: dict[int, dict] = {}

    def snapshot(server_round: int, arrays: ArrayRecord):
        per_round[server_round] = _arrays(arrays)
        return None

    initial = ArrayRecord({k: Array(v) for k, v in initial_state(int(cfg["num-features"])).items()})
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=snapshot)
    report = {
        "arrays": _arrays(result.arrays),
        "per-round-arrays": per_round,
        "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "reports": {r: {k: v for k, v in dataclasses.asdict(rep).items() if k != "started"}
                    for r, rep in strategy.reports.items()},
    }
    path = Path(str(cfg["report-path"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
