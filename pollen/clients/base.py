"""What every Pollen client shares: device, threads, seeds, its data, its model, its state.

Method clients subclass :class:`PollenClient` and implement ``fit``/``evaluate``. The client object
itself is rebuilt for every message (Flower calls ``client_fn`` each time), so anything that must
outlive one message goes through ``self.state`` (``context.state``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from flwr.client import NumPyClient
from flwr.common import Context

from pollen.clients.state import ClientState
from pollen.datasets.tasks import ClientData, partition_data, resolve_task
from pollen.methods.training import LocalTraining, derive_seed, pick_device, seed_everything
from pollen.models import SMALL_MODELS, SplitModel, build_model, to_channels_last
from pollen.privacy.payload import PayloadPrivacy
from pollen.privacy.sample import SamplePrivacy

# Conv backbones are stored channels-last (NHWC): faster training on CPU as well as CUDA, see
# bench/backbones.py and bench/results/backbones.md. The small nets (SMALL_MODELS) keep the default layout.

@functools.lru_cache(maxsize=32)
def _state_keys(name: str, num_classes: int, channels: int, size: int, width: float) -> tuple[str, ...]:
    with torch.device("meta"):  # shapes and names only: no memory, no init
        model = build_model(name, num_classes, in_channels=channels, image_size=size, width=width)
    return tuple(model.state_dict().keys())


if TYPE_CHECKING:  # the app layer builds these; clients only read them
    from pollen.app.config import NodeConfig, RunConfig


class PollenClient(NumPyClient):
    """Base NumPyClient: resolved config, device, seeded RNG, lazily built data, state access."""

    def __init__(self, cfg: RunConfig, node: NodeConfig, context: Context):
        self.cfg = cfg
        self.node = node
        self.flower_context = context
        self.state = ClientState(context.state)
        self.task = resolve_task(cfg.task, cfg.task_options(node))
        torch.set_num_threads(cfg.torch_threads)
        self.device = pick_device(cfg.device)

    # identity and randomness ---------------------------------------------------------------
    @property
    def partition_id(self) -> int:
        return self.node.partition_id

    def round_generator(self, server_round: int, purpose: int = 0) -> torch.Generator:
        """Seed all RNGs from (run seed, partition, round, purpose): reproducible in any process."""
        return seed_everything(derive_seed(self.cfg.seed, self.partition_id, server_round, purpose))

    def local_training(self) -> LocalTraining:
        """The run's local optimisation settings, as a method core takes them."""
        c = self.cfg
        return LocalTraining(epochs=c.local_epochs, batch_size=c.batch_size, lr=c.lr, momentum=c.momentum,
                             weight_decay=c.weight_decay, proximal_mu=c.fedprox_mu)

    def payload_privacy(self) -> PayloadPrivacy | None:
        """``dp-mode = payload``: the mechanism and this partition's ledger (in ``context.state``);
        σ covers ``num-server-rounds`` releases. ``None`` in any other mode."""
        if self.cfg.dp_mode != "payload":
            return None
        return PayloadPrivacy(self.cfg.privacy, self.cfg.num_server_rounds, self.state,
                              f"partition {self.partition_id}")

    def sample_privacy(self, prototypes: bool = False) -> SamplePrivacy | None:
        """``dp-mode = sample``: this client's DP-SGD plan over its training set (and, for ``prototypes``,
        the prototype release after training) and its ledger. ``None`` in any other mode."""
        if self.cfg.dp_mode != "sample":
            return None
        return SamplePrivacy(self.cfg.privacy, self.cfg.num_server_rounds, self.state, f"partition {self.partition_id}",
                             num_records=self.data.num_train, batch_size=self.cfg.batch_size,
                             epochs=self.cfg.local_epochs, prototypes=prototypes)

    def base_metrics(self) -> dict[str, Any]:
        return {"partition-id": self.partition_id}

    # data and model ------------------------------------------------------------------------
    @functools.cached_property
    def data(self) -> ClientData:
        """This partition's data, built by the task (:func:`~pollen.datasets.tasks.partition_data`, which
        ``pollen predict`` asks too); a family whose method settles the domain tasks' sizes passes them."""
        return partition_data(self.cfg.task, self.cfg.task_options(self.node), self.partition_id,
                              self.node.num_partitions, *self.data_sizes())

    def data_sizes(self) -> tuple[tuple[int, ...] | None, int]:
        """The domain tasks' training sizes and test size this client's method asks for: the task's own."""
        return None, 0

    @property
    def model_name(self) -> str:
        """Node config beats run config beats the task's per-partition default."""
        return self.node.model or self.cfg.model or self.task.model_for(self.partition_id)

    def state_keys(self) -> list[str]:
        """Names of this client's model state in ``state_dict`` order (cached per architecture)."""
        fmt = self.task.fmt
        return list(_state_keys(self.model_name, self.task.num_classes, fmt.channels, fmt.size,
                                self.cfg.width_for(self.model_name)))

    def new_model(self, init_seed: int | None = None, **kwargs) -> SplitModel:
        """A fresh model on this client's device; ``init_seed`` makes initial weights reproducible."""
        if init_seed is not None:
            torch.manual_seed(init_seed)
        model = self.cfg.model_spec(self.task, self.model_name, **kwargs).build().to(self.device)
        return model if self.model_name in SMALL_MODELS else to_channels_last(model)
