"""Data sources (fixture files in each dataset's real on-disk format) and batched transforms."""

from __future__ import annotations

import bz2
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from pollen.datasets import sources
from pollen.datasets.sources import (
    SOURCE_NAMES,
    DatasetMissingError,
    ImageSet,
    clear_cache,
    load_source,
)
from pollen.datasets.transforms import (
    CIFAR10_FORMAT,
    DIGITS_FORMAT,
    MNIST_FORMAT,
    ImageFormat,
    augment,
    batches,
    to_model_input,
)
from tests.conftest import needs_real_data, real_data_root

torch.set_num_threads(1)

DATA_ROOT = real_data_root()  # the one skip rule (tests/conftest.py)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


# ------------------------------------------------------------------------------------------
# fixture writers (the real file formats)


def write_idx_images(path, images: np.ndarray) -> None:
    """IDX3: magic 0x00000803, count, rows, cols (big-endian int32), then the raw bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    n, h, w = images.shape
    with open(path, "wb") as f:
        f.write(struct.pack(">iiii", 2051, n, h, w))
        f.write(images.astype(np.uint8).tobytes())


def write_idx_labels(path, labels: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack(">ii", 2049, labels.size))
        f.write(labels.astype(np.uint8).tobytes())


def write_mnist_like(root, folder: str, rng, n_train=5, n_test=3):
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labs = rng.integers(0, 10, size=n).astype(np.uint8)
        write_idx_images(os.path.join(root, folder, "raw", f"{prefix}-images-idx3-ubyte"), imgs)
        write_idx_labels(os.path.join(root, folder, "raw", f"{prefix}-labels-idx1-ubyte"), labs)
        arrays[prefix] = (imgs, labs)
    return arrays


def write_cifar_batch(path, data: np.ndarray, labels, key: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"data": data, key: list(int(v) for v in labels), "batch_label": "fixture"}, f)


@pytest.fixture
def skip_md5(monkeypatch):
    """Tests only: keep torchvision's file-existence check but skip the md5 comparison."""
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.svhn as tv_svhn
    from torchvision.datasets.utils import check_integrity

    def exists_only(fpath, md5=None):
        return check_integrity(fpath, None)

    monkeypatch.setattr(tv_cifar, "check_integrity", exists_only)
    monkeypatch.setattr(tv_svhn, "check_integrity", exists_only)


def save_png(path, array_hwc: np.ndarray) -> None:
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array_hwc).save(path)


# ------------------------------------------------------------------------------------------
# torchvision-backed sets


def test_mnist_idx_fixture_roundtrip(tmp_path):
    arrays = write_mnist_like(str(tmp_path), "MNIST", np.random.default_rng(0))
    for split, prefix in (("train", "train"), ("test", "t10k")):
        imgs, labs = arrays[prefix]
        ds = load_source("mnist", str(tmp_path), split)
        assert ds.images.dtype == torch.uint8 and ds.images.shape == (len(labs), 1, 28, 28)
        assert ds.labels.dtype == torch.int64
        assert np.array_equal(ds.images[:, 0].numpy(), imgs)
        assert np.array_equal(ds.labels.numpy(), labs.astype(np.int64))
        assert ds.num_classes == 10 and ds.name == "mnist" and len(ds) == len(labs)


def test_fashion_mnist_fixture(tmp_path):
    arrays = write_mnist_like(str(tmp_path), "FashionMNIST", np.random.default_rng(1))
    ds = load_source("fashion_mnist", str(tmp_path), "test")
    assert np.array_equal(ds.images[:, 0].numpy(), arrays["t10k"][0])


@needs_real_data
def test_idx_reader_equals_torchvision_on_the_real_files():
    """MNIST / Fashion-MNIST are read from the IDX files directly; torchvision's decoder gives the same bytes."""
    import torchvision.datasets as tvd

    for name, cls in (("mnist", tvd.MNIST), ("fashion_mnist", tvd.FashionMNIST)):
        for split in ("train", "test"):
            ours = load_source(name, DATA_ROOT, split)
            theirs = cls(DATA_ROOT, train=split == "train", download=False)
            assert np.array_equal(ours.images[:, 0].numpy(), theirs.data.numpy())
            assert np.array_equal(ours.labels.numpy(), theirs.targets.numpy())


