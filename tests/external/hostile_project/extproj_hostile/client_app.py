"""ClientApp: partition 0 is honest; partitions 1 and 2 send one kind of bad reply per round.

| partition | train round 1 | train round 2 | train round 3 | evaluate (every round) |
|---|---|---|---|---|
| 0 | honest | honest | honest | honest |
| 1 | ``num-examples`` = 10**15 | ``w`` = 3e38 (finite float32, right shape), no ``partition-id`` | claims ``partition-id`` 0 (impostor) | ``loss`` = NaN |
| 2 | ``partition-id`` = NaN | ``w`` right dtype/shape, ~50 MB of bytes | honest | honest |

Round 3's impostor makes partition 0 claimed by two nodes: neither is trusted, so the honest node's
replies are refused too (quarantine) and round 3 aggregates partition 2 alone. Partition 1's NaN loss
costs only that metric (its evaluate reply counts); it names no partition there, so its first valid
claim is the impostor's.

Scenario ``all-bad``: every client sends its trained state as float64 (the contract says float32).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from extproj_hostile.model import WEIGHT, evaluate_state, local_train, partition
from pollen.protocol import encode_weights_reply

app = ClientApp()


def _inputs(msg: Message, context: Context, split: int):
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    x, y = partition(int(cfg["data-seed"]), pid, split, int(cfg["num-features"]))
    return cfg, pid, state, x, y


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, pid, state, x, y = _inputs(msg, context, 0)
    rnd = int(msg.content["config"]["server-round"])
    new = local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
    n, metrics = len(y), {"partition-id": pid}
    if str(cfg["scenario"]) == "all-bad":
        new = {k: v.astype(np.float64) for k, v in new.items()}
    elif pid == 1 and rnd == 1:
        n = 10**15
    elif pid == 1 and rnd == 2:  # no claim yet: its first valid claim will be the impostor's
        new, metrics = {k: np.full_like(v, 3e38) for k, v in new.items()}, {}
    elif pid == 1:
        metrics["partition-id"] = 0
    elif pid == 2 and rnd == 1:
        metrics["partition-id"] = float("nan")
    elif pid == 2 and rnd == 2:
        good = ArrayRecord({k: Array(v) for k, v in new.items()})
        honest = good[WEIGHT]
        good[WEIGHT] = Array(dtype=honest.dtype, shape=honest.shape, stype=honest.stype,
                             data=honest.data + b"\0" * int(cfg["oversize-bytes"]))
        new = good
    return Message(content=encode_weights_reply(new, n, metrics), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _cfg, pid, state, x, y = _inputs(msg, context, 1)
    loss, acc = evaluate_state(state, x, y)
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": acc, "partition-id": pid})
    if pid == 1:
        metrics = MetricRecord({"num-examples": len(y), "loss": float("nan"), "accuracy": acc})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
