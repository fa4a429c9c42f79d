"""Trackers (run key ``tracking``): what a run streams to TensorBoard and MLflow, read back with each tool's own
reader, and a tracker that fails leaves a completed run with a WARNING.

The tests run Pollen's real ServerApp and ClientApps in process (no Ray) and read the event files with
TensorBoard's ``event_processing``; docs/tracking.md's commands launch real simulations with each tracker
and list the files they wrote.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from pollen.app.tracking import SafeTracker, Tracker, open_tracker, round_scalars
from pollen.testing import InProcessGrid, clientapp_node
from tests.conftest import PROJECT_ROOT

RC = {"task": "uci-dirichlet", "max-train-samples": 64, "batch-size": 8, "seed": 1, "num-server-rounds": 2,
      "device": "cpu", "min-available-clients": 3}


def _server_run(tmp_path: Path, **keys) -> Path:
    """A whole run through Pollen's ServerApp and 3 real ClientApps in this process; its run folder."""
    from pollen.app import client_app, server_app

    rc = {**RC, "out-dir": str(tmp_path / "runs"), **keys}
    grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, 3) for p in range(3)})
    server_app.app(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    return tmp_path / "runs" / "7"


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files under ``logdir``, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_round_scalars_name_every_number_of_a_round_record():
    rec = {"round": 3, "fit": {"train-loss": 0.5, "accepted": 2, "lst": [1, 2]},
           "evaluate": {"accuracy": 0.75, "bad": None}, "server-evaluate": {"accuracy": 0.8},
           "fit-clients": {"partition 0": {"train-loss": 0.4, "dp-epsilon": 1.5}, "partition 1": {"train-loss": 0.6}},
           "evaluate-clients": {"partition 0": {"accuracy": 0.7}},
           "bytes-down": 100, "bytes-up": 50, "wall-time-s": 1.25, "sampled": 2, "accepted": 2,
           "rejected": [{"client": "partition 2"}], "failures": 1,
           "network": {"sim-round-s": 4.0, "sim-clock-s": 12.0, "deadline-s": 4.0,
                       "missing": [{"why": "dropped"}, {"why": "late"}, {"why": "late"}]}}
    assert round_scalars(rec) == {
        "train/train-loss": 0.5, "train/accepted": 2.0, "evaluate/accuracy": 0.75, "server-evaluate/accuracy": 0.8,
        "clients/partition-0/train/train-loss": 0.4, "clients/partition-0/train/dp-epsilon": 1.5,
        "privacy/epsilon/partition-0": 1.5, "clients/partition-1/train/train-loss": 0.6,
        "clients/partition-0/evaluate/accuracy": 0.7, "bytes/down": 100.0, "bytes/up": 50.0,
        "round/wall-time-s": 1.25, "round/sampled": 2.0, "round/accepted": 2.0, "round/rejected": 1.0,
        "round/failures": 1.0, "network/sim-round-s": 4.0, "network/sim-clock-s": 12.0, "network/deadline-s": 4.0,
        "network/dropped": 1.0, "network/late": 2.0}


def test_a_tracker_that_raises_warns_once_and_is_left_alone(caplog, tmp_path):
    class Broken(Tracker):
        name = "broken"
        calls = 0

        def log_round(self, step, scalars):
            Broken.calls += 1
            raise ConnectionError("tracker went away")

    tracker = SafeTracker(Broken(), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        tracker.log_round(1, {"a": 1.0})
        tracker.log_round(2, {"a": 2.0})
        tracker.finish({"status": "completed"}, tmp_path)
    assert Broken.calls == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "logging round 1 failed (ConnectionError: tracker went away)" in warnings[0]
    assert str(tmp_path) in warnings[0]


def test_tracking_imports_nothing_until_asked():
    """A ServerApp without a tracker pays nothing: neither package is imported by the app or the key check."""
    code = ("import sys; import pollen.app.server_app, pollen.app.config as c; c.parse_run_config({}); "
            "print(sorted(m for m in ('tensorboard', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_tensorboard_event_file_holds_every_rounds_metrics(tmp_path):
    run_dir = _server_run(tmp_path, tracking="tensorboard")
    scalars = _scalars(run_dir / "tensorboard")
    rounds = _rounds(run_dir)
    for rec in rounds:
        for tag, value in round_scalars(rec).items():
            assert (rec["round"], pytest.approx(value, rel=1e-6)) in scalars[tag], tag
    assert [s for s, _ in scalars["evaluate/accuracy"]] == [1, 2]
    assert {"clients/partition-0/train/train-loss", "bytes/up", "round/wall-time-s"} <= set(scalars)


def test_mlflow_file_store_holds_params_metrics_and_artifacts(tmp_path):
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    run_dir = _server_run(tmp_path, tracking="mlflow", **{"tracking-uri": store})
    kept = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(kept["run-id"])
    config = json.loads((run_dir / "config.json").read_text())
    assert run.data.params["method"] == "fedavg" and run.data.params["num-server-rounds"] == "2"
    assert set(run.data.params) == set(config)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    rounds = _rounds(run_dir)
    history = client.get_metric_history(run.info.run_id, "evaluate/accuracy")
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["evaluate"]["accuracy"]))
                                                    for r in rounds]
    client_loss = client.get_metric_history(run.info.run_id, "clients/partition-2/train/train-loss")
    assert [m.step for m in client_loss] == [1, 2]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "metrics.jsonl", "config.json", "curves.png", "final"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "final")} >= {"final/global.safetensors"}
    local = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "down")))
    assert json.loads(local.read_text()) == json.loads((run_dir / "summary.json").read_text())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_mlflow_server_leaves_the_run_completed_with_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{_closed_port()}"
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        run_dir = _server_run(tmp_path, tracking="mlflow", **{"tracking-uri": uri})
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["last-round"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"tracking = mlflow: cannot open {uri}" in w and "the run goes on without a tracker" in w
               for w in warnings), warnings


