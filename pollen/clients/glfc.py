"""The class-incremental family's client: :class:`pollen.methods.glfc.IncrementalRound` (GLFC, its
ablations, FedAvg + iCaRL, Finetune) on this node's data, state and device.

It works on named arrays only: :meth:`IncrementalClient.train` takes the message as
:func:`pollen.protocol.glfc.decode_train_content` decodes it and answers with a
:class:`pollen.protocol.glfc.TrainReply`, so no positional list or array count exists between the wire
and the core.
"""

from __future__ import annotations

import dataclasses
import functools

from flwr.common import Context

from pollen.clients.base import PollenClient, state_keys
from pollen.datasets.tasks import get_task
from pollen.methods.glfc import IncrementalRound, build_stream_model
from pollen.methods.glfc_settings import IncrementalSettings
from pollen.methods.training import model_state
from pollen.models import SplitModel
from pollen.models.spec import ModelSpec, choose_model
from pollen.protocol.glfc import TrainInstruction, TrainReply
from pollen.protocol.records import Evaluation


class IncrementalClient(PollenClient):
    """Learned classes, exemplar memory, detector state and cached old models in ``context.state``."""
    release_kind = "glfc"

    def __init__(self, cfg, node, context: Context, settings: IncrementalSettings):
        super().__init__(cfg, node, context)
        self.settings = settings

    @property
    def stream_model(self) -> ModelSpec:
        """The stream's model (:func:`~pollen.models.catalog.choose_model`), its head one task's classes."""
        spec = choose_model(self.cfg, get_task(self.settings.task), self.node)
        return dataclasses.replace(spec, num_classes=self.settings.stream.classes_per_task)

    @property
    def stream_model_name(self) -> str:
        return self.stream_model.name

    def state_keys(self) -> list[str]:
        """Names of this client's model state in ``state_dict`` order (the head size does not change them)."""
        s = self.stream_model
        return list(state_keys(s.name, s.num_classes, s.in_channels, s.image_size, s.width))

    def _model(self, num_classes: int) -> SplitModel:
        s = self.stream_model
        return build_stream_model(self.settings.task, s.name, num_classes, s.width).to(self.device)

    @functools.cached_property
    def core(self) -> IncrementalRound:
        return IncrementalRound(self.settings, self.local_training(), self.state, self.partition_id, self.cfg.seed,
                                self.device, self._model, self.node.data_root or self.cfg.data_root,
                                self.cfg.download, self.payload_privacy())

    def get_parameters(self, config):
        return list(model_state(self._model(self.settings.stream.classes_per_task)).values())

    def check_model(self, ins: TrainInstruction) -> None:
        """Refuse a global state whose names are not this client's model's, naming the model."""
        keys = self.state_keys()
        if sorted(keys) != sorted(ins.model):
            missing = sorted(set(keys) - set(ins.model))[:5]
            extra = sorted(set(ins.model) - set(keys))[:5]
            raise ValueError(f"server model state does not match this client's model {self.stream_model_name!r}: "
                             f"missing {missing}, unexpected {extra}; do server and client use the same model "
                             "and width?")

    def train(self, ins: TrainInstruction) -> TrainReply:
        """One round: the trained state by name, the gradient sets by LeNet parameter name, examples,
        metrics, and under ``leak-audit`` the sample behind each set (else none: the reply is unchanged)."""
        self.check_model(ins)
        state, grads, num, metrics, samples = self.core.fit(ins)
        return TrainReply(state, grads, num, {**self.base_metrics(), **metrics}, samples if self.cfg.leak_audit else [])

    def test(self, ins: TrainInstruction) -> Evaluation:
        """A detect-only (or plain) evaluate message: loss, examples, metrics."""
        self.check_model(ins)
        loss, num, metrics = self.core.evaluate(ins)
        return Evaluation(loss, num, {**self.base_metrics(), **metrics})
