"""CIFAR-style ResNets (FCCL ResNet10/12, GLFC and FedProto ResNet18, FCCL Office ResNet34).

Stem: 3×3 stride-1 conv + BN + ReLU, no max-pool, so a 32×32 input reaches the last stage at
4×4; global average pooling gives the 512·width feature. Module names follow torchvision's
(``conv1``, ``bn1``, ``layerN.i.{conv1,bn1,conv2,bn2,downsample}``) so an ImageNet ResNet-18/34
state dict, minus ``conv1``/``bn1``/``fc``, loads into the stages (FedProto's CIFAR-10 setup).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import SplitModel, scale_channels

STAGE_PLANES = (64, 128, 256, 512)
RESNET_BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "resnet10": (1, 1, 1, 1),
    "resnet12": (2, 1, 1, 1),
    "resnet18": (2, 2, 2, 2),
    "resnet34": (3, 4, 6, 3),
}


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3×3 convs with an identity (or 1×1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = _conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(cout),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(SplitModel):
    """CIFAR ResNet with BasicBlocks; ``blocks`` = number of blocks in each of the 4 stages."""

    def __init__(
        self,
        blocks: tuple[int, int, int, int] | list[int],
        num_classes: int,
        in_channels: int = 3,
        width: float = 1.0,
    ) -> None:
        super().__init__()
        if len(blocks) != 4 or any(int(b) < 1 for b in blocks):
            raise ValueError(f"blocks must be 4 positive stage depths, got {blocks!r}")
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        planes = [scale_channels(p, width) for p in STAGE_PLANES]
        self.blocks = tuple(int(b) for b in blocks)
        self.conv1 = _conv3x3(in_channels, planes[0])
        self.bn1 = nn.BatchNorm2d(planes[0])
        cin = planes[0]
        stages = []
        for i, (cout, depth) in enumerate(zip(planes, self.blocks)):
            first_stride = 1 if i == 0 else 2
            layers = []
            for j in range(depth):
                layers.append(BasicBlock(cin, cout, first_stride if j == 0 else 1))
                cin = cout
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self._attach_head(cin, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


def resnet10(num_classes: int, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet(RESNET_BLOCKS["resnet10"], num_classes, in_channels, width)


def resnet12(num_classes: int, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet(RESNET_BLOCKS["resnet12"], num_classes, in_channels, width)


def resnet18(num_classes: int, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet(RESNET_BLOCKS["resnet18"], num_classes, in_channels, width)


def resnet34(num_classes: int, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet(RESNET_BLOCKS["resnet34"], num_classes, in_channels, width)
