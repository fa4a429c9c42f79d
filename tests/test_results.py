import contextlib
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from pollen.app import results
from pollen.app.checkpoints import CheckpointError
from pollen.app.results import RunRecorder


def test_recorder_writes_round_lines_summary_and_plot(tmp_path, capsys):
    rec = RunRecorder(tmp_path / "run", {"method": "fedavg", "task": "uci-dirichlet"}, num_rounds=2)
    for rnd, acc in ((1, 0.5), (2, 0.75)):
        r = rec.round(rnd)
        r["bytes-down"] += 2048
        r["bytes-up"] += 1024
        r["fit"] = {"train-loss": 1.0 / rnd}
        r["evaluate"] = {"accuracy": acc, "accuracy-client-mean": acc, "accuracy-client-std": 0.1}
        r["evaluate-clients"] = {"partition 0": {"accuracy": acc}}
        if rnd == 2:
            r["rejected"].append({"round": 2, "client": "partition 1", "reason": "NaN"})
        rec.end_round(rnd)
    summary = rec.finish()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    assert lines[1]["rejected"][0]["reason"] == "NaN" and lines[0]["bytes-down"] == 2048
    assert all(x["wall-time-s"] >= 0 for x in lines)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["final-accuracy"] == {"metric": "accuracy", "mean": 0.75, "std": 0.1}
    assert saved["bytes-up-total"] == 2048 and saved["rejected-total"] == 1
    assert json.loads((tmp_path / "run" / "config.json").read_text())["method"] == "fedavg"
    png = (tmp_path / "run" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    out = capsys.readouterr().out
    assert "round 2/2" in out and "accuracy 0.7500 ± 0.1000" in out and "rejected 1" in out


def test_round_report_keeps_failure_reasons_and_failed_status(tmp_path):
    from pollen.strategies.base import RoundReport

    rec = RunRecorder(tmp_path / "run", {"method": "local"}, num_rounds=1, echo=False)
    report = RoundReport(1, sampled=2)
    report.failures.append({"stage": "train", "client": "node 7", "code": 2,
                            "reason": "ConfigError: node config is missing 'partition-id'"})
    rec.record_report(report)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert line["failures"] == 1 and line["sampled"] == 2
    assert line["failure-reasons"] == [{"stage": "train", "client": "node 7", "code": 2,
                                        "reason": "ConfigError: node config is missing 'partition-id'"}]
    summary = rec.finish(status="failed", reason="round 1 trained nobody")
    assert summary["status"] == "failed" and summary["failure-reason"] == "round 1 trained nobody"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_round_lines_say_elapsed_time_and_eta(tmp_path, monkeypatch, capsys):
    import pollen.app.results as results

    clock = [100.0]
    monkeypatch.setattr(results.time, "perf_counter", lambda: clock[0])
    rec = RunRecorder(tmp_path / "run", {"method": "fedavg", "task": "uci-dirichlet"}, num_rounds=5,
                      resume_after=1)  # a resumed run: its ETA counts only the rounds this process ran
    for rnd in (2, 3):
        rec.round(rnd)
        clock[0] += 30.0
        rec.end_round(rnd)
    out = capsys.readouterr().out
    assert "round 2/5 |" in out and "| elapsed 30s, ETA 1m30s" in out
    assert "round 3/5 |" in out and "| elapsed 1m00s, ETA 1m00s" in out


def test_a_dropped_metric_is_kept_in_the_round_line_and_absent_when_none(tmp_path, capsys):
    """The strategy drops a bad reported metric alone (its reply counts); the run folder says which."""
    from pollen.strategies.base import RoundReport

    rec = RunRecorder(tmp_path / "run", {"method": "fedavg"}, num_rounds=2)
    clean, bad = RoundReport(1, sampled=2), RoundReport(2, sampled=2)
    bad.dropped_metrics.append({"stage": "train", "client": "partition 1", "key": "train-accuracy",
                                "value": 87.5, "reason": "metric 'train-accuracy' = 87.5 is above 1"})
    bad.dropped_metrics.append({"stage": "evaluate", "client": "partition 0", "key": "loss",
                                "value": float("nan"), "reason": "not finite"})
    for report in (clean, bad):
        rec.record_report(report)
    first, second = (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert "dropped-metrics" not in first  # a clean round's line is what it always was
    assert [(d["key"], d["value"]) for d in second["dropped-metrics"]] == [("train-accuracy", "87.5"),
                                                                          ("loss", "nan")]
    assert "dropped metrics 2" in capsys.readouterr().out


def test_the_summary_quotes_the_worst_clients_epsilon_not_the_mean(tmp_path):
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=2, echo=False)
    spent = {1: {"partition 0": 1.5, "partition 1": 2.5}, 2: {"partition 0": 3.0}}  # partition 1 stopped
    for rnd, by_client in spent.items():
        r = rec.round(rnd)
        r["fit-clients"] = {c: {"dp-epsilon": e, "dp-delta": 1e-5} for c, e in by_client.items()}
        r["fit"] = {"dp-epsilon": sum(by_client.values()) / len(by_client)}
        rec.end_round(rnd)
    summary = rec.finish()
    assert summary["privacy"] == {"dp-epsilon-max": 3.0, "dp-delta": 1e-5,
                                  "dp-epsilon-per-client": {"partition 0": 3.0, "partition 1": 2.5}}
    assert "privacy" not in RunRecorder(tmp_path / "off", {"method": "fedavg"}, num_rounds=1, echo=False).finish()


def test_a_client_that_stopped_releasing_is_counted_at_the_epsilon_its_ledger_holds(tmp_path):
    """A capped client's reply is an error (no metrics); its reason carries its ledger's exact ε, which the
    summary counts even when the server never learnt which partition the node serves (a resumed run
    whose node stopped before its first reply)."""
    from pollen.privacy import Budget, BudgetExhausted, LedgerFile, Release

    file = LedgerFile.in_folder(tmp_path / "node")
    budget = Budget(file, 1e-5, 0.0, who="partition 1")
    budget.spend(Release(1.0), Release(1.0))
    with pytest.raises(BudgetExhausted) as stop:
        Budget(file, 1e-5, budget.ledger.epsilon(), who="partition 1").check(Release(1.0))
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=1, echo=False)
    r = rec.round(1)
    r["fit-clients"] = {"partition 0": {"dp-epsilon": 0.5, "dp-delta": 1e-5}}
    r["failures"] = 1
    r["failure-reasons"] = [{"stage": "train", "client": "node 17", "code": 2,
                             "reason": f"BudgetExhausted: {stop.value}"}]
    rec.end_round(1)
    assert rec.finish()["privacy"]["dp-epsilon-per-client"] == {"partition 0": 0.5,
                                                                "partition 1": budget.ledger.epsilon()}


