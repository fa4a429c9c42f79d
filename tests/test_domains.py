"""Digit domains and unlabeled public sets (pollen.datasets.domains, pollen.datasets.public).

Tests that need MNIST / Fashion-MNIST read their root from ``POLLEN_DATA_ROOT`` and skip without
it (the one rule in tests/conftest.py). ``python -m tests.test_domains [out.png]`` (from the project
root) writes a grid of samples of every domain.
"""

from __future__ import annotations

import bz2
import os

import numpy as np
import pytest
import torch

from pollen.datasets import domains as dom
from pollen.datasets.domains import (
    DIGIT_DOMAINS,
    OFFLINE_DIGIT_DOMAINS,
    blend_mnistm,
    load_domain,
    mnistm_recipe,
    render_syn,
    sample_photos,
    syn_cache_path,
)
from pollen.datasets.public import PUBLIC_SETS, load_public, photo_patches
from pollen.datasets.sources import DatasetMissingError, load_source
from tests.conftest import needs_real_data, real_data_root

torch.set_num_threads(1)

DATA_ROOT = real_data_root()  # the one skip rule (tests/conftest.py)
needs_root = needs_real_data

# Small syn sets reused by several tests (load_domain caches them per process).
SYN_TRAIN, SYN_TEST = 2000, 500


# --------------------------------------------------------------------------------------------
# independent helpers


def hog_features(images: torch.Tensor, cell: int = 4, bins: int = 9) -> np.ndarray:
    """Histogram of unsigned gradient orientations per 4×4 cell of the luma, L2-normalised.

    Unsigned orientation makes the features independent of stroke/background polarity, which
    syn and mnistm pick at random per image.
    """
    x = images.to(torch.float64).numpy()
    g = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2] if x.shape[1] == 3 else x[:, 0]
    gx = np.zeros_like(g)
    gy = np.zeros_like(g)
    gx[:, :, 1:-1] = g[:, :, 2:] - g[:, :, :-2]
    gy[:, 1:-1] = g[:, 2:] - g[:, :-2]
    mag = np.hypot(gx, gy)
    which = np.minimum((np.mod(np.arctan2(gy, gx), np.pi) / np.pi * bins).astype(int), bins - 1)
    n, side = g.shape[0], g.shape[1] // cell
    feats = np.stack(
        [(mag * (which == k)).reshape(n, side, cell, side, cell).sum(axis=(2, 4)) for k in range(bins)],
        axis=-1,
    ).reshape(n, -1)
    return feats / (np.linalg.norm(feats, axis=1, keepdims=True) + 1e-9)


def nearest_centroid_accuracy(train_x, train_y, test_x, test_y) -> float:
    centroids = np.stack([train_x[train_y == c].mean(axis=0) for c in range(10)])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return float((np.argmax(test_x @ centroids.T, axis=1) == test_y).mean())


def image_keys(images: torch.Tensor) -> list[bytes]:
    return [img.numpy().tobytes() for img in images]


def check_domain_set(data, n: int | None, shape: tuple[int, int, int]) -> None:
    assert data.images.dtype == torch.uint8 and data.labels.dtype == torch.int64
    assert tuple(data.images.shape[1:]) == shape
    if n is not None:
        assert len(data) == n and data.images.shape[0] == n
    assert data.num_classes == 10
    assert int(data.labels.min()) >= 0 and int(data.labels.max()) <= 9


# --------------------------------------------------------------------------------------------
# names


def test_domain_name_lists():
    assert OFFLINE_DIGIT_DOMAINS == ("mnist", "uci", "mnistm", "syn")
    assert set(OFFLINE_DIGIT_DOMAINS) < set(DIGIT_DOMAINS)
    assert {"usps", "svhn", "syndigits"} < set(DIGIT_DOMAINS)
    assert PUBLIC_SETS == ("fashion_mnist", "photo_patches", "cifar100", "mnist")


# --------------------------------------------------------------------------------------------
# uci


def test_uci_natural_split_shapes_and_total():
    train = load_domain("uci", None, "train")
    test = load_domain("uci", None, "test")
    check_domain_set(train, None, (1, 8, 8))
    check_domain_set(test, None, (1, 8, 8))
    assert len(train) + len(test) == 1797  # the whole UCI set embedded in scikit-learn
    assert abs(len(test) / 1797 - 0.2) < 0.01
    assert set(train.labels.tolist()) == set(range(10))


