"""``pollen predict``: saved models classify what their clients evaluated, with the same result.

Real runs (Pollen's ServerApp ``main`` + ClientApp on the in-process grid, node state in the simulation
default layout ``<run>/nodes/partition-<i>``) are made once per module; predict must then reproduce, for
each partition, the accuracy the client reported in ``metrics.jsonl`` for the last round — the classifier
head for local / FedAvg / FedProto, nearest-prototype for FedProto's ``proto-accuracy``. A folder of PNG
files must give what the same images give as tensors; files that do not fit are refused with exit code 2.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from pollen.app.checkpoints import load_arrays, save_arrays, write_json
from pollen.app.client_app import app as client_app
from pollen.app.server_app import main as server_main
from pollen.launch.predict import LoadedModel, input_format, main, task_split
from pollen.testing import InProcessGrid, clientapp_node
from tests.conftest import PROJECT_ROOT, real_data_root, require_real_data

PARTITIONS = 3
ACC = re.compile(r"accuracy: ([0-9.]+) \((\d+)/(\d+)\)")
SHOT = {"shot-shots": 12, "shot-stdev": 1, "shot-test-per-class": 5}


def _run(run_config: dict, out_dir: Path, partitions: int = PARTITIONS) -> Path:
    """A real run; each node's state folder is ``<run>/nodes/partition-<i>`` (the simulation default)."""
    run_dir = out_dir / "7"
    grid = InProcessGrid({100 + p: clientapp_node(client_app, run_config, p, partitions,
                                                  state_dir=str(run_dir / "nodes" / f"partition-{p}"))
                          for p in range(partitions)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**run_config, "out-dir": str(out_dir)}))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    return run_dir


def _reported(run_dir: Path, partition: int) -> dict:
    """What the client of ``partition`` reported from its evaluate in the last round."""
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return last["evaluate-clients"][f"partition {partition}"]


def _model(run_dir: Path, partition: int) -> Path:
    return run_dir / "nodes" / f"partition-{partition}" / "final-model.safetensors"


def _predict(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _cli(*argv, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pollen.launch.predict", *map(str, argv)], cwd=PROJECT_ROOT, check=False,
                          capture_output=True, text=True, timeout=timeout)


def _accuracy(stdout: str) -> float:
    match = ACC.search(stdout)
    assert match, stdout
    return float(match.group(1))


@pytest.fixture(scope="module")
def uci_runs(tmp_path_factory):
    """fedavg and local on the embedded UCI digits (no files needed), 3 partitions, 2 rounds."""
    base = {"task": "uci-dirichlet", "seed": 5, "num-server-rounds": 2}
    root = tmp_path_factory.mktemp("uci")
    return {m: _run({**base, "method": m}, root / m) for m in ("fedavg", "local")}


@pytest.fixture(scope="module")
def proto_run(tmp_path_factory):
    root = require_real_data()
    return _run({"method": "fedproto", "task": "mnist-shot", "seed": 3, "num-server-rounds": 2,
                 "data-root": root, **SHOT}, tmp_path_factory.mktemp("proto") / "out")


# -- the task split: what the client evaluated --------------------------------------------------------
@pytest.mark.parametrize("partition", range(PARTITIONS))
def test_local_personal_model_reproduces_the_clients_accuracy(uci_runs, capsys, partition):
    run_dir = uci_runs["local"]
    rc, out, _ = _predict(capsys, "--model", _model(run_dir, partition), "--num-partitions", PARTITIONS)
    assert rc == 0, out
    assert f"run config: {run_dir / 'config.json'}" in out  # found from the default node layout
    assert abs(_accuracy(out) - _reported(run_dir, partition)["accuracy"]) <= 1e-6


@pytest.mark.parametrize("partition", range(PARTITIONS))
def test_fedavg_global_model_reproduces_the_clients_accuracy(uci_runs, capsys, partition):
    run_dir = uci_runs["fedavg"]
    rc, out, _ = _predict(capsys, "--run", run_dir, "--partition", partition, "--num-partitions", PARTITIONS)
    assert rc == 0, out
    assert abs(_accuracy(out) - _reported(run_dir, partition)["accuracy"]) <= 1e-6


def test_cli_writes_csv_and_the_console_script_is_declared(uci_runs, tmp_path):
    import tomllib

    scripts = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pollen": "pollen.launch.cli:main"}  # `pollen predict`; the old `pollen-predict` is gone
    run_dir = uci_runs["fedavg"]
    out_csv = tmp_path / "preds.csv"
    done = _cli("--run", run_dir, "--partition", 1, "--num-partitions", PARTITIONS, "--out", out_csv)
    assert done.returncode == 0, done.stderr
    acc = _accuracy(done.stdout)
    assert abs(acc - _reported(run_dir, 1)["accuracy"]) <= 1e-6
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0]) == ["file", "label", "prediction", "score"]
    assert len(rows) == _reported(run_dir, 1)["num-examples"]
    assert rows[0]["file"] == "uci-dirichlet/partition-1/test/0"
    assert all(0.0 < float(r["score"]) <= 1.0 for r in rows)
    assert np.mean([r["label"] == r["prediction"] for r in rows]) == pytest.approx(acc, abs=1e-6)


