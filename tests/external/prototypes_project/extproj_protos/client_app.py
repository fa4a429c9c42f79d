"""ClientApp: local class means of a fixed embedding, sent with Pollen's prototype protocol."""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pollen.protocol import decode_global_prototypes, encode_prototype_reply

from extproj_protos.task import class_means, embed, embedding_matrix, partition

app = ClientApp()


def _setup(context: Context):
    cfg = context.run_config
    seed, classes = int(cfg["data-seed"]), int(cfg["num-classes"])
    features, dim = int(cfg["num-features"]), int(cfg["embed-dim"])
    pid = int(context.node_config["partition-id"])
    return pid, seed, classes, features, dim, embedding_matrix(seed, features, dim)


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid, seed, classes, features, dim, w = _setup(context)
    x, y = partition(seed, pid, 0, int(context.run_config["train-size"]), classes, features)
    protos, counts = class_means(embed(x, w), y, classes)
    received = decode_global_prototypes(msg.content["arrays"], classes, dim)
    gap = 0.0
    if received is not None:
        glob, present, _margin = received
        both = (counts > 0) & present
        gap = float(((protos[both] - glob[both]) ** 2).mean()) if both.any() else 0.0
    metrics = {"partition-id": pid, "had-global": int(received is not None), "global-gap": gap}
    return Message(content=encode_prototype_reply(protos, counts, metrics=metrics), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    pid, seed, classes, features, dim, w = _setup(context)
    x, y = partition(seed, pid, 1, int(context.run_config["test-size"]), classes, features)
    received = decode_global_prototypes(msg.content["arrays"], classes, dim)
    if received is None:
        raise RuntimeError("evaluate before any global prototypes")
    glob, present, _margin = received
    emb = embed(x, w)
    dist = ((emb[:, None, :] - glob[None, :, :]) ** 2).mean(axis=2)
    dist[:, ~present] = np.inf
    accuracy = float((dist.argmin(axis=1) == y).mean())
    loss = float(dist[np.arange(len(y)), y].mean()) if present[y].all() else 0.0
    metrics = MetricRecord({"num-examples": len(y), "accuracy": accuracy, "loss": loss, "partition-id": pid})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