def test_uci_subset_is_seeded_and_drawn_from_the_split():
    full = load_domain("uci", None, "train")
    a = load_domain("uci", None, "train", seed=4, size=100)
    b = load_domain("uci", None, "train", seed=4, size=100)
    c = load_domain("uci", None, "train", seed=5, size=100)
    check_domain_set(a, 100, (1, 8, 8))
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    # Every drawn sample is a sample of the split, with its label (UCI has a few duplicate
    # images, so compare (image, label) pairs as a multiset-free membership test).
    pairs = {(k, int(y)) for k, y in zip(image_keys(full.images), full.labels)}
    assert all((k, int(y)) in pairs for k, y in zip(image_keys(a.images), a.labels))


# --------------------------------------------------------------------------------------------
# syn


def test_syn_shapes_labels_and_balance():
    data = load_domain("syn", None, "train", seed=0, size=SYN_TRAIN)
    check_domain_set(data, SYN_TRAIN, (3, 32, 32))
    assert torch.bincount(data.labels, minlength=10).tolist() == [SYN_TRAIN // 10] * 10
    # Every block of ten consecutive images holds each digit once.
    blocks = data.labels[:50].reshape(5, 10).sort(dim=1).values
    assert torch.equal(blocks, torch.arange(10).expand(5, 10))
    # Colour images, not grey ones painted into three channels.
    x = data.images.to(torch.int16)
    assert (x[:, 0] - x[:, 1]).abs().float().mean() > 5


def test_syn_natural_test_size():
    data = load_domain("syn", None, "test")
    check_domain_set(data, 2000, (3, 32, 32))


def test_syn_is_deterministic_per_seed_and_split():
    a = render_syn(7, "train", 40)
    b = render_syn(7, "train", 40)  # rendered again, not served from a cache
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, render_syn(8, "train", 40).images)
    assert not torch.equal(a.images, render_syn(7, "test", 40).images)
    # Image i depends only on (seed, split, i): a smaller set is a prefix of a larger one.
    c = render_syn(7, "train", 25)
    assert torch.equal(c.images, a.images[:25]) and torch.equal(c.labels, a.labels[:25])


def test_syn_labels_match_the_drawn_digit():
    train = load_domain("syn", None, "train", seed=0, size=SYN_TRAIN)
    test = load_domain("syn", None, "test", seed=0, size=SYN_TEST)
    xtr, xte = hog_features(train.images), hog_features(test.images)
    ytr, yte = train.labels.numpy(), test.labels.numpy()
    acc = nearest_centroid_accuracy(xtr, ytr, xte, yte)
    assert acc > 0.5, f"nearest-centroid accuracy {acc:.3f} on syn: labels do not match content"
    # Control: the same classifier trained on shuffled labels is near chance.
    shuffled = np.random.default_rng(0).permutation(ytr)
    assert nearest_centroid_accuracy(xtr, shuffled, xte, yte) < 0.25
    # The labels mean the digits humans mean (not a consistent relabelling): centroids learnt
    # on syn classify real handwritten UCI digits (upscaled to 32×32) far above chance.
    uci = load_domain("uci", None, "test")
    uci32 = torch.nn.functional.interpolate(uci.images.float(), size=(32, 32), mode="bilinear")
    cross = nearest_centroid_accuracy(xtr, ytr, hog_features(uci32.round().byte()), uci.labels.numpy())
    assert cross > 0.3, f"syn → uci nearest-centroid accuracy {cross:.3f}"


