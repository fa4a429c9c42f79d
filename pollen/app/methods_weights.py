"""Registry entries for the weights family (FedAvg, FedProx) and local-only training.

Both families share :mod:`pollen.protocol.weights` (the model state by name) and
:mod:`pollen.clients.weights`; their keys (``avg-weighting``, ``fedprox-mu``) are common keys
(``WeightKeys`` in :mod:`pollen.settings.common`), since ``fedprox-mu`` is every method's proximal
coefficient. Importing this module imports no torch: the clients are imported when a node first builds one,
and torch when the weights server builds its starting model (:func:`initial_model_arrays`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, Context

from pollen.app.method_spec import ClientAdapter, Family, MethodSpec, register_family, register_method, strategy_options
from pollen.datasets.tasks import TaskOptions, resolve_task
from pollen.models.spec import choose_model
from pollen.protocol import weights as weights_protocol
from pollen.settings import ConfigError, NodeConfig, RunConfig
from pollen.strategies.base import PollenStrategy
from pollen.strategies.weights import LocalOnly, WeightAveraging

if TYPE_CHECKING:
    from flwr.client import NumPyClient

WEIGHTS_FAMILY = register_family(Family(
    "weights", "Weight averaging",
    ("pollen.protocol.weights", "pollen.strategies.weights", "pollen.clients.weights", "pollen.app.methods_weights")))
LOCAL_FAMILY = register_family(Family(
    "local", "Local-only training",
    ("pollen.strategies.weights", "pollen.clients.weights", "pollen.app.methods_weights")))


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
    initial_arrays=initial_model_arrays, validate=validate_weights,
    dp_modes=("payload", "sample", "distributed")))
register_method(MethodSpec(
    name="fedprox", family="weights",
    description="FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2·||w - w_global||² (key fedprox-mu)",
    make_strategy=_weight_strategy(proximal=True), make_client=_weight_client, adapter=WEIGHTS,
    initial_arrays=initial_model_arrays, validate=validate_weights,
    dp_modes=("payload", "sample", "distributed")))
register_method(MethodSpec(
    name="local", family="local", description="Local-only training: no communication (lower bound)",
    make_strategy=_local_strategy, make_client=_local_client, adapter=WEIGHTS,
    personal_model=LOCAL_MODEL_KEY))
