"""Registry entries for the prototype family: ``fedproto``, ``bd-fedproto`` and ``fedproto-prox``.

All share :class:`~pollen.strategies.prototypes.PrototypeStrategy` and one client; a method differs
only in its loss terms (:class:`~pollen.methods.prototypes.PrototypeMethod`). Run keys are prefixed
``proto-`` (``docs/usage.md``), declared once by :class:`~pollen.methods.prototype_settings.ProtoSettings`.

Importing this module, and building the strategy, imports no torch: the strategy is numpy-only and
its one model fact, the embedding size d, comes from :mod:`pollen.models.catalog`; a method is
registered by name and its client (torch) is imported when a node first builds one (issue 30:
start-up cost of the launcher and the ServerApp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pollen.app.method_spec import ClientAdapter, Family, MethodSpec, register_family, register_method, strategy_options
from pollen.datasets.tasks import TaskOptions, get_task, resolve_task
from pollen.methods.prototype_settings import MODEL_KEY, ProtoSettings, heterogeneous_channels
from pollen.models.spec import choose_model
from pollen.protocol import prototypes as proto_protocol
from pollen.settings import ConfigError, Key, NodeConfig, RunConfig, declared_keys, from_values
from pollen.strategies.prototypes import PrototypeStrategy

if TYPE_CHECKING:
    from flwr.app import Context
    from flwr.client import NumPyClient

FAMILY = register_family(Family("prototypes", "Prototype methods", (
    "pollen.protocol.prototypes", "pollen.strategies.prototypes", "pollen.methods.prototype_settings",
    "pollen.methods.prototypes", "pollen.methods.prototype_losses", "pollen.clients.prototypes",
    "pollen.app.methods_prototypes")))

# The prototype family's run keys, declared by its typed settings.
PROTO_KEYS: dict[str, Key] = declared_keys(ProtoSettings)


# How a prototype client's messages reach it: the global prototypes by name in, its release out.
PROTOTYPES = ClientAdapter(proto_protocol.decode_instruction)


PRETRAINED_MODELS = ("resnet18", "resnet34")


def settings(cfg: RunConfig) -> ProtoSettings:
    return from_values(ProtoSettings, cfg.extra)


def validate_proto(cfg: RunConfig) -> None:
    """What the ranges of the ``proto-…`` keys cannot say (checked before any data is loaded), and what
    the family's privacy needs."""
    if cfg.dp_mode != "off" and settings(cfg).local_protos == "training":
        raise ConfigError("run config key 'proto-local-protos' = 'training' releases training-time features, but "
                          f"dp-mode = {cfg.dp_mode!r} clips the embeddings of a pass after training: set "
                          "proto-local-protos = 'post-pass'")
    if (cfg.dp_mode == "sample" and cfg.method == "bd-fedproto" and settings(cfg).cpa
            and get_task(cfg.task).resolve is not None):
        raise ConfigError(f"dp-mode = 'sample' with bd-fedproto on task {cfg.task!r}: its contrastive negatives "
                          "(proto-cpa) are the classes a client does not hold, which on user data are read off the "
                          "client's labels, a statistic of the whole dataset that DP-SGD keeps out of every "
                          "per-sample loss. Set proto-cpa = false, use dp-mode = 'payload', or a task whose plan "
                          "fixes each client's classes")
    pretrained = settings(cfg).pretrained
    name = choose_model(cfg, get_task(cfg.task)).name
    if pretrained.strip() and name not in PRETRAINED_MODELS:
        raise ConfigError(f"run config key 'proto-pretrained' = {pretrained!r} is invalid: expected empty: "
                          f"ImageNet stage weights fit only {', '.join(PRETRAINED_MODELS)} (model is {name!r})")
    embed_dim(cfg)


def embed_dim(cfg: RunConfig) -> int:
    """d of the task's model; every client's encoder must match it (checked on each reply).

    Read from :mod:`pollen.models.catalog`, without building the model (no torch); only a model the
    catalog does not describe (one added with ``register_model``) is built, as every model was before."""
    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    name = choose_model(cfg, task).name
    kwargs = {"channels": heterogeneous_channels(0)} if settings(cfg).model_heter and name == "cnn_mnist" else {}
    spec = choose_model(cfg, task, options=kwargs)
    try:
        declared = spec.feature_dim
    except ValueError as err:  # the arguments the model would refuse, refused before any round
        raise ConfigError(f"model {name!r} on task {cfg.task!r}: {err}") from None
    if declared is not None:
        return declared
    return spec.build().feature_dim


def make_prototype_strategy(cfg: RunConfig) -> PrototypeStrategy:
    return PrototypeStrategy(
        num_classes=resolve_task(cfg.task, TaskOptions.of(cfg)).num_classes, embed_dim=embed_dim(cfg),
        weighting=settings(cfg).weighting, evaluate_every=settings(cfg).evaluate_every,
        **strategy_options(cfg))


def client_factory(name: str) -> Callable[[RunConfig, NodeConfig, Context], NumPyClient]:
    """The registry's ``make_client`` of method ``name``: the shared client with the method's core
    (:data:`pollen.methods.prototypes.PROTOTYPE_METHODS`), both imported on a node's first call only."""

    def make(cfg: RunConfig, node: NodeConfig, context: Context) -> NumPyClient:
        from pollen.clients.prototypes import prototype_client
        from pollen.methods.prototypes import PROTOTYPE_METHODS

        return prototype_client(PROTOTYPE_METHODS[name])(cfg, node, context)

    return make


def register_prototype_method(name: str, description: str) -> None:
    """A prototype-family method: the shared strategy and client, its own loss terms (the
    :class:`~pollen.methods.prototypes.PrototypeMethod` called ``name``)."""
    register_method(MethodSpec(
        name=name, family="prototypes", description=description,
        make_strategy=make_prototype_strategy, make_client=client_factory(name), adapter=PROTOTYPES,
        personal_model=MODEL_KEY, keys=PROTO_KEYS, validate=validate_proto,
        dp_modes=("payload", "sample", "distributed"), leak_audit=True))


register_prototype_method(
    "fedproto", "FedProto (Tan et al. 2022): clients share class prototypes; L_S + λ·L_P (keys proto-*)")
register_prototype_method(
    "bd-fedproto", "BD-FedProto (Xu et al. 2024): FedProto + contrastive negatives (CPA) + dynamic λ_D (DA); "
                   "CPA's loss form and DA's rule are reconstructed (keys proto-*)")
register_prototype_method(
    "fedproto-prox", "FedProto + a proximal term μ/2·‖w − w_start‖² on the private model (keys proto-*, "
                     "fedprox-mu): the worked example of docs/development.md")