@pytest.mark.parametrize("unit", ["client", "row-given-model"])
def test_every_epsilon_names_its_unit_and_neighbour_and_only_a_record_or_client_one_is_the_headline(tmp_path, unit):
    neighbour = "replace-one" if unit == "client" else "add-remove"
    terms = {"dp-unit": unit, "dp-neighbour": neighbour}
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=1, echo=False, dp_terms=terms)
    r = rec.round(1)
    beside = {"dp-epsilon-add-remove": 1.0} if unit == "client" else {}
    r["fit-clients"] = {"partition 0": {"dp-epsilon": 2.5, "dp-delta": 1e-5, **beside}}
    rec.end_round(1)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert (line["dp-unit"], line["dp-neighbour"]) == (unit, neighbour)
    privacy = rec.finish()["privacy"]
    assert (privacy["dp-unit"], privacy["dp-neighbour"]) == (unit, neighbour)
    if unit == "client":
        assert privacy["dp-epsilon-max"] == 2.5 and privacy["dp-epsilon-add-remove-max"] == 1.0
    else:  # one embedding row given a model trained without DP: never the run's ε
        assert privacy["dp-epsilon-max"] is None and "dp-epsilon-per-client" not in privacy
        assert privacy["dp-epsilon-row-given-model-max"] == 2.5 and "no guarantee" in privacy["no-headline"]


