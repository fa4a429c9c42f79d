"""ServerApp: Pollen's own ``WeightAveraging`` or ``PrototypeStrategy`` (run key ``mode``), unchanged, on a
``SecureGrid``: each train round is a SecAgg+ round of Pollen's driver, so the server learns sums, never a
node's own reply."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pollen.secagg import SecAggConfig
from pollen.secagg.grid import SecureGrid
from pollen.strategies import PrototypeStrategy, WeightAveraging

from extproj_secagg.task import initial_state

app = ServerApp()


def _strategy_run(grid: Grid, cfg, secagg: SecAggConfig) -> dict:
    nodes, rounds = int(cfg["min-nodes"]), int(cfg["num-server-rounds"])
    common = {"min_available_nodes": nodes, "min_train_nodes": nodes, "min_evaluate_nodes": nodes,
              "num_rounds": rounds}
    if cfg["mode"] == "prototypes":
        strategy = PrototypeStrategy(num_classes=int(cfg["num-classes"]), embed_dim=int(cfg["embed-dim"]), **common)
        initial = ArrayRecord()
    else:
        strategy = WeightAveraging(**common)
        initial = ArrayRecord({k: Array(v) for k, v in initial_state(int(cfg["num-features"])).items()})
    secure = SecureGrid(grid, secagg)
    result = strategy.start(grid=secure, initial_arrays=initial, num_rounds=rounds)
    return {"arrays": {k: a.numpy().tolist() for k, a in result.arrays.items()},
            "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
            "survivors": len(secure.last.survivors) if secure.last else 0,
            "clear-metrics": sorted({k for m in secure.last.replies.values() for k in m.content["metrics"].keys()})
            if secure.last else []}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    mode = str(cfg["mode"])  # "weights" or "prototypes": the payload kind is the strategy's family
    secagg = SecAggConfig(neighbours=int(cfg["secagg-neighbours"]), threshold=float(cfg["secagg-threshold"]),
                          kind=mode, max_weight=100_000)
    report = _strategy_run(grid, cfg, secagg)
    path = Path(str(cfg["report-path"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
