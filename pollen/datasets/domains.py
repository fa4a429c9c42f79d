"""Digit domains: ten digit classes seen through different acquisition processes (P(X|Y)).

FCCL's Digits task gives each client one domain: MNIST, USPS, SVHN and SynDigits in the paper.
Only MNIST of those can be had offline, so Pollen also builds an *offline* digits task whose four
domains are real or faithfully synthetic and need nothing beyond the pip dependencies and the
MNIST files:

========  ===========================================================================  ==========
domain    what it is                                                                   images
========  ===========================================================================  ==========
mnist     real MNIST, the **first half** of each MNIST split (train 0..29999,          1×28×28
          test 0..4999 for the full dataset)
uci       real UCI optical digits embedded in scikit-learn (other writers, 8×8         1×8×8
          acquisition), the stratified 80/20 split of :mod:`~pollen.datasets.sources`
mnistm    MNIST-M construction (Ganin et al., 2016) from digits of the **second half**     3×32×32
          of each MNIST split (train 30000..59999, test 5000..9999), so no MNIST image is
          in both ``mnist`` and ``mnistm``; backgrounds are patches of scikit-learn's
          two sample photographs
syn       SynNumbers-style rendering (Ganin & Lempitsky, 2015) from the TrueType fonts     3×32×32
          bundled with matplotlib
========  ===========================================================================  ==========

The paper's domains are available by name for users who have the files: ``usps``, ``svhn``,
``syndigits`` (plain :func:`~pollen.datasets.sources.load_source` splits).

Natural sizes (``size=None``): ``mnist`` the whole half split (30000 / 5000), ``uci`` the sklearn
split (1437 / 360), ``mnistm`` and ``syn`` 10000 train / 2000 test (``mnistm``: at most the digits
in its half of the MNIST split), the paper's domains their files. Images keep their native
resolution; :func:`pollen.datasets.transforms.to_model_input` brings all of them to 3×32×32.

Everything is a pure function of ``(name, split, seed, size)`` (plus the files): every process
asking for the same arguments gets identical tensors. Results are cached per process and shared
between callers, so treat the returned tensors as read-only.
"""

from __future__ import annotations

import functools
import glob
import os
import tempfile
import zlib
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.sources import ImageSet, load_source

if TYPE_CHECKING:
    pass

DIGIT_DOMAINS: tuple[str, ...] = ("mnist", "uci", "mnistm", "syn", "usps", "svhn", "syndigits")
OFFLINE_DIGIT_DOMAINS: tuple[str, ...] = ("mnist", "uci", "mnistm", "syn")
SPLITS: tuple[str, ...] = ("train", "test")
NUM_CLASSES = 10

# Natural sizes of the generated domains (the size of MNIST-M's test set is ~10k in the original;
# 2000 keeps every client's evaluation on four domains cheap on CPU).
SYNTHETIC_NATURAL_SIZE: dict[str, int] = {"train": 10000, "test": 2000}

SYNTH_SIDE = 32  # side of mnistm / syn images
# Bump when the syn rendering changes, so stale cache files are not reused.
SYN_RENDER_VERSION = 1


# --------------------------------------------------------------------------------------------
# seeds and argument checks


def _tag(text: str) -> int:
    """A stable 32-bit number for a string (Python's ``hash`` is salted per process)."""
    return zlib.crc32(text.encode("utf-8"))


def keyed_rng(*keys: int | str) -> np.random.Generator:
    """A generator keyed by a seed and names, so every (domain, split, seed) has its own stream."""
    return np.random.default_rng([_tag(k) if isinstance(k, str) else int(k) for k in keys])


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _check_size(size: int | None, what: str) -> int | None:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size for {what} must be a positive integer or None, got {size!r}")
    return int(size)


