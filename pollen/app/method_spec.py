"""What a family and a method are (:class:`Family`, :class:`MethodSpec`) and the tables they register in
(:data:`FAMILIES`, :data:`METHODS`).

The mechanism only: :mod:`pollen.app.registry` fills the tables from the ``methods_<family>`` modules, so a
family module imports this and never the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, RecordDict

from pollen.datasets.tasks import TASK_KINDS, TASKS, TaskOptions, get_task, resolve_task
from pollen.privacy.bounds import DpBounds, dp_bounds
from pollen.privacy.config import PrivacyConfig, release_unit
from pollen.protocol.identity import parse_partition_pins
from pollen.protocol.screening import PayloadBounds
from pollen.settings import ConfigError, Key, NodeConfig, RunConfig
from pollen.strategies.base import PollenStrategy
from pollen.strategies.network import NetworkModel

if TYPE_CHECKING:
    from flwr.client import NumPyClient


@dataclass(frozen=True)
class ClientAdapter:
    """How one family's messages reach its ``NumPyClient``: ``decode`` (the family's protocol module) turns
    a message's named records into the typed instruction; the client's ``train``/``test`` take it and
    return named values (a reply with its ``content()``, an :class:`~pollen.protocol.records.Evaluation`),
    so the records on the wire are exactly what an external client would send."""

    decode: Callable[[RecordDict], Any]

    def train(self, client: Any, content: RecordDict) -> RecordDict:
        return client.train(self.decode(content)).content()

    def evaluate(self, client: Any, content: RecordDict) -> RecordDict:
        return client.released_evaluation(client.test(self.decode(content))).content()


@dataclass(frozen=True)
class Family:
    """A payload kind, in one place: its name, the heading of its keys in ``docs/usage.md``, and the
    modules that are its own (protocol, strategy, settings, core, client, this registration), by import
    name. Whatever else it uses is shared machinery (``tests/test_families.py`` lists and bounds them)."""

    name: str
    title: str
    modules: tuple[str, ...]


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str
    description: str
    make_strategy: Callable[[RunConfig], PollenStrategy]
    make_client: Callable[[RunConfig, NodeConfig, Context], NumPyClient]
    adapter: ClientAdapter | None = None
    # The ServerApp's initial_arrays (weights: the shared starting model); empty by default.
    initial_arrays: Callable[[RunConfig], ArrayRecord] = lambda cfg: ArrayRecord()
    # The number of SuperNodes this configuration needs (None: any); the default asks the task.
    required_nodes: Callable[[RunConfig], int | None] = (
        lambda cfg: resolve_task(cfg.task, TaskOptions.of(cfg)).fixed_partitions)
    # The domain tasks' training sizes and test size its clients build their data with (None, 0: the
    # task's own), for whoever rebuilds a partition without a client (`pollen predict`).
    data_sizes: Callable[[RunConfig], tuple[tuple[int, ...] | None, int]] = lambda cfg: (None, 0)
    # The context.state key of the client's personal model, saved as the node's final-model.safetensors.
    personal_model: str | None = None
    # Method run keys (prefixed, e.g. "fccl-..."): the family's settings class, read with declared_keys.
    keys: dict[str, Key] = field(default_factory=dict)
    validate: Callable[[RunConfig], None] | None = None
    # The kinds of task the method runs on (pollen.datasets.tasks.TASK_KINDS), checked before anything starts.
    task_kinds: tuple[str, ...] = ("partitioned",)
    # The dp-mode values its clients implement (docs/privacy.md); any other is refused before start.
    dp_modes: tuple[str, ...] = ()
    # Whether its strategy asks clients to evaluate (fraction-evaluate); GLFC evaluates on the server.
    client_evaluation: bool = True
    # Whether its clients measure what their release reveals under leak-audit (docs/privacy.md).
    leak_audit: bool = False

    @property
    def defaults(self) -> dict[str, Any]:
        return {key: spec.default for key, spec in self.keys.items()}


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    if spec.family not in FAMILIES:
        raise ValueError(f"method {spec.name!r}: register its family {spec.family!r} first (register_family)")
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def method_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in METHODS.values():
        out.update(spec.defaults)
    return out


def check_task_kind(spec: MethodSpec, task: str) -> None:
    """Refuse a task of a kind the method does not run on, naming the tasks it does run on."""
    kind = get_task(task).kind
    if kind in spec.task_kinds:
        return
    fitting = sorted(name for name, t in TASKS.items() if t.kind in spec.task_kinds)
    wanted = " or ".join(TASK_KINDS[k][0] for k in spec.task_kinds)
    raise ConfigError(f"method {spec.name!r} needs {wanted}: set task to one of {', '.join(fitting)} "
                      f"(task {task!r} is {TASK_KINDS[kind][0]})")


def _dp_bounds(cfg: RunConfig) -> DpBounds | None:
    """The screening bounds of the run's DP keys, σ as the clients size it for what their releases protect."""
    config = PrivacyConfig.of(cfg)
    if not config.private:
        return None
    return dp_bounds(config, cfg.num_server_rounds, unit=release_unit(METHODS[cfg.method].family, config.mode),
                     sgd_epochs=cfg.local_epochs, sgd_batch=cfg.batch_size)


def strategy_options(cfg: RunConfig) -> dict[str, Any]:
    """The sampling, failure and screening options every method's strategy takes from the run config."""
    # distributed DP samples by Poisson on the clients themselves (each its own secret draw with probability
    # fraction-fit, pollen.privacy.distributed): the strategy asks every connected client
    poisson = cfg.dp_mode == "distributed"
    return {"fraction_train": 1.0 if poisson else cfg.fraction_fit, "fraction_evaluate": cfg.fraction_evaluate,
            "min_available_nodes": cfg.min_available_clients, "num_rounds": cfg.num_server_rounds,
            "min_evaluate_nodes": 1 if cfg.fraction_evaluate > 0 else 0, "seed": cfg.seed,
            "max_empty_rounds": cfg.max_empty_rounds, "min_train_nodes": cfg.min_train_clients,
            # dropouts, slow clients, a round deadline (docs/stragglers.md); under secure aggregation on its stages
            "network": None if cfg.secure_aggregation else NetworkModel.of(cfg),
            "identify_nodes": cfg.sample_by_partition,  # Pollen's ClientApp answers QUERY
            "aggregation": cfg.aggregation, "trim_fraction": cfg.trim_fraction, "outlier_factor": cfg.outlier_factor,
            "bounds": PayloadBounds(cfg.max_update_norm, cfg.max_logit_abs, cfg.max_grad_norm,
                                    _dp_bounds(cfg)),
            "partition_pins": parse_partition_pins(cfg.partition_pins)}
