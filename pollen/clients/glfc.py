"""The class-incremental family's NumPyClient: a thin adapter from Flower's ``fit``/``evaluate`` to
:class:`pollen.methods.glfc.IncrementalRound` (GLFC, its ablations, FedAvg + iCaRL, Finetune).

The ClientApp adapter (``pollen.app.methods_glfc.GLFC_ADAPTER``) turns the named records of
:mod:`pollen.protocol.glfc` into positional arrays in this client's own state-dict order
(:meth:`IncrementalClient.state_keys`) and back.
"""

from __future__ import annotations

import functools

from flwr.common import Context, NDArrays, Scalar

from pollen.clients.base import PollenClient, _state_keys
from pollen.datasets.incremental import SOURCES
from pollen.methods.glfc import IncrementalRound, IncrementalSettings, build_stream_model
from pollen.methods.training import model_arrays
from pollen.models import SplitModel


class IncrementalClient(PollenClient):
    """Learned classes, exemplar memory, detector state and cached old models in ``context.state``."""

    def __init__(self, cfg, node, context: Context, settings: IncrementalSettings):
        super().__init__(cfg, node, context)
        self.settings = settings

    @property
    def stream_model_name(self) -> str:
        return self.node.model or self.cfg.model or SOURCES[self.settings.task].default_model

    def state_keys(self) -> list[str]:
        """Names of this client's model state in ``state_dict`` order (the head size does not change them)."""
        src = SOURCES[self.settings.task]
        name = self.stream_model_name
        return list(_state_keys(name, self.settings.stream.classes_per_task, src.fmt.channels, src.fmt.size,
                                self.cfg.width_for(name)))

    def _model(self, num_classes: int) -> SplitModel:
        name = self.stream_model_name
        return build_stream_model(self.settings.task, name, num_classes, self.cfg.width_for(name)).to(self.device)

    @functools.cached_property
    def core(self) -> IncrementalRound:
        return IncrementalRound(self.settings, self.local_training(), self.state, self.partition_id, self.cfg.seed,
                                self.device, self._model, self.node.data_root or self.cfg.data_root,
                                self.cfg.download, self.payload_privacy())

    def get_parameters(self, config):
        return model_arrays(self._model(self.settings.stream.classes_per_task))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        arrays, num, metrics = self.core.fit(list(parameters), dict(config))
        return arrays, num, {**self.base_metrics(), **metrics}

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        loss, num, metrics = self.core.evaluate(list(parameters), dict(config))
        return loss, num, {**self.base_metrics(), **metrics}
