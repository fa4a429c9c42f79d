"""Legacy ClientApp: a NumPyClient following the legacy prototype contract.

fit receives ``[]`` in round 1, then ``[protos C×d float32, present C int64, margin (1,) float32]``;
it replies ``[protos C×d float32, class counts C int64]``.
"""

from __future__ import annotations

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from extproj_legacy.task import class_means, embed, embedding_matrix, partition


class PrototypeClient(NumPyClient):
    def __init__(self, pid: int, cfg):
        self.pid = pid
        self.seed, self.classes = int(cfg["data-seed"]), int(cfg["num-classes"])
        self.features, self.dim = int(cfg["num-features"]), int(cfg["embed-dim"])
        self.train_size, self.test_size = int(cfg["train-size"]), int(cfg["test-size"])
        self.w = embedding_matrix(self.seed, self.features, self.dim)

    def fit(self, parameters, config):
        x, y = partition(self.seed, self.pid, 0, self.train_size, self.classes, self.features)
        protos, counts = class_means(embed(x, self.w), y, self.classes)
        had_global = int(len(parameters) == 3)
        return [protos.astype(np.float32), counts], int(counts.sum()), {"partition-id": self.pid,
                                                                         "had-global": had_global}

    def evaluate(self, parameters, config):
        glob, present = parameters[0], parameters[1].astype(bool)
        x, y = partition(self.seed, self.pid, 1, self.test_size, self.classes, self.features)
        dist = ((embed(x, self.w)[:, None, :] - glob[None, :, :]) ** 2).mean(axis=2)
        dist[:, ~present] = np.inf
        accuracy = float((dist.argmin(axis=1) == y).mean())
        loss = float(dist[np.arange(len(y)), y].mean())
        return loss, len(y), {"accuracy": accuracy, "partition-id": self.pid}


def client_fn(context: Context):
    return PrototypeClient(int(context.node_config["partition-id"]), context.run_config).to_client()


app = ClientApp(client_fn=client_fn)
