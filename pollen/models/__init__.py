"""Backbones and small nets; every model is a SplitModel exposing features(x) and classify(z).

The names resolve on first use (PEP 562 ``__getattr__``), so importing a torch-free submodule,
:mod:`pollen.models.catalog` (model names, widths, embedding sizes), does not import torch: the
launcher and numpy-only ServerApps read the catalog and never build a network (issue 30: start-up cost).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import SplitModel, scale_channels, to_channels_last
    from .mobile import EfficientNetB0, GoogLeNet, MobileNetV2
    from .registry import MODEL_KWARGS, MODEL_NAMES, MODELS, SMALL_MODELS, build_model, register_model
    from .resnet import ResNet
    from .small import CNNMnist, LeNet
    from .spec import ModelSpec, choose_model

# name -> the submodule that defines it
_WHERE = {
    "SplitModel": "base", "scale_channels": "base", "to_channels_last": "base",
    "EfficientNetB0": "mobile", "GoogLeNet": "mobile", "MobileNetV2": "mobile",
    "MODEL_KWARGS": "registry", "MODEL_NAMES": "registry", "MODELS": "registry", "SMALL_MODELS": "registry",
    "ModelSpec": "spec", "choose_model": "spec", "build_model": "registry", "register_model": "registry",
    "ResNet": "resnet",
    "CNNMnist": "small", "LeNet": "small",
}

__all__ = [
    "ModelSpec",
    "CNNMnist",
    "EfficientNetB0",
    "GoogLeNet",
    "LeNet",
    "MODEL_KWARGS",
    "MODEL_NAMES",
    "MODELS",
    "MobileNetV2",
    "SMALL_MODELS",
    "ResNet",
    "SplitModel",
    "build_model",
    "choose_model",
    "register_model",
    "scale_channels",
    "to_channels_last",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
