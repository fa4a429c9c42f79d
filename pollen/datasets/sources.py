"""Real image sources, decoded once into uint8 tensors.

Every loader returns an :class:`ImageSet`: one ``uint8`` tensor ``N×C×H×W`` and one ``int64``
label tensor. Training loops then index these tensors directly, which is about two orders of
magnitude faster than a per-sample PIL pipeline.

On-disk layouts under ``root`` (the ``data-root`` run key):

==============  ==========================================================================
mnist           ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (torchvision)
fashion_mnist   ``FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
usps            ``usps.bz2`` (train), ``usps.t.bz2`` (test) (torchvision)
svhn            ``train_32x32.mat``, ``test_32x32.mat`` (torchvision; needs scipy)
cifar10         ``cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``
cifar100        ``cifar-100-python/{train,test,meta}``
syndigits       ``SynDigits/{train,test}/<digit 0-9>/*.png`` (ImageFolder layout)
officehome      ``OfficeHome/<Domain>/<class>/*.jpg``, Domain in Art, Clipart, Product,
                Real_World (a ``Real World`` folder, as in the official zip, is accepted too)
uci_digits      embedded in scikit-learn; no root needed
==============  ==========================================================================

The returned tensors are shared by every caller in the process (see :func:`load_source`'s
cache): treat them as read-only and never modify them in place; ``ImageSet.subset`` and
``to_model_input`` always produce new tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

SOURCE_NAMES: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "usps",
    "svhn",
    "cifar10",
    "cifar100",
    "syndigits",
    "officehome",
    "uci_digits",
)

SPLITS: tuple[str, ...] = ("train", "test")

OFFICEHOME_DOMAINS: tuple[str, ...] = ("Art", "Clipart", "Product", "Real_World")

# Images of the two folder-based sets are resized to this side when decoded (the FCCL setting).
FOLDER_IMAGE_SIZE = 32

_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp")

_SYNDIGITS_URL_HINT = (
    "Synthetic Digits (Ganin & Lempitsky, 2015) is not downloadable through torchvision; "
    "place its images as root/SynDigits/{train,test}/<digit 0-9>/*.png"
)
_OFFICEHOME_URL_HINT = (
    "download Office-Home from https://www.hemanthdv.org/officeHomeDataset.html and unpack it "
    "as root/OfficeHome/<Art|Clipart|Product|Real_World>/<class>/*.jpg"
)

if TYPE_CHECKING:
    import torch


class DatasetMissingError(FileNotFoundError):
    """A dataset's files are not where the loader looks; the message says how to get them."""