def test_syn_cache_file_is_written_read_and_repaired(tmp_path):
    folder = str(tmp_path / "cache")
    first = load_domain("syn", None, "test", seed=3, size=30, cache_dir=folder)
    path = syn_cache_path(os.path.abspath(folder), 3, "test", 30)
    assert os.path.isfile(path)
    on_disk = torch.load(path, weights_only=True)
    assert torch.equal(on_disk["images"], first.images) and torch.equal(on_disk["labels"], first.labels)
    assert torch.equal(first.images, render_syn(3, "test", 30).images)

    # A fresh process (empty in-process cache) loads the file instead of rendering: prove it by
    # planting different, well-formed content in the file.
    planted = {"images": torch.zeros(30, 3, 32, 32, dtype=torch.uint8), "labels": first.labels.clone()}
    torch.save(planted, path)
    dom._syn.cache_clear()
    assert torch.equal(load_domain("syn", None, "test", seed=3, size=30, cache_dir=folder).images,
                       planted["images"])

    # A truncated file is re-rendered and overwritten.
    with open(path, "wb") as fh:
        fh.write(b"not a torch file")
    dom._syn.cache_clear()
    again = load_domain("syn", None, "test", seed=3, size=30, cache_dir=folder)
    assert torch.equal(again.images, first.images)
    assert torch.equal(torch.load(path, weights_only=True)["images"], first.images)
    assert [f for f in os.listdir(folder) if f.startswith(".syn-")] == []  # no temp files left


# --------------------------------------------------------------------------------------------
# mnistm without files: the recipe and the blending rule


def test_blend_rule_hand_worked():
    digits = np.array([[[0, 255], [128, 10]]], dtype=np.uint8)
    patches = np.array([[[[10, 200, 255], [10, 200, 255]], [[10, 200, 255], [0, 0, 0]]]], dtype=np.uint8)
    out = blend_mnistm(digits, patches)
    expected = np.array([[[[10, 200, 255], [245, 55, 0]], [[118, 72, 127], [10, 10, 10]]]], dtype=np.uint8)
    assert out.dtype == np.uint8 and np.array_equal(out, expected)


def test_mnistm_recipe_uses_only_the_second_half_of_mnist():
    for split, n_mnist, size in (("train", 60000, 10000), ("test", 10000, 2000)):
        r = mnistm_recipe(split, 0, size, n_mnist)
        idx = r["mnist_index"]
        assert len(np.unique(idx)) == size
        assert idx.min() >= n_mnist // 2 and idx.max() < n_mnist  # mnist domain uses [0, n/2)
        photos = sample_photos()
        assert set(np.unique(r["photo"])) <= set(range(len(photos)))
        for p, y, x in zip(r["photo"], r["y"], r["x"]):
            h, w = photos[p].shape[:2]
            assert 0 <= y <= h - 32 and 0 <= x <= w - 32
    a, b = mnistm_recipe("train", 1, 50, 60000), mnistm_recipe("train", 2, 50, 60000)
    assert not np.array_equal(a["mnist_index"], b["mnist_index"])
    assert all(np.array_equal(a[k], mnistm_recipe("train", 1, 50, 60000)[k]) for k in a)
    with pytest.raises(ValueError, match="30000"):
        mnistm_recipe("train", 0, 30001, 60000)


# --------------------------------------------------------------------------------------------
# domains that need MNIST


@needs_root
def test_mnist_domain_is_the_first_half_of_each_split():
    for split, half in (("train", 30000), ("test", 5000)):
        source = load_source("mnist", DATA_ROOT, split)
        data = load_domain("mnist", DATA_ROOT, split)
        check_domain_set(data, half, (1, 28, 28))
        assert torch.equal(data.images, source.images[:half])
        assert torch.equal(data.labels, source.labels[:half])
    sub = load_domain("mnist", DATA_ROOT, "train", seed=2, size=150)
    check_domain_set(sub, 150, (1, 28, 28))
    first_half = set(image_keys(load_source("mnist", DATA_ROOT, "train").images[:30000]))
    assert all(k in first_half for k in image_keys(sub.images))
    assert not torch.equal(sub.images, load_domain("mnist", DATA_ROOT, "train", seed=3, size=150).images)
    with pytest.raises(ValueError, match="30000"):
        load_domain("mnist", DATA_ROOT, "train", size=30001)


