"""Your own data on your own nodes: each node given only its own folder of real MNIST images (node config
``data-dir``). On a real fleet (``pollen fleet --data-dirs``: a SuperLink and three SuperNodes) FedProto
runs to the end and every node's personal model classifies that node's own test images with ``pollen
predict``; in process (the ServerApp and real ClientApps, no launch) FedAvg's global model does.

That no node read another's folder is checked three ways: the run config carries no path at all (the
only folder a node can know is the one in its own node config); the folders have different sizes, and
every node's reported training and test counts are exactly its own folder's; and each node's
``final-model.json`` names its own folder. Run under ``flock /tmp/pollen-cpu.lock``, one e2e test at a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pollen.app.config import ConfigError
from pollen.launch.fleet import format_config, plan_nodes
from pollen.launch.processes import groups_alive
from tests.conftest import PROJECT_ROOT
from tests.test_user_data import write_image_folder

CLASSES = {"zero": 0, "one": 1, "two": 2}
# Node i: TRAIN[i] training and TEST[i] test images per class, disjoint MNIST images on every node.
TRAIN, TEST = (20, 25, 30), (6, 7, 8)
AGREED = {"task": "image-folder", "classes": "zero,one,two", "image-size": 28, "image-channels": 1,
          "local-epochs": 1, "batch-size": 16, "lr": 0.05, "seed": 2}
ACC = re.compile(r"accuracy: ([0-9.]+) \((\d+)/(\d+)\)")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("own")
    out = []
    for i, (n_train, n_test) in enumerate(zip(TRAIN, TEST)):
        folder = base / f"site-{i}" / "images"  # each node's folder lives in its own place
        write_image_folder(folder, "mnist", CLASSES, {"train": n_train, "test": n_test}, offset=200 * i)
        out.append(folder)
    return out


def test_plan_nodes_gives_each_supernode_its_own_data_dir(folders, tmp_path):
    nodes = plan_nodes(3, data_dirs=[str(f) for f in folders])
    assert [n.config["data-dir"] for n in nodes] == [str(f.resolve()) for f in folders]
    assert "data-dir=" in nodes[0].node_config
    with pytest.raises(ConfigError, match="2 folders for 3 SuperNodes"):
        plan_nodes(3, data_dirs=[str(f) for f in folders[:2]])
    with pytest.raises(ConfigError, match="no such file or folder"):
        plan_nodes(1, data_dirs=[str(tmp_path / "missing")])


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _predict(*argv) -> tuple[float, int]:
    proc = subprocess.run([sys.executable, "-m", "pollen.launch.predict", *map(str, argv)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = ACC.search(proc.stdout)
    assert match, proc.stdout
    return float(match.group(1)), int(match.group(3))


def _check_own_counts(run_dir: Path) -> dict:
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data-dir"] == ""  # no data folder travels with the run
    last = _rounds(run_dir)[-1]
    assert last["failures"] == 0, last
    for i in range(3):
        assert last["fit-clients"][f"partition {i}"]["num-examples"] == 3 * TRAIN[i]
        assert last["evaluate-clients"][f"partition {i}"]["num-examples"] == 3 * TEST[i]
    return last


@pytest.mark.e2e
def test_fedproto_fleet_through_the_cli_where_every_node_trains_on_its_own_folder(folders, tmp_path):
    """``pollen fleet --data-dirs``: each SuperNode is started with its own folder, trains and tests on it
    alone, and its personal model classifies that folder's test images as the node's last evaluation did."""
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "pollen.launch.cli", "fleet", "--method", "fedproto", "--num-supernodes", "3",
         "--rounds", "2", "--data-dirs", ",".join(str(f) for f in folders), "--run-config", format_config(AGREED),
         "--work-dir", str(tmp_path / "work"), "--out-dir", str(out), "--quiet"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(out.glob("*/fleet.json")).read_text())
    assert [n["node-config"].count(f"data-dir='{f.resolve()}'") for n, f in zip(report["nodes"], folders)] == [1, 1, 1]
    assert report["client_errors"] == {}
    assert not groups_alive([report["superlink_pid"]] + [n["pid"] for n in report["nodes"]])
    run_dir = Path(report["results_dir"])
    last = _check_own_counts(run_dir)
    task = json.loads((run_dir / "task.json").read_text())
    assert task["classes"] == ["zero", "one", "two"] and task["image-size"] == 28
    for i, folder in enumerate(folders):
        state = run_dir / "nodes" / f"partition-{i}"
        meta = json.loads((state / "final-model.json").read_text())
        assert meta["data-dir"] == str(folder.resolve()) and meta["class-names"] == ["zero", "one", "two"]
        assert (meta["num-train"], meta["num-test"]) == (3 * TRAIN[i], 3 * TEST[i])
        acc, n = _predict("--model", state / "final-model.safetensors", "--images", folder / "test")
        assert n == 3 * TEST[i]
        assert abs(acc - last["evaluate-clients"][f"partition {i}"]["accuracy"]) <= 1e-6
        assert acc > 1 / 3  # two rounds on 60-90 digits already beat chance


def test_fedavg_on_nodes_with_their_own_folders_and_its_global_model_on_each(folders, tmp_path, capsys):
    """FedAvg, the ServerApp and three real ClientApps in this process, each node given only its own folder
    by node config (the fleet above carries node config ``data-dir`` through Flower; a method's family does
    not change how a node reads it): one round, each node's counts are its own folder's, and the global model
    (``pollen predict --run``, its entry point called here) scores each folder's test split as that node's
    evaluation did."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.launch.predict import main as predict
    from pollen.testing import InProcessGrid, clientapp_node

    config = {**AGREED, "method": "fedavg", "num-server-rounds": 1}
    grid = InProcessGrid({100 + i: clientapp_node(client_app, config, i, 3, state_dir=str(tmp_path / f"p{i}"),
                                                  node_config={"data-dir": str(folder)})
                          for i, folder in enumerate(folders)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**config, "out-dir": str(tmp_path / "runs"), "run-name": "fedavg"}))
    run_dir = tmp_path / "runs" / "fedavg"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    last = _check_own_counts(run_dir)
    capsys.readouterr()
    for i, folder in enumerate(folders):
        assert predict(["--run", str(run_dir), "--data-dir", str(folder)]) == 0
        said = capsys.readouterr().out
        match = ACC.search(said)
        assert match, said
        acc, n = float(match.group(1)), int(match.group(3))
        assert n == 3 * TEST[i]
        assert abs(acc - last["evaluate-clients"][f"partition {i}"]["accuracy"]) <= 1e-6