# -- every exit path keeps its summary ------------------------------------------------------------------
def test_the_summary_comes_first_and_a_failed_plot_or_hook_is_a_warning(tmp_path, monkeypatch, caplog, capsys):
    """The seam for optional things (the plot, trackers): each runs after summary.json exists, in order; one
    that fails (here: the plot, on a full disk) is a WARNING naming it, and the status and the closing line
    stand."""
    run = tmp_path / "run"
    rec = RunRecorder(run, {"method": "fedavg", "task": "uci-dirichlet"}, num_rounds=1)
    assert (run / results.RESERVE).stat().st_size == results.RESERVE_BYTES  # room kept for the summary
    rec.round(1)
    rec.end_round(1)
    seen = []

    def full_disk(*args, **kwargs):
        seen.append(("plot", json.loads((run / "summary.json").read_text())["status"]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results, "plot_curves", full_disk)
    rec.after_summary.append(("tracker", lambda summary: seen.append(("tracker", summary["status"]))))
    summary = rec.finish()
    assert seen == [("plot", "completed"), ("tracker", "completed")]
    assert summary["status"] == "completed" and not (run / "curves.png").exists()
    assert "curves.png: not written (OSError: [Errno 28] No space left on device); summary.json is, with status " \
           "completed" in caplog.text
    assert not (run / results.RESERVE).exists()  # given back once the summary is written
    assert capsys.readouterr().out.rstrip().endswith(f"summary: {run / 'summary.json'}")  # the closing line, last


def test_a_summary_finds_room_on_a_full_disk_and_keeps_its_essentials_at_least(tmp_path, monkeypatch):
    """No room for the summary: the reserve is given back and the write tried again; when a whole summary
    still does not fit, its essentials (status, reason, last round) are written alone."""
    run = tmp_path / "run"
    run.mkdir()
    results.reserve_summary_space(run)
    writes = []
    real = results.atomic_write

    def fills_up(path, data):
        writes.append(((run / results.RESERVE).exists(), len(data)))
        if len(writes) < 3:  # the whole summary never fits, its essentials do
            raise CheckpointError(f"cannot write {path}: No space left on device")
        real(path, data)

    monkeypatch.setattr(results, "atomic_write", fills_up)
    summary = {"status": "failed", "failure-reason": "OSError: [Errno 28] No space left on device", "last-round": 2,
               "final": {"evaluate-clients": {f"partition {i}": {"accuracy": 0.5} for i in range(100)}}}
    results.write_summary(run / "summary.json", summary)
    assert [held for held, _ in writes] == [True, False, False] and writes[2][1] < writes[0][1] // 10
    saved = json.loads((run / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["last-round"] == 2 and "final" not in saved
    assert "No space left" in saved["failure-reason"]
    monkeypatch.setattr(results, "atomic_write", lambda path, data: (_ for _ in ()).throw(
        CheckpointError(f"cannot write {path}: No space left on device")))
    assert results.write_stopped_summary(run, "interrupted", "SIGTERM") is None  # a WARNING, not a crash


def _server_run(out_dir: Path, rounds: int, on_round=None) -> Path:
    """A real fedavg run (ServerApp + 3 ClientApps in process) with its node states in its run folder;
    ``on_round(round)`` is called after each round is recorded."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    cfg = {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": rounds, "seed": 1,
           "out-dir": str(out_dir), "run-name": "full-disk", "max-empty-rounds": 0}
    run_dir = out_dir / "full-disk"
    grid = InProcessGrid({100 + p: clientapp_node(client_app, cfg, p, 3, state_dir=str(run_dir / "nodes" / f"p{p}"))
                          for p in range(3)})
    if on_round is not None:
        end_round = RunRecorder.end_round

        def recorded(self, server_round):
            end_round(self, server_round)
            on_round(server_round)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RunRecorder, "end_round", recorded)
            with contextlib.suppress(Exception):  # the ServerApp raises after writing its failed summary
                server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    return run_dir


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs mounted for the test (root with CAP_SYS_ADMIN); skipped where it cannot be made."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN); the injected-failure "
                    "test covers the same path")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its file system says it is full."""
    with open(folder / "ballast", "wb") as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(bytes(1 << 16))
                fh.flush()
        with contextlib.suppress(OSError):
            os.fsync(fh.fileno())


def test_a_disk_filled_mid_run_leaves_summary_json_with_status_failed_and_the_reason(small_disk):
    """A real run on a real 6 MiB file system, filled to the last byte right after round 1 of 4: whatever
    write fails first (a node's state, a round's line, a checkpoint), the run ends failed and summary.json
    says so, with the kernel's reason."""
    run_dir = _server_run(small_disk, rounds=4, on_round=lambda r: _fill(small_disk) if r == 1 else None)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "No space left on device" in summary["failure-reason"], summary["failure-reason"]
    assert 1 <= summary["last-round"] < 4


def test_a_write_failing_mid_run_leaves_summary_json_with_status_failed_and_the_reason(tmp_path, monkeypatch):
    """The same where no small file system can be made: from round 2 on every write of metrics.jsonl fails
    as on a full disk."""
    real_open = Path.open

    def full_after_round_1(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and "a" in mode and full["now"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_open(self, mode, *args, **kwargs)

    full = {"now": False}
    monkeypatch.setattr(Path, "open", full_after_round_1)
    run_dir = _server_run(tmp_path, rounds=4, on_round=lambda r: full.update(now=True) if r == 1 else None)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["last-round"] == 1, summary
    assert summary["failure-reason"].startswith("OSError: [Errno 28] No space left on device"), summary
