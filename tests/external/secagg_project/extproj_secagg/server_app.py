"""ServerApp: FedAvg whose every round is one SecAgg+ round of Pollen's driver (``SecAggPlus``): the
server learns Σ n·w and Σ n, never a node's own update."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from pollen.secagg import SecAggConfig, SecAggPlus, mean_of_sums

from extproj_secagg.task import initial_state

app = ServerApp()


def _nodes(grid: Grid, count: int, wait_s: float = 120.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while len(ids := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(ids)} of {count} nodes connected")
        time.sleep(0.5)
    return ids


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    driver = SecAggPlus(SecAggConfig(neighbours=int(cfg["secagg-neighbours"]),
                                     threshold=float(cfg["secagg-threshold"]), kind="weights"))
    nodes = _nodes(grid, int(cfg["min-nodes"]))
    state = initial_state(int(cfg["num-features"]))
    report: dict = {"rounds": {}}
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in state.items()}),
                              "config": ConfigRecord({"server-round": rnd})})
        result = driver.aggregate(grid, dict.fromkeys(nodes, content), server_round=rnd)
        mean = mean_of_sums("weights", result.sums)
        state = {k: np.asarray(np.rint(mean[k]) if v.dtype.kind in "iu" else mean[k]).astype(v.dtype)
                 for k, v in state.items()}
        report["rounds"][rnd] = {
            "arrays": {k: v.tolist() for k, v in state.items()}, "weight": int(result.sums["weight"]),
            "survivors": len(result.survivors), "dropped": len(result.dropped), "refused": result.refused,
            "metrics": sorted({k for m in result.replies.values() for k in m.content["metrics"].keys()}),
            "bytes-up": result.bytes_up, "bytes-down": result.bytes_down}
    path = Path(str(cfg["report-path"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
