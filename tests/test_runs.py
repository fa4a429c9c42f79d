"""Run folders: sortable names, ``latest``, one launcher per folder (lock naming its holder, a dead
holder's lock taken over), ``summary.json`` on every exit path, and the checks ``--resume`` makes before
anything starts (federation and run keys from the folder, changed values refused by name, altered
files refused by name) — each asserted with the exit code and the message a user sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from pollen.app.client_app import app as client_app
from pollen.app.results import write_stopped_summary
from pollen.app.server_app import main as server_main
from pollen.launch import launcher as launch
from pollen.launch import runs
from pollen.launch.errors import EXIT_USAGE, LaunchConfigError
from pollen.testing import InProcessGrid, clientapp_node
from tests.conftest import PROJECT_ROOT


def _refuse_starts(monkeypatch) -> None:
    """From here on, starting any process or the private FLWR_HOME fails the test."""
    def refuse(*args, **_kwargs):
        raise AssertionError(f"the launcher tried to start something: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


@pytest.fixture
def nothing_starts(monkeypatch):
    _refuse_starts(monkeypatch)


HOLD = ("import sys, time; from pollen.launch.runs import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")


def test_run_names_sort_by_start_time_and_say_what_ran(tmp_path):
    first = runs.run_name("fedproto", "mnist-shot", when=time.mktime((2026, 3, 9, 8, 5, 7, 0, 0, -1)))
    assert first == "20260309-080507-fedproto-mnist-shot"
    later = runs.run_name("fedavg", "uci-dirichlet", when=time.mktime((2026, 12, 1, 0, 0, 0, 0, 0, -1)))
    assert sorted([later, first]) == [first, later]
    a = runs.create_run_dir(tmp_path / "runs", first)
    b = runs.create_run_dir(tmp_path / "runs", first)  # same second, same method and task
    assert (a.name, b.name) == (first, f"{first}-2")
    link = runs.link_latest(b)
    assert os.readlink(link) == b.name and link.resolve() == b.resolve()
    runs.link_latest(a)
    assert link.resolve() == a.resolve()


def test_an_out_dir_that_cannot_be_created_is_refused_before_anything_starts(tmp_path, capsys, nothing_starts):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = launch.main(["--run-config", "num-server-rounds=1", "--out-dir", str(blocker / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"out-dir {blocker / 'runs'} cannot be created: Not a directory" in err


def test_too_little_free_space_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch, nothing_starts):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(2**30, 2**30 - 2**20, 2**20))
    code = launch.main(["--run-config", "num-server-rounds=1", "--out-dir", str(tmp_path / "new" / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"{tmp_path / 'new' / 'runs'}: 1 MiB free, the run needs about 256 MiB" in err
    assert not (tmp_path / "new").exists()


def test_seed_and_counts_are_bounded_before_anything_starts(capsys, nothing_starts):
    code = launch.main(["--run-config", f"seed={2**32}"])
    assert code == EXIT_USAGE
    assert f"'seed' = {2**32} is invalid: expected an integer in [0, 4294967295]" in capsys.readouterr().err
    code = launch.main(["--run-config", f"num-server-rounds={2**63 - 1}"])
    assert code == EXIT_USAGE and "'num-server-rounds'" in capsys.readouterr().err


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_run_folder_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(runs.RunFolderError, match=rf"{tmp_path} is in use by another launcher "
                                                      rf"\(launcher PID {holder.pid}\)"):
            runs.RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = runs.RunLock(tmp_path).acquire()  # the kernel dropped the dead holder's lock
    try:
        assert lock.taken_over is not None and lock.taken_over["pid"] == holder.pid
        assert json.loads((tmp_path / runs.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


# -- --resume: everything comes from the run folder, checked before anything starts ----------------------
def _finished_run(tmp_path: Path, rounds: int) -> Path:
    """A real fedavg run on 3 nodes (ServerApp + ClientApps in process), as the launcher lays it out."""
    cfg = {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": rounds, "seed": 2,
           "out-dir": str(tmp_path / "runs"), "run-name": "20260101-000000-fedavg-uci-dirichlet"}
    run_dir = tmp_path / "runs" / cfg["run-name"]
    grid = InProcessGrid({100 + p: clientapp_node(client_app, cfg, p, 3,
                                                  state_dir=str(run_dir / "nodes" / f"partition-{p}"))
                          for p in range(3)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    runs.write_launch_info(run_dir, {"num-supernodes": 3, "cpus-per-client": 1, "gpus-per-client": 0.0})
    return run_dir


@pytest.fixture
def finished_run(tmp_path):
    return _finished_run(tmp_path, rounds=1)


def test_resume_refuses_another_out_dir_a_changed_key_and_another_federation(finished_run, capsys, nothing_starts):
    code = launch.main(["--resume", str(finished_run), "--out-dir", "/tmp/elsewhere"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"a resumed run continues in its own folder {finished_run}; drop --out-dir" in err
    assert "given twice" not in err
    code = launch.main(["--resume", str(finished_run), "--run-config", "num-server-rounds=2 lr=0.1"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "--run-config changes 'lr' = 0.1 (the run has 0.05)" in err
    code = launch.main(["--resume", str(finished_run), "--num-supernodes", "5"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "the run ran on 3 SuperNodes" in err


def test_resume_refuses_an_altered_file_naming_it(finished_run, capsys, nothing_starts):
    state = finished_run / "nodes" / "partition-1" / "round-0001" / "small-state.json"
    state.write_text(state.read_text().replace('"rounds-trained": 1', '"rounds-trained": 7'))
    code = launch.main(["--resume", str(finished_run), "--run-config", "num-server-rounds=2"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"{state}: content does not match its recorded SHA-256" in err


def test_resume_falls_back_past_a_damaged_checkpoint_and_refuses_a_file_without_its_sidecar(tmp_path, capsys):
    """What docs/outputs.md promises: a checkpoint whose tensor data changed (one bit, the file still parses) is
    refused by name and the previous one used; any other file a resume loads must match its sidecar and have
    one (deleting it does not turn the check off)."""
    import argparse

    from pollen.launch.resume import check_resume

    run_dir = _finished_run(tmp_path, rounds=2)
    tensors = run_dir / "checkpoints" / "round-0002.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0x10  # the last bytes are tensor data, far past the header
    tensors.write_bytes(bytes(data))

    def args(**kw):
        return argparse.Namespace(**{"resume": run_dir, "out_dir": None, "run_config": "num-server-rounds=3",
                                     "num_supernodes": None, "cpus_per_client": None, "gpus_per_client": None, **kw})

    checked, values, lock = check_resume(PROJECT_ROOT, args())
    lock.release()
    out = capsys.readouterr()
    assert checked == run_dir and values["num-server-rounds"] == 3 and values["resume-from"] == str(run_dir)
    assert "the checkpoints after round 1 (newest: round 2) are damaged" in out.out
    assert "the run continues from round 1" in out.out
    from pollen.app.checkpoints import sidecar

    state = run_dir / "nodes" / "partition-0" / "round-0002" / "small-state.json"
    sidecar(state).unlink()
    with pytest.raises(LaunchConfigError, match=rf"{state}: no small-state.json.sha256 beside it"):
        check_resume(PROJECT_ROOT, args())


def test_resume_of_a_folder_another_launcher_holds_is_refused_at_once(finished_run, capsys, monkeypatch):
    """Refused on the lock, before any of its files is read: a file the holder is rewriting is no reason."""
    state = finished_run / "nodes" / "partition-1" / "round-0001" / "small-state.json"
    state.write_text(state.read_text() + " ")
    holder = _holder(finished_run)
    _refuse_starts(monkeypatch)
    try:
        started = time.monotonic()
        code = launch.main(["--resume", str(finished_run), "--run-config", "num-server-rounds=2"])
        err = capsys.readouterr().err
        assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()
    assert code == EXIT_USAGE and f"is in use by another launcher (launcher PID {holder.pid})" in err
    assert "content does not match" not in err


def test_a_stopped_run_gets_a_summary_unless_its_server_app_wrote_a_final_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedproto", "task": "mnist-shot", "num-server-rounds": 9}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3)))
    since = time.time()
    summary = write_stopped_summary(run, "interrupted", "interrupted by SIGINT", 42, since=since)
    saved = json.loads((run / "summary.json").read_text())
    assert saved == summary and saved["status"] == "interrupted" and saved["last-round"] == 3
    assert saved["flower-run-id"] == 42 and saved["failure-reason"] == "interrupted by SIGINT"
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert write_stopped_summary(run, "interrupted", "late Ctrl-C", 42, since=since) is None
    (run / "summary.json").write_text(json.dumps({"status": "failed", "failure-reason": "SystemExit"}))
    assert write_stopped_summary(run, "interrupted", "SIGTERM", 42, since=since)["status"] == "interrupted"
    with pytest.raises(ValueError, match="expected one of"):
        write_stopped_summary(run, "crashed", "?")