def _check_split(split: str, what: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for {what}; allowed: {', '.join(SPLITS)}")
    return split


def _too_many(size: int, available: int, what: str) -> ValueError:
    return ValueError(f"size {size} for {what} exceeds the {available} samples available")


def seeded_subset(data: ImageSet, size: int | None, seed: int, *keys: str) -> ImageSet:
    """``size`` samples of ``data`` drawn without replacement (kept in their original order).

    ``keys`` name the purpose, so different users of one seed draw independent subsets.
    ``size=None`` returns ``data`` itself.
    """
    if size is None:
        return data
    if size > len(data):
        raise _too_many(size, len(data), data.name)
    idx = np.sort(keyed_rng(seed, *keys).choice(len(data), size=size, replace=False))
    return data.subset(idx)


# --------------------------------------------------------------------------------------------
# the two sample photographs (MNIST-M backgrounds, syn backgrounds, the photo_patches public set)


@functools.lru_cache(maxsize=1)
def sample_photos() -> tuple[np.ndarray, ...]:
    """scikit-learn's two embedded photographs (china, flower) as read-only uint8 H×W×3 arrays."""
    from sklearn.datasets import load_sample_images

    photos = []
    for image in load_sample_images().images:
        arr = np.ascontiguousarray(image, dtype=np.uint8)
        arr.setflags(write=False)
        photos.append(arr)
    return tuple(photos)


def crop_resized(photo: np.ndarray, y: int, x: int, side: int, out: int) -> np.ndarray:
    """The ``side``×``side`` square at (y, x) resized to ``out``×``out`` (antialiased bilinear)."""
    from PIL import Image

    crop = photo[y : y + side, x : x + side]
    if side == out:
        return np.array(crop)
    return np.asarray(Image.fromarray(crop).resize((out, out), Image.Resampling.BILINEAR))


# --------------------------------------------------------------------------------------------
# MNIST halves and MNIST-M


def mnist_half(split: str, num_mnist: int, half: str) -> tuple[int, int]:
    """Index range ``[lo, hi)`` of the MNIST split that a domain may use.

    ``half='first'`` is the ``mnist`` domain, ``half='second'`` the digit pool of ``mnistm``:
    the two never share an image. With the full dataset: train 0..29999 / 30000..59999,
    test 0..4999 / 5000..9999.
    """
    _check_split(split, "mnist_half")
    mid = num_mnist // 2
    if half == "first":
        return 0, mid
    if half == "second":
        return mid, num_mnist
    raise ValueError(f"half must be 'first' or 'second', got {half!r}")


def mnistm_recipe(split: str, seed: int, size: int, num_mnist: int) -> dict[str, np.ndarray]:
    """Which MNIST digit goes on which photo patch, for ``size`` MNIST-M images.

    Returns int64 arrays of length ``size``: ``mnist_index`` (into the MNIST split, inside the
    second half, no repeats), ``photo`` (0 = china, 1 = flower), and the patch's top-left corner
    ``y``, ``x``. Drawn from a stream keyed by (seed, "mnistm", split); independent of the pixels,
    so it can be inspected without the MNIST files.
    """
    _check_split(split, "mnistm")
    lo, hi = mnist_half(split, num_mnist, "second")
    if size > hi - lo:
        raise _too_many(size, hi - lo, f"domain 'mnistm' ({split}: MNIST digits {lo}..{hi - 1})")
    rng = keyed_rng(seed, "mnistm", split)
    mnist_index = lo + rng.permutation(hi - lo)[:size]
    photos = sample_photos()
    photo = rng.integers(0, len(photos), size=size)
    heights = np.array([photos[p].shape[0] for p in photo])
    widths = np.array([photos[p].shape[1] for p in photo])
    y = np.floor(rng.random(size) * (heights - SYNTH_SIDE + 1)).astype(np.int64)
    x = np.floor(rng.random(size) * (widths - SYNTH_SIDE + 1)).astype(np.int64)
    return {"mnist_index": mnist_index.astype(np.int64), "photo": photo.astype(np.int64), "y": y, "x": x}


def blend_mnistm(digits: np.ndarray, patches: np.ndarray) -> np.ndarray:
    """MNIST-M's blending rule, per pixel and channel: ``out = |patch − digit|``.

    ``digits`` uint8 N×32×32 (grey MNIST strokes, 0 = background), ``patches`` uint8 N×32×32×3.
    Off the digit (digit = 0) the photo is untouched; on a full-intensity stroke (255) the colour
    is inverted (255 − patch); anti-aliased stroke edges fall in between. (Ganin et al. blend the
    binarised digit; keeping MNIST's grey levels only smooths the stroke edges.)
    Returns uint8 N×32×32×3.
    """
    diff = patches.astype(np.int16) - digits.astype(np.int16)[..., None]
    return np.abs(diff).astype(np.uint8)


@functools.lru_cache(maxsize=8)
def _mnistm(root: str | None, split: str, seed: int, size: int | None) -> ImageSet:
    import torch
    mnist = load_source("mnist", root, split)
    lo, hi = mnist_half(split, len(mnist), "second")
    n = min(SYNTHETIC_NATURAL_SIZE[split], hi - lo) if size is None else size
    recipe = mnistm_recipe(split, seed, n, len(mnist))
    pad = (SYNTH_SIDE - mnist.images.shape[-1]) // 2
    digits = mnist.images[torch.from_numpy(recipe["mnist_index"]), 0].numpy()
    digits = np.pad(digits, ((0, 0), (pad, pad), (pad, pad)))
    photos = sample_photos()
    patches = np.empty((n, SYNTH_SIDE, SYNTH_SIDE, 3), dtype=np.uint8)
    for k, (p, y, x) in enumerate(zip(recipe["photo"], recipe["y"], recipe["x"])):
        patches[k] = photos[p][y : y + SYNTH_SIDE, x : x + SYNTH_SIDE]
    images = torch.from_numpy(blend_mnistm(digits, patches)).permute(0, 3, 1, 2).contiguous()
    labels = mnist.labels[torch.from_numpy(recipe["mnist_index"])]
    return ImageSet(images, labels, NUM_CLASSES, "mnistm")


# --------------------------------------------------------------------------------------------
# syn: SynNumbers-style rendering

# Families bundled with matplotlib that hold real digit glyphs (the DejaVu/STIX "Display" and
# symbol fonts, and LastResort, do not).
SYN_FONT_FILES: tuple[str, ...] = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf", "cmr10.ttf", "cmb10.ttf", "cmss10.ttf",
    "cmtt10.ttf", "cmti10.ttf",
)