def test_fedproto_classifier_and_nearest_prototype_reproduce_the_clients_metrics(proto_run, capsys):
    protos = proto_run / "final" / "global.safetensors"
    for partition in range(PARTITIONS):
        reported = _reported(proto_run, partition)
        rc, out, _ = _predict(capsys, "--model", _model(proto_run, partition), "--num-partitions", PARTITIONS)
        assert rc == 0 and abs(_accuracy(out) - reported["accuracy"]) <= 1e-6, out
        rc, out, _ = _predict(capsys, "--model", _model(proto_run, partition), "--num-partitions", PARTITIONS,
                              "--prototypes", protos)
        assert rc == 0 and "(partition)" in out, out
        own = _accuracy(out)
        assert abs(own - reported["proto-accuracy"]) <= 1e-6
        # Over every present class the task is no easier: a sample right among all is right among its own.
        rc, out, _ = _predict(capsys, "--model", _model(proto_run, partition), "--num-partitions", PARTITIONS,
                              "--prototypes", protos, "--proto-classes", "present")
        assert rc == 0 and "(present)" in out and _accuracy(out) <= own + 1e-9


def test_fedproto_nearest_prototype_through_the_cli(proto_run, tmp_path):
    """The CLI end to end in a fresh process, with --config naming the run folder and --data-root."""
    out_csv = tmp_path / "p.csv"
    done = _cli("--model", _model(proto_run, 2), "--config", proto_run, "--partition", 2,
                "--num-partitions", PARTITIONS, "--prototypes", proto_run, "--data-root", real_data_root(),
                "--out", out_csv)
    assert done.returncode == 0, done.stderr
    assert abs(_accuracy(done.stdout) - _reported(proto_run, 2)["proto-accuracy"]) <= 1e-6
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == _reported(proto_run, 2)["num-examples"] and all(float(r["score"]) >= 0 for r in rows)


def test_fccl_heterogeneous_personal_models_reproduce_intra_accuracy(capsys, tmp_path):
    """Four architectures (resnet10/12, efficientnet_b0, mobilenet_v2; channels-last) on a domain task:
    the split comes from the FCCL client itself (its train/test sizes), so intra-accuracy is reproduced."""
    root = require_real_data()
    run_dir = _run({"method": "fccl", "task": "digits-offline", "num-server-rounds": 1, "model-width": 0.125,
                    "fccl-public": "photo_patches", "fccl-public-size": 40, "fccl-public-batch-size": 20,
                    "fccl-train-sizes": "24,24,24,24", "fccl-solo-epochs": 1, "fccl-local-epochs": "1",
                    "fccl-test-size": 20, "fccl-batch-size": 12, "data-root": root}, tmp_path, partitions=4)
    for partition in range(4):
        rc, out, err = _predict(capsys, "--model", _model(run_dir, partition))  # 4 = the task's fixed count
        assert rc == 0, err
        assert abs(_accuracy(out) - _reported(run_dir, partition)["intra-accuracy"]) <= 1e-6


def _refuse_clients(monkeypatch, method: str) -> None:
    """From here on the registry cannot make a ``method`` client: what still works makes none."""
    from pollen.app.registry import METHODS

    def refuse(*args):
        raise AssertionError(f"a {method} client was made")

    monkeypatch.setitem(METHODS, method, dataclasses.replace(METHODS[method], make_client=refuse))


