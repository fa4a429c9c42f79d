"""Your own data: an image folder or a ``.npz`` file, read strictly so a bad file fails by name.

Two tasks read user data (registered in :mod:`pollen.datasets.tasks`):

``image-folder``
    ``<dir>/train/<class>/*.png|jpg|jpeg|bmp`` and optionally ``<dir>/test/<class>/...`` (torchvision's
    ImageFolder layout). Without ``test/``, a seeded per-class share (``test-fraction``) of ``train/``
    is held out.
``array``
    ``<dir>/train.npz`` (+ optional ``<dir>/test.npz``), or ``<dir>`` itself a ``.npz`` file, holding
    ``x`` (N×H×W, N×H×W×C or N×C×H×W; uint8 0..255 or float 0..1 / 0..255) and ``y`` (int labels 0..K-1).

Class names are agreed through the run config (``classes``) so that every node maps a folder name to
the same index, whatever subset of classes it holds; an empty ``classes`` detects them from the
run's shared ``data-dir``. Image side and channels work the same way (``image-size``, ``image-channels``),
because the server builds the model before any node has read a file.

Every problem in the data raises :class:`UserDataError` naming the file or folder: a client that
raises it fails that message with the error as its reason; the server and the other nodes go on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.sources import ImageSet

if TYPE_CHECKING:
    pass

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp")
TRAIN, TEST = "train", "test"


class UserDataError(ValueError):
    """A user's folder or file does not hold readable data of the expected layout (message names it)."""


# ---------------------------------------------------------------------------------- class names
def parse_classes(value: str, key: str = "classes") -> tuple[str, ...]:
    """``"a,b,c"`` or the path of a file with one name per line -> the names in index order."""
    value = value.strip()
    if not value:
        return ()
    path = Path(value).expanduser()
    if "," not in value and path.is_file():
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise UserDataError(f"{key} file {str(path)!r} is not readable text: {err}") from err
        names = [line.strip() for line in lines if line.strip()]
        where = f"{key} file {str(path)!r}"
    else:
        names = [n.strip() for n in value.split(",")]
        where = f"{key} = {value!r}"
        if any(not n for n in names):
            raise UserDataError(f"{where} has an empty name: expected comma-separated class names")
    if not names:
        raise UserDataError(f"{where} lists no class names")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise UserDataError(f"{where} names classes more than once: {dups}")
    return tuple(names)


# ---------------------------------------------------------------------------------- image folders
def _class_dirs(split_dir: Path) -> list[Path]:
    return sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_classes(data_dir: str | Path) -> tuple[str, ...]:
    """The class folder names of ``<dir>/train`` (sorted, ImageFolder's order)."""
    split_dir = _train_dir(Path(data_dir))
    names = tuple(p.name for p in _class_dirs(split_dir))
    if not names:
        raise UserDataError(f"{split_dir}: no class folders (expected {split_dir}/<class>/*.png)")
    return names


def _train_dir(data_dir: Path) -> Path:
    path = _split_dir(data_dir, TRAIN, required=True)
    assert path is not None  # required: missing raises
    return path


def _split_dir(data_dir: Path, split: str, required: bool) -> Path | None:
    if not data_dir.is_dir():
        raise UserDataError(f"data folder {str(data_dir)!r} not found (expected {data_dir}/train/<class>/*.png)")
    path = data_dir / split
    if not path.is_dir():
        if required:
            raise UserDataError(f"{data_dir}: has no '{split}' folder (expected {path}/<class>/*.png)")
        return None
    return path


def _image_paths(class_dir: Path) -> list[Path]:
    paths = []
    for f in sorted(class_dir.iterdir()):
        if f.name.startswith("."):
            continue
        if f.is_dir():
            raise UserDataError(f"{f}: unexpected folder inside class folder {class_dir.name!r} "
                                "(images must lie directly in <split>/<class>/)")
        if f.suffix.lower() not in IMAGE_EXTENSIONS:
            raise UserDataError(f"{f}: not an image file (expected {', '.join(IMAGE_EXTENSIONS)})")
        paths.append(f)
    return paths