def test_damaged_idx_files_are_named(tmp_path):
    write_mnist_like(str(tmp_path), "MNIST", np.random.default_rng(0), n_train=4)
    images = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    labels = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    whole = images.read_bytes()
    images.write_bytes(whole[:-5])
    with pytest.raises(DatasetMissingError, match="truncated or corrupted") as err:
        load_source("mnist", str(tmp_path), "train")
    assert str(images) in str(err.value)
    clear_cache()
    images.write_bytes(b"PK\x03\x04" + whole[4:])  # e.g. a zip saved under the IDX name
    with pytest.raises(DatasetMissingError, match="not an IDX file"):
        load_source("mnist", str(tmp_path), "train")
    clear_cache()
    images.write_bytes(whole)
    write_idx_labels(str(labels), np.zeros(3, dtype=np.uint8))
    with pytest.raises(DatasetMissingError, match="4 images but .* 3 labels"):
        load_source("mnist", str(tmp_path), "train")


def test_reading_mnist_does_not_import_torchvision(tmp_path):
    """Every simulation actor reads its data; importing torchvision there only costs start-up time."""
    import subprocess
    import sys

    write_mnist_like(str(tmp_path), "FashionMNIST", np.random.default_rng(2))
    code = ("import sys\nfrom pollen.datasets.sources import load_source\n"
            f"assert len(load_source('fashion_mnist', {str(tmp_path)!r}, 'test')) == 3\n"
            "print('torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_cache_returns_same_object_per_key(tmp_path):
    write_mnist_like(str(tmp_path), "MNIST", np.random.default_rng(0))
    a = load_source("mnist", str(tmp_path), "train")
    b = load_source("mnist", str(tmp_path) + os.sep, "train")  # same folder, other spelling
    c = load_source("mnist", str(tmp_path), "test")
    assert a is b and a is not c


def test_cifar10_pickle_fixture(tmp_path, skip_md5):
    rng = np.random.default_rng(2)
    base = tmp_path / "cifar-10-batches-py"
    per_batch = 2
    rows, labels = [], []
    for i in range(1, 6):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        lab = rng.integers(0, 10, size=per_batch)
        write_cifar_batch(base / f"data_batch_{i}", data, lab, "labels")
        rows.append(data)
        labels.extend(lab.tolist())
    test_data = rng.integers(0, 256, size=(3, 3072), dtype=np.uint8)
    write_cifar_batch(base / "test_batch", test_data, [1, 2, 3], "labels")
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)

    ds = load_source("cifar10", str(tmp_path), "train")
    rows_all = np.concatenate(rows)
    assert ds.images.shape == (10, 3, 32, 32) and ds.images.is_contiguous()
    # A CIFAR row is 1024 red, then 1024 green, then 1024 blue values, row-major.
    for n in range(10):
        for ch in range(3):
            expected = rows_all[n, ch * 1024 : (ch + 1) * 1024].reshape(32, 32)
            assert np.array_equal(ds.images[n, ch].numpy(), expected)
    assert ds.labels.tolist() == labels
    te = load_source("cifar10", str(tmp_path), "test")
    assert te.labels.tolist() == [1, 2, 3] and te.num_classes == 10


def test_cifar100_pickle_fixture(tmp_path, skip_md5):
    rng = np.random.default_rng(3)
    base = tmp_path / "cifar-100-python"
    data = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)
    write_cifar_batch(base / "train", data, [0, 55, 99, 7], "fine_labels")
    write_cifar_batch(base / "test", data[:1], [3], "fine_labels")
    with open(base / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    ds = load_source("cifar100", str(tmp_path), "train")
    assert ds.num_classes == 100 and ds.labels.tolist() == [0, 55, 99, 7]
    assert np.array_equal(ds.images[2, 1].numpy(), data[2, 1024:2048].reshape(32, 32))


def test_cifar_md5_mismatch_is_reported(tmp_path):
    base = tmp_path / "cifar-10-batches-py"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(base / name, np.zeros((1, 3072), np.uint8), [0], "labels")
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["x"] * 10}, f)
    with pytest.raises(DatasetMissingError, match="md5"):
        load_source("cifar10", str(tmp_path), "train")


