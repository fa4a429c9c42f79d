"""The launcher on a real multi-node Ray cluster (two raylets on this machine's loopback).

One cluster per module, started with the command docs/cluster.md gives (``python -m pollen.launch.cluster
loopback``) and stopped by its process group at the end: FedAvg and FedProto complete with ClientApp
actors on both nodes (Ray's own records, read independently here), a cluster too small for one client
and an unreachable address are refused with exit 2 before anything starts, and a worker node killed
mid-run ends the run within a bound while the head stays up. The node-killing test runs last.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pollen.launch import cluster
from pollen.launch import EXIT_USAGE, stop_process
from tests.conftest import PROJECT_ROOT

HAS_PROC = Path("/proc/self/environ").exists()
pytestmark = pytest.mark.skipif(not HAS_PROC, reason="reads /proc")

TINY = "num-server-rounds=2 local-epochs=1"  # embedded UCI digits, no data files
# The two commands of docs/cluster.md's loopback recipe (test_the_documented_recipe_is_what_these_tests_run).
LOOPBACK_ARGS = ["-m", "pollen.launch.cluster", "loopback", "--nodes", "2", "--num-cpus", "1"]
LAUNCH_ARGS = ["run", "--ray-address", "{address}", "--num-supernodes", "3", "--run-config", TINY]
POLLEN = str(Path(sys.executable).parent / "pollen")  # the console script `make install` puts beside python
LOOPBACK_CMD = [sys.executable, *LOOPBACK_ARGS]
# Ray notices a dead node after ~15 s by default; the test's cluster checks every second (5 misses).
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}

# Ray's own records, read by a separate driver (as docs/cluster.md shows): ClientApp actors per node.
ACTORS_PER_NODE = """
import collections, json, logging, sys
import ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
per_node = collections.Counter(actor["Address"]["NodeID"] for actor in state.actors().values()
                               if actor["ActorClassName"] == "ClientAppActor")
print(json.dumps(per_node))
ray.shutdown()
"""


@dataclass
class Loopback:
    address: str
    head_id: str
    worker_id: str
    head_raylet: int
    worker_raylet: int
    proc: subprocess.Popen


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", cluster.LOOPBACK_VAR: "0",
                "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"})
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stop_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """The launcher's own stop: SIGTERM the process group, SIGKILL what is left after ``grace``."""
    stop_process(proc, grace=grace)


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    """A head and one worker node, 1 CPU each, owned by this module: stopped by PID/process group."""
    log_path = tmp_path_factory.mktemp("loopback") / "loopback.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(LOOPBACK_CMD, cwd=PROJECT_ROOT, env=_env(**FAST_HEALTH), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        text = ""
        while "attach with" not in text:
            assert proc.poll() is None, f"loopback cluster exited {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"loopback cluster not up in 180s:\n{log_path.read_text()}"
            time.sleep(0.5)
            text = log_path.read_text()
        address = re.search(r"up: address (\S+) ", text).group(1)
        nodes = re.findall(r"node \d \((head|worker)\): id (\w+), raylet pid (\d+)", text)
        (_, head_id, head_pid), (_, worker_id, worker_pid) = nodes
        yield Loopback(address, head_id, worker_id, int(head_pid), int(worker_pid), proc)
    finally:
        _stop_group(proc)
    assert "loopback Ray cluster stopped" in log_path.read_text()


def _launch(address: str, out: Path, *args: str, run_config: str = TINY, timeout: float = 400,
            **env: str) -> subprocess.CompletedProcess:
    cmd = [POLLEN, *(a.format(address=address) for a in LAUNCH_ARGS[:-1]), run_config,
           "--out-dir", str(out), "--timeout", "300", *args]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _placement(out: Path) -> dict:
    return json.loads(next(out.glob("*/cluster.json")).read_text())


def _summary(out: Path) -> dict:
    return json.loads(next(p for p in out.glob("*/summary.json") if not p.parent.is_symlink()).read_text())