def _decode(path: Path) -> np.ndarray:
    """H×W×C uint8 (C = 1 for grey images, 3 otherwise), exactly as stored in the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            if img.mode in ("I;16", "I;16B", "I;16L"):
                return (np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8)[..., None]
            if img.mode in ("1", "L", "LA", "I", "F"):
                return np.asarray(img.convert("L"), dtype=np.uint8)[..., None]
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise UserDataError(f"{path}: unreadable image ({type(err).__name__}: {err})") from err


@dataclass(frozen=True)
class FolderInfo:
    """What one glance at a folder says: class names found, image side and channels of its first image."""

    classes: tuple[str, ...]
    height: int
    width: int
    channels: int


def peek_image_folder(data_dir: str | Path) -> FolderInfo:
    """Class folders of ``train/`` and the first image's size (one file decoded, for detection)."""
    split_dir = _train_dir(Path(data_dir))
    classes = folder_classes(data_dir)
    for name in classes:
        paths = _image_paths(split_dir / name)
        if paths:
            arr = _decode(paths[0])
            return FolderInfo(classes, arr.shape[0], arr.shape[1], arr.shape[2])
    raise UserDataError(f"{split_dir}: the class folders hold no images")


def _read_split(split_dir: Path, classes: tuple[str, ...], size_ref: list) -> tuple[list[np.ndarray], list[int]]:
    index = {name: i for i, name in enumerate(classes)}
    loose = sorted(f for f in split_dir.iterdir() if f.is_file() and not f.name.startswith("."))
    if loose:
        raise UserDataError(f"{loose[0]}: file outside a class folder (expected {split_dir}/<class>/{loose[0].name})")
    dirs = _class_dirs(split_dir)
    if not dirs:
        raise UserDataError(f"{split_dir}: no class folders (expected {split_dir}/<class>/*.png)")
    images: list[np.ndarray] = []
    labels: list[int] = []
    for class_dir in dirs:
        if class_dir.name not in index:
            raise UserDataError(f"{class_dir}: unknown class folder {class_dir.name!r}; the run's classes "
                                f"(run key 'classes') are {list(classes)}")
        paths = _image_paths(class_dir)
        if not paths:
            raise UserDataError(f"{class_dir}: empty class folder (no {', '.join(IMAGE_EXTENSIONS)} files); "
                                "remove it or add images")
        for path in paths:
            arr = _decode(path)
            if not size_ref:
                size_ref.append((arr.shape[:2], path))
            elif arr.shape[:2] != size_ref[0][0]:
                (h, w), first = size_ref[0]
                raise UserDataError(f"{path}: image is {arr.shape[1]}x{arr.shape[0]} but {first} is {w}x{h}; "
                                    "all images of a data folder must have the same size")
            images.append(arr)
            labels.append(index[class_dir.name])
    return images, labels


def _stack(images: list[np.ndarray], labels: list[int], num_classes: int, name: str) -> ImageSet:
    import torch
    channels = 3 if any(a.shape[2] == 3 for a in images) else 1
    arr = np.stack([np.repeat(a, 3, axis=2) if a.shape[2] != channels else a for a in images])
    return ImageSet(torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous(),
                    torch.tensor(labels, dtype=torch.int64), num_classes, name)


@functools.lru_cache(maxsize=8)
def read_image_folder(data_dir: str, classes: tuple[str, ...]) -> tuple[ImageSet, ImageSet | None]:
    """``(train, test or None)`` of an ImageFolder-layout folder, labels indexed by ``classes``.

    Every image is decoded (cached per process); all images of the folder must share one size, and
    grey images are repeated to RGB when the folder also holds colour ones.
    """
    root = Path(data_dir)
    size_ref: list = []
    train_images, train_labels = _read_split(_train_dir(root), classes, size_ref)
    test_dir = _split_dir(root, TEST, required=False)
    test_images, test_labels = _read_split(test_dir, classes, size_ref) if test_dir is not None else ([], [])
    both = _stack(train_images + test_images, train_labels + test_labels, len(classes), str(root))
    n = len(train_labels)
    train = both.subset(np.arange(n))
    test = both.subset(np.arange(n, len(both))) if test_dir is not None else None
    return train, test


def _unlabeled_paths(folder: Path) -> list[Path]:
    """Every image file under ``folder`` (any depth), in sorted relative-path order; anything else is refused."""
    paths = []
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or f.is_dir():
            continue
        if f.suffix.lower() not in IMAGE_EXTENSIONS:
            raise UserDataError(f"{f}: not an image file (a public folder holds only "
                                f"{', '.join(IMAGE_EXTENSIONS)} files)")
        paths.append(f)
    return paths


def count_unlabeled_images(folder: str) -> int:
    """How many images :func:`read_unlabeled_folder` would read (no file decoded)."""
    if not Path(folder).is_dir():
        raise UserDataError(f"public folder {folder!r} not found (expected a folder of images)")
    return len(_unlabeled_paths(Path(folder)))