@dataclass(frozen=True, eq=False)
class ImageSet:
    """A whole split of a dataset as two tensors (images uint8 N×C×H×W, labels int64 N)."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        import torch
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"ImageSet {self.name!r}: images must be a uint8 N×C×H×W tensor, got "
                f"{self.images.dtype} with shape {tuple(self.images.shape)}"
            )
        if self.images.shape[1] not in (1, 3):
            raise ValueError(
                f"ImageSet {self.name!r}: images must have 1 or 3 channels, got {self.images.shape[1]}"
            )
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise ValueError(
                f"ImageSet {self.name!r}: labels must be an int64 vector, got "
                f"{self.labels.dtype} with shape {tuple(self.labels.shape)}"
            )
        if self.labels.shape[0] != self.images.shape[0]:
            raise ValueError(
                f"ImageSet {self.name!r}: {self.images.shape[0]} images but {self.labels.shape[0]} labels"
            )
        if self.num_classes < 1:
            raise ValueError(f"ImageSet {self.name!r}: num_classes must be >= 1, got {self.num_classes}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, index: Any) -> ImageSet:
        """The samples at ``index`` (ints; numpy array, tensor or sequence), as new tensors."""
        import torch
        idx = torch.as_tensor(np.asarray(index), dtype=torch.int64).reshape(-1)
        idx = idx.to(self.labels.device)
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"ImageSet {self.name!r}: subset index out of range for {n} samples")
        return ImageSet(self.images[idx], self.labels[idx], self.num_classes, self.name)


# --------------------------------------------------------------------------------------------
# torchvision-backed sets


@dataclass(frozen=True)
class _TorchvisionSpec:
    cls_name: str
    num_classes: int
    files: dict[str, tuple[str, ...]]  # split -> files relative to root
    uses_split_arg: bool = False  # SVHN takes split="train"/"test", the others train=bool


def _mnist_files(folder: str) -> dict[str, tuple[str, ...]]:
    return {
        split: tuple(
            os.path.join(folder, "raw", f"{prefix}-{kind}-ubyte")
            for kind in ("images-idx3", "labels-idx1")
        )
        for split, prefix in (("train", "train"), ("test", "t10k"))
    }


_TORCHVISION: dict[str, _TorchvisionSpec] = {
    "mnist": _TorchvisionSpec("MNIST", 10, _mnist_files("MNIST")),
    "fashion_mnist": _TorchvisionSpec("FashionMNIST", 10, _mnist_files("FashionMNIST")),
    "usps": _TorchvisionSpec("USPS", 10, {"train": ("usps.bz2",), "test": ("usps.t.bz2",)}),
    "svhn": _TorchvisionSpec(
        "SVHN", 10, {"train": ("train_32x32.mat",), "test": ("test_32x32.mat",)}, uses_split_arg=True
    ),
    "cifar10": _TorchvisionSpec(
        "CIFAR10",
        10,
        {
            "train": tuple(
                os.path.join("cifar-10-batches-py", f)
                for f in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                          "batches.meta")
            ),
            "test": tuple(os.path.join("cifar-10-batches-py", f) for f in ("test_batch", "batches.meta")),
        },
    ),
    "cifar100": _TorchvisionSpec(
        "CIFAR100",
        100,
        {
            "train": tuple(os.path.join("cifar-100-python", f) for f in ("train", "meta")),
            "test": tuple(os.path.join("cifar-100-python", f) for f in ("test", "meta")),
        },
    ),
}


def _missing_message(name: str, root: str, expected: list[str], how: str, extra: str = "") -> str:
    listed = ", ".join(expected)
    text = f"dataset {name!r} not found under root {root!r}: expected {listed}"
    if extra:
        text += f" ({extra})"
    return f"{text}. To get it: {how}."


def _torchvision_how(name: str) -> str:
    return (
        f"run once with download=True on a machine that is online "
        f"(torchvision.datasets.{_TORCHVISION[name].cls_name} fetches it into the same root), "
        f"or copy the files there in torchvision's layout"
    )


def _torchvision_dataset(name: str, root: str, split: str, download: bool) -> Any:
    import torchvision.datasets as tvd

    spec = _TORCHVISION[name]
    cls = getattr(tvd, spec.cls_name)
    kwargs: dict[str, Any] = {"download": download}
    if spec.uses_split_arg:
        kwargs["split"] = split
    else:
        kwargs["train"] = split == "train"
    expected = [os.path.join(root, f) for f in spec.files[split]]
    try:
        return cls(root, **kwargs)
    except RuntimeError as err:
        if "not found" not in str(err):
            raise
        missing = [p for p in expected if not os.path.isfile(p)]
        extra = (
            f"missing: {', '.join(missing)}"
            if missing
            else "the files exist but failed torchvision's md5 check (corrupted or a different version)"
        )
        raise DatasetMissingError(_missing_message(name, root, expected, _torchvision_how(name), extra)) from err


def _torchvision_files_present(name: str, root: str, split: str) -> bool:
    return all(os.path.isfile(os.path.join(root, f)) for f in _TORCHVISION[name].files[split])


def _as_uint8_nchw(data: Any, layout: str) -> torch.Tensor:
    """Convert a whole array (N×H×W, N×C×H×W or N×H×W×C) to one contiguous uint8 N×C×H×W tensor."""
    import torch
    t = torch.as_tensor(np.asarray(data) if not isinstance(data, torch.Tensor) else data)
    if t.dtype != torch.uint8:
        raise ValueError(f"expected uint8 pixel data, got {t.dtype}")
    if layout == "NHW":
        t = t.unsqueeze(1)
    elif layout == "NHWC":
        t = t.permute(0, 3, 1, 2)
    elif layout != "NCHW":
        raise ValueError(f"unknown layout {layout!r}")
    return t.contiguous()


def read_idx(path: str, ndim: int) -> np.ndarray:
    """An uncompressed IDX file of unsigned bytes (MNIST's format) as a read-only ``ndim``-d uint8 array."""
    with open(path, "rb") as fh:
        data = fh.read()
    header = 4 + 4 * ndim
    if len(data) < header or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or data[3] != ndim:
        raise DatasetMissingError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (header "
                                  f"{data[:4].hex() or 'empty'}): replace it with the original, uncompressed file")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    if len(data) - header != int(np.prod(dims)):
        raise DatasetMissingError(f"{path} declares {dims} bytes of data but holds {len(data) - header}: "
                                  "the file is truncated or corrupted; replace it with the original")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _load_torchvision(name: str, root: str, split: str) -> ImageSet:
    import torch
    spec = _TORCHVISION[name]
    expected = [os.path.join(root, f) for f in spec.files[split]]
    if not _torchvision_files_present(name, root, split):
        missing = [p for p in expected if not os.path.isfile(p)]
        raise DatasetMissingError(
            _missing_message(name, root, expected, _torchvision_how(name), f"missing: {', '.join(missing)}")
        )
    if name in ("mnist", "fashion_mnist"):  # IDX files: read directly, no torchvision import per process
        images_np = read_idx(expected[0], ndim=3)
        labels_np = read_idx(expected[1], ndim=1)
        if len(images_np) != len(labels_np):
            raise DatasetMissingError(f"{expected[0]} holds {len(images_np)} images but {expected[1]} "
                                      f"{len(labels_np)} labels: the files do not belong together")
        images = torch.from_numpy(images_np.copy()).unsqueeze(1)
        return ImageSet(images, torch.from_numpy(labels_np.astype(np.int64)), spec.num_classes, name)
    ds = _torchvision_dataset(name, root, split, download=False)
    if name in ("mnist", "fashion_mnist", "usps"):
        images = _as_uint8_nchw(ds.data, "NHW")
        labels = ds.targets
    elif name == "svhn":
        images = _as_uint8_nchw(ds.data, "NCHW")  # torchvision already transposed to N×3×32×32
        labels = ds.labels
    else:  # cifar10 / cifar100: N×32×32×3
        images = _as_uint8_nchw(ds.data, "NHWC")
        labels = ds.targets
    labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.int64).reshape(-1).clone()
    return ImageSet(images, labels_t, spec.num_classes, name)


