"""``pollen fleet`` (:mod:`pollen.launch.fleet`): config plumbing (fast), then real fleets — a SuperLink and SuperNode processes on free
ports, owned and stopped by each test (run the e2e ones under `flock /tmp/pollen-cpu.lock`).

Every ClientApp message starts a fresh process that imports torch, so a 2-round deployment run costs
about a minute on 2 cores; the e2e tests share runs between checks to stay within a few minutes.
Adding a method family's deployment test is one entry in ``FLEET_CASES``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pollen.launch.errors import EXIT_USAGE
from pollen.launch.fleet import (
    Fleet,
    NodeSpec,
    SuperNode,
    compose_run_config,
    format_config,
    parse_config_string,
    plan_nodes,
    supernodes,
)
from pollen.launch.fleet.cli import main
from pollen.launch.processes import groups_alive
from pollen.app import checkpoints
from pollen.app.config import ConfigError
from tests.conftest import PROJECT_ROOT, require_real_data

# --- config plumbing (no processes) -------------------------------------------------------------------

def test_format_config_round_trips_through_flowers_parser():
    values = {"method": "fedprox", "num-server-rounds": 3, "lr": 0.05, "fedprox-mu": 1e-05, "download": False,
              "out-dir": "/tmp/with space/runs", "data-root": r"C:\data\mnist", "note": "it's", "neg": -2}
    assert parse_config_string(format_config(values)) == values


@pytest.mark.parametrize("values, match", [
    ({"lr": float("nan")}, "finite"),
    ({"x": "both ' and \""}, "quote"),
    ({"x": "two\nlines"}, "single-line"),
    ({"bad key": 1}, "without spaces"),
    ({"x": [1, 2]}, "bool, int, float or string"),
])
def test_format_config_refuses_what_flower_cannot_carry(values, match):
    with pytest.raises(ConfigError, match=match):
        format_config(values)


def test_plan_nodes_partitions_models_and_gpus(tmp_path):
    nodes = plan_nodes(4, data_root=str(tmp_path), models=["cnn_mnist"], gpus=["0", "1"])
    assert [n.config["partition-id"] for n in nodes] == [0, 1, 2, 3]
    assert {n.config["num-partitions"] for n in nodes} == {4}
    assert {n.config["data-root"] for n in nodes} == {str(tmp_path.resolve())}
    assert {n.config["model"] for n in nodes} == {"cnn_mnist"}
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in nodes] == ["0", "1", "0", "1"]
    hetero = plan_nodes(2, models=["cnn_mnist", "lenet"])
    assert [n.config["model"] for n in hetero] == ["cnn_mnist", "lenet"]
    assert hetero[0].env == {} and "data-root" not in hetero[0].config
    assert hetero[1].node_config == "partition-id=1 num-partitions=2 model='lenet'"


@pytest.mark.parametrize("kwargs, match", [
    ({"num_supernodes": 0}, "num-supernodes"),
    ({"num_supernodes": 3, "models": ["cnn_mnist", "lenet"]}, "one per SuperNode"),
    ({"num_supernodes": 2, "models": ["no-such-net"]}, "not known"),
])
def test_plan_nodes_rejects_bad_fleets(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_nodes(**kwargs)


def test_compose_run_config_merges_validates_and_refuses_conflicts(tmp_path):
    values, cfg = compose_run_config(method="fedprox", rounds=2, out_dir=tmp_path / "r", data_root=None,
                                     user="fedprox-mu=0.5 local-epochs=1", num_supernodes=2)
    assert values == {"fedprox-mu": 0.5, "local-epochs": 1, "method": "fedprox", "num-server-rounds": 2,
                      "out-dir": str((tmp_path / "r").resolve())}
    assert (cfg.method, cfg.num_server_rounds, cfg.fedprox_mu) == ("fedprox", 2, 0.5)
    kept, _ = compose_run_config(method=None, rounds=None, out_dir=None, data_root=None,
                                 user="out-dir='/elsewhere' method='local'", num_supernodes=2)
    assert kept["out-dir"] == "/elsewhere" and kept["method"] == "local"
    with pytest.raises(ConfigError, match="given twice"):
        compose_run_config(method="fedavg", rounds=None, out_dir=None, data_root=None,
                           user="method='fedprox'", num_supernodes=2)
    with pytest.raises(ConfigError, match="min-available-clients"):
        compose_run_config(method=None, rounds=None, out_dir=None, data_root=None,
                           user="min-available-clients=3", num_supernodes=2)
    with pytest.raises(ConfigError, match="unknown run config key"):
        compose_run_config(method=None, rounds=None, out_dir=None, data_root=None, user="no-such-key=1",
                           num_supernodes=2)
    with pytest.raises(ConfigError, match="method"):
        compose_run_config(method="no-such-method", rounds=None, out_dir=None, data_root=None, user="",
                           num_supernodes=2)


@pytest.mark.parametrize("argv, match", [
    (["--num-supernodes", "3", "--models", "cnn_mnist,lenet"], "one per SuperNode"),
    (["--host", "link.example"], "add --tls"),
    (["--num-supernodes", "2", "--run-config", "min-available-clients=5"], "min-available-clients"),
    (["--method", "no-such-method"], "method"),
    (["--timeout", "0"], "timeout"),
])
def test_cli_refuses_bad_options_before_starting_anything(tmp_path, capsys, argv, match):
    work = tmp_path / "work"
    assert main([*argv, "--work-dir", str(work)]) == EXIT_USAGE
    assert re.search(match, capsys.readouterr().err)
    assert not work.exists()  # nothing was started, not even a FLWR_HOME


def test_client_errors_are_read_from_supernode_logs(tmp_path):
    fleet = Fleet(tmp_path)
    log = tmp_path / "a.log"
    log.write_text("INFO: Starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "pollen.settings.errors.ConfigError: node config is missing 'partition-id': start ...\n"
                   "ERROR: Exit Code: 800\nValueError: bad shape\n"
                   "pollen.settings.errors.ConfigError: node config is missing 'partition-id': start ...\n")
    quiet = tmp_path / "b.log"
    quiet.write_text("INFO: Sent successfully\nno error here: fine\n")
    fleet.supernodes = [SuperNode(NodeSpec("a", {}), None, log), SuperNode(NodeSpec("b", {}), None, quiet)]
    assert fleet.client_errors() == {"a": [
        "pollen.settings.errors.ConfigError: node config is missing 'partition-id': start ...", "ValueError: bad shape"]}


def test_node_ids_are_counted_from_the_supernode_logs(tmp_path):
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    logs[0].write_text("INFO: Starting Flower SuperNode\n")
    logs[1].write_text("INFO: Starting Flower SuperNode\n\x1b[92mINFO \x1b[0m:      SuperNode ID: 1488\n")
    assert supernodes.logs_with_node_id(logs) == 1  # logs[2] does not exist yet


def test_supernodes_are_stopped_together_and_nothing_of_their_groups_is_left(tmp_path):
    """Each stand-in takes 2 s to exit after SIGTERM, as a SuperNode does; one after the other, three take 6 s."""
    slow = "trap 'sleep 2; exit 0' TERM; sleep 30 & wait; sleep 30 & wait"
    fleet = Fleet(tmp_path)
    fleet.supernodes = [SuperNode(NodeSpec(f"n{i}", {}), subprocess.Popen(["sh", "-c", slow], start_new_session=True),
                                  tmp_path / f"n{i}.log") for i in range(3)]
    time.sleep(0.5)  # the traps are set
    began = time.monotonic()
    fleet._stop_supernodes()
    assert time.monotonic() - began < 4.5
    assert [n.proc.returncode for n in fleet.supernodes] == [0, 0, 0]  # each exited on its own
    assert groups_alive([n.pid for n in fleet.supernodes]) == []  # and its `sleep` went with its group


def test_groups_alive_sees_running_groups_only():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert groups_alive([proc.pid]) == [proc.pid]
    finally:
        proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie now
    assert groups_alive([proc.pid]) == []
    proc.wait()
    assert groups_alive([proc.pid]) == []


def test_cli_refuses_a_work_dir_inside_the_app(capsys):
    assert main(["--work-dir", str(PROJECT_ROOT / "fleet-work")]) == EXIT_USAGE
    assert "inside the app directory" in capsys.readouterr().err
    assert not (PROJECT_ROOT / "fleet-work").exists()


# --- real fleets ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FleetCase:
    """One method family's deployment run: the method and the tiny run config that keeps it fast."""

    method: str
    run_config: dict = field(default_factory=dict)
    needs_data: bool = False  # reads POLLEN_DATA_ROOT (skipped without MNIST/raw there)


