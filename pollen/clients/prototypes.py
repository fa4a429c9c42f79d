"""The prototype family's NumPyClient: a thin adapter from Flower's ``fit``/``evaluate`` to
:class:`pollen.methods.prototypes.PrototypeRound` (the method math lives there).

One class serves every prototype method; which one is the :class:`PrototypeMethod` it is built with
(:func:`prototype_client` makes the registry's client factory). It reads a
:class:`~pollen.protocol.prototypes.PrototypeInstruction` and answers with a
:class:`~pollen.protocol.prototypes.PrototypeReply` (or its private form): ``fit``/``evaluate`` are the
``NumPyClient`` boundary, where Flower's positional parameters become those named values and back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from flwr.common import Context, NDArrays, Scalar

from pollen.clients.base import PollenClient
from pollen.methods.prototype_settings import ProtoSettings, heterogeneous_channels
from pollen.methods.prototypes import FEDPROTO, PrototypeMethod, PrototypeRound
from pollen.methods.training import derive_seed
from pollen.privacy.leakage import prototype_audit
from pollen.protocol.prototypes import PrivatePrototypeReply, PrototypeInstruction, PrototypeReply, held_at
from pollen.protocol.records import Evaluation
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
        reply = self.train(PrototypeInstruction.from_parameters(parameters, config))
        return reply.parameters(), reply.num_examples, dict(reply.metrics)

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        return self.numpy_evaluation(self.test(PrototypeInstruction.from_parameters(parameters, config)))

    def train(self, ins: PrototypeInstruction) -> PrototypeReply | PrivatePrototypeReply:
        seed = derive_seed(self.cfg.seed, self.partition_id, ins.server_round, 0)
        reply = self.core.fit(ins.glob, ins.server_round, seed, ins.monitor)
        metrics = dict(reply.metrics)
        if self.cfg.leak_audit:
            metrics.update(self.leak_audit(reply))
        return dataclasses.replace(reply, metrics={**self.base_metrics(), **metrics})

    def leak_audit(self, reply: PrototypeReply | PrivatePrototypeReply) -> dict[str, float]:
        """What the server reads off the released counts (exact, or noisy with their noise std), against
        this client's true label counts."""
        truth = np.bincount(self.data.y_train.numpy(), minlength=self.task.num_classes)
        return prototype_audit(truth, reply.released_counts, held_at(reply.count_std))

    def test(self, ins: PrototypeInstruction) -> Evaluation:
        loss, num, metrics = self.core.evaluate(ins.glob)
        return Evaluation(loss, num, {**self.base_metrics(), **metrics})


def prototype_client(method: PrototypeMethod):
    """The registry's ``make_client`` for ``method``: ``(cfg, node, context) -> PrototypeClient``."""
    return functools.partial(PrototypeClient, method=method)
