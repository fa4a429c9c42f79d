"""ClientApp: weights (local gradient steps on the received global state) or prototypes (class means of a
fixed embedding), as Pollen's wire contract says; Pollen's SecAgg+ mod masks whatever the reply holds."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pollen.protocol import encode_prototype_reply, encode_weights_reply
from pollen.secagg import secagg_mod

from extproj_secagg.task import class_means, local_train, partition

app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    if cfg["mode"] == "prototypes":
        protos, counts = class_means(int(cfg["data-seed"]), pid, int(cfg["proto-train-size"]), int(cfg["num-classes"]),
                                     int(cfg["proto-features"]), int(cfg["embed-dim"]))
        return Message(content=encode_prototype_reply(protos, counts, {"partition-id": pid}), reply_to=msg)
    state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    x, y = partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
    new, loss = local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
    return Message(content=encode_weights_reply(new, len(y), {"partition-id": pid, "train-loss": loss}),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
