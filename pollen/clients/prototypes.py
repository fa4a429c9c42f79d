"""The prototype family's NumPyClient: a thin adapter from Flower's ``fit``/``evaluate`` to
:class:`pollen.methods.prototypes.PrototypeRound` (the method math lives there).

One class serves every prototype method; which one is the :class:`PrototypeMethod` it is built with
(:func:`prototype_client` makes the registry's client factory).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from flwr.common import Context, NDArrays, Scalar

from pollen.clients.base import PollenClient
from pollen.methods.prototype_settings import ProtoSettings, heterogeneous_channels
from pollen.methods.prototypes import FEDPROTO, PrototypeMethod, PrototypeRound
from pollen.methods.training import derive_seed
from pollen.privacy.leakage import prototype_audit
from pollen.protocol.prototypes import held_at
from pollen.settings import from_values


class PrototypeClient(PollenClient):
    """Private model in ``context.state``; only class prototypes leave the node."""

    MODEL_KEY = PrototypeRound.MODEL_KEY
    release_kind = "prototypes"

    def __init__(self, cfg, node, context: Context, method: PrototypeMethod = FEDPROTO):
        super().__init__(cfg, node, context)
        self.method = method
        self.settings = from_values(ProtoSettings, cfg.extra)

    def model_kwargs(self) -> dict[str, Any]:
        if self.settings.model_heter and self.model_name == "cnn_mnist":
            return {"channels": heterogeneous_channels(self.partition_id)}
        return {}

    @functools.cached_property
    def core(self) -> PrototypeRound:
        init_seed = derive_seed(self.cfg.seed, self.partition_id, 0, 0x5052)
        return PrototypeRound(self.method, self.settings, self.local_training(), self.state, self.data,
                              self.task.num_classes, self.device,
                              lambda: self.new_model(init_seed=init_seed, **self.model_kwargs()),
                              self.payload_privacy() or self.sample_privacy(prototypes=True))

    def load_model(self):
        return self.core.load_model()

    def get_parameters(self, config):
        return []

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        server_round = int(config.get("server-round", 0))
        seed = derive_seed(self.cfg.seed, self.partition_id, server_round, 0)
        reply, num, metrics = self.core.fit(list(parameters), server_round, seed, bool(config.get("monitor", True)))
        if self.cfg.leak_audit:
            metrics.update(self.leak_audit(reply))
        return reply, num, {**self.base_metrics(), **metrics}

    def leak_audit(self, reply: NDArrays) -> dict[str, float]:
        """What the server reads off the released counts (``reply[1]``; under DP ``reply[2]`` is their
        noise std), against this client's true label counts."""
        count_std = float(reply[2][0]) if len(reply) == 3 else 0.0
        truth = np.bincount(self.data.y_train.numpy(), minlength=self.task.num_classes)
        return prototype_audit(truth, reply[1], held_at(count_std))

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        loss, num, metrics = self.core.evaluate(list(parameters))
        return loss, num, {**self.base_metrics(), **metrics}


def prototype_client(method: PrototypeMethod):
    """The registry's ``make_client`` for ``method``: ``(cfg, node, context) -> PrototypeClient``."""
    return functools.partial(PrototypeClient, method=method)
