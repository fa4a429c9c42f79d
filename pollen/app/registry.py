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

from pollen.app.adapters import LOCAL, WEIGHTS
from pollen.app.method_spec import (
    METHODS,
    MethodSpec,
    check_task_kind,
    method_defaults,
    register_method,
    strategy_options,
)
from pollen.app.run_keys import check
from pollen.datasets.tasks import resolve_task
from pollen.strategies.base import PollenStrategy
from pollen.strategies.weights import LocalOnly, WeightAveraging

if TYPE_CHECKING:
    from flwr.client import NumPyClient

    from pollen.app.config import NodeConfig, RunConfig

__all__ = ["METHODS", "MethodSpec", "check_task_kind", "initial_model_arrays", "method_defaults",
           "register_method", "strategy_options", "validate_method_config"]


def validate_method_config(cfg: RunConfig) -> None:
    """Each of the method's keys against its documented range (the one check of every run key), then
    the method's own checks that involve several keys, the task or the data."""
    spec = METHODS[cfg.method]
    check_task_kind(spec, cfg.task)
    for key in spec.defaults:
        check(key, cfg.extra[key])
    if spec.validate is not None:
        spec.validate(cfg)


def initial_model_arrays(cfg: RunConfig) -> ArrayRecord:
    """The shared starting model of weight-averaging methods, from the run seed (same as clients').
    The one place the weights family's server imports torch: when it builds this model."""
    import torch

    task = resolve_task(cfg.task, cfg.task_options())
    torch.manual_seed(cfg.seed)
    model = cfg.model_spec(task).build()
    return ArrayRecord(model.state_dict())


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


# context.state key of a local client's model (pollen.clients.weights.LocalClient.STATE_KEY; a test keeps them equal)
LOCAL_MODEL_KEY = "local-model"


register_method(MethodSpec(
    name="fedavg", family="weights", description="FedAvg (McMahan et al. 2017): average full model state",
    make_strategy=_weight_strategy(proximal=False), make_client=_weight_client, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays, dp_modes=("payload", "sample")))
register_method(MethodSpec(
    name="fedprox", family="weights",
    description="FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2·||w - w_global||² (key fedprox-mu)",
    make_strategy=_weight_strategy(proximal=True), make_client=_weight_client, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays, dp_modes=("payload", "sample")))
register_method(MethodSpec(
    name="local", family="local", description="Local-only training: no communication (lower bound)",
    make_strategy=_local_strategy, make_client=_local_client, adapter=LOCAL,
    personal_model=LOCAL_MODEL_KEY))

# Every other family registers itself on import: each ``pollen/app/methods_<family>.py`` module, found rather
# than listed, so a new family is its own module and nothing here.
for _family in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                      if m.name.startswith("methods_")):
    importlib.import_module(f"pollen.app.{_family}")