def _split_of(cfg, partition: int, num_partitions: int, split: str):
    info = {"task": cfg.task, "method": cfg.method}
    return task_split(LoadedModel(None, "", info, Path("."), cfg), cfg.task, partition, num_partitions, split, None)


def test_task_split_is_the_logit_clients_data_with_custom_train_sizes(monkeypatch):
    """A domain task with the run's own ``fccl-train-sizes`` / ``fccl-test-size``: ``pollen predict``
    rebuilds exactly the FCCL client's tensors (both ask :func:`pollen.datasets.tasks.partition_data`; the
    predict side gets the sizes from the method's ``data_sizes``), and it does so without making a client."""
    from pollen.app.config import NodeConfig, parse_run_config
    from pollen.app.registry import METHODS

    cfg = parse_run_config({"method": "fccl", "task": "digits-offline", "seed": 4, "profile": "quick",
                            "data-root": require_real_data(), "fccl-train-sizes": "40,30,50,60",
                            "fccl-test-size": 60})
    threads = torch.get_num_threads()
    try:
        clients = {p: METHODS["fccl"].make_client(cfg, NodeConfig(p, 4), Context(
            run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})).data for p in (1, 3)}
    finally:
        torch.set_num_threads(threads)  # a client sets the run's torch-threads
    _refuse_clients(monkeypatch, "fccl")
    for p, data in clients.items():
        assert len(data.y_train) == (40, 30, 50, 60)[p] and len(data.y_test) == 60
        for split, x, y in (("train", data.x_train, data.y_train), ("test", data.x_test, data.y_test)):
            inputs = _split_of(cfg, p, 4, split)
            assert torch.equal(inputs.x, x) and torch.equal(inputs.y, y) and inputs.classes == data.classes


def test_task_split_makes_no_client(monkeypatch):
    """The partition's data come from the task alone: with the method's client refused, predict's split is
    still the one the task builds for the run's options and seed."""
    from pollen.app.config import parse_run_config
    from pollen.datasets.tasks import TaskOptions, partition_data

    cfg = parse_run_config({"method": "fedavg", "task": "uci-dirichlet", "seed": 5, "max-train-samples": 80})
    _refuse_clients(monkeypatch, "fedavg")
    data = partition_data("uci-dirichlet", TaskOptions.of(cfg), 2, 3)
    for split, x, y in (("train", data.x_train, data.y_train), ("test", data.x_test, data.y_test)):
        inputs = _split_of(cfg, 2, 3, split)
        assert torch.equal(inputs.x, x) and torch.equal(inputs.y, y)
    assert len(data.y_train) == 80


# -- a folder of images --------------------------------------------------------------------------------
def _load_model(path: Path):
    from pollen.models import build_model

    info = json.loads(path.with_suffix(".json").read_text())
    model = build_model(info["model"], info["num-classes"], in_channels=info["in-channels"],
                        image_size=info["image-size"], width=info["width"], **info["model-kwargs"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in load_arrays(path).items()})
    return model.eval()