@needs_root
def test_mnistm_is_built_by_the_documented_rule_from_unused_mnist_digits():
    n = 300
    data = load_domain("mnistm", DATA_ROOT, "train", seed=5, size=n)
    check_domain_set(data, n, (3, 32, 32))
    mnist = load_source("mnist", DATA_ROOT, "train")
    recipe = mnistm_recipe("train", 5, n, len(mnist))
    assert recipe["mnist_index"].min() >= 30000  # disjoint from the mnist domain's 0..29999
    photos = sample_photos()
    on_mask, off_mask = [], []
    for k in range(n):  # naive per-image reconstruction
        digit = np.zeros((32, 32), dtype=np.int64)
        digit[2:30, 2:30] = mnist.images[recipe["mnist_index"][k], 0].numpy()
        y, x = recipe["y"][k], recipe["x"][k]
        patch = photos[recipe["photo"][k]][y : y + 32, x : x + 32].astype(np.int64)
        out = data.images[k].permute(1, 2, 0).numpy().astype(np.int64)
        assert np.array_equal(out, np.abs(patch - digit[..., None]))
        assert int(data.labels[k]) == int(mnist.labels[recipe["mnist_index"][k]])
        on_mask.append(np.abs(out - patch)[digit >= 200].ravel())
        off_mask.append(np.abs(out - patch)[digit == 0].ravel())
    # The digit really changes the patch where it is drawn, and nowhere else.
    assert np.concatenate(on_mask).mean() > 60 and np.concatenate(off_mask).max() == 0
    # Different seeds draw different digits; train and test use different halves' digits.
    other = load_domain("mnistm", DATA_ROOT, "train", seed=6, size=n)
    assert not torch.equal(other.images, data.images)
    test_recipe = mnistm_recipe("test", 5, 100, 10000)
    assert test_recipe["mnist_index"].min() >= 5000


@needs_root
def test_mnistm_natural_size_and_recognisable_digits():
    train = load_domain("mnistm", DATA_ROOT, "train")
    test = load_domain("mnistm", DATA_ROOT, "test")
    check_domain_set(train, 10000, (3, 32, 32))
    check_domain_set(test, 2000, (3, 32, 32))
    acc = nearest_centroid_accuracy(
        hog_features(train.images[:2000]), train.labels[:2000].numpy(),
        hog_features(test.images[:500]), test.labels[:500].numpy(),
    )
    assert acc > 0.5, f"nearest-centroid accuracy {acc:.3f} on mnistm"
    # No MNIST image of the mnist domain appears (by pixels) as an mnistm source digit.
    mnist = load_source("mnist", DATA_ROOT, "train")
    used = mnistm_recipe("train", 0, 10000, len(mnist))["mnist_index"]
    domain_keys = set(image_keys(load_domain("mnist", DATA_ROOT, "train").images))
    assert not any(k in domain_keys for k in image_keys(mnist.images[torch.from_numpy(used)]))


# --------------------------------------------------------------------------------------------
# the paper's domains pass through to the real loaders


def _write_usps(path: str, labels: list[int]) -> np.ndarray:
    """A USPS file in its real format (libsvm lines, labels 1..10, pixels in [-1, 1])."""
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1, 1, (len(labels), 256))
    with bz2.open(path, "wt") as fh:
        for y, row in zip(labels, pixels):
            fh.write(f"{y + 1} " + " ".join(f"{i + 1}:{v:.6f}" for i, v in enumerate(row)) + "\n")
    return pixels


def test_usps_domain_reads_the_real_format(tmp_path):
    labels = [i % 10 for i in range(40)]
    _write_usps(str(tmp_path / "usps.bz2"), labels)
    data = load_domain("usps", str(tmp_path), "train")
    check_domain_set(data, 40, (1, 16, 16))
    assert data.labels.tolist() == labels
    sub = load_domain("usps", str(tmp_path), "train", seed=1, size=12)
    assert len(sub) == 12
    with pytest.raises(ValueError, match="40"):
        load_domain("usps", str(tmp_path), "train", size=41)


# --------------------------------------------------------------------------------------------
# public sets


def test_photo_patches_are_unlabeled_sized_and_deterministic():
    a = load_public("photo_patches", None, 64, seed=0)
    assert a.images.dtype == torch.uint8 and tuple(a.images.shape) == (64, 3, 32, 32)
    assert torch.equal(a.labels, torch.full((64,), -1, dtype=torch.int64))
    again = photo_patches(64, 0)  # generated afresh, not from the cache
    assert torch.equal(again.images, a.images)
    assert not torch.equal(photo_patches(64, 1).images, a.images)
    # Natural-image content with structure: flat patches (sky, blurred background) are redrawn.
    x = a.images.float()
    luma = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    assert luma.std(dim=(1, 2)).min() >= 8.0
    assert len(set(image_keys(a.images))) == 64


