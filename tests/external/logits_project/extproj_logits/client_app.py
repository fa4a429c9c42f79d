"""ClientApp: softmax regression trained locally, distilled towards the consensus on a public set.

Each client writes what it sent and what it decoded to ``dump-dir`` so the test can check the server's
arithmetic without re-running the training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pollen.protocol import decode_consensus, encode_logit_reply, public_fingerprint

app = ClientApp()


def _data(cfg, pid: int, split: int, size: int):
    seed, classes, features = int(cfg["data-seed"]), int(cfg["num-classes"]), int(cfg["num-features"])
    truth = np.random.default_rng([seed, 1]).normal(size=(features, classes))
    rng = np.random.default_rng([seed, 100 + pid, split])
    x = rng.normal(size=(size, features)) + 0.3 * pid
    y = (x @ truth).argmax(axis=1)
    return x, y


def _public(cfg) -> np.ndarray:
    rng = np.random.default_rng([int(cfg["data-seed"]), 2])
    return rng.normal(size=(int(cfg["public-size"]), int(cfg["num-features"])))


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _model(context: Context, features: int, classes: int) -> np.ndarray:
    if "model" in context.state:
        return context.state["model"]["w"].numpy().astype(np.float64)
    return np.zeros((features, classes))


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    classes, features = int(cfg["num-classes"]), int(cfg["num-features"])
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    contributed = bool(msg.content["config"].get("contributed", False))
    x, y = _data(cfg, pid, 0, int(cfg["train-size"]))
    public = _public(cfg)
    w = _model(context, features, classes)
    received = decode_consensus(msg.content["arrays"], int(cfg["public-size"]), classes)
    lr = float(cfg["lr"])
    onehot = np.eye(classes)[y]
    for _ in range(int(cfg["local-steps"])):
        grad = x.T @ (_softmax(x @ w) - onehot) / len(y)
        if received is not None:  # distil towards the consensus' soft labels
            grad += float(cfg["distill-weight"]) * public.T @ (_softmax(public @ w) - _softmax(received[0])) / len(public)
        w -= lr * grad
    context.state["model"] = ArrayRecord({"w": Array(w.astype(np.float32))})
    logits = (public @ w).astype(np.float32)
    dump = Path(str(cfg["dump-dir"]))
    dump.mkdir(parents=True, exist_ok=True)
    np.save(dump / f"sent-r{rnd}-p{pid}.npy", logits)
    if received is not None:
        np.save(dump / f"received-r{rnd}-p{pid}.npy", received[0])
    (dump / f"meta-r{rnd}-p{pid}.json").write_text(json.dumps(
        {"contributors": None if received is None else received[1], "contributed": contributed}))
    acc = float(((x @ w).argmax(axis=1) == y).mean())
    return Message(content=encode_logit_reply(logits, len(y), {"partition-id": pid, "train-accuracy": acc},
                                              public_digest=public_fingerprint(public)), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    classes, features = int(cfg["num-classes"]), int(cfg["num-features"])
    pid = int(context.node_config["partition-id"])
    x, y = _data(cfg, pid, 1, 30)
    w = _model(context, features, classes)
    p = _softmax(x @ w)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    metrics = MetricRecord({"num-examples": len(y), "accuracy": float((p.argmax(axis=1) == y).mean()),
                            "loss": loss, "partition-id": pid})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
