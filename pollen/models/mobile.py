"""CIFAR-style MobileNetV2, EfficientNet-B0 and GoogLeNet, as the FCCL code uses them.

All three keep a stride-1 stem so 32×32 inputs are not downsampled away (torchvision's ImageNet
versions reduce 32×32 to 1×1 long before the last stage). Features are globally average-pooled:
MobileNetV2 1280·width, EfficientNet-B0 320·width (the CIFAR variant has no final 1×1 conv to
1280), GoogLeNet 1024·width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import SplitModel, scale_channels


def _check_in_channels(in_channels: int) -> None:
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")


def _pool(x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


# --------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    """1×1 expand -> 3×3 depthwise -> 1×1 linear projection.

    As in the FCCL/CIFAR variant, every stride-1 block has a shortcut, a 1×1 conv + BN when the
    channel count changes; stride-2 blocks have none.
    """

    def __init__(self, cin: int, cout: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = expansion * cin
        self.stride = stride
        self.conv1 = nn.Conv2d(cin, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.conv3 = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module | None = None
        if stride == 1 and cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.stride != 1:
            return out
        return out + (x if self.shortcut is None else self.shortcut(x))


class MobileNetV2(SplitModel):
    # (expansion, out channels, blocks, first stride); stage 2 stride 1 for 32×32 inputs.
    CFG = (
        (1, 16, 1, 1),
        (6, 24, 2, 1),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )
    STEM = 32
    LAST = 1280

    def __init__(self, num_classes: int, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        _check_in_channels(in_channels)
        stem = scale_channels(self.STEM, width)
        self.conv1 = nn.Conv2d(in_channels, stem, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        blocks = []
        cin = stem
        for expansion, cout, depth, stride in self.CFG:
            cout = scale_channels(cout, width)
            for j in range(depth):
                blocks.append(InvertedResidual(cin, cout, expansion, stride if j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        last = scale_channels(self.LAST, width)
        self.conv2 = nn.Conv2d(cin, last, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(last)
        self._attach_head(last, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.relu(self.bn2(self.conv2(out)))
        return _pool(out)


# --------------------------------------------------------------------------- EfficientNet-B0


class SqueezeExcite(nn.Module):
    """Channel gating: pool -> 1×1 conv -> swish -> 1×1 conv -> sigmoid -> scale."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.se1 = nn.Conv2d(channels, squeezed, 1)
        self.se2 = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.adaptive_avg_pool2d(x, 1)
        gate = torch.sigmoid(self.se2(F.silu(self.se1(gate))))
        return x * gate


def drop_connect(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Drop whole residual branches per sample with probability ``rate`` (stochastic depth)."""
    if not training or rate <= 0.0:
        return x
    keep = 1.0 - rate
    mask = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * mask / keep


class MBConv(nn.Module):
    """Expand (skipped when expansion is 1) -> depthwise k×k -> SE -> 1×1 projection."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel_size: int,
        stride: int,
        expansion: int,
        se_ratio: float,
        drop_rate: float,
    ) -> None:
        super().__init__()
        hidden = expansion * cin
        self.drop_rate = drop_rate
        self.expand: nn.Sequential | None = None
        if expansion != 1:
            self.expand = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden))
        self.conv_dw = nn.Conv2d(
            hidden, hidden, kernel_size, stride=stride, padding=kernel_size // 2, groups=hidden, bias=False
        )
        self.bn_dw = nn.BatchNorm2d(hidden)
        # Squeeze width is relative to the block's input channels, as in the FCCL code.
        self.se = SqueezeExcite(hidden, max(1, int(cin * se_ratio)))
        self.project = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn_project = nn.BatchNorm2d(cout)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.expand is None else F.silu(self.expand(x))
        out = F.silu(self.bn_dw(self.conv_dw(out)))
        out = self.se(out)
        out = self.bn_project(self.project(out))
        if self.has_skip:
            out = drop_connect(out, self.drop_rate, self.training) + x
        return out