def test_svhn_mat_fixture(tmp_path, skip_md5):
    from scipy.io import savemat

    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, size=(32, 32, 3, 4), dtype=np.uint8)  # H×W×C×N as in the .mat files
    y = np.array([[10], [1], [9], [10]], dtype=np.uint8)  # SVHN stores digit 0 as 10
    savemat(str(tmp_path / "test_32x32.mat"), {"X": x, "y": y})
    ds = load_source("svhn", str(tmp_path), "test")
    assert ds.images.shape == (4, 3, 32, 32)
    assert ds.labels.tolist() == [0, 1, 9, 0]
    for n in range(4):
        assert np.array_equal(ds.images[n].numpy(), x[:, :, :, n].transpose(2, 0, 1))
    with pytest.raises(DatasetMissingError, match="train_32x32.mat"):
        load_source("svhn", str(tmp_path), "train")


def test_usps_bz2_fixture(tmp_path):
    rng = np.random.default_rng(5)
    values = rng.uniform(-1, 1, size=(3, 256)).round(6)
    labels = [1, 10, 4]  # USPS labels are 1..10
    lines = [
        f"{lab} " + " ".join(f"{j + 1}:{v}" for j, v in enumerate(row)) for lab, row in zip(labels, values)
    ]
    with bz2.open(tmp_path / "usps.bz2", "wt") as f:
        f.write("\n".join(lines) + "\n")
    ds = load_source("usps", str(tmp_path), "train")
    assert ds.images.shape == (3, 1, 16, 16)
    assert ds.labels.tolist() == [0, 9, 3]
    expected = ((values.astype(np.float32) + 1) / 2 * 255).astype(np.uint8).reshape(3, 16, 16)
    assert np.array_equal(ds.images[:, 0].numpy(), expected)


# ------------------------------------------------------------------------------------------
# folder-based sets


def test_syndigits_imagefolder(tmp_path):
    rng = np.random.default_rng(6)
    written = {}
    for digit, count in ((0, 2), (3, 1), (7, 2)):
        for k in range(count):
            img = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
            save_png(tmp_path / "SynDigits" / "train" / str(digit) / f"img{k}.png", img)
            written[(digit, k)] = img
    # A larger, constant-colour image must come back as 32×32 of the same colour.
    save_png(tmp_path / "SynDigits" / "train" / "9" / "big.png", np.full((40, 50, 3), (10, 200, 90), np.uint8))
    ds = load_source("syndigits", str(tmp_path), "train")
    assert ds.images.shape == (6, 3, 32, 32) and ds.num_classes == 10
    assert ds.labels.tolist() == [0, 0, 3, 7, 7, 9]  # class folders, then files, in sorted order
    order = [(0, 0), (0, 1), (3, 0), (7, 0), (7, 1)]
    for n, key in enumerate(order):
        assert np.array_equal(ds.images[n].permute(1, 2, 0).numpy(), written[key])
    assert ds.images[5, 0].eq(10).all() and ds.images[5, 1].eq(200).all() and ds.images[5, 2].eq(90).all()
    with pytest.raises(DatasetMissingError, match="SynDigits"):
        load_source("syndigits", str(tmp_path), "test")


def _save_jpg(path, colour, size=(48, 40)):
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=95)