# One entry per method family (families land over time; see deploy/README.md, "Covered methods").
FLEET_CASES = [
    pytest.param(FleetCase("fedavg", {"local-epochs": 1}), id="weights-fedavg"),
    pytest.param(FleetCase("fedproto", {"local-epochs": 1, "max-train-samples": 200}), id="prototypes-fedproto"),
]


def _pids_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"^\[fleet\] .*?\bpid (\d+)", text, flags=re.M)]


def _rounds_written(out_dir: Path) -> list[dict]:
    files = list(out_dir.glob("*/metrics.jsonl"))
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def _run_past_round_1(fleet: Fleet, values: dict, out: Path, timeout: float) -> tuple[threading.Thread, dict]:
    """Start the run in a thread and return once round 1 is in ``metrics.jsonl`` (the thread and the
    dict its outcome, or the exception it raised, will land in)."""
    done: dict = {}

    def run() -> None:
        try:
            done["outcome"] = fleet.run(values, timeout=timeout, echo=False)
        except BaseException as err:  # reported by the main thread
            done["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 400
    while not _rounds_written(out) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rounds_written(out), f"round 1 never finished: {done}\n{fleet.log_tails()}"
    return thread, done


@pytest.mark.e2e
@pytest.mark.parametrize("case", FLEET_CASES)
def test_method_on_fleet_survives_a_lost_node_and_reports_a_misconfigured_one(case, tmp_path):
    """Insecure fleet: 2 good SuperNodes + 1 started without partition-id; one good node is killed
    after round 1. The run must still complete, and the results must show both problems."""
    if case.needs_data:
        require_real_data()  # this method's task needs the real datasets
    out = tmp_path / "runs"
    values, cfg = compose_run_config(method=case.method, rounds=2, out_dir=out, data_root=None,
                                     user=format_config(case.run_config), num_supernodes=3)
    assert cfg.min_available_clients <= 2  # the run must go on with the 2 nodes left after the kill

    with Fleet(tmp_path / "work", echo=False) as fleet:
        good = [fleet.add_supernode(spec) for spec in plan_nodes(2)]
        misconfigured = fleet.add_supernode(NodeSpec("no_partition_id", {"num-partitions": 2}))
        fleet.wait_for_nodes(3, timeout=180)
        thread, done = _run_past_round_1(fleet, values, out, timeout=500)
        fleet.stop_supernode(good[1])  # partition 1 leaves while the run is in progress
        thread.join(timeout=500)
        assert not thread.is_alive(), fleet.log_tails()
        groups = fleet.process_groups()
        bad_log = misconfigured.log_path.read_text(errors="replace")
        client_errors = fleet.client_errors()
    assert not groups_alive(groups), "a SuperLink/SuperNode outlived its fleet"
    assert "error" not in done, done.get("error")
    outcome = done["outcome"]
    assert outcome.completed, outcome.log[-4000:]

    rounds = _rounds_written(out)
    run_dir = out / str(outcome.run_id)
    assert (run_dir / "metrics.jsonl").exists() and [r["round"] for r in rounds] == [1, 2]
    first, second = rounds
    assert set(first["fit-clients"]) == set(first["evaluate-clients"]) == {"partition 0", "partition 1"}
    assert first["failures"] == 2  # the misconfigured node: its train and its evaluate message
    assert set(second["fit-clients"]) == set(second["evaluate-clients"]) == {"partition 0"}
    assert second["failures"] >= 2  # the misconfigured node again, plus any message lost with partition 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures-total"] == first["failures"] + second["failures"]
    assert (run_dir / "curves.png").stat().st_size > 0
    # The misconfigured SuperNode failed at its first message, naming the missing key.
    assert "node config is missing 'partition-id'" in bad_log
    assert list(client_errors) == ["no_partition_id"]
    assert any(e.startswith("pollen.settings.errors.ConfigError: node config is missing 'partition-id'")
               for e in client_errors["no_partition_id"])


@pytest.mark.e2e
def test_supernode_killed_and_restarted_carries_on_from_its_state_dir(tmp_path, capfd):
    """SIGKILL of a SuperNode's process after round 1 (no chance to clean up), then a new SuperNode with
    the same node config (partition, ``state-dir``): the fleet says which node died and how, the new
    node takes the partition over once the SuperLink has dropped the dead one, and it carries on from
    the saved state: its round counter counts the dead process's rounds too. Nothing is left behind."""
    out = tmp_path / "runs"
    rounds = 3  # round 1 on the old node, round 2 waits out the dead one, round 3 on the new one
    values, _ = compose_run_config(method="fedproto", rounds=rounds, out_dir=out, data_root=None,
                                   user=format_config({"local-epochs": 1, "max-train-samples": 200}),
                                   num_supernodes=2)
    specs = [NodeSpec(s.name, {**s.config, "state-dir": str(tmp_path / "state" / f"p{i}")})
             for i, s in enumerate(plan_nodes(2))]

    with Fleet(tmp_path / "work", echo=False) as fleet:
        nodes = [fleet.add_supernode(spec) for spec in specs]
        fleet.wait_for_nodes(2, timeout=180)
        thread, done = _run_past_round_1(fleet, values, out, timeout=600)
        victim = nodes[1].pid
        os.kill(victim, signal.SIGKILL)  # the SuperNode alone, as a crash would: no stop_supernode
        nodes[1].proc.wait(timeout=30)
        fleet.add_supernode(NodeSpec("supernode_1_restarted", specs[1].config))
        thread.join(timeout=700)
        assert not thread.is_alive(), fleet.log_tails()
        groups = fleet.process_groups()
    assert not groups_alive(groups), "a SuperLink/SuperNode outlived its fleet"
    assert "error" not in done, done.get("error")
    outcome = done["outcome"]
    assert outcome.completed, outcome.log[-4000:]
    said = capfd.readouterr().err
    assert f"supernode_1 (pid {victim}) died with code -9 (SIGKILL); the run goes on without it" in said, said

    rows = _rounds_written(out)
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    served = [r["round"] for r in rows if "partition 1" in r["fit-clients"]]
    assert served[0] == 1 and served[-1] == rounds, served  # the old node, then the new one to the end
    assert all("partition 0" in r["fit-clients"] for r in rows)
    assert not any("already served" in x["reason"] for r in rows for x in r.get("rejected", [])), rows
    node_state = tmp_path / "state" / "p1"
    newest = checkpoints.state_folder(node_state, checkpoints.state_rounds(node_state)[-1])
    history = json.loads((newest / "small-state.json").read_text())["node-history"]["values"]
    # A fresh start would have counted only the new node's rounds (at most len(served) - 1); the old
    # process may also have trained round 2 before it died, without its reply arriving.
    assert len(served) <= history["rounds-trained"] <= len(served) + 1, (history, served)
    assert history["last-round"] == rounds
    for i in (0, 1):
        meta = json.loads((tmp_path / "state" / f"p{i}" / "final-model.json").read_text())
        assert meta["round"] == rounds and meta["partition-id"] == i


@pytest.mark.e2e
def test_cli_tears_the_fleet_down_on_sigterm(tmp_path):
    """SIGTERM while the run is in progress: exit 128+15, and no SuperLink/SuperNode left behind."""
    log_path = tmp_path / "cli.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pollen.launch.cli", "fleet", "--num-supernodes", "2", "--rounds", "3",
             "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "runs")],
            cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "[pollen] method=" not in log_path.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    pids = _pids_in(text)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert "interrupted by SIGTERM" in text
    assert len(pids) == 3  # SuperLink + 2 SuperNodes
    assert not groups_alive(pids), text[-3000:]


@pytest.mark.e2e
def test_cli_says_when_the_superlink_is_killed_and_leaves_nothing(tmp_path):
    """SIGKILL of the SuperLink mid-run: within seconds the CLI names the dead SuperLink and its signal,
    exits 3, and no process of the fleet (SuperNodes, superexec, ServerApp, ClientApps) is left, checked by
    PID both through the fleet's process groups and through the test's own record of every process."""
    from tests.test_launch import TreeWatcher

    log_path = tmp_path / "cli.log"
    with TreeWatcher() as watcher, log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pollen.launch.cli", "fleet", "--num-supernodes", "2", "--rounds", "50",
             "--max-restarts", "0", "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "runs")],
            cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, env=watcher.env())
        try:
            deadline = time.monotonic() + 240
            while "[pollen] method=" not in log_path.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.3)
            time.sleep(2.0)  # the run is under way
            superlink_pid = int(re.search(r"^\[fleet\] SuperLink \S+ \(.*?\) pid (\d+)", log_path.read_text(),
                                          flags=re.M).group(1))
            os.kill(superlink_pid, signal.SIGKILL)
            killed = time.monotonic()
            said = f"SuperLink (pid {superlink_pid}) died with code -9 (SIGKILL)"
            while said not in log_path.read_text() and proc.poll() is None and time.monotonic() < killed + 60:
                time.sleep(0.1)
            noticed_s = time.monotonic() - killed
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + 5
        while watcher.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = watcher.alive()
    text = log_path.read_text()
    assert code == 3, text[-3000:]
    assert said in text and noticed_s < 10, (noticed_s, text[-3000:])
    assert "none left (checked by PID)" in text, text[-3000:]
    assert not groups_alive(_pids_in(text))
    assert left == [], left
    # the run is named, and its folder says what happened (issue 43: neither file was written, "run None")
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert re.search(rf"run {run_dir.name} \(Flower run \d+\): error: {re.escape(said)}", text), text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and said in summary["failure-reason"], summary
    report = json.loads((run_dir / "fleet.json").read_text())
    assert report["run_name"] == run_dir.name and said in report["status"] and report["superlink_restarts"] == []


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: r[k] for k in ("round", "fit", "evaluate", "fit-clients", "evaluate-clients")} for r in rows]