class EfficientNetB0(SplitModel):
    """EfficientNet-B0, CIFAR variant: stride-1 stem, 320-d pooled feature, dropout 0.2 before
    the head.

    ``drop_connect_rate`` defaults to 0: the FCCL code sets 0.2 but never advances its block
    counter, so every block's effective rate there is 0. Pass 0.2 for the linearly increasing
    stochastic depth of the EfficientNet paper.
    """

    # (expansion, out channels, blocks, kernel, first stride)
    CFG = (
        (1, 16, 1, 3, 1),
        (6, 24, 2, 3, 2),
        (6, 40, 2, 5, 2),
        (6, 80, 3, 3, 2),
        (6, 112, 3, 5, 1),
        (6, 192, 4, 5, 2),
        (6, 320, 1, 3, 1),
    )
    STEM = 32
    SE_RATIO = 0.25

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        width: float = 1.0,
        dropout: float = 0.2,
        drop_connect_rate: float = 0.0,
    ) -> None:
        super().__init__()
        _check_in_channels(in_channels)
        if not 0.0 <= drop_connect_rate < 1.0:
            raise ValueError(f"drop_connect_rate must be in [0, 1), got {drop_connect_rate}")
        stem = scale_channels(self.STEM, width)
        self.conv1 = nn.Conv2d(in_channels, stem, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        total = sum(c[2] for c in self.CFG)
        blocks = []
        cin = stem
        index = 0
        for expansion, cout, depth, kernel, stride in self.CFG:
            cout = scale_channels(cout, width)
            for j in range(depth):
                rate = drop_connect_rate * index / total
                blocks.append(
                    MBConv(cin, cout, kernel, stride if j == 0 else 1, expansion, self.SE_RATIO, rate)
                )
                cin = cout
                index += 1
        self.layers = nn.Sequential(*blocks)
        self._attach_head(cin, num_classes, dropout=dropout)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = F.silu(self.bn1(self.conv1(x)))
        return _pool(self.layers(out))


# --------------------------------------------------------------------------- GoogLeNet


def _conv_bn_relu(cin: int, cout: int, kernel_size: int) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel_size, padding=kernel_size // 2),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class Inception(nn.Module):
    """Four parallel branches concatenated: 1×1 | 1×1->3×3 | 1×1->3×3->3×3 | maxpool->1×1.

    The CIFAR variant replaces the 5×5 branch by two 3×3 convs.
    """

    def __init__(self, cin: int, n1: int, n3red: int, n3: int, n5red: int, n5: int, npool: int) -> None:
        super().__init__()
        self.b1 = nn.Sequential(*_conv_bn_relu(cin, n1, 1))
        self.b2 = nn.Sequential(*_conv_bn_relu(cin, n3red, 1), *_conv_bn_relu(n3red, n3, 3))
        self.b3 = nn.Sequential(
            *_conv_bn_relu(cin, n5red, 1), *_conv_bn_relu(n5red, n5, 3), *_conv_bn_relu(n5, n5, 3)
        )
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), *_conv_bn_relu(cin, npool, 1))
        self.out_channels = n1 + n3 + n5 + npool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)


class GoogLeNet(SplitModel):
    """GoogLeNet, CIFAR variant: 3×3 stem to 192 channels, inception 3a-5b, 1024-d pooled feature."""

    STEM = 192
    # (n1x1, n3x3red, n3x3, n5x5red, n5x5, pool_proj) per inception module; "pool" = max-pool /2.
    CFG = (
        ("a3", (64, 96, 128, 16, 32, 32)),
        ("b3", (128, 128, 192, 32, 96, 64)),
        ("pool", None),
        ("a4", (192, 96, 208, 16, 48, 64)),
        ("b4", (160, 112, 224, 24, 64, 64)),
        ("c4", (128, 128, 256, 24, 64, 64)),
        ("d4", (112, 144, 288, 32, 64, 64)),
        ("e4", (256, 160, 320, 32, 128, 128)),
        ("pool", None),
        ("a5", (256, 160, 320, 32, 128, 128)),
        ("b5", (384, 192, 384, 48, 128, 128)),
    )

    def __init__(self, num_classes: int, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        _check_in_channels(in_channels)
        stem = scale_channels(self.STEM, width)
        self.pre_layers = nn.Sequential(*_conv_bn_relu(in_channels, stem, 3))
        modules: list[nn.Module] = []
        cin = stem
        for _name, sizes in self.CFG:
            if sizes is None:
                modules.append(nn.MaxPool2d(3, stride=2, padding=1))
                continue
            block = Inception(cin, *(scale_channels(s, width) for s in sizes))
            modules.append(block)
            cin = block.out_channels
        self.inceptions = nn.Sequential(*modules)
        self._attach_head(cin, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return _pool(self.inceptions(self.pre_layers(x)))