# --------------------------------------------------------------------------------------------
# folder-based sets (decoded with PIL once)


def _image_files(folder: str) -> list[str]:
    return sorted(
        f
        for f in os.listdir(folder)
        if f.lower().endswith(_IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, f))
    )


def decode_images(paths: list[str], size: int) -> torch.Tensor:
    """Decode image files to one uint8 N×3×size×size tensor (bilinear resize when needed)."""
    import torch
    from PIL import Image

    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    for i, path in enumerate(paths):
        with Image.open(path) as img:
            # For JPEGs, let the decoder downscale by a power of two first (stays >= 2*size):
            # decoding a full-resolution photo only to shrink it to 32x32 is the slow part.
            img.draft("RGB", (2 * size, 2 * size))
            rgb = img.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            out[i] = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def _load_syndigits(root: str, split: str) -> ImageSet:
    import torch
    split_dir = os.path.join(root, "SynDigits", split)
    if not os.path.isdir(split_dir):
        raise DatasetMissingError(
            _missing_message(
                "syndigits", root, [os.path.join(split_dir, "<digit 0-9>", "*.png")], _SYNDIGITS_URL_HINT
            )
        )
    paths: list[str] = []
    labels: list[int] = []
    for entry in sorted(os.listdir(split_dir)):
        class_dir = os.path.join(split_dir, entry)
        if not os.path.isdir(class_dir):
            continue
        if entry not in {str(d) for d in range(10)}:
            raise ValueError(
                f"syndigits: unexpected class folder {class_dir!r}; class folders must be named 0..9"
            )
        files = _image_files(class_dir)
        paths.extend(os.path.join(class_dir, f) for f in files)
        labels.extend([int(entry)] * len(files))
    if not paths:
        raise DatasetMissingError(
            _missing_message(
                "syndigits",
                root,
                [os.path.join(split_dir, "<digit 0-9>", "*.png")],
                _SYNDIGITS_URL_HINT,
                "the folder holds no images",
            )
        )
    images = decode_images(paths, FOLDER_IMAGE_SIZE)
    return ImageSet(images, torch.tensor(labels, dtype=torch.int64), 10, "syndigits")


