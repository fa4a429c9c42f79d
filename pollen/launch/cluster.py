"""The launcher's knowledge of Ray clusters: look before attaching, say where the clients ran.

Flower attaches its simulation to an existing Ray cluster only through ``RAY_ADDRESS`` in the
environment of ``flwr-simulation`` (``pollen.launch.launcher --ray-address``). Left alone, an unreachable
address makes that process retry for minutes and a cluster too small for one client leaves the actor
pool empty, so before the SuperLink starts :func:`attach` probes the cluster from a short-lived
subprocess (never this process: ``ray`` stays out of the launcher, a hung connection is killed by
PID) and refuses with :class:`ClusterUnfit` (exit 2) what cannot run. After the run :func:`placement`
reads Ray's actor and task records of the run's job and tells how many ClientApp actors and calls
each node ran. Nothing here stops a cluster; ``ray.shutdown()`` in a probe only disconnects it.

``python -m pollen.launch.cluster loopback`` starts a cluster of several nodes on this machine's loopback
for trying (and testing) all of this; it stops exactly what it started when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ray rewrites 127.0.0.1 to the machine's interface address unless this is 0 (on Linux it defaults to 1);
# every process of a loopback cluster (nodes, launcher, probes) needs it.
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PROBE_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
CLIENT_ACTOR = "ClientAppActor"
PLACEMENT_FILE = "cluster.json"


class ClusterUnfit(ValueError):
    """The Ray cluster cannot be reached or cannot hold one client: nothing was started (the launcher
    turns it into its ``LaunchConfigError``, exit 2)."""


@dataclass
class RayNode:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    head: bool = False
    free_cpus: float | None = None
    free_gpus: float | None = None

    def slots(self, cpus: float, gpus: float, free: bool = False) -> int:
        """Clients this node holds at once, as Flower sizes its actor pool (whole CPUs, GPU shares); with
        ``free``, in what other jobs leave free now (Flower sizes by the totals, extra actors wait)."""
        have_cpus, have_gpus = (self.free_cpus or 0.0, self.free_gpus or 0.0) if free else (self.cpus, self.gpus)
        count = int(have_cpus // cpus) if cpus > 0 else 0
        if gpus > 0:
            count = min(count, int(have_gpus // gpus)) if have_gpus else 0
        return count

    def label(self) -> str:
        return f"{self.node_id[:8]}{' (head)' if self.head else ''} {self.ip}"


@dataclass
class ClusterInfo:
    address: str
    source: str  # how the user named it, for messages ("--ray-address")
    nodes: list[RayNode]
    jobs_before: list[str] = field(default_factory=list)  # job ids already known before the run

    def slots(self, cpus: float, gpus: float, free: bool = False) -> int:
        return sum(node.slots(cpus, gpus, free) for node in self.nodes)


# --- the address --------------------------------------------------------------------------------------

def split_address(address: str, source: str = "--ray-address") -> tuple[str, int]:
    """``HOST:PORT`` of a head's GCS; anything else (``auto``, ``ray://``) is refused by name: the launcher
    attaches only to a cluster it was told about, never to one recorded on the machine."""
    host, sep, port = address.strip().rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterUnfit(f"{source} {address!r}: expected HOST:PORT of the head node's GCS, as `ray start --head` "
                           "prints it (e.g. 10.0.0.5:6379)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _reachable(host: str, port: int, address: str, source: str) -> None:
    """A plain TCP connect first: a refused or silent port fails in seconds, not after Ray's retries."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError | socket.timeout) else (err.strerror or str(err))
        raise ClusterUnfit(f"Ray cluster at {address} ({source}) is unreachable: connecting to {host}:{port} "
                           f"failed ({reason}). Is the head node started (`ray start --head --port {port}`)?") from None


# --- probes: a short-lived Ray driver in a subprocess --------------------------------------------------

def _probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the address is passed explicitly
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    return env


