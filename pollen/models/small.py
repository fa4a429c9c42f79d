"""Small networks: FedProto's MNIST CNN and the DLG LeNet of GLFC's gradient-inversion proxy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import SplitModel, scale_channels


def _check_common(in_channels: int, image_size: int) -> None:
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")


class CNNMnist(SplitModel):
    """FedProto's ``CNNMnist``; the 50-d ReLU output of ``fc1`` is the prototype embedding.

    conv(in->10, 5) -> maxpool 2 -> ReLU -> conv(10->``channels``, 5) -> Dropout2d -> maxpool 2
    -> ReLU -> fc(->50) -> ReLU | dropout -> fc(50->C).

    ``channels`` is the output width of the second conv, the knob FedProto's model-heterogeneous
    setting turns (18 / 20 / 22 for clients 0-6 / 7-13 / 14-19; 20 otherwise); ``fc1``'s input
    follows it and the input size, so 1×28×28 (320 inputs to fc1 by default), 1×32×32 and 3×32×32
    all work while the embedding stays 50-d for every client.
    """

    EMBED_DIM = 50
    CONV1 = 10

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 1,
        image_size: int = 28,
        channels: int = 20,
        width: float = 1.0,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        _check_common(in_channels, image_size)
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(
                f"image_size must be >= 16 for cnn_mnist (two 5×5 convs + pools), got {image_size}"
            )
        c1 = scale_channels(self.CONV1, width)
        c2 = scale_channels(channels, width)
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=5)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(p=dropout)
        self.fc1 = nn.Linear(c2 * side * side, self.EMBED_DIM)
        self._attach_head(self.EMBED_DIM, num_classes, dropout=dropout)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(F.max_pool2d(self.conv1(x), 2))
        out = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(out)), 2))
        return F.relu(self.fc1(torch.flatten(out, 1)))


class LeNet(SplitModel):
    """The DLG LeNet: 3 × (conv 5×5, padding 2, strides 2/2/1, sigmoid), 12 channels, FC head.

    For 3×32×32 inputs the feature is 12·8·8 = 768. Every weight and bias is drawn from
    U(-0.5, 0.5) with a dedicated generator (``generator`` if given, else one seeded with
    ``seed``), never from the global RNG: GLFC's clients and proxy server must build bit-identical
    nets so the proxy can invert the clients' gradients. The net is never trained.
    """

    CHANNELS = 12
    INIT_RANGE = 0.5

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        width: float = 1.0,
        seed: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        _check_common(in_channels, image_size)
        ch = scale_channels(self.CHANNELS, width)
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, ch, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(ch, ch, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(ch, ch, kernel_size=5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        # conv(k=5, p=2, s=2) maps n -> ceil(n / 2); the stride-1 conv keeps the size.
        side = ((image_size + 1) // 2 + 1) // 2
        self._attach_head(ch * side * side, num_classes)
        if generator is None:
            generator = torch.Generator().manual_seed(int(seed))
        elif generator.device.type != "cpu":
            raise ValueError(
                "generator must be a CPU torch.Generator (build on CPU, then .to(device)), "
                f"got one on {generator.device}"
            )
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """Draw every parameter from U(-0.5, 0.5) in ``parameters()`` order using ``generator``."""
        for p in self.parameters():
            p.uniform_(-self.INIT_RANGE, self.INIT_RANGE, generator=generator)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.body(x), 1)

    def gradient(self, x: torch.Tensor, label: int) -> list[torch.Tensor]:
        """``grad_theta CE(LeNet(x), label)`` for one image ``x`` (C×H×W), detached, in ``parameters()``
        order: what a GLFC client shares and what the proxy server inverts."""
        params = list(self.parameters())
        out = self(x.to(params[0].device, params[0].dtype).unsqueeze(0))
        loss = F.cross_entropy(out, torch.tensor([int(label)], device=out.device))
        return [g.detach() for g in torch.autograd.grad(loss, params)]
