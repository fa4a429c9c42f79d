"""Registry entries for the prototype family: ``fedproto`` and ``bd-fedproto``.

Both share :class:`~pollen.strategies.prototypes.PrototypeStrategy`; BD-FedProto's extras (CPA, DA)
are client-side. Run keys are prefixed ``proto-`` (``docs/usage.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pollen.app.adapters import PROTOTYPES
from pollen.app.config import ConfigError
from pollen.app.registry import MethodSpec, register_method, strategy_options
from pollen.app.run_keys import Key
from pollen.clients.prototypes import (
    BDPrototypeClient,
    PrototypeClient,
    heterogeneous_channels,
)
from pollen.datasets.tasks import get_task, resolve_task
from pollen.models import build_model
from pollen.strategies.prototypes import PrototypeStrategy

if TYPE_CHECKING:
    from pollen.app.config import RunConfig

# The prototype family's run keys: default, range, help (pyproject.toml repeats the defaults).
PROTO_KEYS: dict[str, Key] = {
    "proto-lambda": Key(1.0, "float > 0", "λ (λ_0 for BD-FedProto): weight of the prototype loss L_P"),
    "proto-beta": Key(0.5, "float >= 0", "β: weight of CPA's negative loss L_N (BD-FedProto)"),
    "proto-cpa": Key(True, "bool",
        "BD-FedProto: use CPA's negatives (the global prototypes of classes the client lacks)"),
    "proto-da": Key(True, "bool", "BD-FedProto: adapt λ_D each round (DA); false = fixed λ"),
    "proto-da-alpha": Key(0.5, "float in [0, 1]", "DA smoothing α of λ_D"),
    "proto-da-t0": Key(2.0, "float > 0", "DA annealing temperature T_0"),
    "proto-da-kappa": Key(0.95, "float in (0, 1]", "DA temperature decay κ per round"),
    "proto-da-tmin": Key(0.05, "float > 0", "DA minimum temperature"),
    "proto-negative": Key("hinge", "choice", "form of CPA's negative loss: margin hinge or InfoNCE"),
    "proto-tau": Key(0.5, "float > 0", "temperature of the InfoNCE negatives and of the MI monitor"),
    "proto-weighting": Key("samples", "choice",
        "server average per class: by class counts, or `uniform` (the official code)"),
    "proto-local-protos": Key("post-pass", "choice",
        "local prototypes from a pass after training, or training-time features (the official code)"),
    "proto-model-heter": Key(False, "bool", "FedProto's model-heterogeneous CNNs (18/20/22 channels by client)"),
    "proto-evaluate-every": Key(1, "int >= 1", "evaluate every N rounds (and in the last)"),
    "proto-pretrained": Key("", "path",
        "local ImageNet ResNet-18/34 state dict loaded into every client (all but conv1/bn1/fc); empty = none"),
}


PRETRAINED_MODELS = ("resnet18", "resnet34")


def validate_proto(cfg: RunConfig) -> None:
    """What the ranges of the ``proto-…`` keys cannot say (checked before any data is loaded)."""
    pretrained = cfg.extra["proto-pretrained"]
    name = cfg.model or get_task(cfg.task).model_for(0)
    if pretrained.strip() and name not in PRETRAINED_MODELS:
        raise ConfigError(f"run config key 'proto-pretrained' = {pretrained!r} is invalid: expected empty: "
                          f"ImageNet stage weights fit only {', '.join(PRETRAINED_MODELS)} (model is {name!r})")
    embed_dim(cfg)


def embed_dim(cfg: RunConfig) -> int:
    """d of the task's model; every client's encoder must match it (checked on each reply)."""
    task = resolve_task(cfg.task, cfg.task_options())
    name = cfg.model or task.model_for(0)
    kwargs = {"channels": heterogeneous_channels(0)} if cfg.extra["proto-model-heter"] and name == "cnn_mnist" else {}
    model = build_model(name, task.num_classes, in_channels=task.fmt.channels, image_size=task.fmt.size,
                        width=cfg.width_for(name), **kwargs)
    return model.feature_dim


def make_prototype_strategy(cfg: RunConfig) -> PrototypeStrategy:
    return PrototypeStrategy(
        num_classes=resolve_task(cfg.task, cfg.task_options()).num_classes, embed_dim=embed_dim(cfg),
        weighting=cfg.extra["proto-weighting"], evaluate_every=int(cfg.extra["proto-evaluate-every"]),
        **strategy_options(cfg))


register_method(MethodSpec(
    name="fedproto", family="prototypes",
    description="FedProto (Tan et al. 2022): clients share class prototypes; L_S + λ·L_P (keys proto-*)",
    make_strategy=make_prototype_strategy, make_client=PrototypeClient, adapter=PROTOTYPES,
    personal_model=PrototypeClient.MODEL_KEY, keys=PROTO_KEYS,
    validate=validate_proto))
register_method(MethodSpec(
    name="bd-fedproto", family="prototypes",
    description="BD-FedProto (Xu et al. 2024): FedProto + contrastive negatives (CPA) + dynamic λ_D (DA); "
                "CPA's loss form and DA's rule are reconstructed (keys proto-*)",
    make_strategy=make_prototype_strategy, make_client=BDPrototypeClient, adapter=PROTOTYPES,
    personal_model=PrototypeClient.MODEL_KEY, keys=PROTO_KEYS,
    validate=validate_proto))
