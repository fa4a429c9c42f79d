"""conf/*.toml: one preset per paper experiment, usable by ``flwr run --run-config`` and the launcher.

Every preset must be a valid run config for Pollen's app (known keys, values the method accepts), name
the SuperNodes it needs in its ``# pollen: num-supernodes = N`` line (what the task demands, when it
demands a number) and say what it needs or what to expect. Presets that need only the offline data
(MNIST, Fashion-MNIST) run to completion here at a tiny size: Pollen's real ServerApp and ClientApps,
served in this process (``pollen.testing``), with the preset's keys plus the size overrides below.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from pollen.app.client_app import app as client_app
from pollen.app.config import parse_run_config
from pollen.app.registry import METHODS
from pollen.app.server_app import main as server_main
from pollen.launch import app_run_config
from tests.conftest import PROJECT_ROOT, require_real_data
from pollen.testing import InProcessGrid, clientapp_node

PRESETS = sorted((PROJECT_ROOT / "conf").glob("*.toml"))
NODES_LINE = re.compile(r"^# pollen: num-supernodes = (\d+)$", re.M)
OFFLINE_TASKS = {"mnist-shot", "fmnist-shot", "digits-offline", "mnist-fmnist-cil"}
# Tiny sizes per task: the preset's procedure, a fraction of its data and rounds.
SMOKE = {
    "mnist-shot": {"num-server-rounds": 1, "shot-shots": 4, "shot-stdev": 1, "shot-test-per-class": 3},
    "digits-offline": {"num-server-rounds": 1, "fccl-train-sizes": "12,12,12,12", "fccl-public-size": 16,
                       "fccl-public-batch-size": 8, "fccl-local-epochs": "1,1,1,1", "fccl-solo-epochs": 1,
                       "fccl-test-size": 8},
    "mnist-fmnist-cil": {"glfc-rounds-per-task": 1, "num-server-rounds": 4, "glfc-max-per-class": 4,
                         "glfc-memory-size": 8, "glfc-eval-per-class": 4, "glfc-proxy-iterations": 1,
                         "glfc-proxy-keep": 1, "glfc-perturb-steps": 1, "local-epochs": 1},
}


def _preset(path: Path) -> tuple[dict, int]:
    text = path.read_text()
    found = NODES_LINE.findall(text)
    assert len(found) == 1, f"{path.name}: needs exactly one '# pollen: num-supernodes = N' line"
    return tomllib.loads(text), int(found[0])


def test_there_is_a_preset_per_paper_experiment():
    names = {p.stem for p in PRESETS}
    for n in (3, 4, 5):
        assert {f"fedproto-mnist-n{n}", f"bd-fedproto-mnist-n{n}"} <= names
    assert {"fedproto-cifar10", "bd-fedproto-cifar10", "fccl-digits", "fccl-office-home", "fccl-digits-offline",
            "glfc-cifar100-t5", "glfc-cifar100-t10", "glfc-cifar100-t20", "glfc-mnist-fmnist"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_is_a_valid_run_config_with_the_nodes_it_needs(path):
    values, nodes = _preset(path)
    known = app_run_config(PROJECT_ROOT)
    assert set(values) <= set(known), f"unknown keys: {sorted(set(values) - set(known))}"
    cfg = parse_run_config({**known, **values})  # validates every key, the method's included
    needed = METHODS[cfg.method].required_nodes(cfg)
    assert needed in (None, nodes), f"{path.name}: the task needs {needed} SuperNodes, the preset says {nodes}"
    text = path.read_text()
    assert f"conf/{path.name}" in text  # the command line that runs it
    assert "Expected" in text or "No result is committed" in text


@pytest.mark.e2e
@pytest.mark.parametrize("path", [p for p in PRESETS if tomllib.loads(p.read_text())["task"] in OFFLINE_TASKS],
                         ids=lambda p: p.stem)
def test_offline_preset_runs_to_completion_at_a_tiny_size(path, tmp_path):
    values, nodes = _preset(path)
    run_config = {**app_run_config(PROJECT_ROOT), **values, **SMOKE[values["task"]],
                  "data-root": require_real_data(), "out-dir": str(tmp_path / "runs")}
    grid = InProcessGrid({100 + p: clientapp_node(client_app, run_config, p, nodes,
                                                  state_dir=str(tmp_path / "nodes" / f"p{p}"))
                          for p in range(nodes)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    summary = json.loads((tmp_path / "runs" / "7" / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["rounds"] == run_config["num-server-rounds"]


def test_the_launcher_starts_the_nodes_a_preset_names_and_refuses_others(capsys):
    from pollen.launch import compose, launcher

    for path in PRESETS:
        assert compose.preset_node_count(str(path)) == _preset(path)[1]
    assert compose.preset_node_count("method='fedavg'") is None
    code = launcher.main(["--run-config", str(PROJECT_ROOT / "conf" / "fccl-digits-offline.toml"),
                        "--num-supernodes", "5"])
    assert code == launcher.EXIT_USAGE
    assert "needs exactly 4 SuperNodes, got --num-supernodes 5" in capsys.readouterr().err