def _run_probe(args: Sequence[str], address: str, source: str, timeout: float) -> dict[str, Any]:
    """Run ``python -m pollen.launch.cluster <args>`` in its own process group; its last stdout line is JSON."""
    cmd = [sys.executable, "-m", "pollen.launch.cluster", *args]
    proc = subprocess.Popen(cmd, env=_probe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tempfile.gettempdir())
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        hint = ""
        host = address.rpartition(":")[0]
        if is_loopback(host) and os.environ.get(LOOPBACK_VAR) != "0":
            hint = (f"; a cluster on this machine's loopback needs {LOOPBACK_VAR}=0 in every process (its nodes, "
                    "this launcher), or Ray looks for it at the machine's interface address")
        raise ClusterUnfit(f"Ray cluster at {address} ({source}) did not answer a Ray driver within {timeout:.0f}s "
                           f"(the port is open; is it a Ray head's GCS port?){hint}") from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-5:])
        raise ClusterUnfit(f"Ray cluster at {address} ({source}): a Ray driver could not attach "
                           f"(exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def attach(address: str, *, source: str, cpus_per_client: float, gpus_per_client: float,
           timeout: float = PROBE_TIMEOUT_S, echo: bool = True) -> ClusterInfo:
    """Probe the cluster at ``address`` before anything starts: print its nodes and resources and whether
    they hold one client of ``cpus_per_client``/``gpus_per_client``; raise :class:`ClusterUnfit` when the
    address is malformed, unreachable or not a Ray cluster (within about ``timeout`` seconds), or when no
    node can hold one client (Flower's actor pool would be empty)."""
    host, port = split_address(address, source)
    began = time.monotonic()
    _reachable(host, port, address, source)
    data = _run_probe(["probe", address], address, source, timeout)
    info = ClusterInfo(address=address, source=source, jobs_before=list(data.get("jobs", [])),
                       nodes=[RayNode(**node) for node in data["nodes"]])
    slots = info.slots(cpus_per_client, gpus_per_client)
    if echo:
        cpus = sum(n.cpus for n in info.nodes)
        gpus = sum(n.gpus for n in info.nodes)
        print(f"[pollen] Ray cluster at {address} ({source}): {len(info.nodes)} node(s) alive, "
              f"{cpus:g} CPU, {gpus:g} GPU in all (probed in {time.monotonic() - began:.1f}s)", flush=True)
        for node in info.nodes:
            free = ""
            if node.free_cpus is not None:
                free = f", free now {node.free_cpus:g} CPU / {node.free_gpus or 0:g} GPU"
            print(f"[pollen]   node {node.label()}: {node.cpus:g} CPU, {node.gpus:g} GPU{free} -> "
                  f"{node.slots(cpus_per_client, gpus_per_client)} client(s) at once", flush=True)
    want = f"client-resources-num-cpus={cpus_per_client:g}, client-resources-num-gpus={gpus_per_client:g}"
    if slots == 0:
        biggest = max(info.nodes, key=lambda n: (n.cpus, n.gpus), default=None)
        has = f"the largest node has {biggest.cpus:g} CPU, {biggest.gpus:g} GPU" if biggest else "no node is alive"
        raise ClusterUnfit(f"Ray cluster at {address} ({source}) cannot hold one client ({want}): {has}; "
                           "lower --cpus-per-client / --gpus-per-client or add a node that fits")
    if echo:
        print(f"[pollen] Ray cluster holds {slots} client(s) at once ({want}); the launcher will not stop it",
              flush=True)
        if info.slots(cpus_per_client, gpus_per_client, free=True) == 0:
            print("[pollen] warning: other jobs hold the cluster's resources now: no node has room for a client "
                  "until they free some (the run waits for them)", file=sys.stderr, flush=True)
    return info


