"""Public-logit methods: FCCL, FCCL w/o CON, FedMD, FedDF and SOLO on domain-per-client tasks.

Homogeneous mode (paper Table 3) is configuration, not a separate method: run every client with the
same backbone (``model = "resnet12"``) and set ``fccl-average-weights = true``; then ``fccl`` is
"FCCL + averaging" (model states are averaged FedAvg-style and loaded before the collaborative step)
and ``solo`` with averaging is FedAvg evaluated per domain.

Importing this module, and building the strategy, imports no torch: the strategy is numpy-only, the
keys and recipes are declared in :mod:`pollen.methods.logit_settings`, and the client (torch) is imported
when a node first builds one (issue 30: start-up cost of the launcher and the ServerApp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pollen.app.method_spec import ClientAdapter, Family, MethodSpec, register_family, register_method, strategy_options
from pollen.datasets.public import PUBLIC_FOLDER
from pollen.datasets.tasks import TaskOptions, get_task, resolve_task
from pollen.datasets.user_data import UserDataError, count_unlabeled_images
from pollen.methods.logit_settings import (
    FCCL,
    FCCL_WITHOUT_CON,
    FEDDF,
    FEDMD,
    NET_KEY,
    SOLO,
    LogitOptions,
    LogitSettings,
    Recipe,
    resolve_settings,
)
from pollen.protocol import logits as logit_protocol
from pollen.settings import ConfigError, Key, NodeConfig, RunConfig, declared_keys, from_values
from pollen.strategies.base import PollenStrategy
from pollen.strategies.logits import LogitAveraging
from pollen.strategies.weights import LocalOnly

if TYPE_CHECKING:
    from flwr.app import Context
    from flwr.client import NumPyClient

FAMILY = register_family(Family("logits", "Logit methods", (
    "pollen.protocol.logits", "pollen.strategies.logits", "pollen.methods.logit_settings", "pollen.methods.logits",
    "pollen.methods.logit_losses", "pollen.clients.logits", "pollen.app.methods_logits")))

# The logit family's run keys, declared by its typed options (0 / "" = the profile's value, see
# pollen.methods.logit_settings.QUICK / PAPER).
LOGIT_KEYS: dict[str, Key] = declared_keys(LogitOptions)


# How a logit client's messages reach it: the consensus (and in homogeneous mode the model) in, logits out.
LOGITS = ClientAdapter(logit_protocol.decode_instruction)


def settings(cfg: RunConfig) -> LogitSettings:
    """The run's logit settings, resolved against its profile and task."""
    return resolve_settings(from_values(LogitOptions, cfg.extra), cfg.profile, get_task(cfg.task, "domains"))


def data_sizes(cfg: RunConfig) -> tuple[tuple[int, ...] | None, int]:
    """The sizes the logit client builds its data with (:meth:`pollen.clients.logits.LogitClient.data_sizes`)."""
    s = settings(cfg)
    return s.train_sizes, s.test_size


def _bad(key, value, expected) -> ConfigError:
    return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")


def validate(cfg: RunConfig) -> None:
    """What the ranges of the ``fccl-…`` keys cannot say, before any training (the registry has checked
    that the task is a domain-per-client one), and what the family's privacy needs."""
    if cfg.dp_mode != "off":
        averaging = from_values(LogitOptions, cfg.extra).average_weights
        if cfg.method == "solo" and not averaging:
            raise ConfigError("method 'solo' sends nothing to the server, so dp-mode has nothing to privatize: "
                              "set dp-mode = 'off'")
        if averaging:
            raise ConfigError("run config key 'fccl-average-weights' = true also sends model weights, which "
                              "dp-mode = 'payload' does not privatize for the logit family: set it to false")
    try:
        s = settings(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if s.public_batch_size < 2 or s.public_batch_size > s.public_size:
        raise ConfigError(f"run config keys 'fccl-public-batch-size' = {s.public_batch_size} and 'fccl-public-size' "
                          f"= {s.public_size}: need 2 <= batch size <= public size (batches drop the remainder, "
                          "and the cross-correlation needs >= 2 rows)")
    if any(n < 1 for n in s.train_sizes):
        raise _bad("fccl-train-sizes", from_values(LogitOptions, cfg.extra).train_sizes, "positive sizes")
    if s.public_dir and s.public != PUBLIC_FOLDER:
        raise ConfigError(f"run config key 'fccl-public-dir' is read only with fccl-public = '{PUBLIC_FOLDER}'; "
                          f"the run's public set is {s.public!r}")
    if s.public == PUBLIC_FOLDER and s.public_dir:  # else every node's node config 'public-dir' names it
        try:
            count = count_unlabeled_images(s.public_dir)
        except UserDataError as err:
            raise ConfigError(f"run config key 'fccl-public-dir': {err}") from err
        if count < s.public_size:
            raise ConfigError(f"run config key 'fccl-public-dir' = {s.public_dir!r} holds {count} images, fewer "
                              f"than fccl-public-size = {s.public_size}: set fccl-public-size <= {count}")


def make_strategy(cfg: RunConfig) -> PollenStrategy:
    s = settings(cfg)
    if cfg.method == "solo" and not s.average_weights:
        return LocalOnly(**strategy_options(cfg))
    num_classes = resolve_task(cfg.task, TaskOptions.of(cfg)).num_classes  # image-domains: from the run
    return LogitAveraging(num_public=s.public_size, num_classes=num_classes,
                          average_weights=s.average_weights, **strategy_options(cfg))


def client_factory(recipe: Recipe) -> Callable[[RunConfig, NodeConfig, Context], NumPyClient]:
    """The registry's ``make_client`` of ``recipe``: the shared logit client, imported on a node's first call."""

    def make(cfg: RunConfig, node: NodeConfig, context: Context) -> NumPyClient:
        from pollen.clients.logits import logit_client

        return logit_client(recipe)(cfg, node, context)

    return make


for _name, _recipe, _descr in (
    ("fccl", FCCL, "FCCL (Huang et al. 2022): cross-correlation to consensus public logits, "
                   "then CE + KL(previous model) + KL(SOLO model)"),
    ("fccl-wo-con", FCCL_WITHOUT_CON, "FCCL without the local dual-domain distillation (ablation): "
                                      "cross-correlation step, then CE only"),
    ("fedmd", FEDMD, "FedMD (Li & Wang 2019): L1 to consensus public logits, then CE only"),
    ("feddf", FEDDF, "FedDF (Lin et al. 2020), heterogeneous: KL to consensus public logits, then CE only"),
    ("solo", SOLO, "SOLO: each client trains alone (CE) from its pretrained model; with "
                   "fccl-average-weights = true, FedAvg evaluated per domain"),
):
    register_method(MethodSpec(name=_name, family="logits", description=_descr, make_strategy=make_strategy,
                               make_client=client_factory(_recipe), adapter=LOGITS,
                               data_sizes=data_sizes, personal_model=NET_KEY, keys=LOGIT_KEYS, validate=validate,
                               task_kinds=("domains",), dp_modes=("payload", "distributed"), leak_audit=True))