# Rendering parameters (per image, uniform unless noted). Digit heights are in pixels of the
# final 32×32 image.
SYN_DIGIT_HEIGHT = (13.0, 24.0)
SYN_JITTER = 2.5  # centre offset, px, each axis
SYN_ROTATION = 15.0  # degrees, ±
SYN_NEIGHBOUR_PROB = 0.55  # per side
SYN_GAP = (-1.0, 3.0)  # px between the digit and a neighbour
SYN_BACKGROUND_PROBS = (0.35, 0.35, 0.30)  # flat colour, two-colour gradient, blurred photo patch
SYN_MIN_CONTRAST = 64.0  # |luma(fg) − mean luma(bg)|, 0..255
SYN_BLUR = (0.0, 1.2)  # Gaussian blur radius, px
SYN_NOISE = (0.0, 6.0)  # std of additive Gaussian pixel noise, 0..255
_CANVAS = 48  # render larger than 32 so rotation never clips; neighbours are cut by the crop


@functools.lru_cache(maxsize=1)
def syn_fonts() -> tuple[str, ...]:
    """Paths of the fonts syn draws from (those of :data:`SYN_FONT_FILES` present)."""
    import matplotlib

    folder = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
    found = {os.path.basename(p): p for p in glob.glob(os.path.join(folder, "*.ttf"))}
    paths = tuple(found[f] for f in SYN_FONT_FILES if f in found)
    if not paths:
        raise FileNotFoundError(
            f"no digit fonts found in matplotlib's font folder {folder!r}; expected some of "
            f"{', '.join(SYN_FONT_FILES)}"
        )
    return paths


@functools.cache
def _font(path: str, px: int):
    from PIL import ImageFont

    return ImageFont.truetype(path, px)


@functools.cache
def _height_per_px(path: str) -> float:
    """Ink height of the digits per pixel of font size (font families differ a lot)."""
    font = _font(path, 100)
    boxes = [font.getbbox(str(d), anchor="ls") for d in range(10)]
    return float(np.median([b[3] - b[1] for b in boxes])) / 100.0


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


def _syn_background(rng: np.random.Generator) -> np.ndarray:
    """float32 32×32×3 in 0..255: flat colour, linear two-colour gradient, or blurred photo."""
    from PIL import Image, ImageFilter

    kind = rng.choice(3, p=SYN_BACKGROUND_PROBS)
    if kind == 0:
        return np.broadcast_to(rng.uniform(0, 255, 3).astype(np.float32), (SYNTH_SIDE, SYNTH_SIDE, 3))
    if kind == 1:
        a, b = rng.uniform(0, 255, (2, 3)).astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        coords = np.arange(SYNTH_SIDE, dtype=np.float32) / (SYNTH_SIDE - 1) - 0.5
        t = np.cos(angle) * coords[None, :] + np.sin(angle) * coords[:, None] + 0.5
        t = np.clip(t, 0, 1)[..., None]
        return a * (1 - t) + b * t
    photos = sample_photos()
    photo = photos[rng.integers(len(photos))]
    side = int(rng.integers(SYNTH_SIDE, 3 * SYNTH_SIDE + 1))
    y = int(rng.integers(0, photo.shape[0] - side + 1))
    x = int(rng.integers(0, photo.shape[1] - side + 1))
    patch = Image.fromarray(crop_resized(photo, y, x, side, SYNTH_SIDE))
    patch = patch.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
    return np.asarray(patch, dtype=np.float32)


