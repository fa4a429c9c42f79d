"""Registry entries for the prototype family: ``fedproto`` and ``bd-fedproto``.

Both share :class:`~pollen.strategies.prototypes.PrototypeStrategy`; BD-FedProto's extras (CPA, DA)
are client-side. Run keys are prefixed ``proto-`` (``docs/usage.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pollen.app.adapters import PROTOTYPES
from pollen.app.config import ConfigError
from pollen.app.registry import MethodSpec, register_method, strategy_options
from pollen.clients.prototypes import (
    LOCAL_PROTO_MODES,
    NEGATIVE_FORMS,
    BDPrototypeClient,
    PrototypeClient,
    heterogeneous_channels,
)
from pollen.datasets.tasks import get_task, resolve_task
from pollen.models import build_model
from pollen.strategies.prototypes import PROTO_WEIGHTINGS, PrototypeStrategy

if TYPE_CHECKING:
    from pollen.app.config import RunConfig

PROTO_DEFAULTS = {
    "proto-lambda": 1.0,
    "proto-beta": 0.5,
    "proto-cpa": True,
    "proto-da": True,
    "proto-da-alpha": 0.5,
    "proto-da-t0": 2.0,
    "proto-da-kappa": 0.95,
    "proto-da-tmin": 0.05,
    "proto-negative": "hinge",
    "proto-tau": 0.5,
    "proto-weighting": "samples",
    "proto-local-protos": "post-pass",
    "proto-model-heter": False,
    "proto-evaluate-every": 1,
    "proto-pretrained": "",
}


PRETRAINED_MODELS = ("resnet18", "resnet34")


def _bad(key: str, value, expected: str) -> ConfigError:
    return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")


def _number(cfg: RunConfig, key: str, low: float, high: float | None = None, low_open: bool = False) -> float:
    value = cfg.extra[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, value, "a number")
    value = float(value)
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high) or value != value:
        rng = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise _bad(key, value, f"a number {rng}")
    return value


def _integer(cfg: RunConfig, key: str, low: int) -> int:
    value = cfg.extra[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < low:
        raise _bad(key, value, f"an integer >= {low}")
    return int(value)


def validate_proto(cfg: RunConfig) -> None:
    """Check every ``proto-…`` key before any data is loaded."""
    _number(cfg, "proto-lambda", 0.0, low_open=True)
    _number(cfg, "proto-beta", 0.0)
    _number(cfg, "proto-tau", 0.0, low_open=True)
    _number(cfg, "proto-da-alpha", 0.0, 1.0)
    _number(cfg, "proto-da-t0", 0.0, low_open=True)
    _number(cfg, "proto-da-kappa", 0.0, 1.0, low_open=True)
    _number(cfg, "proto-da-tmin", 0.0, low_open=True)
    _integer(cfg, "proto-evaluate-every", 1)
    for key in ("proto-cpa", "proto-da", "proto-model-heter"):
        if not isinstance(cfg.extra[key], bool):
            raise _bad(key, cfg.extra[key], "true or false")
    for key, allowed in (("proto-negative", NEGATIVE_FORMS), ("proto-weighting", PROTO_WEIGHTINGS),
                         ("proto-local-protos", LOCAL_PROTO_MODES)):
        if cfg.extra[key] not in allowed:
            raise _bad(key, cfg.extra[key], "one of " + ", ".join(allowed))
    pretrained = cfg.extra["proto-pretrained"]
    if not isinstance(pretrained, str):
        raise _bad("proto-pretrained", pretrained, "a path (string) or empty")
    name = cfg.model or get_task(cfg.task).model_for(0)
    if pretrained.strip() and name not in PRETRAINED_MODELS:
        raise _bad("proto-pretrained", pretrained,
                   f"empty: ImageNet stage weights fit only {', '.join(PRETRAINED_MODELS)} (model is {name!r})")
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
    personal_model=PrototypeClient.MODEL_KEY, defaults=dict(PROTO_DEFAULTS),
    validate=validate_proto))
register_method(MethodSpec(
    name="bd-fedproto", family="prototypes",
    description="BD-FedProto (Xu et al. 2024): FedProto + contrastive negatives (CPA) + dynamic λ_D (DA); "
                "CPA's loss form and DA's rule are reconstructed (keys proto-*)",
    make_strategy=make_prototype_strategy, make_client=BDPrototypeClient, adapter=PROTOTYPES,
    personal_model=PrototypeClient.MODEL_KEY, defaults=dict(PROTO_DEFAULTS),
    validate=validate_proto))