@pytest.mark.e2e
def test_a_tls_fleet_survives_its_superlink_killed_after_round_2_of_3(tmp_path):
    """The durable fleet (issue 44): TLS with node authentication, SIGKILL of the SuperLink once round 2 of 3 is
    written. Without a hand the fleet restarts it (same port, certificates, database), the SuperNodes
    reconnect with their keys, the run continues from its round-2 checkpoint, and its metrics equal an
    uninterrupted run's (fedavg: deterministic); the restart is in summary.json and fleet.json. It is also the
    CLI's TLS test (certificates, one registered key per node, HTTPS, nothing left running)."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    out, work, rounds = tmp_path / "runs", tmp_path / "work", 3
    config = {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": rounds, "local-epochs": 1, "seed": 4}
    log_path = tmp_path / "fleet.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pollen.launch.cli", "fleet", "--tls", "--num-supernodes", "2",
             "--run-config", format_config(config), "--work-dir", str(work), "--out-dir", str(out), "--quiet"],
            cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while len(_rounds_written(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        superlink = int(re.search(r"^\[fleet\] SuperLink \S+ \(TLS.*?\) pid (\d+)", log_path.read_text(),
                                  flags=re.M).group(1))
        os.kill(superlink, signal.SIGKILL)
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-4000:]
    assert text.count(f"SuperLink (pid {superlink}) died with code -9 (SIGKILL)") == 1, text[-3000:]
    assert "restarting the SuperLink (1 of at most 3, --max-restarts)" in text
    assert "continues after round" in text and "(TLS + node auth)" in text and "SuperLink restart(s)" in text
    run_dir = (out / "latest").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == rounds, summary
    assert len(summary["final"]["evaluate-clients"]) == 2, summary["final"]
    [restart] = summary["superlink-restarts"]
    assert f"pid {superlink}" in restart["superlink-died"] and restart["resumed-after-round"] >= 2, restart
    report = json.loads((run_dir / "fleet.json").read_text())
    assert report["superlink_restarts"] == [restart] and report["status"] == "finished:completed" and report["tls"]
    assert report["run_s"] > 0 and report["total_s"] >= report["run_s"]
    # certificates and one registered key pair per node, kept in the work folder; nothing left running
    assert sorted((work / "certs" / "keys").iterdir()) == sorted(
        work / "certs" / "keys" / f for f in ("supernode_0", "supernode_0.pub", "supernode_1", "supernode_1.pub"))
    assert not groups_alive([superlink, report["superlink_pid"]] + [n["pid"] for n in report["nodes"]])

    # the same run, uninterrupted: the ServerApp and both ClientApps in this process
    alone = tmp_path / "alone"
    grid = InProcessGrid({100 + p: clientapp_node(client_app, config, p, 2, state_dir=str(alone / f"p{p}"))
                          for p in range(2)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**config, "out-dir": str(alone), "run-name": "alone"}))
    assert _metrics(run_dir) == _metrics(alone / "alone")


@pytest.mark.e2e
def test_cli_timeout_stops_the_fleet(tmp_path):
    """`--timeout` holds even while the CLI is blocked on the log stream: exit 124, nothing left running.

    500 rounds cannot finish in 30 s on any machine, and 30 s leave a loaded one time to submit the run (about
    15 s measured on 2 cores at load 4-7)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pollen.launch.cli", "fleet", "--num-supernodes", "2", "--rounds", "500", "--timeout", "30",
         "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "runs")],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=400)
    pids = _pids_in(proc.stdout)
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    # mid-run ("the fleet run did not finish within 30s") or, on a loaded machine, still bringing nodes up
    assert re.search(r"\): run \S+( \(Flower run \d+\))?: timeout: ", proc.stdout), proc.stdout[-3000:]
    assert pids and not groups_alive(pids)