def test_png_folder_equals_the_same_images_as_tensors(proto_run, capsys, tmp_path):
    from PIL import Image

    from pollen.datasets.sources import load_source
    from pollen.datasets.tasks import TaskOptions, build_client_data
    from pollen.datasets.transforms import to_model_input
    from pollen.methods.prototype_losses import squared_distances

    test = load_source("mnist", real_data_root(), "test")
    idx = np.arange(0, 400, 10)  # 40 test images, every digit
    raw, labels = test.images[idx], test.labels[idx]
    folder = tmp_path / "digits"
    for i, (img, label) in enumerate(zip(raw, labels.tolist())):
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img[0].numpy(), mode="L").save(folder / str(label) / f"{i:03d}.png")

    # the tensor path: the task's own conversion (the format its clients' data carries)
    fmt = build_client_data("mnist-shot", TaskOptions(data_root=real_data_root(), seed=3, shots=12, stdev=1,
                                                      test_per_class=5), 0, PARTITIONS).fmt
    assert input_format("mnist-shot") == fmt
    x = to_model_input(raw, fmt)
    path = _model(proto_run, 0)
    model = _load_model(path)
    with torch.no_grad():
        head = model(x).argmax(1)
        glob = load_arrays(proto_run / "final" / "global.safetensors")
        present = np.flatnonzero(glob["present"])
        dist = squared_distances(model.features(x), torch.from_numpy(glob["prototypes"][present]))
        nearest = torch.from_numpy(present)[dist.argmin(1)]

    for argv, pred in ((), head), (("--prototypes", proto_run), nearest):
        out_csv = tmp_path / "preds.csv"
        rc, out, err = _predict(capsys, "--model", path, "--images", folder, "--out", out_csv, *argv)
        assert rc == 0, err
        assert "40 images, 40 labelled" in out
        assert abs(_accuracy(out) - float((pred == labels).float().mean())) <= 1e-6
        rows = list(csv.DictReader(out_csv.open()))
        order = [int(Path(r["file"]).stem) for r in rows]  # files are listed by class folder
        assert [int(r["prediction"]) for r in rows] == pred[order].tolist()
        assert [int(r["label"]) for r in rows] == labels[order].tolist()


def test_unlabelled_and_rgb_images_on_a_grey_model(uci_runs, capsys, tmp_path):
    """Flat folder: no labels, no accuracy; an RGB file with R=G=B predicts as its grey twin."""
    from PIL import Image

    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)  # UCI digits are 8×8, resized to 28 like the task
    Image.fromarray(grey, mode="L").save(tmp_path / "a-grey.png")
    Image.fromarray(np.repeat(grey[..., None], 3, axis=2), mode="RGB").save(tmp_path / "b-rgb.png")
    out_csv = tmp_path / "out" / "p.csv"
    rc, out, err = _predict(capsys, "--run", uci_runs["fedavg"], "--images", tmp_path, "--out", out_csv)
    assert rc == 0, err
    assert "accuracy: n/a (no labels)" in out
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["label"] for r in rows] == ["", ""] and rows[0]["prediction"] == rows[1]["prediction"]
    assert float(rows[0]["score"]) == pytest.approx(float(rows[1]["score"]), abs=1e-5)


def test_input_format_is_the_one_the_task_data_is_normalised_with():
    """fmnist-dirichlet normalises with Fashion-MNIST's statistics, not MNIST's."""
    from pollen.datasets.tasks import get_task

    assert input_format("fmnist-dirichlet").mean == (0.2860,) == get_task("fmnist-dirichlet").fmt.mean
    assert input_format("mnist-shot") == get_task("mnist-shot").fmt
    assert input_format("digits").channels == 3 and input_format("uci-digits-cil").size == 28


# -- refusals ------------------------------------------------------------------------------------------
def _copy_model(run_dir: Path, tmp_path: Path) -> Path:
    """A node's personal model, its JSON and their sidecars, elsewhere."""
    src = _model(run_dir, 0)
    dst = tmp_path / "node" / "final-model.safetensors"
    dst.parent.mkdir(parents=True)
    for name in ("final-model.safetensors", "final-model.json"):
        for suffix in ("", ".sha256"):
            (dst.parent / (name + suffix)).write_bytes((src.parent / (name + suffix)).read_bytes())
    return dst


def test_a_safetensors_with_other_keys_is_refused_naming_them(uci_runs, tmp_path):
    path = _copy_model(uci_runs["local"], tmp_path)
    arrays = load_arrays(path)
    arrays["classifier.weight"] = arrays.pop("head.weight")
    digest = save_arrays(path, arrays)  # a consistent file (sidecar and JSON digest), of another model
    write_json(path.with_suffix(".json"), {**json.loads(path.with_suffix(".json").read_text()), "sha256": digest})
    done = _cli("--model", path, "--config", uci_runs["local"], "--num-partitions", PARTITIONS)
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(path) in done.stderr
    assert "missing keys ['head.weight']" in done.stderr and "unexpected keys ['classifier.weight']" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_of_another_shape_or_without_its_json_is_refused(uci_runs, capsys, tmp_path):
    path = _copy_model(uci_runs["local"], tmp_path)
    meta = path.with_suffix(".json")
    info = json.loads(meta.read_text())
    write_json(meta, {**info, "model-kwargs": {"channels": 22}})
    rc, _, err = _predict(capsys, "--model", path, "--num-partitions", PARTITIONS)
    assert rc == 2 and str(path) in err
    assert "shape mismatch 'conv2.weight': file (20, 10, 5, 5) vs model (22, 10, 5, 5)" in err
    meta.unlink()
    rc, _, err = _predict(capsys, "--model", path, "--num-partitions", PARTITIONS)
    assert rc == 2 and f"{meta}: the model's JSON not found" in err