def _officehome_domain_dir(root: str, domain: str) -> str | None:
    candidates = [domain] + ([domain.replace("_", " ")] if "_" in domain else [])
    for c in candidates:
        path = os.path.join(root, "OfficeHome", c)
        if os.path.isdir(path):
            return path
    return None


def _officehome_classes(root: str) -> list[str]:
    """Sorted union of the class folders of every domain present (ImageFolder order).

    Taking the union keeps labels identical across domains even if one domain lacks a class;
    the complete dataset has 65.
    """
    names: set[str] = set()
    for d in OFFICEHOME_DOMAINS:
        path = _officehome_domain_dir(root, d)
        if path is not None:
            names.update(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)))
    return sorted(names)


def officehome_is_train(position: int) -> bool:
    """FCCL+ split rule: the i-th image of a class (sorted file order) trains iff i % 10 <= 7."""
    return position % 10 <= 7


def _load_officehome(root: str, split: str, domain: str) -> ImageSet:
    import torch
    domain_dir = _officehome_domain_dir(root, domain)
    expected = [os.path.join(root, "OfficeHome", domain, "<class>", "*.jpg")]
    if domain_dir is None:
        raise DatasetMissingError(_missing_message("officehome", root, expected, _OFFICEHOME_URL_HINT))
    classes = _officehome_classes(root)
    paths: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        class_dir = os.path.join(domain_dir, cls)
        if not os.path.isdir(class_dir):
            continue
        for pos, f in enumerate(_image_files(class_dir)):
            if officehome_is_train(pos) == (split == "train"):
                paths.append(os.path.join(class_dir, f))
                labels.append(label)
    if not paths:
        raise DatasetMissingError(
            _missing_message(
                "officehome", root, expected, _OFFICEHOME_URL_HINT, f"no {split} images in {domain_dir!r}"
            )
        )
    images = decode_images(paths, FOLDER_IMAGE_SIZE)
    return ImageSet(images, torch.tensor(labels, dtype=torch.int64), len(classes), f"officehome/{domain}")


# --------------------------------------------------------------------------------------------
# scikit-learn's embedded UCI digits

UCI_DIGITS_TEST_FRACTION = 0.2
UCI_DIGITS_SPLIT_SEED = 0
# Which of the 1,797 samples are test samples (a bit per sample, big-endian bytes, hex): the stratified
# 80/20 split that scikit-learn's train_test_split draws with seed 0, stored so that no process has to
# import scikit-learn (about 1.5 s) to rebuild it; tests/test_sources.py checks it against that split.
UCI_DIGITS_TEST_MASK = (
    "000004883524104000064100934205001a00080100240028062c12001000940a009019120420f8a0028110a000080a8820"
    "441524494240a00a0000004004d80000818020004805c400104008a0100005404800301000020ec409000224840083a801"
    "3c20a6980a0000000b08400804a0184802024041c1008004404684376a810216004480004042a0a4180a5000840b8561c6"
    "08108008004c80c02004068e00010882008100380803c008190000100e01008410a0210033282904c044c080680e010283"
    "0082008822a6402c24042108a860809081a00c02820242120138a41500"
)


def _uci_digits_table() -> np.ndarray:
    """scikit-learn's embedded ``digits.csv.gz`` (64 pixel columns, then the label), read without importing
    scikit-learn; its own loader when the file is not where the installed package keeps it."""
    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if path is not None and path.is_file():
        return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


