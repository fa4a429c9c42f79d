"""Backbones and small nets; every model is a SplitModel exposing features(x) and classify(z)."""

from .base import SplitModel, scale_channels, to_channels_last
from .mobile import EfficientNetB0, GoogLeNet, MobileNetV2
from .registry import MODEL_KWARGS, MODEL_NAMES, MODELS, SMALL_MODELS, ModelSpec, build_model, register_model
from .resnet import ResNet
from .small import CNNMnist, LeNet

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
    "register_model",
    "scale_channels",
    "to_channels_last",
]
