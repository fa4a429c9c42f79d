"""One table from method name to (Message-API strategy, NumPyClient + records adapter, method run keys).

Method families register here; the ServerApp and ClientApp only ever look methods up by name, so a
new method is one entry, and ``method = "..."`` errors list exactly what exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, Context

from pollen.app.adapters import LOCAL, WEIGHTS, ClientAdapter
from pollen.clients.weights import LocalClient, WeightClient
from pollen.datasets.tasks import TASK_KINDS, TASKS, get_task, resolve_task
from pollen.models import build_model
from pollen.privacy.bounds import dp_bounds
from pollen.protocol.identity import parse_partition_pins
from pollen.protocol.screening import PayloadBounds
from pollen.strategies.base import PollenStrategy
from pollen.strategies.weights import LocalOnly, WeightAveraging

if TYPE_CHECKING:
    from flwr.client import NumPyClient

    from pollen.app.config import NodeConfig, RunConfig
    from pollen.app.run_keys import Key


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
        lambda cfg: resolve_task(cfg.task, cfg.task_options()).fixed_partitions)
    # The context.state key of the client's personal model, saved as the node's final-model.safetensors.
    personal_model: str | None = None
    # Method run keys (prefixed, e.g. "fccl-..."): default, range, help; defaults also in pyproject.toml.
    keys: dict[str, Key] = field(default_factory=dict)
    validate: Callable[[RunConfig], None] | None = None
    # The kinds of task the method runs on (pollen.datasets.tasks.TASK_KINDS), checked before anything starts.
    task_kinds: tuple[str, ...] = ("partitioned",)

    @property
    def defaults(self) -> dict[str, Any]:
        return {key: spec.default for key, spec in self.keys.items()}


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def method_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in METHODS.values():
        out.update(spec.defaults)
    return out


def validate_method_config(cfg: RunConfig) -> None:
    """Each of the method's keys against its documented range (the one check of every run key), then
    the method's own checks that involve several keys, the task or the data."""
    from pollen.app.run_keys import check

    spec = METHODS[cfg.method]
    check_task_kind(spec, cfg.task)
    for key in spec.defaults:
        check(key, cfg.extra[key])
    if spec.validate is not None:
        spec.validate(cfg)


def check_task_kind(spec: MethodSpec, task: str) -> None:
    """Refuse a task of a kind the method does not run on, naming the tasks it does run on."""
    from pollen.app.config import ConfigError

    kind = get_task(task).kind
    if kind in spec.task_kinds:
        return
    fitting = sorted(name for name, t in TASKS.items() if t.kind in spec.task_kinds)
    wanted = " or ".join(TASK_KINDS[k][0] for k in spec.task_kinds)
    raise ConfigError(f"method {spec.name!r} needs {wanted}: set task to one of {', '.join(fitting)} "
                      f"(task {task!r} is {TASK_KINDS[kind][0]})")


def strategy_options(cfg: RunConfig) -> dict[str, Any]:
    """The sampling, failure and screening options every method's strategy takes from the run config."""
    return {"fraction_train": cfg.fraction_fit, "fraction_evaluate": cfg.fraction_evaluate,
            "min_available_nodes": cfg.min_available_clients, "num_rounds": cfg.num_server_rounds,
            "min_evaluate_nodes": 1 if cfg.fraction_evaluate > 0 else 0, "seed": cfg.seed,
            "max_empty_rounds": cfg.max_empty_rounds,
            "identify_nodes": cfg.sample_by_partition,  # Pollen's ClientApp answers QUERY
            "aggregation": cfg.aggregation, "trim_fraction": cfg.trim_fraction,
            "bounds": PayloadBounds(cfg.max_update_norm, cfg.max_logit_abs, cfg.max_grad_norm,
                                    dp_bounds(cfg.privacy, cfg.num_server_rounds)),  # σ as the clients size it
            "partition_pins": parse_partition_pins(cfg.partition_pins)}


def initial_model_arrays(cfg: RunConfig) -> ArrayRecord:
    """The shared starting model of weight-averaging methods, from the run seed (same as clients')."""
    task = resolve_task(cfg.task, cfg.task_options())
    torch.manual_seed(cfg.seed)
    name = cfg.model or task.default_model
    model = build_model(name, task.num_classes, in_channels=task.fmt.channels, image_size=task.fmt.size,
                        width=cfg.width_for(name))
    return ArrayRecord(model.state_dict())


def _weight_strategy(proximal: bool) -> Callable[[RunConfig], PollenStrategy]:
    def make(cfg: RunConfig) -> PollenStrategy:
        return WeightAveraging(weighting=cfg.avg_weighting, proximal_mu=cfg.fedprox_mu if proximal else 0.0,
                               **strategy_options(cfg))
    return make


def _local_strategy(cfg: RunConfig) -> PollenStrategy:
    return LocalOnly(**strategy_options(cfg))


register_method(MethodSpec(
    name="fedavg", family="weights", description="FedAvg (McMahan et al. 2017): average full model state",
    make_strategy=_weight_strategy(proximal=False), make_client=WeightClient, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays))
register_method(MethodSpec(
    name="fedprox", family="weights",
    description="FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2·||w - w_global||² (key fedprox-mu)",
    make_strategy=_weight_strategy(proximal=True), make_client=WeightClient, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays))
register_method(MethodSpec(
    name="local", family="local", description="Local-only training: no communication (lower bound)",
    make_strategy=_local_strategy, make_client=LocalClient, adapter=LOCAL,
    personal_model=LocalClient.STATE_KEY))

# Method families register themselves on import (one line each, below).
from pollen.app import (
    methods_glfc,  # noqa: E402,F401
    methods_logits,  # noqa: E402,F401
    methods_prototypes,  # noqa: E402,F401
)