@pytest.mark.e2e
def test_glfc_family_on_a_fleet_with_joining_clients(tmp_path):
    """GLFC on a real fleet: 4 SuperNodes sized to the final population (2 clients + 2 joining at task 2),
    the proxy running; embedded UCI digits stream, so no data files are needed."""
    out = tmp_path / "runs"
    tiny = ("task='uci-digits-cil' glfc-tasks=2 glfc-rounds-per-task=1 glfc-initial-clients=2 glfc-new-clients=2 "
            "glfc-clients-per-round=2 glfc-max-per-class=10 glfc-memory-size=10 glfc-oracle-boundary=true "
            "glfc-proxy-iterations=2 glfc-proxy-keep=1 glfc-perturb-steps=1 glfc-eval-per-class=10 "
            "model-width=0.125 local-epochs=1 lr=0.5 momentum=0.0")
    proc = subprocess.run(
        [sys.executable, "-m", "pollen.launch.cli", "fleet", "--method", "glfc", "--num-supernodes", "4", "--rounds", "2",
         "--run-config", tiny, "--work-dir", str(tmp_path / "work"), "--out-dir", str(out), "--quiet"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(out.glob("*/fleet.json")).read_text())
    rounds = [json.loads(x) for x in (Path(report["results_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["server-evaluate"]["seen-classes"] for r in rounds] == [5, 10]
    assert {int(k.split()[-1]) for k in rounds[0]["fit-clients"]} <= {0, 1}  # only the initial clients exist
    assert sum(r["fit"].get("proxy-gradients", 0) for r in rounds) > 0
    assert not groups_alive([report["superlink_pid"]] + [n["pid"] for n in report["nodes"]])