def test_officehome_folders_and_fccl_split(tmp_path):
    root = tmp_path / "OfficeHome"
    # Art: 12 "Mug" images (positions 0..7, 10, 11 train; 8, 9 test) and 3 "Bike" images.
    for k in range(12):
        _save_jpg(root / "Art" / "Mug" / f"{k:05d}.jpg", (200, 30, 30), size=(300, 200) if k == 0 else (48, 40))
    for k in range(3):
        _save_jpg(root / "Art" / "Bike" / f"{k:05d}.jpg", (30, 30, 200))
    # The official zip names the last domain "Real World" (with a space); it holds one more class.
    for k in range(2):
        _save_jpg(root / "Real World" / "Alarm_Clock" / f"{k:05d}.jpg", (30, 200, 30))
        _save_jpg(root / "Real World" / "Mug" / f"{k:05d}.jpg", (200, 30, 30))

    classes = ["Alarm_Clock", "Bike", "Mug"]  # sorted union over domains
    tr = load_source("officehome", str(tmp_path), "train", domain="Art")
    te = load_source("officehome", str(tmp_path), "test", domain="Art")
    assert tr.num_classes == te.num_classes == 3
    assert tr.images.shape == (13, 3, 32, 32) and te.images.shape == (2, 3, 32, 32)
    assert sorted(tr.labels.tolist()) == [classes.index("Bike")] * 3 + [classes.index("Mug")] * 10
    assert te.labels.tolist() == [classes.index("Mug")] * 2
    # Constant-colour JPEGs stay (nearly) that colour after decoding and resizing.
    mug = tr.images[tr.labels == classes.index("Mug")].float()
    assert (mug[:, 0] - 200).abs().max() <= 4 and (mug[:, 1] - 30).abs().max() <= 4
    rw = load_source("officehome", str(tmp_path), "train", domain="Real_World")
    assert sorted(rw.labels.tolist()) == [0, 0, 2, 2] and rw.name == "officehome/Real_World"
    with pytest.raises(DatasetMissingError, match="Clipart"):
        load_source("officehome", str(tmp_path), "train", domain="Clipart")
    with pytest.raises(ValueError, match="Real_World"):
        load_source("officehome", str(tmp_path), "train")
    with pytest.raises(ValueError, match="Art, Clipart"):
        load_source("officehome", str(tmp_path), "train", domain="Sketch")


def test_officehome_split_rule_positions():
    train_positions = [p for p in range(25) if sources.officehome_is_train(p)]
    assert train_positions == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24]


# ------------------------------------------------------------------------------------------
# UCI digits (embedded in scikit-learn)


def test_uci_digits_split_and_scaling():
    from sklearn.datasets import load_digits

    tr = load_source("uci_digits", None, "train")
    te = load_source("uci_digits", "/somewhere/irrelevant", "test")
    assert len(tr) + len(te) == 1797 and len(te) == 360
    assert tr.images.shape[1:] == (1, 8, 8) and tr.images.dtype == torch.uint8
    digits = load_digits()
    expected = np.floor(digits.images * 255 / 16 + 0.5).astype(np.uint8)  # round half up; v*255/16 is never .5
    # Train ∪ test is exactly the full set (as a multiset of (image, label) rows).
    def rows(images, labels):
        return sorted(img.tobytes() + bytes([lab]) for img, lab in zip(images, labels))

    ours = np.concatenate([tr.images[:, 0].numpy(), te.images[:, 0].numpy()])
    ours_lab = np.concatenate([tr.labels.numpy(), te.labels.numpy()])
    assert rows(ours, ours_lab) == rows(expected, digits.target)
    # Stratified: each class's test share is ~20%.
    for c in range(10):
        n_c = int((digits.target == c).sum())
        assert abs(int((te.labels == c).sum()) - 0.2 * n_c) <= 1
    clear_cache()
    again = load_source("uci_digits", None, "test")
    assert torch.equal(again.images, te.images) and torch.equal(again.labels, te.labels)


