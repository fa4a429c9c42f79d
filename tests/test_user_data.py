"""Your own data: the image-folder and array tasks on real MNIST / Fashion-MNIST images written by the tests
(PNG and JPEG through PIL, .npz through numpy), the node-local ``data-dir``, the errors that name the file,
and an in-process federation (real ClientApps and ServerApp) where every node reads only its own folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from PIL import Image

from pollen.app.client_app import app as client_app
from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.server_app import main as server_main
from pollen.datasets.sources import load_source
from pollen.datasets.spec import TaskOptions
from pollen.datasets.tasks import TaskError, build_client_data, resolve_task
from pollen.datasets.user_data import UserDataError, holdout, parse_classes, read_image_folder
from pollen.launch.predict import main as predict_main
from pollen.testing import InProcessGrid, clientapp_node
from tests.conftest import require_real_data

DIGITS = {"zero": 0, "one": 1, "two": 2}


def write_image_folder(root: Path, source: str, classes: dict[str, int], per_class: dict[str, int],
                       offset: int = 0, ext: str = ".png", rgb: bool = False) -> dict[str, int]:
    """``root/<split>/<name>/*.<ext>`` from the real ``source`` train set: ``per_class[split]`` images of each
    class, starting at the class's ``offset``-th image (disjoint offsets give disjoint images). Returns the
    count written per split."""
    data = load_source(source, require_real_data(), "train")
    labels = data.labels.numpy()
    counts: dict[str, int] = {}
    start = offset
    for split, n in per_class.items():
        for name, label in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in np.flatnonzero(labels == label)[start:start + n]:
                img = Image.fromarray(data.images[i, 0].numpy())
                (img.convert("RGB") if rgb else img).save(folder / f"{source}-{i}{ext}")
        counts[split] = n * len(classes)
        start += n
    return counts


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """3 MNIST classes, 30 train + 10 test images each."""
    root = tmp_path_factory.mktemp("digits")
    write_image_folder(root, "mnist", DIGITS, {"train": 30, "test": 10})
    return root


def _opts(node: dict | None = None, **keys):
    cfg = parse_run_config({"task": "image-folder", **keys})
    return cfg, TaskOptions.of(cfg, parse_node_config({"partition-id": 0, "num-partitions": 1, **(node or {})})
                                 if node else None)


# -- loaders ------------------------------------------------------------------------------------------------
def test_image_folder_detects_format_and_splits_the_folder_across_partitions(digits):
    cfg, opts = _opts(**{"data-dir": str(digits), "data-split": "iid"})
    spec = resolve_task("image-folder", opts)
    assert spec.class_names == ("one", "two", "zero")  # detected: the folder names, sorted
    assert (spec.num_classes, spec.fmt.channels, spec.fmt.size) == (3, 1, 28)
    parts = [build_client_data("image-folder", opts, p, 3) for p in range(3)]
    assert sum(p.num_train for p in parts) == 90 and sum(len(p.y_test) for p in parts) == 30
    assert all(p.x_train.shape[1:] == (1, 28, 28) and p.x_train.dtype == torch.float32 for p in parts)
    whole = torch.cat([p.x_train for p in parts])  # normalised with the whole folder's own statistics
    assert abs(float(whole.mean())) < 1e-3 and abs(float(whole.std()) - 1.0) < 1e-2
    assert len({p.fmt for p in parts}) == 1


def test_class_names_from_the_run_config_fix_the_label_indices(digits, tmp_path):
    names = tmp_path / "classes.txt"
    names.write_text("two\nzero\n\none\n")
    for value in ("two,zero,one", str(names)):
        cfg, opts = _opts(**{"data-dir": str(digits), "classes": value})
        assert resolve_task("image-folder", opts).class_names == ("two", "zero", "one")
        train, test = read_image_folder(str(digits), cfg.class_names)
        mnist = load_source("mnist", require_real_data(), "train")
        # folders are read in name order (one, two, zero); each gets the index of its name in `classes`
        assert train.labels.tolist() == [2] * 30 + [0] * 30 + [1] * 30
        first = sorted((digits / "train" / "two").iterdir())[0]  # a real MNIST 2, written by the fixture
        k = int(first.stem.split("-")[1])
        assert int(mnist.labels[k]) == 2 and torch.equal(train.images[30], mnist.images[k])
        assert torch.bincount(test.labels).tolist() == [10, 10, 10]


def test_node_data_dir_is_used_whole_and_may_hold_a_subset_of_the_classes(tmp_path):
    own = tmp_path / "node"
    write_image_folder(own, "mnist", {"two": 2, "one": 1}, {"train": 12, "test": 4})
    node = {"data-dir": str(own)}
    cfg, opts = _opts(node, classes="zero,one,two", **{"image-size": 28, "image-channels": 1})
    for partition, num in ((0, 1), (2, 5)):  # the partition does not split a node's own folder
        data = build_client_data("image-folder", opts, partition, num)
        assert (data.num_train, len(data.y_test)) == (24, 8)
        assert data.classes == (1, 2) and data.num_classes == 3
        assert torch.bincount(data.y_train, minlength=3).tolist() == [0, 12, 12]


def test_without_a_test_folder_a_seeded_share_of_train_is_held_out(tmp_path):
    root = tmp_path / "notest"
    write_image_folder(root, "mnist", DIGITS, {"train": 20})
    _, opts = _opts(**{"data-dir": str(root), "test-fraction": 0.25})
    data = build_client_data("image-folder", opts, 0, 1)
    assert (data.num_train, len(data.y_test)) == (45, 15)
    assert torch.bincount(data.y_test).tolist() == [5, 5, 5]
    again = holdout(np.repeat([0, 1, 2], 20), 0.25, 0)
    assert [len(a) for a in again] == [45, 15] and not set(again[0]) & set(again[1])


def test_rgb_jpeg_folder_resized_to_the_run_image_size(tmp_path):
    root = tmp_path / "fashion"
    write_image_folder(root, "fashion_mnist", {"trouser": 1, "bag": 8}, {"train": 10, "test": 3}, ext=".jpg", rgb=True)
    cfg, opts = _opts(**{"data-dir": str(root), "image-size": 32, "image-mean": "0.5,0.5,0.5"})
    spec = resolve_task("image-folder", opts)
    assert (spec.fmt.channels, spec.fmt.size, spec.class_names) == (3, 32, ("bag", "trouser"))
    data = build_client_data("image-folder", opts, 0, 1)
    assert data.x_train.shape == (20, 3, 32, 32) and data.fmt.mean == (0.5, 0.5, 0.5)
    assert data.fmt.std != (1.0, 1.0, 1.0)  # std not given: the folder's own


@pytest.mark.parametrize("layout", ["NHW", "NHWC-float", "NCHW"])
def test_array_task_reads_npz_layouts(tmp_path, layout):
    mnist = load_source("mnist", require_real_data(), "train")
    x = mnist.images[:60, 0].numpy()
    y = (mnist.labels[:60].numpy() % 3).astype(np.int64)
    if layout == "NHWC-float":
        x = np.repeat(x[..., None], 3, axis=3).astype(np.float32) / 255.0
    elif layout == "NCHW":
        x = x[:, None]
    np.savez(tmp_path / "train.npz", x=x[:45], y=y[:45])
    np.savez(tmp_path / "test.npz", x=x[45:], y=y[45:])
    cfg = parse_run_config({"task": "array", "data-dir": str(tmp_path), "classes": "a,b,c"})
    spec = resolve_task("array", TaskOptions.of(cfg))
    channels = 3 if layout == "NHWC-float" else 1
    assert (spec.num_classes, spec.fmt.channels, spec.fmt.size) == (3, channels, 28)
    data = build_client_data("array", TaskOptions.of(cfg), 0, 1)
    assert data.x_train.shape == (45, channels, 28, 28) and torch.equal(data.y_test, torch.from_numpy(y[45:]))
    # one .npz file as data-dir: detected classes (max label + 1), seeded hold-out
    np.savez(tmp_path / "all.npz", x=x, y=y)
    cfg = parse_run_config({"task": "array", "data-dir": str(tmp_path / "all.npz")})
    assert resolve_task("array", TaskOptions.of(cfg)).class_names == ("0", "1", "2")
    data = build_client_data("array", TaskOptions.of(cfg), 0, 1)
    assert data.num_train + len(data.y_test) == 60 and len(data.y_test) > 0


# -- errors name the file -------------------------------------------------------------------------------------
def _copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _build_error(root: Path, classes: str = "zero,one,two") -> str:
    cfg = parse_run_config({"task": "image-folder", "classes": classes, "image-size": 28, "image-channels": 1})
    opts = TaskOptions.of(cfg, parse_node_config({"partition-id": 0, "num-partitions": 1, "data-dir": str(root)}))
    with pytest.raises(TaskError) as err:
        build_client_data("image-folder", opts, 0, 1)
    return str(err.value)


def test_unknown_class_folder_is_named(digits, tmp_path):
    root = _copy_folder(digits, tmp_path / "d")
    (root / "train" / "two").rename(root / "train" / "seven")
    msg = _build_error(root)
    assert f"{root / 'train' / 'seven'}: unknown class folder 'seven'" in msg and "['zero', 'one', 'two']" in msg


def test_empty_class_folder_is_named(digits, tmp_path):
    root = _copy_folder(digits, tmp_path / "d")
    (root / "test" / "three").mkdir()
    assert f"{root / 'test' / 'three'}: empty class folder" in _build_error(root, "zero,one,two,three")


def test_corrupt_and_truncated_images_are_named(digits, tmp_path):
    root = _copy_folder(digits, tmp_path / "d")
    bad = sorted((root / "train" / "one").iterdir())[3]
    bad.write_bytes(b"this is no png")
    assert f"{bad}: unreadable image" in _build_error(root)
    root2 = _copy_folder(digits, tmp_path / "d2")
    cut = sorted((root2 / "test" / "zero").iterdir())[0]
    cut.write_bytes(cut.read_bytes()[:60])  # a truncated PNG: the header is there, the pixels are not
    assert f"{cut}: unreadable image" in _build_error(root2)


def test_mixed_sizes_and_stray_files_are_named(digits, tmp_path):
    root = _copy_folder(digits, tmp_path / "d")
    odd = sorted((root / "train" / "two").iterdir())[5]
    Image.open(odd).resize((32, 32)).save(odd)
    msg = _build_error(root)
    assert f"{odd}: image is 32x32 but " in msg and "is 28x28" in msg
    root2 = _copy_folder(digits, tmp_path / "d2")
    note = root2 / "train" / "one" / "notes.txt"
    note.write_text("hi")
    assert f"{note}: not an image file" in _build_error(root2)


def test_bad_npz_files_are_named(tmp_path):
    x = np.zeros((4, 8, 8), np.uint8)
    cases = {
        "no-y.npz": (dict(x=x), "lacks array(s) ['y']"),
        "labels.npz": (dict(x=x, y=np.array([0, 1, 5, 1])), "label 5 in 'y' but the run has 3 classes"),
        "shape.npz": (dict(x=np.zeros((4, 5, 8, 8), np.uint8), y=np.zeros(4, int)), "array 'x' has shape"),
        "range.npz": (dict(x=np.full((4, 8, 8), 300.0), y=np.zeros(4, int)), "values span 300..300"),
        "count.npz": (dict(x=x, y=np.zeros(3, int)), "4 images in 'x' but 3 labels"),
    }
    for name, (arrays, text) in cases.items():
        np.savez(tmp_path / name, **arrays)
        cfg = parse_run_config({"task": "array", "classes": "a,b,c", "image-size": 8, "image-channels": 1})
        opts = TaskOptions.of(cfg, parse_node_config({"partition-id": 0, "num-partitions": 1,
                                                   "data-dir": str(tmp_path / name)}))
        with pytest.raises(TaskError, match=re.escape(f"{tmp_path / name}: ") + ".*" + re.escape(text)):
            build_client_data("array", opts, 0, 1)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'junk.npz'}: unreadable .npz")):
        parse_run_config({"task": "array", "data-dir": str(tmp_path / "junk.npz")})


def test_run_and_node_config_errors_name_the_key(digits, tmp_path):
    with pytest.raises(ConfigError, match=r"\['classes', 'image-size', 'image-channels'\] are empty"):
        parse_run_config({"task": "image-folder"})
    with pytest.raises(ConfigError, match=r"\['data-dir', 'image-size'\] are read only by tasks image-folder, array"):
        parse_run_config({"task": "uci-dirichlet", "data-dir": str(digits), "image-size": 28})
    with pytest.raises(ConfigError, match="'image-channels' = 2"):
        parse_run_config({"task": "image-folder", "image-channels": 2})
    with pytest.raises(ConfigError, match="'image-mean' lists 3 value"):
        parse_run_config({"task": "image-folder", "data-dir": str(digits), "image-mean": "0.1,0.2,0.3"})
    with pytest.raises(ConfigError, match=re.escape(f"data folder {str(tmp_path / 'none')!r} not found")):
        parse_run_config({"task": "image-folder", "data-dir": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="names classes more than once"):
        parse_run_config({"task": "image-folder", "classes": "a,b,a"})
    with pytest.raises(ConfigError, match="node config 'data-dir' = .* no such file or folder on this node"):
        parse_node_config({"partition-id": 0, "num-partitions": 1, "data-dir": str(tmp_path / "none")})
    with pytest.raises(UserDataError, match="empty name"):
        parse_classes("a,,b")


# -- a federation where every node reads its own folder -------------------------------------------------------
def _federate(run_config: dict, out: Path, folders: list[Path]) -> Path:
    """A real ServerApp run over real ClientApps, node i with node config ``data-dir = folders[i]``."""
    run_dir = out / "7"
    grid = InProcessGrid({100 + i: clientapp_node(client_app, run_config, i, len(folders),
                                                  state_dir=str(run_dir / "nodes" / f"partition-{i}"),
                                                  node_config={"data-dir": str(f)})
                          for i, f in enumerate(folders)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**run_config, "out-dir": str(out)}))
    return run_dir


@pytest.fixture(scope="module")
def node_folders(tmp_path_factory) -> list[Path]:
    """Three nodes, disjoint MNIST images; node 2 holds only two of the three classes."""
    base = tmp_path_factory.mktemp("nodes")
    folders = []
    for i, classes in enumerate([DIGITS, DIGITS, {"one": 1, "two": 2}]):
        write_image_folder(base / f"node{i}", "mnist", classes, {"train": 20, "test": 6}, offset=100 * i)
        folders.append(base / f"node{i}")
    return folders


AGREED = {"task": "image-folder", "classes": "zero,one,two", "image-size": 28, "image-channels": 1,
          "num-server-rounds": 2, "seed": 4, "lr": 0.05, "batch-size": 16}


def test_fedproto_on_own_folders_and_a_node_with_a_corrupt_file(node_folders, tmp_path, capsys):
    folders = [_copy_folder(f, tmp_path / f.name) for f in node_folders]
    bad = sorted((folders[1] / "train" / "zero").iterdir())[0]
    bad.write_bytes(b"\x89PNG broken")
    run_dir = _federate({**AGREED, "method": "fedproto"}, tmp_path / "out", folders)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rounds:
        assert set(r["fit-clients"]) == {"partition 0", "partition 2"}
        assert any(str(bad) in f["reason"] and "unreadable image" in f["reason"] for f in r["failure-reasons"]), r
    last = rounds[-1]
    assert last["fit-clients"]["partition 0"]["num-examples"] == 60
    assert last["fit-clients"]["partition 2"]["num-examples"] == 40
    task = json.loads((run_dir / "task.json").read_text())
    assert task["classes"] == ["zero", "one", "two"] and task["image-size"] == 28
    meta = json.loads((run_dir / "nodes" / "partition-2" / "final-model.json").read_text())
    assert meta["class-names"] == ["zero", "one", "two"] and meta["data-dir"] == str(folders[2].resolve())
    assert (meta["num-train"], meta["num-test"]) == (40, 12)
    # the personal model classifies its node's own test images as the node evaluated them
    model = run_dir / "nodes" / "partition-2" / "final-model.safetensors"
    reported = last["evaluate-clients"]["partition 2"]["accuracy"]
    for source in (["--data-dir", folders[2]], ["--images", folders[2] / "test"]):
        assert predict_main(["--model", str(model), *map(str, source)]) == 0
        out = capsys.readouterr().out
        acc = float(re.search(r"accuracy: ([0-9.]+) \((\d+)/12\)", out).group(1))
        assert abs(acc - reported) <= 1e-6, out


def test_fedavg_on_own_folders_then_predict_with_the_global_model(node_folders, tmp_path, capsys):
    run_dir = _federate({**AGREED, "method": "fedavg"}, tmp_path / "out", node_folders)
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["failures"] == 0
    assert {k: v["num-examples"] for k, v in last["fit-clients"].items()} == {
        "partition 0": 60, "partition 1": 60, "partition 2": 40}
    for i, folder in enumerate(node_folders):
        assert predict_main(["--run", str(run_dir), "--data-dir", str(folder)]) == 0
        out = capsys.readouterr().out
        acc = float(re.search(r"accuracy: ([0-9.]+) \(", out).group(1))
        assert abs(acc - last["evaluate-clients"][f"partition {i}"]["accuracy"]) <= 1e-6, out
    # the global model has no per-node normalisation: --images is refused with the way out
    assert predict_main(["--run", str(run_dir), "--images", str(node_folders[0] / "test")]) == 2
    assert "--data-dir DIR" in capsys.readouterr().err


def test_node_data_dir_with_another_task_fails_that_node_only(node_folders, tmp_path):
    run_config = {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": 1}
    run_dir = tmp_path / "out" / "7"
    grid = InProcessGrid({
        100: clientapp_node(client_app, run_config, 0, 2, state_dir=str(run_dir / "n0")),
        101: clientapp_node(client_app, run_config, 1, 2, state_dir=str(run_dir / "n1"),
                            node_config={"data-dir": str(node_folders[0])})})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**run_config, "out-dir": str(tmp_path / "out")}))
    (row,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(row["fit-clients"]) == {"partition 0"}
    assert any("node config 'data-dir'" in f["reason"] and "read only by tasks image-folder, array" in f["reason"]
               for f in row["failure-reasons"]), row


def test_sample_and_check_commands(tmp_path, capsys):
    from pollen.datasets.user_data import main

    root = require_real_data()
    assert main(["sample", str(tmp_path / "s"), "--data-root", root, "--sites", "2", "--labels", "3,5",
                 "--train", "4", "--test", "2"]) == 0
    site1 = tmp_path / "s" / "site-1"
    assert sorted(p.name for p in (site1 / "train").iterdir()) == ["five", "three"]
    files = [sorted(p.name for p in (tmp_path / "s" / f"site-{k}").rglob("*.png")) for k in (0, 1)]
    assert len(files[0]) == len(files[1]) == 12 and not set(files[0]) & set(files[1])  # other images per site
    capsys.readouterr()
    assert main(["check", str(site1), "--classes", "three,five"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{site1}: 8 training images, 4 test images", "image: 1 channel(s), 28x28 pixels",
        "classes: 0 three (4+2), 1 five (4+2)"]
    assert main(["check", str(site1), "--classes", "three"]) == 2
    assert f"{site1 / 'train' / 'five'}: unknown class folder 'five'" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "n"), "--data-root", root, "--format", "npz", "--labels", "7,1",
                 "--train", "5", "--test", "0"]) == 0
    capsys.readouterr()
    assert main(["check", str(tmp_path / "n" / "site-0"), "--task", "array"]) == 0
    assert "classes: 0 0 (5), 1 1 (5)" in capsys.readouterr().out  # label 7 is index 0: labels follow --labels
