"""One table from method name to (Message-API strategy, NumPyClient + records adapter, method run keys).

Method families register here; the ServerApp and ClientApp only ever look methods up by name, so a
new method is one entry, and ``method = "..."`` errors list exactly what exists. The mechanism
(:class:`MethodSpec`, :func:`register_method`) is :mod:`pollen.app.method_spec`; importing this module
fills the table: the weights family below, the other families from their ``methods_*`` modules.

Filling the table imports no torch (nor any client): the launcher checks run configs with it and a
ServerApp whose strategy is numpy-only never needs torch (issue 30: start-up cost). So a ``make_client``
imports its client when a node first calls it, and :func:`initial_model_arrays` imports torch when the
weights family's server builds its starting model.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, Context

from pollen.app.method_spec import (
    METHODS,
    ClientAdapter,
    MethodSpec,
    check_task_kind,
    method_defaults,
    register_method,
    strategy_options,
)
from pollen.datasets.tasks import TASKS, TaskOptions, resolve_task
from pollen.models.catalog import MODEL_NAMES
from pollen.models.spec import choose_model
from pollen.protocol import weights as weights_protocol
from pollen.settings import COMMON, ConfigError, Key, NodeConfig, RunConfig, allowed_values
from pollen.strategies.base import PollenStrategy
from pollen.strategies.weights import LocalOnly, WeightAveraging

if TYPE_CHECKING:
    from flwr.client import NumPyClient

__all__ = ["METHODS", "MethodSpec", "all_defaults", "all_keys", "check_task_kind", "choices", "initial_model_arrays",
           "method_defaults", "register_method", "registered_choices", "strategy_options"]


def all_keys() -> dict[str, Key]:
    """Every run key: the common ones, then each registered method family's."""
    out = dict(COMMON)
    for spec in METHODS.values():
        out.update(spec.keys)
    return out


def all_defaults() -> dict[str, object]:
    """Every run key the code knows, with its declared default."""
    return {key: spec.default for key, spec in all_keys().items()}


def registered_choices() -> dict[str, list[str]]:
    """The allowed values of the keys whose choices are a registry above the settings."""
    return {"method": sorted(METHODS), "task": sorted(TASKS), "model": ["", *MODEL_NAMES]}


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a ``choice`` key, as its declaration (or the registry it names) gives them."""
    return allowed_values(key, all_keys()[key], registered_choices())


def initial_model_arrays(cfg: RunConfig) -> ArrayRecord:
    """The shared starting model of weight-averaging methods, from the run seed (same as clients').
    The one place the weights family's server imports torch: when it builds this model."""
    import torch

    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    torch.manual_seed(cfg.seed)
    model = choose_model(cfg, task).build()
    return ArrayRecord(model.state_dict())


def validate_weights(cfg: RunConfig) -> None:
    """The weights family's rule: under DP the clients' sample counts are not released."""
    if cfg.dp_mode != "off" and cfg.avg_weighting != "uniform":
        raise ConfigError(f"run config key 'avg-weighting' = {cfg.avg_weighting!r} weights clients by their sample "
                          f"counts, which dp-mode = {cfg.dp_mode!r} does not release: set avg-weighting = 'uniform'")


def _weight_strategy(proximal: bool) -> Callable[[RunConfig], PollenStrategy]:
    def make(cfg: RunConfig) -> PollenStrategy:
        return WeightAveraging(weighting=cfg.avg_weighting, proximal_mu=cfg.fedprox_mu if proximal else 0.0,
                               **strategy_options(cfg))
    return make


def _local_strategy(cfg: RunConfig) -> PollenStrategy:
    return LocalOnly(**strategy_options(cfg))


def _weight_client(cfg: RunConfig, node: NodeConfig, context: Context) -> NumPyClient:
    from pollen.clients.weights import WeightClient  # torch: on the node, when it first builds a client

    return WeightClient(cfg, node, context)


def _local_client(cfg: RunConfig, node: NodeConfig, context: Context) -> NumPyClient:
    from pollen.clients.weights import LocalClient  # torch: on the node, when it first builds a client

    return LocalClient(cfg, node, context)


# A weights (and local) client reads the global state by name; a local client ignores it (none is sent).
WEIGHTS = ClientAdapter(weights_protocol.decode_instruction)

# context.state key of a local client's model (pollen.clients.weights.LocalClient.STATE_KEY; a test keeps them equal)
LOCAL_MODEL_KEY = "local-model"


register_method(MethodSpec(
    name="fedavg", family="weights", description="FedAvg (McMahan et al. 2017): average full model state",
    make_strategy=_weight_strategy(proximal=False), make_client=_weight_client, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays, validate=validate_weights, dp_modes=("payload", "sample")))
register_method(MethodSpec(
    name="fedprox", family="weights",
    description="FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2·||w - w_global||² (key fedprox-mu)",
    make_strategy=_weight_strategy(proximal=True), make_client=_weight_client, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays, validate=validate_weights, dp_modes=("payload", "sample")))
register_method(MethodSpec(
    name="local", family="local", description="Local-only training: no communication (lower bound)",
    make_strategy=_local_strategy, make_client=_local_client, adapter=WEIGHTS,
    personal_model=LOCAL_MODEL_KEY))

# Every other family registers itself on import: each ``pollen/app/methods_<family>.py`` module, found rather
# than listed, so a new family is its own module and nothing here.
for _family in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                      if m.name.startswith("methods_")):
    importlib.import_module(f"pollen.app.{_family}")