def test_uci_digits_split_is_scikit_learns_stratified_split():
    """The stored test mask is exactly train_test_split's stratified 80/20 split with seed 0, in order."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from pollen.datasets.sources import UCI_DIGITS_SPLIT_SEED, UCI_DIGITS_TEST_FRACTION

    digits = load_digits()
    train_idx, test_idx = train_test_split(np.arange(len(digits.target)), test_size=UCI_DIGITS_TEST_FRACTION,
                                           stratify=digits.target, random_state=UCI_DIGITS_SPLIT_SEED)
    expected = np.rint(digits.images * 255.0 / 16.0).clip(0, 255).astype(np.uint8)
    for split, idx in (("train", np.sort(train_idx)), ("test", np.sort(test_idx))):
        ours = load_source("uci_digits", None, split)
        assert np.array_equal(ours.images[:, 0].numpy(), expected[idx])
        assert np.array_equal(ours.labels.numpy(), digits.target[idx])


def test_reading_uci_digits_does_not_import_scikit_learn():
    """The default task's data in every actor: importing scikit-learn there costs about 1.5 s of start-up."""
    import subprocess
    import sys

    code = ("import sys\nfrom pollen.datasets.sources import load_source\n"
            "assert len(load_source('uci_digits', None, 'test')) == 360\n"
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------
# errors and ImageSet


def test_missing_files_message_names_dataset_root_and_files(tmp_path):
    with pytest.raises(DatasetMissingError) as info:
        load_source("mnist", str(tmp_path), "train")
    msg = str(info.value)
    assert "'mnist'" in msg and str(tmp_path) in msg
    assert "train-images-idx3-ubyte" in msg and "train-labels-idx1-ubyte" in msg
    assert "download=True" in msg
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(DatasetMissingError, match="cifar-100-python"):
        load_source("cifar100", str(tmp_path), "test")
    with pytest.raises(DatasetMissingError, match="usps.t.bz2"):
        load_source("usps", str(tmp_path), "test")


def test_failed_download_becomes_dataset_missing(tmp_path, monkeypatch):
    import urllib.error

    import torchvision.datasets.usps as tv_usps

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(tv_usps, "download_url", offline)  # stands in for an offline machine
    with pytest.raises(DatasetMissingError, match="download failed") as info:
        load_source("usps", str(tmp_path / "new"), "train", download=True)
    assert "usps.bz2" in str(info.value)


def test_root_none_names_the_run_key():
    with pytest.raises(DatasetMissingError, match="data-root"):
        load_source("mnist", None)


def test_bad_arguments_name_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="fashion_mnist"):
        load_source("emnist", str(tmp_path))
    with pytest.raises(ValueError, match="train, test"):
        load_source("mnist", str(tmp_path), "val")
    with pytest.raises(ValueError, match="no domains"):
        load_source("mnist", str(tmp_path), domain="Art")
    assert set(SOURCE_NAMES) == {
        "mnist", "fashion_mnist", "usps", "svhn", "cifar10", "cifar100", "syndigits", "officehome", "uci_digits"
    }


def test_imageset_subset_and_validation():
    images = torch.arange(5 * 4, dtype=torch.uint8).reshape(5, 1, 2, 2)
    ds = ImageSet(images, torch.tensor([4, 3, 2, 1, 0]), 5, "toy")
    sub = ds.subset(np.array([3, 0]))
    assert len(sub) == 2 and sub.labels.tolist() == [1, 4]
    assert torch.equal(sub.images[0], images[3]) and sub.num_classes == 5
    assert ds.subset(torch.tensor([1])).labels.tolist() == [3]
    with pytest.raises(IndexError):
        ds.subset([7])
    with pytest.raises(ValueError, match="uint8"):
        ImageSet(images.float(), ds.labels, 5, "bad")
    with pytest.raises(ValueError, match="labels"):
        ImageSet(images, ds.labels[:3], 5, "bad")


# ------------------------------------------------------------------------------------------
# real MNIST / Fashion-MNIST


@needs_real_data
@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_real_mnist_family(name):
    tr = load_source(name, DATA_ROOT, "train")
    te = load_source(name, DATA_ROOT, "test")
    assert len(tr) == 60000 and len(te) == 10000
    assert tr.images.shape == (60000, 1, 28, 28) and tr.images.dtype == torch.uint8
    assert sorted(torch.unique(tr.labels).tolist()) == list(range(10))
    assert sorted(torch.unique(te.labels).tolist()) == list(range(10))
    assert int(tr.images.max()) == 255 and int(tr.images.min()) == 0


# ------------------------------------------------------------------------------------------
# transforms


