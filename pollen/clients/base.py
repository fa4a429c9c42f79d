"""What every Pollen client shares: device, threads, seeds, its data, its model, its state.

Method clients subclass :class:`PollenClient` and implement ``fit``/``evaluate``. The client object
itself is rebuilt for every message (Flower calls ``client_fn`` each time), so anything that must
outlive one message goes through ``self.state`` (``context.state``). From the run and node config
(:mod:`pollen.settings`) it builds, once, the narrow values a method core takes: the task's options
(``TaskOptions``), its model (``ModelSpec``, :func:`pollen.models.catalog.choose_model`), the local
training (``LocalTraining``) and the privacy settings (``PrivacyConfig``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from flwr.client import NumPyClient
from flwr.common import Context

from pollen.clients.state import ClientState
from pollen.datasets.tasks import ClientData, TaskOptions, partition_data, resolve_task
from pollen.methods.training import LocalTraining, derive_seed, pick_device, seed_everything
from pollen.models import SMALL_MODELS, SplitModel, build_model, to_channels_last
from pollen.models.spec import ModelSpec, choose_model
from pollen.privacy.config import PrivacyConfig
from pollen.privacy.ledger import LedgerFile
from pollen.privacy.payload import PayloadPrivacy
from pollen.privacy.sample import SamplePrivacy
from pollen.protocol.records import Evaluation
from pollen.settings import NodeConfig, RunConfig

# Conv backbones are stored channels-last (NHWC): faster training on CPU as well as CUDA, see
# bench/backbones.py and bench/results/backbones.md. The small nets (SMALL_MODELS) keep the default layout.

@functools.lru_cache(maxsize=32)
def state_keys(name: str, num_classes: int, channels: int, size: int, width: float) -> tuple[str, ...]:
    with torch.device("meta"):  # shapes and names only: no memory, no init
        model = build_model(name, num_classes, in_channels=channels, image_size=size, width=width)
    return tuple(model.state_dict().keys())


class PollenClient(NumPyClient):
    """Base NumPyClient: resolved config, device, seeded RNG, lazily built data, state access."""

    # What this client releases under dp-mode = payload (pollen.privacy.config.PAYLOAD_UNITS).
    release_kind = "weights"

    def __init__(self, cfg: RunConfig, node: NodeConfig, context: Context):
        self.cfg = cfg
        self.node = node
        self.flower_context = context
        self.state = ClientState(context.state)
        self.task_options = TaskOptions.of(cfg, node)
        self.task = resolve_task(cfg.task, self.task_options)
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
        return LocalTraining.of(self.cfg)

    @functools.cached_property
    def privacy_config(self) -> PrivacyConfig:
        return PrivacyConfig.of(self.cfg)

    def ledger(self) -> LedgerFile:
        """This node's append-only ε ledger, beside its state (``<state-dir>/dp-ledger.json``): never
        rolled back with the state, so it counts every release the node ever made."""
        if not self.node.state_dir:
            raise ValueError(f"partition {self.partition_id}: differential privacy keeps its ledger in the node's "
                             "state folder, and this node has none (node config 'state-dir')")
        return LedgerFile.in_folder(self.node.state_dir)

    def payload_privacy(self) -> PayloadPrivacy | None:
        """``dp-mode = payload``: the mechanism and this partition's ledger; σ covers ``num-server-rounds``
        releases. ``None`` in any other mode."""
        if self.cfg.dp_mode != "payload":
            return None
        return PayloadPrivacy(self.privacy_config, self.cfg.num_server_rounds, self.ledger(),
                              f"partition {self.partition_id}", self.release_kind)

    def sample_privacy(self, prototypes: bool = False) -> SamplePrivacy | None:
        """``dp-mode = sample``: this client's DP-SGD plan over its training set (and, for ``prototypes``,
        the prototype release after training) and its ledger. ``None`` in any other mode."""
        if self.cfg.dp_mode != "sample":
            return None
        return SamplePrivacy(self.privacy_config, self.cfg.num_server_rounds, self.ledger(),
                             f"partition {self.partition_id}", num_records=self.data.num_train,
                             batch_size=self.cfg.batch_size, epochs=self.cfg.local_epochs, prototypes=prototypes)

    def released_evaluation(self, evaluation: Evaluation) -> Evaluation:
        """What an evaluate reply may carry: as it is, or under ``dp-evaluate = noised`` only its accuracies,
        noised and composed in this node's ledger (no loss, no test-set size; :mod:`pollen.privacy.evaluation`).
        Other private runs whose clients evaluate are refused before start, or chose ``unprotected``."""
        if self.cfg.dp_mode == "off" or self.cfg.dp_evaluate != "noised":
            return evaluation
        privacy = self.payload_privacy() or self.sample_privacy(prototypes=self.release_kind == "prototypes")
        if privacy is None:
            raise ValueError(f"dp-evaluate = 'noised' has no mechanism in dp-mode {self.cfg.dp_mode!r}")
        metrics, num = privacy.evaluation(evaluation.metrics, evaluation.num_examples)
        return Evaluation(None, num, {**self.base_metrics(), **metrics})

    def numpy_evaluation(self, evaluation: Evaluation) -> tuple[float, int, dict[str, Any]]:
        """``NumPyClient.evaluate``'s answer: the evaluation as the Message API releases it (a loss that
        is not released reads 0)."""
        out = self.released_evaluation(evaluation)
        return (0.0 if out.loss is None else float(out.loss)), out.num_examples, dict(out.metrics)

    def base_metrics(self) -> dict[str, Any]:
        return {"partition-id": self.partition_id}

    # data and model ------------------------------------------------------------------------
    @functools.cached_property
    def data(self) -> ClientData:
        """This partition's data, built by the task (:func:`~pollen.datasets.tasks.partition_data`, which
        ``pollen predict`` asks too); a family whose method settles the domain tasks' sizes passes them."""
        return partition_data(self.cfg.task, self.task_options, self.partition_id, self.node.num_partitions,
                              *self.data_sizes())

    def data_sizes(self) -> tuple[tuple[int, ...] | None, int]:
        """The domain tasks' training sizes and test size this client's method asks for: the task's own."""
        return None, 0

    def model_spec(self, **options: Any) -> ModelSpec:
        """This client's model (:func:`~pollen.models.catalog.choose_model`: node config beats run config
        beats the task's per-partition default), with the model's own keyword arguments ``options``."""
        return choose_model(self.cfg, self.task, self.node, options=options)

    @property
    def model_name(self) -> str:
        return self.model_spec().name

    def state_keys(self) -> list[str]:
        """Names of this client's model state in ``state_dict`` order (cached per architecture)."""
        spec = self.model_spec()
        return list(state_keys(spec.name, spec.num_classes, spec.in_channels, spec.image_size, spec.width))

    def new_model(self, init_seed: int | None = None, **kwargs) -> SplitModel:
        """A fresh model on this client's device; ``init_seed`` makes initial weights reproducible."""
        if init_seed is not None:
            torch.manual_seed(init_seed)
        spec = self.model_spec(**kwargs)
        model = spec.build().to(self.device)
        return model if spec.name in SMALL_MODELS else to_channels_last(model)