def test_a_missing_tracker_package_is_a_warning_naming_the_extra(tmp_path, caplog, monkeypatch):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the extra were not installed
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        tracker = open_tracker("tensorboard", "", tmp_path, {"method": "fedavg"})
    assert tracker.inner is None
    assert any("pollen-fl[tracking]" in r.getMessage() for r in caplog.records)


def test_a_tracking_uri_gets_one_tensorboard_folder_per_run_with_every_round(tmp_path):
    """``tracking-uri`` names a log folder shared by runs: each run streams into its own sub-folder, named as
    its run folder. (That a launched run writes its event file: docs/tracking.md's commands list it.)"""
    logdir = tmp_path / "tb"
    run_dir = _server_run(tmp_path, **{"tracking": "tensorboard", "tracking-uri": str(logdir)})
    scalars = _scalars(logdir / run_dir.name)  # one folder per run under tracking-uri
    for rec in _rounds(run_dir):
        for tag, value in round_scalars(rec).items():
            assert (rec["round"], pytest.approx(value, rel=1e-6)) in scalars[tag], tag
    assert [s for s, _ in scalars["evaluate/accuracy"]] == [1, 2]


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    store, run_dir = (tmp_path / "mlruns").as_uri(), tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    first = open_tracker("mlflow", store, run_dir, {"method": "fedavg", "num-server-rounds": 2})
    first.log_round(1, {"evaluate/accuracy": 0.5})
    again = open_tracker("mlflow", store, run_dir, {"method": "fedavg", "num-server-rounds": 4})  # --resume
    again.log_round(2, {"evaluate/accuracy": 0.75})
    again.finish({"status": "completed", "last-round": 2}, run_dir)
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("pollen").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["num-server-rounds"] == "2"  # params as the run started (a resumable change)
    history = client.get_metric_history(runs[0].info.run_id, "evaluate/accuracy")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
