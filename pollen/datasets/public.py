"""Unlabeled public sets: the only data every participant sees (FCCL's X0, FedMD/FedDF's transfer set).

========================  ================================================================  ========
name                      what it is                                                         images
========================  ================================================================  ========
``fashion_mnist``         Fashion-MNIST train split (needs the files; the paper's option)    1×28×28
``photo_patches``         random squares of scikit-learn's two embedded sample photographs   3×32×32
                          (side 32..128 px, resized to 32): needs no files at all
``cifar100``              CIFAR-100 train split (needs the files; the paper's default)       3×32×32
``mnist``                 MNIST train split (needs the files)                                1×28×28
``folder``                your own unlabeled images: every image under a folder (run key     any
                          ``fccl-public-dir`` or node config ``public-dir``), sorted by path
========================  ================================================================  ========

Every set is returned with all labels −1. ``load_public(name, root, size, seed)`` is a pure
function of its arguments: every client and the server that ask with the same arguments get the
same ``size`` images in the same order, which is what lets clients exchange per-sample logits
aligned by public index. :func:`public_digest` fingerprints the chosen images, so the server can
refuse a node whose copy of the public set differs from the federation's.

Caveats: ``photo_patches`` comes from the same two photographs as the backgrounds of the
``mnistm`` and ``syn`` digit domains (different crops, no digits); ``mnist`` as public data
overlaps the ``mnist`` domain's training images (use ``fashion_mnist`` or ``photo_patches`` with
the MNIST domain).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.domains import check_seed, crop_resized, keyed_rng, sample_photos, seeded_subset
from pollen.datasets.sources import ImageSet, load_source
from pollen.protocol.logits import public_fingerprint

if TYPE_CHECKING:
    import torch

PUBLIC_SETS: tuple[str, ...] = ("fashion_mnist", "photo_patches", "cifar100", "mnist")
PUBLIC_FOLDER = "folder"  # the user's own folder of unlabeled images
PUBLIC_CHOICES: tuple[str, ...] = (*PUBLIC_SETS, PUBLIC_FOLDER)
UNLABELED = -1

PATCH_SIDE = 32
PATCH_SCALE = (32, 128)  # side of the square cut from a photograph, px, inclusive
PATCH_MIN_STD = 8.0  # luma std (0..255) below which a patch counts as flat and is redrawn
PATCH_MAX_TRIES = 10


def photo_patches(size: int, seed: int) -> ImageSet:
    """``size`` random RGB patches (uint8 N×3×32×32) of the two sample photographs.

    Per patch, from a stream keyed by (seed, "photo_patches"): the photograph, a side length
    uniform in ``PATCH_SCALE``, a top-left corner uniform over the positions where the square
    fits; the square is resized to 32×32 (antialiased bilinear). Varying the scale gives
    textures from fine detail to whole objects. A patch whose luma std is below
    ``PATCH_MIN_STD`` (sky, out-of-focus background: about a quarter of raw draws) is drawn
    again, up to ``PATCH_MAX_TRIES`` times, because a flat image tells the models nothing when
    they align their outputs on it.
    """
    import torch
    rng = keyed_rng(seed, "photo_patches")
    photos = sample_photos()
    out = np.empty((size, PATCH_SIDE, PATCH_SIDE, 3), dtype=np.uint8)
    for k in range(size):
        for _ in range(PATCH_MAX_TRIES):
            photo = photos[rng.integers(len(photos))]
            side = int(rng.integers(PATCH_SCALE[0], PATCH_SCALE[1] + 1))
            y = int(rng.integers(0, photo.shape[0] - side + 1))
            x = int(rng.integers(0, photo.shape[1] - side + 1))
            out[k] = crop_resized(photo, y, x, side, PATCH_SIDE)
            if _luma_std(out[k]) >= PATCH_MIN_STD:
                break
    images = torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()
    # ImageSet needs num_classes >= 1; an unlabeled set has no classes, so 1 is a placeholder.
    return ImageSet(images, torch.full((size,), UNLABELED, dtype=torch.int64), 1, "photo_patches")


def _luma_std(rgb: np.ndarray) -> float:
    luma = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
    return float(luma.std())


@functools.lru_cache(maxsize=4)
def _photo_patches_cached(size: int, seed: int) -> ImageSet:
    return photo_patches(size, seed)


def public_digest(images: torch.Tensor) -> int:
    """The wire fingerprint (``public-digest``) of the public images as stored (uint8 N×C×H×W)."""
    return public_fingerprint(images.numpy())


def load_public(name: str, root: str | None, size: int, seed: int, folder: str | None = None) -> ImageSet:
    """``size`` unlabeled public images (labels all −1), the same for every caller with these args.

    The file-based sets draw ``size`` training images without replacement from a stream keyed
    by (seed, "public", name), kept in dataset order; ``photo_patches`` generates them; ``folder``
    draws them the same way from every image under ``folder``.
    ``num_classes`` is the source dataset's (1 for ``photo_patches``), for information only.
    Raises ``ValueError`` for an unknown name or a size beyond the training split, and
    :class:`~pollen.datasets.sources.DatasetMissingError` when a file-based set has no root
    or files.
    """
    import torch
    if name not in PUBLIC_CHOICES:
        raise ValueError(f"unknown public set {name!r}; allowed: {', '.join(PUBLIC_CHOICES)}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size for public set {name!r} must be a positive integer, got {size!r}")
    seed = check_seed(seed)
    size = int(size)
    if name == "photo_patches":
        return _photo_patches_cached(size, seed)
    if name == PUBLIC_FOLDER:
        if not folder:
            raise ValueError("public set 'folder' needs a folder: node config 'public-dir' or run key "
                             "'fccl-public-dir'")
        from pollen.datasets.user_data import read_unlabeled_folder

        source = read_unlabeled_folder(folder)
        if size > len(source):
            raise ValueError(f"the public folder {folder} holds {len(source)} images, fewer than the "
                             f"{size} asked for: set run key 'fccl-public-size' <= {len(source)}")
    else:
        source = load_source(name, root, "train")
        if size > len(source):
            raise ValueError(
                f"size {size} for public set {name!r} exceeds the {len(source)} training images available"
            )
    chosen = seeded_subset(source, size, seed, "public", name)
    return ImageSet(
        chosen.images,
        torch.full((size,), UNLABELED, dtype=torch.int64),
        source.num_classes,
        name,
    )