def _load_uci_digits(split: str) -> ImageSet:
    """UCI optical digits: 1,797 real 8×8 images (values 0..16) scaled to uint8 0..255.

    The split is a stratified 80/20 train/test split with seed 0 (``UCI_DIGITS_TEST_MASK``), each part
    kept in the original sample order, so it is the same on every machine.
    """
    import torch
    table = _uci_digits_table()
    values = table[:, :64].reshape(-1, 8, 8)  # 0..16
    pixels = np.rint(values * 255.0 / 16.0).clip(0, 255).astype(np.uint8)
    target = table[:, 64].astype(np.int64)
    test = np.unpackbits(np.frombuffer(bytes.fromhex(UCI_DIGITS_TEST_MASK), dtype=np.uint8))[: len(target)]
    idx = np.flatnonzero(test == (1 if split == "test" else 0))
    images = torch.from_numpy(pixels[idx]).unsqueeze(1).contiguous()
    return ImageSet(images, torch.from_numpy(target[idx].copy()), 10, "uci_digits")


# --------------------------------------------------------------------------------------------
# public entry point


def _validate(name: str, root: str | None, split: str, domain: str | None) -> tuple[str | None, str | None]:
    if name not in SOURCE_NAMES:
        raise ValueError(f"unknown dataset name {name!r}; allowed: {', '.join(SOURCE_NAMES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for dataset {name!r}; allowed: {', '.join(SPLITS)}")
    if name == "officehome":
        if domain is None:
            raise ValueError(
                f"dataset 'officehome' needs a domain; allowed: {', '.join(OFFICEHOME_DOMAINS)}"
            )
        if domain not in OFFICEHOME_DOMAINS:
            raise ValueError(
                f"unknown officehome domain {domain!r}; allowed: {', '.join(OFFICEHOME_DOMAINS)}"
            )
    elif domain is not None:
        raise ValueError(f"dataset {name!r} has no domains; pass domain=None (got {domain!r})")
    if name == "uci_digits":
        return None, domain  # embedded: the root is irrelevant, keep one cache entry
    if root is None:
        raise DatasetMissingError(
            f"dataset {name!r} is read from files, but no data root was given: set the `data-root` "
            f"run key (or node config) to the folder that holds it"
        )
    return os.path.abspath(os.path.expanduser(str(root))), domain


@functools.cache
def _decode_cached(name: str, root: str | None, split: str, domain: str | None) -> ImageSet:
    if name == "uci_digits":
        return _load_uci_digits(split)
    assert root is not None
    if name in _TORCHVISION:
        return _load_torchvision(name, root, split)
    if name == "syndigits":
        return _load_syndigits(root, split)
    assert domain is not None
    return _load_officehome(root, split, domain)


def load_source(
    name: str,
    root: str | None,
    split: str = "train",
    download: bool = False,
    domain: str | None = None,
) -> ImageSet:
    """Load one split of a dataset as an :class:`ImageSet` (decoded once per process).

    ``download=True`` lets torchvision fetch a missing torchvision-backed set into ``root``
    (needs network); SynDigits and Office-Home must be placed by hand. The result is cached on
    ``(name, root, split, domain)``, so callers share tensors and must not modify them in place.
    Missing files raise :class:`DatasetMissingError` naming the dataset, root, expected files and
    how to obtain them.
    """
    norm_root, domain = _validate(name, root, split, domain)
    if download and name in _TORCHVISION and norm_root is not None:
        if not _torchvision_files_present(name, norm_root, split):
            os.makedirs(norm_root, exist_ok=True)
            try:
                _torchvision_dataset(name, norm_root, split, download=True)
            except DatasetMissingError:
                raise
            except (OSError, RuntimeError) as err:  # offline, HTTP error, bad archive
                expected = [os.path.join(norm_root, f) for f in _TORCHVISION[name].files[split]]
                raise DatasetMissingError(
                    _missing_message(
                        name, norm_root, expected, _torchvision_how(name), f"download failed: {err}"
                    )
                ) from err
    return _decode_cached(name, norm_root, split, domain)


def clear_cache() -> None:
    """Forget every decoded set (tests, or a process that must release the memory)."""
    _decode_cached.cache_clear()