def _nodes_up(address: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pollen.launch.cluster", "probe", address], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [node["node_id"] for node in json.loads(proc.stdout.strip().splitlines()[-1])["nodes"]]


# --- on the cluster -------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_fedavg_runs_on_both_nodes_and_leaves_the_cluster_up(loopback, tmp_path):
    out = tmp_path / "runs"
    proc = _launch(loopback.address, out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    assert f"Ray cluster at {loopback.address} (--ray-address): 2 node(s) alive, 2 CPU, 0 GPU" in proc.stdout
    assert "Ray cluster holds 2 client(s) at once" in proc.stdout
    # the actors the cluster holds, not one per SuperNode (issue 44: it said 4 when the cluster held 2)
    assert "the simulation starts the cluster's 2 ClientApp actor(s) for 3 SuperNode(s) first" in proc.stdout
    assert _summary(out)["status"] == "completed"
    placed = _placement(out)
    assert set(placed["nodes"]) == {loopback.head_id, loopback.worker_id}, placed
    assert all(row["actors"] >= 1 and row["calls"] >= 1 for row in placed["nodes"].values()), placed
    # 3 SuperNodes x 2 rounds train, plus evaluation: every ClientApp call is counted on some node
    assert sum(row["calls"] for row in placed["nodes"].values()) >= 3 * 2, placed
    assert "Ray placement (job" in proc.stdout
    # Ray's records, read here by another driver, agree: ClientApp actors ran on both nodes
    records = subprocess.run([sys.executable, "-c", ACTORS_PER_NODE, loopback.address], env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert records.returncode == 0, records.stderr[-3000:]
    per_node = json.loads(records.stdout.strip().splitlines()[-1])
    assert set(per_node) == {loopback.head_id, loopback.worker_id}, per_node
    # the launcher stopped only its own processes: the cluster it attached to is still running
    assert _alive(loopback.head_raylet) and _alive(loopback.worker_raylet) and loopback.proc.poll() is None
    assert "none left (checked by PID)" in proc.stdout


@pytest.mark.e2e
def test_fedproto_runs_on_both_nodes(loopback, tmp_path):
    out = tmp_path / "runs"
    proc = _launch(loopback.address, out, run_config=f"method='fedproto' {TINY}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    summary = _summary(out)
    assert summary["status"] == "completed" and summary["rounds"] == 2
    placed = _placement(out)
    assert set(placed["nodes"]) == {loopback.head_id, loopback.worker_id}, placed
    assert all(row["actors"] >= 1 for row in placed["nodes"].values()), placed
    assert _alive(loopback.head_raylet) and _alive(loopback.worker_raylet)


@pytest.mark.e2e
def test_a_cluster_too_small_for_one_client_is_refused_before_anything_starts(loopback, tmp_path, monkeypatch):
    """2 CPUs per client on nodes of 1 CPU: Flower's actor pool would be empty and the run would wait
    forever; the launcher refuses it (exit 2) before the SuperLink starts. A GPU share on GPU-less nodes
    likewise (checked on the probe alone, without a second launch)."""
    began = time.monotonic()
    proc = _launch(loopback.address, tmp_path / "runs", "--cpus-per-client", "2", timeout=120)
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert (f"[pollen] error: Ray cluster at {loopback.address} (--ray-address) cannot hold one client "
            "(client-resources-num-cpus=2, client-resources-num-gpus=0): the largest node has 1 CPU, 0 GPU; "
            "lower --cpus-per-client / --gpus-per-client") in proc.stderr
    assert "SuperLink up" not in proc.stdout
    assert time.monotonic() - began < 60
    monkeypatch.setenv(cluster.LOOPBACK_VAR, "0")  # the probe runs with this process's environment
    with pytest.raises(cluster.ClusterUnfit, match=r"cannot hold one client \(client-resources-num-cpus=1, "
                                                   r"client-resources-num-gpus=0.5\)"):
        cluster.attach(loopback.address, source="--ray-address", cpus_per_client=1, gpus_per_client=0.5,
                       echo=False)


@pytest.mark.e2e
def test_unreachable_address_fails_fast_with_exit_2(tmp_path):
    dead = socket.socket()  # bound, never listening: connections are refused
    dead.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{dead.getsockname()[1]}"
    try:
        began = time.monotonic()
        proc = _launch(address, tmp_path / "runs", timeout=120)
        elapsed = time.monotonic() - began
    finally:
        dead.close()
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert f"[pollen] error: Ray cluster at {address} (--ray-address) is unreachable" in proc.stderr
    assert "SuperLink up" not in proc.stdout
    assert elapsed < 30, elapsed


@pytest.mark.e2e
def test_a_port_that_is_not_a_ray_head_is_refused_within_the_probe_timeout(monkeypatch):
    """The port accepts connections but nothing answers (not a Ray GCS): the probe is killed at its
    timeout instead of Ray's minutes of retries; without the loopback variable, the message says so."""
    monkeypatch.delenv(cluster.LOOPBACK_VAR, raising=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes handshakes; nobody ever reads
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        began = time.monotonic()
        with pytest.raises(cluster.ClusterUnfit) as err:
            cluster.attach(address, source="--ray-address", cpus_per_client=1, gpus_per_client=0, timeout=6,
                           echo=False)
        elapsed = time.monotonic() - began
    finally:
        silent.close()
    assert f"Ray cluster at {address} (--ray-address) did not answer a Ray driver within 6s" in str(err.value)
    assert f"{cluster.LOOPBACK_VAR}=0" in str(err.value)
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("address", ["auto", "ray://10.0.0.5:10001", "10.0.0.5", "10.0.0.5:0", ":6379"])
def test_an_address_that_is_not_host_port_is_refused_by_name(address):
    with pytest.raises(cluster.ClusterUnfit, match="expected HOST:PORT of the head node's GCS"):
        cluster.split_address(address)


@pytest.mark.parametrize("args, message", [
    (["loopback", "--nodes", "0"], "--nodes 0 / --num-cpus 1 / --num-gpus 0: expected at least 1 node"),
    (["loopback", "--num-cpus", "0"], "--nodes 2 / --num-cpus 0 / --num-gpus 0: expected at least 1 node"),
    (["probe", "auto"], "address 'auto': expected HOST:PORT of the head node's GCS"),
])
def test_the_cluster_command_refuses_bad_input_by_name(args, message):
    proc = subprocess.run([sys.executable, "-m", "pollen.launch.cluster", *args], cwd=PROJECT_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"[pollen] error: {message}" in proc.stderr, proc.stderr


def test_slots_follow_flowers_actor_pool_sizing():
    gpu_node = cluster.RayNode("a" * 56, "10.0.0.5", cpus=8, gpus=2)
    cpu_node = cluster.RayNode("b" * 56, "10.0.0.6", cpus=8, gpus=0)
    assert gpu_node.slots(1, 0.25) == 8 and gpu_node.slots(2, 0.25) == 4 and gpu_node.slots(1, 0) == 8
    assert cpu_node.slots(1, 0.25) == 0 and cpu_node.slots(3, 0) == 2 and cpu_node.slots(9, 0) == 0
    info = cluster.ClusterInfo("10.0.0.5:6379", "--ray-address", [gpu_node, cpu_node])
    assert info.slots(1, 0.5) == 4 and info.slots(1, 0) == 16
    # what other jobs leave free now: 3 CPUs and half a GPU on the first node, nothing on the second
    gpu_node.free_cpus, gpu_node.free_gpus, cpu_node.free_cpus, cpu_node.free_gpus = 3, 0.5, 0, 0
    assert info.slots(1, 0.25, free=True) == 2 and info.slots(1, 0, free=True) == 3
    assert info.slots(4, 0, free=True) == 0 and info.slots(4, 0) == 4


def test_the_documented_recipe_is_what_these_tests_run():
    """docs/cluster.md's loopback commands are this module's: the cluster command, and the launch the
    tests make (they add only --out-dir, --timeout and the option under test)."""
    lines = [line.strip() for line in (PROJECT_ROOT / "docs" / "cluster.md").read_text().splitlines()]
    loop = [shlex.split(line) for line in lines if line.startswith("python -m pollen.launch.cluster loopback")]
    launch = [shlex.split(line) for line in lines if "pollen run --ray-address 127.0.0.1:PORT" in line]
    assert [cmd[1:] for cmd in loop] == [LOOPBACK_ARGS]
    assert [cmd[0] for cmd in launch] == [f"{cluster.LOOPBACK_VAR}=0"] and _env()[cluster.LOOPBACK_VAR] == "0"
    assert [cmd[2:] for cmd in launch] == [[a.format(address="127.0.0.1:PORT") for a in LAUNCH_ARGS]]
    assert [cmd[1] for cmd in launch] == ["pollen"]
    assert "pollen run --ray-address HEAD_IP:6379" in "\n".join(lines)


@pytest.mark.e2e
def test_worker_node_killed_mid_run_ends_the_run_within_a_bound_and_the_head_stays_up(loopback, tmp_path):
    """Last in this module: it takes the worker node away. SIGKILL of the worker's raylet after round 1;
    the run must end (on the head, or failed with a reason) before its timeout, never hang."""
    out = tmp_path / "runs"
    rounds = 20
    cmd = [POLLEN, "run", "--ray-address", loopback.address, "--num-supernodes", "3",
           "--run-config", f"num-server-rounds={rounds} local-epochs=1", "--out-dir", str(out), "--timeout", "240"]
    log_path = tmp_path / "launch.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        done = 0
        while done < 1:  # round 1 written by the ServerApp (the launcher's log lags behind)
            assert proc.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, "round 1 never came"
            time.sleep(0.2)
            done = sum(len(p.read_text().splitlines()) for p in out.glob("*/metrics.jsonl")
                       if not p.parent.is_symlink())
        os.kill(loopback.worker_raylet, signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=300)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            _stop_group(proc, grace=20)
    text = log_path.read_text()
    assert done < rounds
    assert code in (0, 1), text[-5000:]  # not a timeout (124), not a hang
    assert ended_after < 200, ended_after
    summary = _summary(out)
    if code == 0:  # finished on the head: the dead node's calls failed and were counted, the rest trained
        assert summary["status"] == "completed" and summary["rounds"] == rounds
        assert summary["failures-total"] > 0, summary
        assert "node was terminated unexpectedly" in text or "actor died" in text
    else:
        assert summary["status"] == "failed" and summary.get("failure-reason"), summary
        assert re.search(r"\[pollen\] run \S+ failed: .+", text), text[-3000:]
    placed = _placement(out)
    assert placed["nodes"][loopback.worker_id]["alive"] is False, placed
    # the head is still up and the only node left; the launcher did not stop it
    assert _nodes_up(loopback.address) == [loopback.head_id]
    assert _alive(loopback.head_raylet) and loopback.proc.poll() is None