def _syn_foreground(rng: np.random.Generator, background_luma: float) -> np.ndarray:
    """A random stroke colour whose luma differs from the background's by at least the minimum."""
    for _ in range(32):
        colour = rng.uniform(0, 255, 3).astype(np.float32)
        if abs(float(_luma(colour)) - background_luma) >= SYN_MIN_CONTRAST:
            return colour
    # Rare (mid-grey background and unlucky draws): the extreme with the larger contrast.
    return np.full(3, 0.0 if background_luma > 127.5 else 255.0, dtype=np.float32)


def render_syn_image(seed: int, split: str, index: int, label: int) -> np.ndarray:
    """One SynNumbers-style image (uint8 32×32×3) whose centre digit is ``label``.

    Random per image (stream keyed by seed, split, index): font, digit height, centre jitter,
    rotation about the digit centre, neighbouring distractor digits left/right on the same
    baseline (cut by the frame, as in house-number crops), background (flat / gradient / blurred
    photo patch), a stroke colour contrasting with the background, Gaussian blur and pixel noise.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = keyed_rng(seed, "syn", split, index)
    fonts = syn_fonts()
    path = fonts[rng.integers(len(fonts))]
    height = rng.uniform(*SYN_DIGIT_HEIGHT)
    font = _font(path, max(6, int(round(height / _height_per_px(path)))))
    text = str(label)

    mask = Image.new("L", (_CANVAS, _CANVAS), 0)
    draw = ImageDraw.Draw(mask)
    cx = _CANVAS / 2 + rng.uniform(-SYN_JITTER, SYN_JITTER)
    cy = _CANVAS / 2 + rng.uniform(-SYN_JITTER, SYN_JITTER)
    x0, y0, x1, y1 = font.getbbox(text, anchor="ls")
    ox, oy = cx - (x0 + x1) / 2, cy - (y0 + y1) / 2  # origin that centres the digit's ink
    draw.text((ox, oy), text, fill=255, font=font, anchor="ls")
    gap = rng.uniform(*SYN_GAP)
    left, right = rng.random(2) < SYN_NEIGHBOUR_PROB
    neighbours = rng.integers(0, 10, 2)
    if left:
        other = str(neighbours[0])
        draw.text((ox - font.getlength(other) - gap, oy), other, fill=255, font=font, anchor="ls")
    if right:
        other = str(neighbours[1])
        draw.text((ox + font.getlength(text) + gap, oy), other, fill=255, font=font, anchor="ls")
    angle = rng.uniform(-SYN_ROTATION, SYN_ROTATION)
    mask = mask.rotate(angle, resample=Image.Resampling.BILINEAR, center=(cx, cy))
    margin = (_CANVAS - SYNTH_SIDE) // 2
    mask = mask.crop((margin, margin, margin + SYNTH_SIDE, margin + SYNTH_SIDE))
    alpha = np.asarray(mask, dtype=np.float32)[..., None] / 255.0

    background = _syn_background(rng)
    foreground = _syn_foreground(rng, float(_luma(background).mean()))
    composed = background * (1.0 - alpha) + foreground * alpha
    image = Image.fromarray(np.clip(composed + 0.5, 0, 255).astype(np.uint8))
    image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(*SYN_BLUR))))
    clean = np.asarray(image, dtype=np.float32)
    noisy = clean + rng.normal(0.0, rng.uniform(*SYN_NOISE), clean.shape)  # float64, as numpy promotes
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


def syn_labels(seed: int, split: str, size: int) -> np.ndarray:
    """Balanced labels: every consecutive block of ten images holds each digit once, shuffled."""
    blocks = -(-size // 10)
    labels = np.concatenate([keyed_rng(seed, "syn-labels", split, b).permutation(10) for b in range(blocks)])
    return labels[:size].astype(np.int64)


def render_syn(seed: int, split: str, size: int) -> ImageSet:
    """Render ``size`` syn images (no caching; see :func:`load_domain` for the cached path).

    Image ``i`` depends only on (seed, split, i), so a smaller size is a prefix of a larger one.
    """
    import torch
    labels = syn_labels(seed, split, size)
    images = np.empty((size, SYNTH_SIDE, SYNTH_SIDE, 3), dtype=np.uint8)
    for i, label in enumerate(labels):
        images[i] = render_syn_image(seed, split, i, int(label))
    return ImageSet(
        torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        torch.from_numpy(labels),
        NUM_CLASSES,
        "syn",
    )


def syn_cache_path(cache_dir: str, seed: int, split: str, size: int) -> str:
    """File of a rendered syn set; the name carries every input, including the render version."""
    return os.path.join(cache_dir, f"syn_v{SYN_RENDER_VERSION}_{split}_seed{seed}_n{size}.pt")


def _read_syn_cache(path: str, size: int) -> ImageSet | None:
    """The cached set, or None when the file is absent, unreadable or not what was asked for."""
    import torch
    if not os.path.isfile(path):
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        images, labels = blob["images"], blob["labels"]
    except Exception:  # truncated or foreign file: the caller renders again and overwrites it
        return None
    if not (
        isinstance(images, torch.Tensor)
        and isinstance(labels, torch.Tensor)
        and images.dtype == torch.uint8
        and tuple(images.shape) == (size, 3, SYNTH_SIDE, SYNTH_SIDE)
        and labels.dtype == torch.int64
        and tuple(labels.shape) == (size,)
        and int(labels.min()) >= 0
        and int(labels.max()) < NUM_CLASSES
    ):
        return None
    return ImageSet(images.contiguous(), labels, NUM_CLASSES, "syn")


def _write_syn_cache(path: str, data: ImageSet) -> None:
    """Write atomically (temp file + rename), so concurrent workers never read half a file."""
    import torch
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".syn-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"images": data.images, "labels": data.labels}, fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@functools.lru_cache(maxsize=8)
def _syn(split: str, seed: int, size: int, cache_dir: str | None) -> ImageSet:
    """Rendered once per process; with ``cache_dir``, once per folder.

    FreeType/Pillow versions may anti-alias glyph edges slightly differently, so processes on
    different installs can render pixel-different sets; a shared ``cache_dir`` makes every
    process use the first one written.
    """
    if cache_dir is None:
        return render_syn(seed, split, size)
    path = syn_cache_path(cache_dir, seed, split, size)
    cached = _read_syn_cache(path, size)
    if cached is not None:
        return cached
    data = render_syn(seed, split, size)
    _write_syn_cache(path, data)
    return data


# --------------------------------------------------------------------------------------------
# public entry point


def load_domain(
    name: str,
    root: str | None,
    split: str,
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | None = None,
) -> ImageSet:
    """One split of a digit domain: labels 0..9, ``num_classes`` 10, uint8 at native resolution.

    ``size`` is the number of samples wanted (``None`` = the domain's natural size, see the
    module docstring). For the real domains (``mnist``, ``uci``, ``usps``, ``svhn``,
    ``syndigits``) a given size is a subset drawn with ``seed``; ``mnistm`` draws its digits and
    patches with ``seed``; ``syn`` renders ``size`` images from ``seed``. ``cache_dir`` (used by
    ``syn`` only) keeps the rendered images in a ``.pt`` file so other processes load instead of
    rendering. Domains read from files raise
    :class:`~pollen.datasets.sources.DatasetMissingError` without ``root`` or files; a size
    larger than the domain raises ``ValueError`` naming what is available.
    """
    if name not in DIGIT_DOMAINS:
        raise ValueError(f"unknown digit domain {name!r}; allowed: {', '.join(DIGIT_DOMAINS)}")
    _check_split(split, f"domain {name!r}")
    seed = check_seed(seed)
    size = _check_size(size, f"domain {name!r}")
    if name == "syn":
        n = SYNTHETIC_NATURAL_SIZE[split] if size is None else size
        folder = None if cache_dir is None else os.path.abspath(os.path.expanduser(str(cache_dir)))
        return _syn(split, seed, n, folder)
    if name == "mnistm":
        norm_root = None if root is None else os.path.abspath(os.path.expanduser(str(root)))
        return _mnistm(norm_root, split, seed, size)
    if name == "mnist":
        mnist = load_source("mnist", root, split)
        lo, hi = mnist_half(split, len(mnist), "first")
        data = _first_half_mnist(mnist, lo, hi)
        if size is not None and size > len(data):
            raise _too_many(size, len(data), f"domain 'mnist' ({split}: MNIST images {lo}..{hi - 1})")
        return seeded_subset(data, size, seed, "domain", name, split)
    source = "uci_digits" if name == "uci" else name
    data = load_source(source, root, split)
    if size is not None and size > len(data):
        raise _too_many(size, len(data), f"domain {name!r} ({split})")
    return seeded_subset(data, size, seed, "domain", name, split)


def _first_half_mnist(mnist: ImageSet, lo: int, hi: int) -> ImageSet:
    """The ``mnist`` domain's images as views (no copy) of the cached MNIST tensors."""
    return ImageSet(mnist.images[lo:hi], mnist.labels[lo:hi], NUM_CLASSES, "mnist")