def test_prototypes_of_another_size_are_refused(uci_runs, capsys, tmp_path):
    """d must equal the model's feature_dim (cnn_mnist: 50); a weights file is not prototypes."""
    run_dir = uci_runs["local"]
    bad = tmp_path / "global.safetensors"
    save_arrays(bad, {"prototypes": np.zeros((10, 49), np.float32), "present": np.ones(10, np.int64)})
    write_json(bad.with_suffix(".json"), {"family": "prototypes", "method": "fedproto", "task": "uci-dirichlet",
                                          "round": 1, "values": {"margin": 0.1}})
    rc, _, err = _predict(capsys, "--model", _model(run_dir, 0), "--num-partitions", PARTITIONS,
                          "--prototypes", bad)
    assert rc == 2 and f"{bad}: prototypes have d = 49 but the model's features have feature_dim = 50" in err
    rc, _, err = _predict(capsys, "--model", _model(run_dir, 0), "--num-partitions", PARTITIONS,
                          "--prototypes", uci_runs["fedavg"])
    assert rc == 2 and "not prototypes" in err


def test_usage_errors_exit_2_with_a_message(uci_runs, capsys, tmp_path):
    rc, _, err = _predict(capsys, "--run", uci_runs["local"], "--partition", 0, "--num-partitions", PARTITIONS)
    assert rc == 2 and "local-family run (method 'local') has no global model" in err
    assert "partition-0/final-model.safetensors" in err  # points at the models it does have
    rc, _, err = _predict(capsys, "--run", uci_runs["fedavg"], "--partition", 5, "--num-partitions", PARTITIONS)
    assert rc == 2 and "--partition 5 is outside 0..2" in err
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as other:
        bare = Path(other) / "bare"
        shutil.copytree(uci_runs["fedavg"], bare, ignore=shutil.ignore_patterns("nodes"))  # no record of the split
        rc, _, err = _predict(capsys, "--run", bare, "--partition", 0)
    assert rc == 2 and "--num-partitions is needed" in err and "does not record it" in err
    (tmp_path / "seven").mkdir()
    rc, _, err = _predict(capsys, "--run", uci_runs["fedavg"], "--images", tmp_path)
    assert rc == 2 and "class folder 'seven' is neither a class index nor a class name" in err
    with pytest.raises(SystemExit) as exc:
        main(["--partition", "0"])  # neither --model nor --run: argparse's usage error
    assert exc.value.code == 2


def test_help_explains_models_modes_inputs_and_refusals():
    done = _cli("--help", timeout=120)
    assert done.returncode == 0
    for text in ("--model PATH", "--run RUN_DIR", "--prototypes PATH", "--images DIR", "--partition I",
                 "--num-partitions N", "--out FILE", "nearest-prototype", "file,label,prediction,score",
                 "exit code 2", "final-model.json"):
        assert text in done.stdout, text


# -- verified files, partitioning from the model, predictions on stdout --------------------------------
def test_a_flipped_byte_in_a_saved_model_is_refused_naming_the_file(uci_runs, tmp_path):
    """16 bytes flipped inside the weights (still a valid safetensors file, other numbers): without the
    sidecar check predict would answer differently with exit 0."""
    import shutil

    run_dir = tmp_path / "local"
    shutil.copytree(uci_runs["local"], run_dir)
    model = _model(run_dir, 0)
    data = bytearray(model.read_bytes())
    data[-40:-24] = bytes(b ^ 0x5A for b in data[-40:-24])
    model.write_bytes(bytes(data))
    done = _cli("--model", model, "--num-partitions", PARTITIONS)
    assert done.returncode == 2, done.stdout
    assert f"pollen predict: error: {model}: content does not match its recorded SHA-256" in done.stderr
    glob = run_dir.parent / "fedavg"
    shutil.copytree(uci_runs["fedavg"], glob)
    meta = glob / "final" / "global.json"
    meta.write_text(meta.read_text().replace('"round": 2', '"round": 9'))
    done = _cli("--run", glob, "--partition", 0, "--num-partitions", PARTITIONS)
    assert done.returncode == 2 and f"{meta}: content does not match its recorded SHA-256" in done.stderr