def test_to_model_input_hand_computed():
    images = torch.tensor([[[[0, 255], [51, 102]]], [[[255, 255], [0, 0]]]], dtype=torch.uint8)
    fmt = ImageFormat(1, 2, (0.5,), (0.25,))
    out = to_model_input(images, fmt)
    # (v/255 − 0.5) / 0.25:  0 → −2, 255 → 2, 51 → −1.2, 102 → −0.4
    expected = torch.tensor([[[[-2.0, 2.0], [-1.2, -0.4]]], [[[2.0, 2.0], [-2.0, -2.0]]]])
    assert out.dtype == torch.float32 and out.shape == (2, 1, 2, 2)
    assert torch.allclose(out, expected, atol=1e-6)


def test_to_model_input_channel_conversions():
    grey = torch.tensor([[[[0, 255], [51, 102]]]], dtype=torch.uint8)
    fmt3 = ImageFormat(3, 2, (0.5, 0.4, 0.3), (1.0, 2.0, 4.0))
    out = to_model_input(grey, fmt3)
    v = grey[0, 0].float() / 255
    for c, (m, s) in enumerate(zip(fmt3.mean, fmt3.std)):
        assert torch.allclose(out[0, c], (v - m) / s, atol=1e-6)
    rgb = torch.tensor([255, 0, 0], dtype=torch.uint8).view(1, 3, 1, 1)  # one red pixel
    grey_fmt = ImageFormat(1, 1, (0.0,), (1.0,))
    assert torch.allclose(to_model_input(rgb, grey_fmt), torch.tensor(0.299).view(1, 1, 1, 1), atol=1e-6)
    mixed = torch.tensor([10, 20, 30], dtype=torch.uint8).view(1, 3, 1, 1)
    expected = (0.299 * 10 + 0.587 * 20 + 0.114 * 30) / 255
    assert torch.allclose(to_model_input(mixed, grey_fmt), torch.tensor(expected).view(1, 1, 1, 1), atol=1e-6)


def test_to_model_input_shapes_and_resize_matches_pil():
    from PIL import Image

    rng = np.random.default_rng(7)
    mnist = torch.from_numpy(rng.integers(0, 256, size=(3, 1, 28, 28), dtype=np.uint8))
    out = to_model_input(mnist, DIGITS_FORMAT)
    assert out.shape == (3, 3, 32, 32) and out.dtype == torch.float32
    # Grey replicated: de-normalised channels are identical.
    mean = torch.tensor(DIGITS_FORMAT.mean).view(1, 3, 1, 1)
    std = torch.tensor(DIGITS_FORMAT.std).view(1, 3, 1, 1)
    raw = out * std + mean
    assert torch.allclose(raw[:, 0], raw[:, 1], atol=1e-5) and torch.allclose(raw[:, 1], raw[:, 2], atol=1e-5)
    # Antialiased bilinear resizing agrees with PIL's bilinear filter on a float image.
    img = mnist[0, 0].numpy()
    pil = Image.fromarray(img.astype(np.float32) / 255.0, mode="F")
    for size in (14, 32):
        ref = np.asarray(pil.resize((size, size), Image.BILINEAR))
        ours = to_model_input(mnist[:1], ImageFormat(1, size, (0.0,), (1.0,)))[0, 0].numpy()
        assert np.abs(ours - ref).max() < 1e-4
    cifar = torch.from_numpy(rng.integers(0, 256, size=(2, 3, 32, 32), dtype=np.uint8))
    assert to_model_input(cifar, MNIST_FORMAT).shape == (2, 1, 28, 28)
    assert to_model_input(cifar, CIFAR10_FORMAT).shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="uint8"):
        to_model_input(cifar.float(), CIFAR10_FORMAT)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_augment_identity_when_disabled():
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=_gen(0))
    out = augment(x, _gen(1), crop_pad=0, hflip=False, rotation=0.0, brightness=0.0)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    xf = torch.randn(2, 1, 5, 7, generator=_gen(0))
    assert torch.equal(augment(xf, _gen(1), crop_pad=0, hflip=False), xf)