def placement(info: ClusterInfo, driver_pids: Sequence[int], timeout: float = PROBE_TIMEOUT_S,
              echo: bool = True, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Where the run's ClientApps ran: actors and calls per node, from Ray's records of the job(s) whose
    driver is one of ``driver_pids`` (the launch's ``flwr-simulation``) and that the probe had not seen.
    Printed, and written to ``run_dir/cluster.json`` when given. Never raises: a cluster gone by now
    only costs the report (``None``)."""
    args = ["placement", info.address, "--pids", ",".join(map(str, driver_pids)),
            "--known-jobs", ",".join(info.jobs_before)]
    try:
        data = _run_probe(args, info.address, info.source, timeout)
    except ClusterUnfit as err:
        if echo:
            print(f"[pollen] Ray placement not read: {err}", file=sys.stderr, flush=True)
        return None
    data["address"] = info.address
    if echo:
        for line in placement_lines(data):
            print(line, flush=True)
    if run_dir is not None and run_dir.is_dir():
        (run_dir / PLACEMENT_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def placement_lines(data: Mapping[str, Any]) -> list[str]:
    nodes = data.get("nodes", {})
    if not nodes:
        return [f"[pollen] Ray placement: no ClientApp actor of this run found on {data.get('address')} "
                f"(jobs {', '.join(data.get('jobs', [])) or 'none'})"]
    lines = [f"[pollen] Ray placement (job {', '.join(data.get('jobs', []))}): ClientApp actors and calls per node"]
    for node_id, row in sorted(nodes.items(), key=lambda kv: kv[1].get("ip", "")):
        calls = row.get("calls")
        dead = "" if row.get("alive", True) else " (node dead now)"
        lines.append(f"[pollen]   node {node_id[:8]} {row.get('ip', '?')}: {row['actors']} actor(s), "
                     f"{calls if calls is not None else '?'} call(s){dead}")
    return lines


# --- what runs inside the probe subprocess (imports ray) -----------------------------------------------

def _connect(address: str) -> None:
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False,
             namespace="pollen-probe")


def _probe(address: str) -> dict[str, Any]:
    import ray
    from ray._private import state

    _connect(address)
    try:
        free = state.available_resources_per_node()
        nodes = []
        for node in ray.nodes():
            if not node.get("Alive") or not node.get("Resources"):
                continue
            res, avail = node["Resources"], free.get(node["NodeID"], {})
            nodes.append({"node_id": node["NodeID"], "ip": node.get("NodeManagerAddress", "?"),
                          "cpus": float(res.get("CPU", 0)), "gpus": float(res.get("GPU", 0)),
                          "head": "node:__internal_head__" in res,
                          "free_cpus": float(avail.get("CPU", 0)), "free_gpus": float(avail.get("GPU", 0))})
        jobs = [job["JobID"] for job in state.jobs()]
        return {"nodes": nodes, "jobs": jobs}
    finally:
        ray.shutdown()  # disconnects this driver; the cluster keeps running


def _placement(address: str, pids: set[int], known: set[str]) -> dict[str, Any]:
    import ray
    from ray._private import state
    from ray.core.generated import gcs_pb2

    _connect(address)
    try:
        jobs = [job["JobID"] for job in state.jobs()
                if job["JobID"] not in known and job.get("DriverPid") in pids]
        alive = {node["NodeID"]: node for node in ray.nodes()}
        per_node: dict[str, dict[str, Any]] = {}
        actor_node: dict[str, str] = {}
        for job in jobs:
            for actor_id, actor in state.actors(job_id=ray.JobID(bytes.fromhex(job))).items():
                if actor.get("ActorClassName") != CLIENT_ACTOR:
                    continue
                node_id = actor["Address"]["NodeID"]
                actor_node[actor_id] = node_id
                row = per_node.setdefault(node_id, {"ip": actor["Address"]["IPAddress"], "actors": 0, "calls": 0,
                                                    "alive": bool(alive.get(node_id, {}).get("Alive"))})
                row["actors"] += 1
        # Calls: Ray's task events (kept by the GCS without a dashboard), one per ClientApp call.
        calls_seen = False
        accessor = state.state._connect_and_get_accessor()
        wanted = {bytes.fromhex(job) for job in jobs}
        seen: set[bytes] = set()
        for blob in accessor.get_task_events():
            event = gcs_pb2.TaskEvents.FromString(blob)  # type: ignore[attr-defined]
            if event.job_id not in wanted or not event.HasField("task_info") or event.task_id in seen:
                continue
            actor_id = event.task_info.actor_id.hex()
            if actor_id in actor_node and event.task_info.func_or_class_name.endswith(".run"):
                seen.add(event.task_id)
                per_node[actor_node[actor_id]]["calls"] += 1
                calls_seen = True
        if not calls_seen:
            for row in per_node.values():
                row["calls"] = None  # Ray kept no task events (disabled or dropped): unknown, not zero
        return {"jobs": jobs, "nodes": per_node}
    finally:
        ray.shutdown()


# --- a loopback cluster for trying it on one machine --------------------------------------------------

def loopback(nodes: int, num_cpus: int, num_gpus: int, port: int | None, temp_dir: str | None) -> int:
    """Start a head and ``nodes - 1`` worker nodes on 127.0.0.1 (real raylets, one per node), print the
    address, and block until SIGINT/SIGTERM, then stop exactly these nodes. Ray's own record of the
    cluster goes to a private temp dir, so no other ``ray.init()`` on the machine attaches to it."""
    os.environ[LOOPBACK_VAR] = "0"
    own_tmp = temp_dir is None
    tmp = temp_dir or tempfile.mkdtemp(prefix="pollen-ray-", dir="/tmp")  # short: Ray's socket paths
    os.environ["RAY_TMPDIR"] = tmp
    Path(tmp, "ray").mkdir(parents=True, exist_ok=True)
    stop = []

    def on_signal(signum, _frame):
        stop.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    from ray.cluster_utils import Cluster

    head_args: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "node_ip_address": "127.0.0.1",
                                 "include_dashboard": False, "dashboard_agent_listen_port": None,
                                 "temp_dir": str(Path(tmp, "ray"))}
    if port:
        head_args["port"] = port
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        workers = [cluster.add_node(num_cpus=num_cpus, num_gpus=num_gpus, node_ip_address="127.0.0.1")
                   for _ in range(nodes - 1)]
        cluster.wait_for_nodes(timeout=120)
        print(f"[pollen] loopback Ray cluster up: address {cluster.address} ({nodes} node(s), {num_cpus} CPU and "
              f"{num_gpus} GPU each); SIGINT/SIGTERM stops it", flush=True)
        for index, node in enumerate([cluster.head_node, *workers]):
            raylet = node.all_processes["raylet"][0].process.pid
            print(f"[pollen]   node {index} ({'head' if index == 0 else 'worker'}): id {node.node_id}, "
                  f"raylet pid {raylet}", flush=True)
        print(f"[pollen] attach with: {LOOPBACK_VAR}=0 pollen run --ray-address {cluster.address} "
              "...", flush=True)
        while not stop:
            time.sleep(0.5)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the shutdown
        cluster.shutdown()
        if own_tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        print("[pollen] loopback Ray cluster stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pollen.launch.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="print the cluster's alive nodes and resources as JSON")
    probe.add_argument("address")
    place = sub.add_parser("placement", help="print ClientApp actors and calls per node of the given drivers' jobs")
    place.add_argument("address")
    place.add_argument("--pids", default="", help="comma-separated driver PIDs (the run's flwr-simulation)")
    place.add_argument("--known-jobs", default="", help="comma-separated job ids to leave out (seen before the run)")
    loop = sub.add_parser("loopback", help="start a cluster of several nodes on 127.0.0.1 until interrupted")
    loop.add_argument("--nodes", type=int, default=2, help="nodes including the head")
    loop.add_argument("--num-cpus", type=int, default=1, help="CPUs each node offers")
    loop.add_argument("--num-gpus", type=int, default=0, help="GPUs each node offers")
    loop.add_argument("--port", type=int, default=None, help="the head's GCS port (default: a free one)")
    loop.add_argument("--temp-dir", default=None, help="Ray's temp dir (default: a private one, removed at the end)")
    args = parser.parse_args(argv)
    if args.command in ("probe", "placement"):
        try:
            split_address(args.address, "address")
        except ClusterUnfit as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return 2
    if args.command == "probe":
        print(json.dumps(_probe(args.address)), flush=True)
        return 0
    if args.command == "placement":
        pids = {int(p) for p in args.pids.split(",") if p}
        known = {j for j in args.known_jobs.split(",") if j}
        print(json.dumps(_placement(args.address, pids, known)), flush=True)
        return 0
    if args.nodes < 1 or args.num_cpus < 1 or args.num_gpus < 0:
        print(f"[pollen] error: --nodes {args.nodes} / --num-cpus {args.num_cpus} / --num-gpus {args.num_gpus}: "
              "expected at least 1 node of at least 1 CPU and no negative GPUs", file=sys.stderr, flush=True)
        return 2
    return loopback(args.nodes, args.num_cpus, args.num_gpus, args.port, args.temp_dir)


if __name__ == "__main__":
    sys.exit(main())