def test_a_flipped_byte_without_its_sidecar_is_refused_unless_asked_and_its_json_digest_holds(uci_runs, tmp_path):
    """Deleting the sidecar does not turn the check into a warning: a final model with a flipped byte and
    no ``.sha256`` exits 2 naming the missing sidecar and the way out; ``--allow-unverified`` loads an
    intact file without its sidecar (with a warning), but the flipped one is still refused by the digest
    its JSON records (``final/global.json``, ``final-model.json``)."""
    import shutil

    from pollen.app.checkpoints import sidecar

    glob = tmp_path / "fedavg"
    shutil.copytree(uci_runs["fedavg"], glob)
    weights = glob / "final" / "global.safetensors"
    meta = json.loads((glob / "final" / "global.json").read_text())
    assert meta["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    clean = weights.read_bytes()
    data = bytearray(clean)
    data[-20] ^= 0x01  # inside the tensor data: still a valid safetensors file, one weight changed
    weights.write_bytes(bytes(data))
    sidecar(weights).unlink()
    done = _cli("--run", glob, "--partition", 0, "--num-partitions", PARTITIONS)
    assert done.returncode == 2, done.stdout
    assert (f"pollen predict: error: {weights}: no global.safetensors.sha256 beside it, so nothing says its "
            "content is what was written; refusing to load it; pass --allow-unverified") in done.stderr
    done = _cli("--run", glob, "--partition", 0, "--num-partitions", PARTITIONS, "--allow-unverified")
    assert done.returncode == 2, done.stdout
    assert f"{weights}: content does not match its recorded SHA-256 (in global.json's sha256)" in done.stderr
    weights.write_bytes(clean)  # the bytes written, still without their sidecar
    done = _cli("--run", glob, "--partition", 0, "--num-partitions", PARTITIONS, "--allow-unverified")
    assert done.returncode == 0, done.stderr
    assert "loaded UNVERIFIED, as asked" in done.stderr
    assert abs(_accuracy(done.stdout) - _reported(uci_runs["fedavg"], 0)["accuracy"]) <= 1e-6

    personal = tmp_path / "local"
    shutil.copytree(uci_runs["local"], personal)
    model = _model(personal, 0)
    assert json.loads(model.with_suffix(".json").read_text())["sha256"] == sidecar(model).read_text().split()[0]
    sidecar(model.with_suffix(".json")).unlink()
    done = _cli("--model", model, "--num-partitions", PARTITIONS)
    assert done.returncode == 2 and "final-model.json.sha256 beside it" in done.stderr, done.stderr


def test_partitioning_comes_from_the_model_and_predictions_go_to_stdout(uci_runs, capsys):
    run_dir = uci_runs["local"]
    rc, out, _ = _predict(capsys, "--model", _model(run_dir, 2))  # no --partition, no --num-partitions
    assert rc == 0, out
    assert abs(_accuracy(out) - _reported(run_dir, 2)["accuracy"]) <= 1e-6
    rows = list(csv.reader(out.split("predictions (", 1)[1].splitlines()[1:]))
    assert rows[0] == ["file", "label", "prediction", "score"]
    assert len(rows) - 1 == _reported(run_dir, 2)["num-examples"] and rows[1][0] == "uci-dirichlet/partition-2/test/0"


def test_a_global_model_takes_the_partitioning_its_run_folder_records(uci_runs, capsys):
    run_dir = uci_runs["fedavg"]
    rc, out, _ = _predict(capsys, "--run", run_dir, "--partition", 1)  # 3 nodes/partition-* folders
    assert rc == 0, out
    assert abs(_accuracy(out) - _reported(run_dir, 1)["accuracy"]) <= 1e-6
