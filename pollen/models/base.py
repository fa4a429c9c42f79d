"""The one model interface every Pollen method relies on.

FCCL exchanges logits, FedProto exchanges the embedding ``features(x)``, GLFC grows the classifier
head between tasks: all of them need the split *encoder -> linear classifier* made explicit, so
every backbone here is a :class:`SplitModel`.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .catalog import MIN_CHANNELS, scale_channels

__all__ = ["MIN_CHANNELS", "SplitModel", "scale_channels", "to_channels_last"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class SplitModel(nn.Module):
    """Encoder ``features`` (B×d) followed by a linear head ``classify`` (d -> num_classes).

    Subclasses build their encoder, implement :meth:`features`, then call :meth:`_attach_head`.
    ``head_dropout`` (used by EfficientNet and the FedProto CNN) is applied inside
    :meth:`classify`, so ``forward(x) == classify(features(x))`` holds in every mode and the
    prototype a client shares is the pre-dropout embedding, as in the original code.
    """

    head: nn.Linear
    head_dropout: float

    def _attach_head(self, feature_dim: int, num_classes: int, dropout: float = 0.0) -> None:
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {feature_dim}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"head dropout must be in [0, 1), got {dropout}")
        self.head_dropout = float(dropout)
        self.head = nn.Linear(feature_dim, num_classes)

    @property
    def feature_dim(self) -> int:
        """Size d of the embedding returned by :meth:`features`."""
        return self.head.in_features

    @property
    def num_classes(self) -> int:
        """Number of logits (follows :meth:`grow_classes`)."""
        return self.head.out_features

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement features(x)")

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        """Logits from embeddings ``z`` (B×d)."""
        if self.head_dropout > 0.0:
            z = F.dropout(z, p=self.head_dropout, training=self.training)
        return self.head(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))

    @torch.no_grad()
    def grow_classes(self, new_num_classes: int) -> None:
        """Replace the head by a larger one whose first rows are the old head (GLFC, iCaRL).

        Old classes keep exactly their logits; the new rows get nn.Linear's default init. The
        head's parameters are new objects: re-create any optimizer afterwards.
        """
        old = self.head
        if new_num_classes < old.out_features:
            raise ValueError(
                f"new_num_classes must be >= current num_classes ({old.out_features}), "
                f"got {new_num_classes}"
            )
        if new_num_classes == old.out_features:
            return
        new = nn.Linear(old.in_features, new_num_classes, bias=old.bias is not None)
        new = new.to(device=old.weight.device, dtype=old.weight.dtype)
        new.weight[: old.out_features].copy_(old.weight)
        if old.bias is not None:
            new.bias[: old.out_features].copy_(old.bias)
        new.train(old.training)
        self.head = new


def to_channels_last(model: ModuleT) -> ModuleT:
    """Store the model's 4-D weights in NHWC (channels-last) layout, in place; returns ``model``.

    Worth it for the convolutional backbones (ResNets, MobileNetV2, EfficientNet, GoogLeNet) on
    CUDA, above all with mixed precision, where cuDNN's tensor-core kernels prefer NHWC; feed
    inputs converted with ``x.to(memory_format=torch.channels_last)`` too. On CPU, and for the
    tiny CNNMnist / LeNet, it gains little: leave models as they are there. Results equal the
    default layout up to float rounding.
    """
    return model.to(memory_format=torch.channels_last)
