"""ClientApp: local gradient steps on the received global state, reply by parameter name."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pollen.protocol import encode_weights_reply

from extproj_weights.task import evaluate_state, local_train, partition

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    mu = float(msg.content["config"]["proximal-mu"])  # Pollen's FedProx key; 0 for FedAvg
    assert mu == 0.0, mu
    x, y = partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
    new, loss = local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
    return Message(content=encode_weights_reply(new, len(y), {"partition-id": pid, "train-loss": loss}),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    x, y = partition(int(cfg["data-seed"]), pid, 1, int(cfg["num-features"]))
    loss, acc = evaluate_state(state, x, y)
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": acc, "partition-id": pid})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
