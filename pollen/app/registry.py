"""One table from method name to (Strategy, NumPyClient, method run keys).

Method families register here; the ServerApp and ClientApp only ever look methods up by name, so a
new method is one entry, and ``method = "..."`` errors list exactly what exists.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from flwr.common import Context, ndarrays_to_parameters
from flwr.server.strategy import Strategy

from pollen.clients.weights import LocalClient, WeightClient, model_arrays
from pollen.datasets.tasks import get_task
from pollen.models import build_model
from pollen.strategies.weights import LocalOnly, WeightAveraging

if TYPE_CHECKING:
    from flwr.client import NumPyClient

    from pollen.app.config import NodeConfig, RunConfig


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str
    description: str
    make_strategy: Callable[["RunConfig"], Strategy]
    make_client: Callable[["RunConfig", "NodeConfig", Context], "NumPyClient"]
    # Method run keys (prefixed, e.g. "fccl-...") with defaults; must also be in pyproject.toml.
    defaults: dict[str, Any] = field(default_factory=dict)
    validate: Callable[["RunConfig"], None] | None = None


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    METHODS[spec.name] = spec
    return spec


def method_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in METHODS.values():
        out.update(spec.defaults)
    return out


def validate_method_config(cfg: "RunConfig") -> None:
    spec = METHODS[cfg.method]
    if spec.validate is not None:
        spec.validate(cfg)


def initial_model_arrays(cfg: "RunConfig") -> list[np.ndarray]:
    """The shared starting model of weight-averaging methods, from the run seed (same as clients')."""
    task = get_task(cfg.task)
    torch.manual_seed(cfg.seed)
    name = cfg.model or task.default_model
    model = build_model(name, task.num_classes, in_channels=task.fmt.channels, image_size=task.fmt.size,
                        width=cfg.width_for(name))
    return model_arrays(model)


def _weight_strategy(proximal: bool) -> Callable[["RunConfig"], Strategy]:
    def make(cfg: "RunConfig") -> Strategy:
        random.seed(cfg.seed)  # Flower samples clients with the global `random`
        return WeightAveraging(
            initial_parameters=ndarrays_to_parameters(initial_model_arrays(cfg)),
            weighting=cfg.avg_weighting, proximal_mu=cfg.fedprox_mu if proximal else 0.0,
            fraction_fit=cfg.fraction_fit, fraction_evaluate=cfg.fraction_evaluate,
            min_fit_clients=1, min_evaluate_clients=1 if cfg.fraction_evaluate > 0 else 0,
            min_available_clients=cfg.min_available_clients)
    return make


def _local_strategy(cfg: "RunConfig") -> Strategy:
    return LocalOnly(fraction_evaluate=cfg.fraction_evaluate, min_available_clients=cfg.min_available_clients)


register_method(MethodSpec(
    name="fedavg", family="weights", description="FedAvg (McMahan et al. 2017): average full model state",
    make_strategy=_weight_strategy(proximal=False), make_client=WeightClient))
register_method(MethodSpec(
    name="fedprox", family="weights",
    description="FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2·||w - w_global||² (key fedprox-mu)",
    make_strategy=_weight_strategy(proximal=True), make_client=WeightClient))
register_method(MethodSpec(
    name="local", family="local", description="Local-only training: no communication (lower bound)",
    make_strategy=_local_strategy, make_client=LocalClient))

# Method families register themselves on import (one line each, below).
from pollen.app import methods_prototypes  # noqa: E402,F401
from pollen.app import methods_logits  # noqa: E402,F401
from pollen.app import methods_glfc  # noqa: E402,F401
