"""Batched, tensor-only image transforms.

Datasets are stored as uint8 ``N×C×H×W`` tensors (see :mod:`pollen.datasets.sources`); these
functions turn whole batches into model input and augment them on whatever device the batch
is on, with per-sample randomness drawn from an explicit ``torch.Generator`` so runs are
reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# ITU-R BT.601 luma weights: what PIL's convert("L") and torchvision's rgb_to_grayscale use.
_LUMA = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class ImageFormat:
    """What a model expects: channel count, square side and per-channel normalisation."""

    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise ValueError(f"ImageFormat.channels must be 1 or 3, got {self.channels}")
        if self.size < 1:
            raise ValueError(f"ImageFormat.size must be >= 1, got {self.size}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(
                f"ImageFormat needs one mean and one std per channel ({self.channels}), "
                f"got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"ImageFormat.std must be positive, got {self.std}")


MNIST_FORMAT = ImageFormat(1, 28, (0.1307,), (0.3081,))
# FCCL's Digits task: every digit set as 3×32×32 with ImageNet statistics.
DIGITS_FORMAT = ImageFormat(3, 32, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# Per-channel statistics of the CIFAR training sets (population std).
CIFAR10_FORMAT = ImageFormat(3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_FORMAT = ImageFormat(3, 32, (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))


def to_model_input(images: torch.Tensor, fmt: ImageFormat) -> torch.Tensor:
    """uint8 ``N×C×H×W`` → float32 ``N×fmt.channels×fmt.size×fmt.size``, normalised.

    Grey→RGB repeats the channel, RGB→grey takes BT.601 luminance, and a size mismatch is
    fixed with antialiased bilinear resizing (non-square inputs are stretched to a square, as
    ``transforms.Resize((s, s))`` does). Runs on the device of ``images``.
    """
    import torch
    import torch.nn.functional as F
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(
            f"to_model_input expects a uint8 N×C×H×W tensor, got {images.dtype} with shape "
            f"{tuple(images.shape)}"
        )
    c = images.shape[1]
    if c not in (1, 3):
        raise ValueError(f"to_model_input: images must have 1 or 3 channels, got {c}")
    x = images.to(torch.float32) / 255.0
    # Channel reduction before resizing and channel expansion after it: both are linear per
    # pixel, so the order does not change the result, only the amount of work.
    if c == 3 and fmt.channels == 1:
        w = torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        x = (x * w).sum(dim=1, keepdim=True)
    if x.shape[2] != fmt.size or x.shape[3] != fmt.size:
        if x.shape[0] == 0:
            x = x.new_zeros((0, x.shape[1], fmt.size, fmt.size))
        else:
            x = F.interpolate(x, size=(fmt.size, fmt.size), mode="bilinear", align_corners=False, antialias=True)
    if x.shape[1] == 1 and fmt.channels == 3:
        x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(fmt.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(fmt.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return ((x - mean) / std).contiguous()


def _uniform(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """n draws of U[0,1) from the generator (on its own device), moved to ``device``."""
    import torch
    return torch.rand(n, generator=generator, device=generator.device).to(device)


def augment(
    x: torch.Tensor,
    generator: torch.Generator,
    crop_pad: int = 4,
    hflip: bool = True,
    rotation: float = 0.0,
    brightness: float = 0.0,
) -> torch.Tensor:
    """Random crop (zero padding), horizontal flip, rotation and brightness, per sample.

    The batch analogue of torchvision's ``RandomCrop(size, padding=crop_pad)``,
    ``RandomHorizontalFlip()``, ``RandomRotation(rotation)`` (nearest, fill 0) and
    ``ColorJitter(brightness=brightness)``, applied in that order. Works on uint8 (pixel space,
    like torchvision's PIL pipeline; result rounded and clamped to 0..255) or float tensors
    (no clamping; on normalised input "zero" fill is the mean colour and the brightness factor
    scales deviations from the mean). Returns a new tensor of the same shape, dtype and device.
    """
    import torch
    import torch.nn.functional as F
    if x.dim() != 4:
        raise ValueError(f"augment expects an N×C×H×W tensor, got shape {tuple(x.shape)}")
    if int(crop_pad) != crop_pad or crop_pad < 0:
        raise ValueError(f"augment: crop_pad must be a non-negative int, got {crop_pad}")
    if rotation < 0:
        raise ValueError(f"augment: rotation must be >= 0 degrees, got {rotation}")
    if brightness < 0:
        raise ValueError(f"augment: brightness must be >= 0, got {brightness}")
    n, c, h, w = x.shape
    dev = x.device
    out = x
    if n == 0:
        return x.clone()

    if crop_pad > 0:
        p = int(crop_pad)
        padded = F.pad(out, (p, p, p, p))  # zeros
        off_y = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=generator.device).to(dev)
        off_x = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=generator.device).to(dev)
        rows = off_y[:, None] + torch.arange(h, device=dev)[None, :]  # N×H
        cols = off_x[:, None] + torch.arange(w, device=dev)[None, :]  # N×W
        out = padded.gather(2, rows[:, None, :, None].expand(n, c, h, w + 2 * p))
        out = out.gather(3, cols[:, None, None, :].expand(n, c, h, w))

    if hflip:
        flip = _uniform(n, generator, dev) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(3), out)

    if rotation > 0 or brightness > 0:
        is_int = not out.is_floating_point()
        work = out.to(torch.float32) if is_int else out
        if rotation > 0:
            angle = (_uniform(n, generator, dev) * 2.0 - 1.0) * math.radians(rotation)
            cos, sin = torch.cos(angle), torch.sin(angle)
            zero = torch.zeros_like(angle)
            # Rotation in pixel units expressed in affine_grid's normalised coordinates, so
            # non-square images rotate rigidly instead of shearing.
            theta = torch.stack(
                [
                    torch.stack([cos, -sin * (h / w), zero], dim=1),
                    torch.stack([sin * (w / h), cos, zero], dim=1),
                ],
                dim=1,
            ).to(work.dtype)
            grid = F.affine_grid(theta, [n, c, h, w], align_corners=False)
            work = F.grid_sample(work, grid, mode="nearest", padding_mode="zeros", align_corners=False)
        if brightness > 0:
            lo = max(0.0, 1.0 - brightness)
            factor = lo + _uniform(n, generator, dev) * ((1.0 + brightness) - lo)
            work = work * factor.to(work.dtype)[:, None, None, None]
        if is_int:
            info = torch.iinfo(out.dtype)
            out = work.round().clamp(info.min, info.max).to(out.dtype)
        else:
            out = work
    return out.clone() if out is x else out


def batches(
    n: int,
    batch_size: int,
    generator: torch.Generator | None,
    drop_last: bool = False,
) -> Iterator[torch.Tensor]:
    """Index batches (int64 tensors) over ``range(n)``: shuffled when a generator is given."""
    import torch
    if n < 0:
        raise ValueError(f"batches: n must be >= 0, got {n}")
    if batch_size < 1:
        raise ValueError(f"batches: batch_size must be >= 1, got {batch_size}")
    if generator is None:
        order = torch.arange(n, dtype=torch.int64)
    else:
        order = torch.randperm(n, generator=generator, device=generator.device)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield order[start : start + batch_size]