@functools.lru_cache(maxsize=4)
def read_unlabeled_folder(folder: str) -> ImageSet:
    """Every image under ``folder`` (sub-folders included, sorted by relative path), labels −1.

    The order depends only on the file names, so nodes holding copies of the same folder read the
    same images in the same order — what lets them exchange per-image logits. All images must share
    one size; grey images are repeated to RGB when the folder also holds colour ones.
    """
    root = Path(folder)
    if not root.is_dir():
        raise UserDataError(f"public folder {folder!r} not found (expected a folder of images)")
    paths = _unlabeled_paths(root)
    if not paths:
        raise UserDataError(f"{folder}: the public folder holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    images: list[np.ndarray] = []
    for path in paths:
        arr = _decode(path)
        if images and arr.shape[:2] != images[0].shape[:2]:
            h, w = images[0].shape[:2]
            raise UserDataError(f"{path}: image is {arr.shape[1]}x{arr.shape[0]} but {paths[0]} is {w}x{h}; "
                                "all images of a public folder must have the same size")
        images.append(arr)
    return _stack(images, [-1] * len(images), 1, str(root))


# ---------------------------------------------------------------------------------- arrays
def npz_files(data_path: str | Path) -> tuple[Path, Path | None]:
    """``(train file, test file or None)``: the path itself when it is a ``.npz``, else ``train.npz``/``test.npz``."""
    path = Path(data_path)
    if path.is_file():
        if path.suffix.lower() != ".npz":
            raise UserDataError(f"{path}: not a .npz file (the array task reads numpy .npz archives)")
        return path, None
    if not path.is_dir():
        raise UserDataError(f"data path {str(path)!r} not found (expected a .npz file or a folder with train.npz)")
    train = path / "train.npz"
    if not train.is_file():
        raise UserDataError(f"{path}: has no train.npz (expected {train} with arrays 'x' and 'y')")
    test = path / "test.npz"
    return train, test if test.is_file() else None


def _as_nchw(x: np.ndarray, path: Path) -> np.ndarray:
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        if x.shape[-1] in (1, 3):
            return np.moveaxis(x, -1, 1)
        if x.shape[1] in (1, 3):
            return x
    raise UserDataError(f"{path}: array 'x' has shape {x.shape}; expected N×H×W, N×H×W×C or N×C×H×W with C in 1, 3")


def _as_uint8(x: np.ndarray, path: Path) -> np.ndarray:
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind in "iu":
        x = x.astype(np.float64)
    elif x.dtype.kind != "f":
        raise UserDataError(f"{path}: array 'x' has dtype {x.dtype}; expected uint8 or float")
    if not np.isfinite(x).all():
        raise UserDataError(f"{path}: array 'x' contains NaN or infinite values")
    lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
    if lo < 0 or hi > 255:
        raise UserDataError(f"{path}: array 'x' values span {lo:g}..{hi:g}; expected 0..1 or 0..255")
    scale = 255.0 if hi <= 1.0 else 1.0
    return np.rint(x * scale).clip(0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=8)
def read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x uint8 N×C×H×W, y int64 N)`` of one ``.npz`` (cached per process)."""
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as archive:
            missing = [k for k in ("x", "y") if k not in archive.files]
            if missing:
                raise UserDataError(f"{p}: lacks array(s) {missing} (it holds {archive.files}); "
                                    "expected 'x' (images) and 'y' (int labels)")
            x, y = archive["x"], archive["y"]
    except UserDataError:
        raise
    except (OSError, ValueError, EOFError) as err:  # not a zip, truncated, pickled objects
        raise UserDataError(f"{p}: unreadable .npz ({type(err).__name__}: {err})") from err
    x = _as_uint8(_as_nchw(x, p), p)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise UserDataError(f"{p}: array 'y' has shape {y.shape} and dtype {y.dtype}; expected a vector of int labels")
    if len(y) != len(x):
        raise UserDataError(f"{p}: {len(x)} images in 'x' but {len(y)} labels in 'y'")
    if len(y) == 0:
        raise UserDataError(f"{p}: holds no samples")
    if y.min() < 0:
        raise UserDataError(f"{p}: array 'y' has negative labels ({int(y.min())})")
    return np.ascontiguousarray(x), y.astype(np.int64)


def read_arrays(data_path: str, num_classes: int) -> tuple[ImageSet, ImageSet | None]:
    """``(train, test or None)`` from the ``.npz`` file(s) of ``data_path``; labels must be < ``num_classes``."""
    import torch
    train_path, test_path = npz_files(data_path)
    sets: list[ImageSet | None] = []
    for path in (train_path, test_path):
        if path is None:
            sets.append(None)
            continue
        x, y = read_npz(str(path))
        if int(y.max()) >= num_classes:
            raise UserDataError(f"{path}: label {int(y.max())} in 'y' but the run has {num_classes} classes "
                                "(run key 'classes')")
        sets.append(ImageSet(torch.from_numpy(x), torch.from_numpy(y), num_classes, str(path)))
    train, test = sets
    assert train is not None  # train.npz always exists (npz_files raises otherwise)
    if test is not None and test.images.shape[1:] != train.images.shape[1:]:
        raise UserDataError(f"{test_path}: images are {tuple(test.images.shape[1:])} but {train_path} holds "
                            f"{tuple(train.images.shape[1:])}")
    return train, test


def peek_arrays(data_path: str | Path) -> tuple[int, int, int, int]:
    """``(number of classes = max label + 1, height, width, channels)`` of the training ``.npz``."""
    train_path, _ = npz_files(data_path)
    x, y = read_npz(str(train_path))
    return int(y.max()) + 1, int(x.shape[2]), int(x.shape[3]), int(x.shape[1])


# ---------------------------------------------------------------------------------- splits
def holdout(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded per-class split into (train, test) indices: ``round(fraction·n)`` of each class tested,
    at least one when the class has two or more samples and ``fraction > 0``."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(fraction * len(idx)))
        if fraction > 0 and len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


# ---------------------------------------------------------------------------------- command line
SAMPLE_NAMES = {
    "mnist": ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    "fashion_mnist": ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                      "ankle-boot"),
}


# How ``sample --styles`` renders a site's images: a domain shift for trying task image-domains.
STYLES = ("plain", "inverted", "thick")


def _styled(image: np.ndarray, style: str) -> np.ndarray:
    """``plain`` as stored, ``inverted`` (255 − x: dark strokes on white), ``thick`` (3×3 maximum: bold strokes)."""
    if style == "inverted":
        return 255 - image
    if style == "thick":
        padded = np.pad(image, 1, mode="edge")
        h, w = image.shape
        return np.max([padded[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], axis=0)
    return image


def write_sample(out: Path, source: str, data_root: str, sites: int, labels: list[int], train: int, test: int,
                 fmt: str, styles: tuple[str, ...] = ()) -> list[Path]:
    """``out/site-<k>``: real images of ``source`` (different ones on every site), as PNG class folders
    (``fmt = "png"``) or ``train.npz``/``test.npz`` — data to try the user-data tasks with. ``styles``
    (one per site, from :data:`STYLES`) renders each site as its own domain."""
    if styles and len(styles) != sites:
        raise UserDataError(f"--styles lists {len(styles)} style(s) for {sites} site(s): give one per site")
    bad = [s for s in styles if s not in STYLES]
    if bad:
        raise UserDataError(f"--styles {bad}: expected names from {', '.join(STYLES)}")
    from PIL import Image

    from pollen.datasets.sources import load_source

    data = load_source(source, data_root, "train")
    y = data.labels.numpy()
    picks = {c: np.flatnonzero(y == c) for c in labels}
    need = sites * (train + test)
    short = [c for c in labels if len(picks[c]) < need]
    if short:
        raise UserDataError(f"{source} has too few images of class(es) {short} for {sites} sites × {train + test}")
    folders = []
    for site in range(sites):
        folder = out / f"site-{site}"
        base = site * (train + test)
        style = styles[site] if styles else "plain"
        for split, start, n in ((TRAIN, base, train), (TEST, base + train, test)):
            if n == 0:
                continue
            idx = np.concatenate([picks[c][start:start + n] for c in labels])
            if fmt == "npz":
                folder.mkdir(parents=True, exist_ok=True)
                remap = {c: i for i, c in enumerate(labels)}
                np.savez(folder / f"{split}.npz", x=np.stack([_styled(data.images[i, 0].numpy(), style) for i in idx]),
                         y=np.array([remap[int(v)] for v in y[idx]], dtype=np.int64))
                continue
            for i in idx:
                target = folder / split / SAMPLE_NAMES[source][int(y[i])]
                target.mkdir(parents=True, exist_ok=True)
                Image.fromarray(_styled(data.images[i, 0].numpy(), style)).save(target / f"{source}-{i}.png")
        folders.append(folder)
    return folders


def write_public(out: Path, source: str, data_root: str, count: int, offset: int = 0) -> int:
    """``count`` unlabeled PNGs of ``source``'s training images from index ``offset`` on: a public folder
    (the logit methods' ``fccl-public = "folder"``) to copy to every node."""
    from PIL import Image

    from pollen.datasets.sources import load_source

    data = load_source(source, data_root, "train")
    if offset + count > len(data):
        raise UserDataError(f"{source} has {len(data)} training images: --offset + --count must not exceed it")
    out.mkdir(parents=True, exist_ok=True)
    for i in range(offset, offset + count):
        Image.fromarray(data.images[i, 0].numpy()).save(out / f"{source}-{i:05d}.png")
    return count


def check(path: str, task: str, classes: tuple[str, ...]) -> str:
    """What a node with ``data-dir = path`` would read: classes, counts, image size — or the error."""
    if task == "array":
        x, y = read_npz(str(npz_files(path)[0]))
        k = len(classes) or int(y.max()) + 1
        train, test = read_arrays(path, k)
        names = classes or tuple(str(i) for i in range(k))
    else:
        names = classes or folder_classes(path)
        train, test = read_image_folder(str(Path(path).resolve()), names)
    shape = tuple(train.images.shape[1:])
    lines = [f"{path}: {len(train)} training images, "
             + (f"{len(test)} test images" if test is not None else "no test split (test-fraction is held out)"),
             f"image: {shape[0]} channel(s), {shape[1]}x{shape[2]} pixels",
             "classes: " + ", ".join(f"{i} {n} ({int((train.labels == i).sum())}"
                                     + (f"+{int((test.labels == i).sum())}" if test is not None else "") + ")"
                                     for i, n in enumerate(names))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="pollen data",
                                     description="Check a data folder as a node would read it, or write sample "
                                                 "folders of real images to try the image-folder and array tasks.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="read a folder (or .npz) exactly as a node does; print what it holds")
    c.add_argument("path")
    c.add_argument("--task", choices=("image-folder", "array"), default="image-folder")
    c.add_argument("--classes", default="", help="the run's 'classes' (comma-separated or a file); default: detect")
    s = sub.add_parser("sample", help="write OUT/site-<k>/ folders of real MNIST / Fashion-MNIST images")
    s.add_argument("out", type=Path)
    s.add_argument("--source", choices=tuple(SAMPLE_NAMES), default="mnist")
    s.add_argument("--data-root", default=os.environ.get("POLLEN_DATA_ROOT"),
                   help="dataset root holding the source (default: $POLLEN_DATA_ROOT)")
    s.add_argument("--sites", type=int, default=1, help="how many folders (one per node), disjoint images")
    s.add_argument("--labels", default="0,1,2", help="source labels to take (default 0,1,2)")
    s.add_argument("--train", type=int, default=30, help="training images per class and site")
    s.add_argument("--test", type=int, default=10, help="test images per class and site (0: no test split)")
    s.add_argument("--format", choices=("png", "npz"), default="png")
    s.add_argument("--styles", default="", help=f"one style per site, comma-separated ({', '.join(STYLES)}): each "
                                                "site a domain of its own, for task image-domains")
    p = sub.add_parser("public", help="write OUT/*.png: unlabeled real images, a public folder for the logit methods")
    p.add_argument("out", type=Path)
    p.add_argument("--source", choices=tuple(SAMPLE_NAMES), default="fashion_mnist")
    p.add_argument("--data-root", default=os.environ.get("POLLEN_DATA_ROOT"),
                   help="dataset root holding the source (default: $POLLEN_DATA_ROOT)")
    p.add_argument("--count", type=int, default=200, help="how many images (default 200)")
    p.add_argument("--offset", type=int, default=0, help="index of the first training image taken (default 0)")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(check(args.path, args.task, parse_classes(args.classes)))
            return 0
        if not args.data_root:
            raise UserDataError("no dataset root: pass --data-root or set POLLEN_DATA_ROOT")
        if args.command == "public":
            if args.count < 1 or args.offset < 0:
                raise UserDataError("--count must be >= 1 and --offset >= 0")
            write_public(args.out, args.source, args.data_root, args.count, args.offset)
            print(f"{args.out}: {args.count} unlabeled {args.source} images")
            return 0
        labels = [int(v) for v in args.labels.split(",")]
        if args.sites < 1 or args.train < 1 or args.test < 0 or any(not 0 <= v <= 9 for v in labels):
            raise UserDataError("--sites and --train must be >= 1, --test >= 0, --labels in 0..9")
        for folder in write_sample(args.out, args.source, args.data_root, args.sites, labels, args.train,
                                   args.test, args.format,
                                   tuple(v.strip() for v in args.styles.split(",") if v.strip())):
            print(folder)
        return 0
    except (UserDataError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