def test_augment_hflip_flips_exactly_the_chosen_samples():
    n = 64
    base = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)  # no row is a palindrome
    x = base.expand(n, -1, -1, -1).clone() + torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1) * 100
    out = augment(x, _gen(3), crop_pad=0, hflip=True)
    flipped = []
    for i in range(n):
        same, flip = torch.equal(out[i], x[i]), torch.equal(out[i], x[i].flip(-1))
        assert same != flip  # each sample is either untouched or mirrored, all channels together
        flipped.append(flip)
    assert 10 < sum(flipped) < n - 10
    again = augment(x, _gen(3), crop_pad=0, hflip=True)
    assert torch.equal(out, again)


def test_augment_crop_is_a_window_of_the_zero_padded_image():
    p = 2
    x = torch.randint(1, 256, (16, 2, 6, 6), dtype=torch.uint8, generator=_gen(5))
    out = augment(x, _gen(6), crop_pad=p, hflip=False)
    assert out.shape == x.shape and out.dtype == torch.uint8
    offsets = set()
    for i in range(x.shape[0]):
        padded = torch.zeros(2, 6 + 2 * p, 6 + 2 * p, dtype=torch.uint8)
        padded[:, p : p + 6, p : p + 6] = x[i]
        hits = [
            (dy, dx)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            if torch.equal(out[i], padded[:, dy : dy + 6, dx : dx + 6])
        ]
        assert len(hits) == 1
        offsets.add(hits[0])
    assert len(offsets) > 3  # offsets really vary per sample


def test_augment_rotation_and_brightness():
    x = torch.full((32, 1, 9, 9), 100, dtype=torch.uint8)
    rot = augment(x, _gen(7), crop_pad=0, hflip=False, rotation=30.0)
    assert rot.shape == x.shape and rot.dtype == torch.uint8
    assert set(torch.unique(rot).tolist()) <= {0, 100}
    assert (rot[:, 0, 4, 4] == 100).all()  # the centre never moves
    corner_zero = (rot[:, 0, 0, 0] == 0) | (rot[:, 0, 0, 8] == 0)
    assert corner_zero.sum() > 16  # most nonzero angles rotate a corner out of the image
    bright = augment(x, _gen(8), crop_pad=0, hflip=False, brightness=0.5)
    per_sample = bright.view(32, -1)
    assert (per_sample == per_sample[:, :1]).all()  # one factor per sample
    vals = per_sample[:, 0].float()
    assert vals.min() >= 50 and vals.max() <= 150 and vals.unique().numel() > 5
    sat = augment(torch.full((8, 1, 2, 2), 250, dtype=torch.uint8), _gen(9), 0, False, brightness=0.9)
    assert int(sat.max()) <= 255
    xf = torch.ones(4, 3, 6, 6)
    allon = augment(xf, _gen(1), crop_pad=1, hflip=True, rotation=15.0, brightness=0.2)
    assert allon.shape == xf.shape and allon.dtype == torch.float32
    assert not torch.equal(allon, augment(xf, _gen(2), crop_pad=1, hflip=True, rotation=15.0, brightness=0.2))


def test_batches_cover_every_index_once():
    got = torch.cat(list(batches(10, 3, _gen(0))))
    assert sorted(got.tolist()) == list(range(10))
    sizes = [b.numel() for b in batches(10, 3, _gen(0))]
    assert sizes == [3, 3, 3, 1]
    dropped = list(batches(10, 3, _gen(0), drop_last=True))
    assert [b.numel() for b in dropped] == [3, 3, 3]
    assert torch.equal(torch.cat(dropped), got[:9])
    assert [b.tolist() for b in batches(5, 2, None)] == [[0, 1], [2, 3], [4]]
    a = [b.tolist() for b in batches(50, 7, _gen(11))]
    b = [b.tolist() for b in batches(50, 7, _gen(11))]
    c = [b.tolist() for b in batches(50, 7, _gen(12))]
    assert a == b and a != c
    assert list(batches(0, 4, _gen(0))) == []
    assert list(batches(3, 4, _gen(0), drop_last=True)) == []
    with pytest.raises(ValueError, match="batch_size"):
        list(batches(3, 0, None))
