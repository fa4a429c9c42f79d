"""The ``pollen`` command as a user types it: the console script `make install` puts in the venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pollen.app.results import RunRecorder, write_stopped_summary
from pollen.launch.runs import RunLock
from tests.conftest import POLLEN_SCRIPT, PROJECT_ROOT
from tests.conftest import pollen_command as pollen

pytestmark = pytest.mark.skipif(not POLLEN_SCRIPT.exists(), reason="the `pollen` console script is not "
                                                                     "installed (make install)")


def test_help_lists_every_subcommand_and_no_command_is_a_usage_error():
    shown = pollen("--help")
    assert shown.returncode == 0
    for name in ("run", "fleet", "predict", "data", "runs"):
        assert f"\n  {name} " in shown.stdout
    bare = pollen()
    assert bare.returncode == 2 and "usage: pollen <command>" in bare.stdout


def test_an_unknown_command_is_refused_by_name():
    out = pollen("train")
    assert out.returncode == 2
    assert "unknown command 'train'" in out.stderr


@pytest.mark.parametrize("name, expected", [("run", "--num-supernodes"), ("predict", "--model"),
                                            ("data", "check"), ("fleet", "--num-supernodes"),
                                            ("runs", "--out-dir")])
def test_each_subcommand_shows_its_tools_help_from_any_directory(name, expected, tmp_path):
    """Outside the checkout too: every tool is part of the installed package."""
    out = pollen(name, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout


def test_data_check_of_a_missing_folder_names_it(tmp_path):
    out = pollen("data", "check", str(tmp_path / "nowhere"))
    assert out.returncode == 2
    assert "nowhere" in out.stderr and "not found" in out.stderr


def _completed_run(root: Path, name: str, accuracy: float) -> Path:
    rec = RunRecorder(root / name, {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": 2},
                      num_rounds=2, echo=False)
    for rnd in (1, 2):
        r = rec.round(rnd)
        r["evaluate"] = {"accuracy": accuracy, "accuracy-client-mean": accuracy, "accuracy-client-std": 0.05}
        rec.end_round(rnd)
    rec.finish()
    return root / name


def test_runs_lists_completed_interrupted_and_unfinished_runs(tmp_path):
    root = tmp_path / "runs"
    _completed_run(root, "20261202-100000-fedavg-uci-dirichlet", 0.9)
    stopped = root / "20261202-110000-fedproto-mnist-shot"
    rec = RunRecorder(stopped, {"method": "fedproto", "task": "mnist-shot", "num-server-rounds": 10},
                      num_rounds=10, echo=False)
    rec.round(1)
    rec.end_round(1)
    write_stopped_summary(stopped, "interrupted", "SIGINT")
    RunRecorder(root / "20261202-120000-fccl-digits-offline", {"method": "fccl", "task": "digits-offline",
                                                                "num-server-rounds": 3}, num_rounds=3, echo=False)
    (root / "not-a-run").mkdir()
    live = RunRecorder(root / "20261202-130000-fedavg-uci-dirichlet", {"method": "fedavg", "task": "uci-dirichlet",
                                                                       "num-server-rounds": 5},
                       num_rounds=5, echo=False)
    lock = RunLock(live.run_dir).acquire()  # a launcher at work on it

    try:
        out = pollen("runs", "--out-dir", str(root))
    finally:
        lock.release()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["run", "status", "method", "task", "rounds", "final"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"20261202-100000-fedavg-uci-dirichlet", "20261202-110000-fedproto-mnist-shot",
                         "20261202-120000-fccl-digits-offline", "20261202-130000-fedavg-uci-dirichlet"}
    assert rows["20261202-100000-fedavg-uci-dirichlet"].split()[1:5] == ["completed", "fedavg", "uci-dirichlet", "2/2"]
    assert "accuracy 90.00 ± 5.00 %" in rows["20261202-100000-fedavg-uci-dirichlet"]
    assert rows["20261202-110000-fedproto-mnist-shot"].split()[1:5] == ["interrupted", "fedproto", "mnist-shot",
                                                                        "1/10"]
    assert "SIGINT" in rows["20261202-110000-fedproto-mnist-shot"]
    assert "no summary" in rows["20261202-120000-fccl-digits-offline"]
    assert rows["20261202-130000-fedavg-uci-dirichlet"].split()[1:5] == ["running", "fedavg", "uci-dirichlet", "0/5"]

    as_json = [json.loads(line) for line in pollen("runs", "--out-dir", str(root), "--json").stdout.splitlines()]
    assert [run["status"] for run in as_json] == ["completed", "interrupted", "no summary", "no summary"]


def test_runs_of_a_missing_folder_is_a_usage_error(tmp_path):
    out = pollen("runs", "--out-dir", str(tmp_path / "none"))
    assert out.returncode == 2 and "is not a folder" in out.stderr


def test_listing_runs_loads_neither_torch_nor_flower(tmp_path):
    code = ("import sys; from pollen.launch.cli import main; main(['runs', '--out-dir', sys.argv[1]]); "
            "sys.exit(sorted(m for m in ('torch', 'flwr') if m in sys.modules) or 0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=PROJECT_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr


def test_make_run_pollen_run_and_pollen_runs_share_one_default_folder(tmp_path):
    """`make run` writes to ./runs of the checkout, where `pollen run` writes and `pollen runs` looks by default
    (issue 44: `runs/` against `./pollen-runs`). A real launch into the default folder, then listed by `pollen
    runs`: tests/test_launch.py::test_resume_continues_a_finished_run_with_more_rounds."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in ("POLLEN_OUT_DIR", "MAKEFLAGS")}
    made = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.pollen-installed", "run"],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert f"out-dir='{PROJECT_ROOT / 'runs'}'" in made.stdout, made.stdout
    run = tmp_path / "runs" / "20260101-000000-fedavg-uci-dirichlet"
    write_stopped_summary(run, "interrupted", "Ctrl-C")
    listed = pollen("runs", cwd=tmp_path)  # no --out-dir, no $POLLEN_OUT_DIR: ./runs
    assert listed.returncode == 0 and run.name in listed.stdout, listed.stdout + listed.stderr
    default = subprocess.run([sys.executable, "-c", "from pollen.launch.compose import default_out_dir; "
                              "print(default_out_dir())"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
    assert default.stdout.strip() == str((tmp_path / "runs").resolve()), default.stderr