@needs_root
def test_fashion_mnist_public_is_a_seeded_unlabeled_subset():
    a = load_public("fashion_mnist", DATA_ROOT, 500, seed=0)
    b = load_public("fashion_mnist", DATA_ROOT, 500, seed=0)
    c = load_public("fashion_mnist", DATA_ROOT, 500, seed=1)
    assert tuple(a.images.shape) == (500, 1, 28, 28) and a.images.dtype == torch.uint8
    assert torch.equal(a.labels, torch.full((500,), -1, dtype=torch.int64))
    assert torch.equal(a.images, b.images) and not torch.equal(a.images, c.images)
    source_keys = set(image_keys(load_source("fashion_mnist", DATA_ROOT, "train").images))
    assert all(k in source_keys for k in image_keys(a.images))
    assert len(set(image_keys(a.images))) > 490  # drawn without replacement
    with pytest.raises(ValueError, match="60000"):
        load_public("fashion_mnist", DATA_ROOT, 60001, seed=0)


# --------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_bad_argument_and_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="allowed: mnist, uci, mnistm, syn, usps, svhn, syndigits"):
        load_domain("kmnist", None, "train")
    with pytest.raises(ValueError, match="split"):
        load_domain("uci", None, "validation")
    with pytest.raises(ValueError, match="1437"):
        load_domain("uci", None, "train", size=5000)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="size"):
            load_domain("uci", None, "train", size=bad)
    with pytest.raises(ValueError, match="seed"):
        load_domain("syn", None, "train", seed=-1, size=5)
    for name in ("mnist", "mnistm", "usps", "svhn", "syndigits"):
        with pytest.raises(DatasetMissingError):
            load_domain(name, None, "train", size=10)
    with pytest.raises(DatasetMissingError):
        load_domain("svhn", str(tmp_path), "test")
    with pytest.raises(ValueError, match="allowed: fashion_mnist, photo_patches, cifar100, mnist"):
        load_public("imagenet", None, 10, seed=0)
    with pytest.raises(ValueError, match="size"):
        load_public("photo_patches", None, 0, seed=0)
    with pytest.raises(DatasetMissingError):
        load_public("cifar100", str(tmp_path), 10, seed=0)
    with pytest.raises(DatasetMissingError):
        load_public("fashion_mnist", None, 10, seed=0)


# --------------------------------------------------------------------------------------------
# a picture of every domain


def save_grid(path: str, root: str | None) -> None:
    """10×10 samples per set (row = digit for the domains), all shown at 32×32."""
    import torch.nn.functional as F
    from PIL import Image

    def to32(x: torch.Tensor) -> torch.Tensor:
        x = x.float().expand(-1, 3, -1, -1) if x.shape[1] == 1 else x.float()
        return F.interpolate(x, size=(32, 32), mode="nearest") if x.shape[-1] != 32 else x

    def grid(images: torch.Tensor) -> torch.Tensor:
        cells = F.pad(to32(images), (1, 1, 1, 1), value=128)  # 34×34 cells with a grey border
        return cells.reshape(10, 10, 3, 34, 34).permute(0, 3, 1, 4, 2).reshape(340, 340, 3)

    panels = []
    for name in OFFLINE_DIGIT_DOMAINS:
        if name in ("mnist", "mnistm") and root is None:
            continue
        data = load_domain(name, root, "train", size=200 if name == "syn" else None)
        rows = [data.images[torch.nonzero(data.labels == c).flatten()[:10]] for c in range(10)]
        panels.append(grid(torch.cat(rows)))
    panels.append(grid(load_public("photo_patches", None, 100, seed=0).images))
    if root is not None:
        panels.append(grid(load_public("fashion_mnist", root, 100, seed=0).images))
    while len(panels) % 3:
        panels.append(torch.full_like(panels[0], 255))
    framed = [F.pad(p.permute(2, 0, 1), (6, 6, 6, 6), value=255).permute(1, 2, 0) for p in panels]
    rows = [torch.cat(framed[i : i + 3], dim=1) for i in range(0, len(framed), 3)]
    Image.fromarray(torch.cat(rows, dim=0).round().clamp(0, 255).byte().numpy()).save(path)


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/domains_grid.png"
    save_grid(out, DATA_ROOT)
    print(f"wrote {out}")
