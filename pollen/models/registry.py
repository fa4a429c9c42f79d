"""Build any Pollen model by name, so configs and task definitions can name architectures."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import SplitModel
from .catalog import MODEL_NAMES, SMALL_MODELS, feature_dim
from .mobile import EfficientNetB0, GoogLeNet, MobileNetV2
from .resnet import RESNET_BLOCKS, ResNet
from .small import CNNMnist, LeNet


@dataclass(frozen=True)
class ModelEntry:
    """How to build one named architecture, and the extra keyword arguments it accepts."""

    build: Callable[..., SplitModel]
    kwargs: tuple[str, ...] = ()


MODELS: dict[str, ModelEntry] = {}


def register_model(name: str, build: Callable[..., SplitModel], kwargs: tuple[str, ...] = ()) -> None:
    """Make ``name`` buildable by :func:`build_model` (and selectable by ``model``); a name is taken once."""
    if name in MODELS:
        raise ValueError(f"model {name!r} is already registered")
    MODELS[name] = ModelEntry(build, tuple(kwargs))


def _resnet(name: str) -> Callable[..., SplitModel]:
    def make(num_classes: int, in_channels: int, image_size: int, width: float, **kw: Any) -> SplitModel:
        return ResNet(RESNET_BLOCKS[name], num_classes, in_channels=in_channels, width=width)

    return make


def _no_size(cls: type) -> Callable[..., SplitModel]:
    """Globally pooled nets accept any input size, so ``image_size`` is only validated."""

    def make(num_classes: int, in_channels: int, image_size: int, width: float, **kw: Any) -> SplitModel:
        return cls(num_classes, in_channels=in_channels, width=width, **kw)

    return make


def _sized(cls: type) -> Callable[..., SplitModel]:
    def make(num_classes: int, in_channels: int, image_size: int, width: float, **kw: Any) -> SplitModel:
        return cls(num_classes, in_channels=in_channels, image_size=image_size, width=width, **kw)

    return make


for _name in RESNET_BLOCKS:
    register_model(_name, _resnet(_name))
register_model("efficientnet_b0", _no_size(EfficientNetB0), ("dropout", "drop_connect_rate"))
register_model("mobilenet_v2", _no_size(MobileNetV2))
register_model("googlenet", _no_size(GoogLeNet))
register_model("cnn_mnist", _sized(CNNMnist), ("channels", "dropout"))
register_model("lenet", _sized(LeNet), ("seed", "generator"))

# The built-in architectures are the catalog's (pollen.models.catalog: the names without torch), in its order.
if tuple(MODELS) != MODEL_NAMES:
    raise RuntimeError(f"pollen.models.catalog.MODEL_NAMES {MODEL_NAMES} != the registered models {tuple(MODELS)}")
__all__ = ["MODEL_KWARGS", "MODEL_NAMES", "MODELS", "SMALL_MODELS", "ModelEntry", "build_model",
           "register_model"]
# The extra keyword arguments of each built-in architecture.
MODEL_KWARGS: dict[str, tuple[str, ...]] = {name: entry.kwargs for name, entry in MODELS.items()}


def _positive_int(value: Any, arg: str) -> int:
    """``value`` as an int >= 1 (numpy integers accepted; bools and floats rejected)."""
    try:
        number = operator.index(value)
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
    return number


def build_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 32,
    width: float = 1.0,
    **kwargs: Any,
) -> SplitModel:
    """A fresh :class:`SplitModel` called ``name`` (one of :data:`MODEL_NAMES`).

    ``width`` scales every convolutional channel count (rounded, at least 4); 1.0 gives the
    papers' sizes. It does not touch fixed embedding sizes (CNNMnist's 50-d prototype). Extra
    keyword arguments, per model (see :data:`MODEL_KWARGS`): efficientnet_b0 ``dropout``,
    ``drop_connect_rate``; cnn_mnist ``channels`` (second conv width, FedProto's 18/20/22),
    ``dropout``; lenet ``seed`` / ``generator`` (its U(-0.5, 0.5) init).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model name {name!r}; allowed: {', '.join(MODELS)}")
    num_classes = _positive_int(num_classes, "num_classes")
    in_channels = _positive_int(in_channels, "in_channels")
    image_size = _positive_int(image_size, "image_size")
    is_number = isinstance(width, (int, float)) and not isinstance(width, bool)
    if not is_number or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width must be a finite number > 0 (1.0 = paper size), got {width!r}")
    allowed = MODELS[name].kwargs
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"unexpected argument(s) {', '.join(unknown)} for model {name!r}; "
            f"allowed: {', '.join(allowed) if allowed else 'none'}"
        )
    model = MODELS[name].build(num_classes, in_channels, image_size, float(width), **kwargs)
    declared = feature_dim(name, in_channels, image_size, float(width), kwargs)
    if declared is not None and declared != model.feature_dim:  # the catalog is what servers read d from
        raise RuntimeError(f"model {name!r} has a {model.feature_dim}-d embedding but pollen.models.catalog "
                           f"declares {declared}: fix catalog.feature_dim")
    return model
