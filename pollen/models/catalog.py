"""What each built-in architecture is, without building it (and without torch): the names, the small
nets, the width rule, the embedding size d and the first BatchNorm layer.

The launcher and a ServerApp whose strategy is numpy-only (prototypes, logits) need these facts, not
the networks: the model names a run key may take, FedProto's server needs d to check every
client's prototypes, and the run-config check of ``dp-mode = 'sample'`` needs to know which models
DP-SGD cannot train (BatchNorm mixes the samples of a batch). Reading them from here keeps torch out
of those processes (issue 30: start-up cost) and model building out of validation (issue 33).
:func:`pollen.models.registry.build_model` checks every model it builds against :func:`feature_dim`, and
``tests/test_torch_free_imports.py`` builds every model against :data:`FIRST_BATCHNORM`, so neither table
can drift from the networks unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

MIN_CHANNELS = 4

# The built-in architectures, in a stable order (the registry registers exactly these, in this order).
MODEL_NAMES: tuple[str, ...] = ("resnet10", "resnet12", "resnet18", "resnet34", "efficientnet_b0",
                                "mobilenet_v2", "googlenet", "cnn_mnist", "lenet")

# The two small nets: always full width (the profiles' width multipliers are for large backbones), and
# kept in the default memory layout (channels-last pays off only for the conv backbones).
SMALL_MODELS = frozenset({"cnn_mnist", "lenet"})


def scale_channels(channels: int, width: float) -> int:
    """Channel count scaled by ``width``, rounded half up, never below ``MIN_CHANNELS``.

    ``width == 1.0`` returns ``channels`` unchanged, so full-width models have the papers' sizes;
    small widths keep CPU tests fast while exercising the same code path.
    """
    if not width > 0:
        raise ValueError(f"width must be > 0, got {width!r}")
    if width == 1.0:
        return int(channels)
    return max(MIN_CHANNELS, int(channels * width + 0.5))


# The last stage's channels of each globally pooled backbone (its pooled feature): ResNet's 512, the
# CIFAR EfficientNet-B0's 320, MobileNetV2's final 1×1 conv 1280.
_POOLED_LAST = {"resnet10": 512, "resnet12": 512, "resnet18": 512, "resnet34": 512, "efficientnet_b0": 320,
                "mobilenet_v2": 1280}
# GoogLeNet's feature is its last inception block (b5) concatenated: 1×1 | 3×3 | double 3×3 | pool branch,
# each branch scaled on its own.
_GOOGLENET_B5_OUT = (384, 384, 128, 128)
CNN_MNIST_EMBED_DIM = 50  # FedProto's fc1: fixed, whatever the width and the input
LENET_CHANNELS = 12


def _cnn_mnist(in_channels: int, image_size: int, width: float, options: Mapping[str, Any]) -> int:
    if ((image_size - 4) // 2 - 4) // 2 < 1:
        raise ValueError(f"image_size must be >= 16 for cnn_mnist (two 5×5 convs + pools), got {image_size}")
    return CNN_MNIST_EMBED_DIM


def _lenet(in_channels: int, image_size: int, width: float, options: Mapping[str, Any]) -> int:
    side = ((image_size + 1) // 2 + 1) // 2  # conv(k=5, p=2, s=2) twice: n -> ceil(n / 2); stride 1 keeps it
    return scale_channels(LENET_CHANNELS, width) * side * side


def _pooled(last: int) -> Callable[[int, int, float, Mapping[str, Any]], int]:
    def rule(in_channels: int, image_size: int, width: float, options: Mapping[str, Any]) -> int:
        return scale_channels(last, width)

    return rule


def _googlenet(in_channels: int, image_size: int, width: float, options: Mapping[str, Any]) -> int:
    return sum(scale_channels(n, width) for n in _GOOGLENET_B5_OUT)


_FEATURE_DIMS: dict[str, Callable[[int, int, float, Mapping[str, Any]], int]] = {
    **{name: _pooled(last) for name, last in _POOLED_LAST.items()},
    "googlenet": _googlenet,
    "cnn_mnist": _cnn_mnist,
    "lenet": _lenet,
}


def feature_dim(name: str, in_channels: int = 3, image_size: int = 32, width: float = 1.0,
                options: Mapping[str, Any] | None = None) -> int | None:
    """d, the size of ``features(x)`` of model ``name`` built with these arguments; None for a model this
    catalog does not describe (one added with :func:`pollen.models.register_model`: build it to know)."""
    rule = _FEATURE_DIMS.get(name)
    return None if rule is None else rule(in_channels, image_size, width, options or {})


# The first layer that mixes the samples of a batch (a BatchNorm), per model, as the built network's
# ``named_modules()`` meets it: (its path, its class name); None for a model without any. The same for
# every width, input format and option (which change how many BatchNorm layers MobileNetV2 has, never
# its first); DP-SGD (dp-mode = 'sample') refuses a model that has one, and the run-config check names
# this layer without building the model.
FIRST_BATCHNORM: dict[str, tuple[str, str] | None] = {
    **{name: ("bn1", "BatchNorm2d") for name in ("resnet10", "resnet12", "resnet18", "resnet34",
                                                 "efficientnet_b0", "mobilenet_v2")},
    "googlenet": ("pre_layers.1", "BatchNorm2d"),
    "cnn_mnist": None,
    "lenet": None,
}


