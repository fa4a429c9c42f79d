"""Run Pollen under a SuperLink this process owns, and report whether the run really completed.

``flwr run`` exits 0 even when the ServerApp crashes, and its managed local SuperLink outlives the
command. This launcher starts its own ``flower-superlink`` (simulation, or deployment for ``deploy/``),
submits the app with ``flwr run``, streams the run's log, reads the final status with ``flwr ls`` and
always stops every process it started, by PID. Used by ``make run``, the tests and the benchmarks::

    python -m pollen.app.launch --num-supernodes 5 --run-config "method='fedprox' num-server-rounds=3"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Iterator, Sequence

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process: isolated home, offline, no per-run ``uv sync``."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
    })
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def write_connection(flwr_home: Path, name: str, address: str, *, root_certificates: str | None = None,
                     make_default: bool = True) -> None:
    """Add (or replace) one SuperLink connection in ``$FLWR_HOME/config.toml``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    sections: dict[str, list[str]] = {}
    current = None
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("["):
                current = line.strip()
                sections[current] = []
            elif current is not None and line.strip():
                sections[current].append(line)
    body = [f'address = "{address}"']
    body.append(f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true")
    sections[f"[superlink.{name}]"] = body
    default = sections.get("[superlink]", [])
    if make_default or not default:
        default = [f'default = "{name}"']
    sections["[superlink]"] = default
    ordered = ["[superlink]"] + sorted(k for k in sections if k != "[superlink]")
    path.write_text("\n".join(f"{key}\n" + "\n".join(sections[key]) + "\n" for key in ordered))


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited early with code {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink on port {port} not healthy after {timeout:.0f}s")


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group (the SuperLink and what it spawned), then SIGKILL stragglers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def superlink(flwr_home: Path, *, simulation: bool, port: int | None = None,
              extra_args: Sequence[str] = (), connection: str = "pollen",
              root_certificates: str | None = None) -> Iterator[tuple[str, int, subprocess.Popen]]:
    """A SuperLink owned by the caller; yields (connection name, port, process) and stops it after."""
    flwr_home = flwr_home.resolve()
    port = port or free_port()
    env = flower_env(flwr_home)
    write_connection(flwr_home, connection, f"127.0.0.1:{port}", root_certificates=root_certificates)
    args = [flower_bin("flower-superlink"), "--port", str(port), "--disable-runtime-dependency-installation"]
    if root_certificates is None and "--ssl-certfile" not in extra_args:
        args.append("--insecure")
    if simulation:
        args.append("--simulation")
    args.extend(extra_args)
    log_path = flwr_home / f"superlink-{port}.log"
    with log_path.open("w") as log:
        # A neutral cwd: Ray workers get the SuperLink's cwd on sys.path (FLOWER.md, traps).
        proc = subprocess.Popen(args, cwd=flwr_home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        if root_certificates is None:
            wait_healthy(port, proc)
        else:
            wait_healthy_tls(port, root_certificates, proc)
        yield connection, port, proc
    finally:
        stop_process(proc)
        stop_orphaned_apps(port)


def stop_orphaned_apps(port: int) -> list[int]:
    """Kill ServerApp/ClientApp processes still attached to the SuperLink that served ``port``.

    ``flwr-serverapp`` runs in its own session, so stopping the SuperLink's process group misses it;
    a run interrupted mid-flight (timeout, Ctrl-C) otherwise leaves it waiting forever. Linux only
    (reads /proc); elsewhere nothing is done.
    """
    needle = f"127.0.0.1:{port}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith((b"flwr-serverapp", b"flwr-clientapp")) for a in argv[:2]) and needle in argv:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


@dataclass
class RunOutcome:
    run_id: int
    status: str
    wall_time_s: float
    log: str

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def _flwr(args: Sequence[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> str:
    proc = subprocess.run([flower_bin("flwr"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"flwr {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _json_tail(text: str) -> dict:
    start = text.find("{")
    if start < 0:
        raise RuntimeError(f"no JSON in flwr output:\n{text}")
    return json.loads(text[start:])


def submit_and_wait(app_dir: Path, connection: str, flwr_home: Path, *, run_config: str = "",
                    federation_config: str = "", timeout: float = 3600.0, echo: bool = True) -> RunOutcome:
    """``flwr run`` + stream the log until the run ends + read its final status."""
    env = flower_env(flwr_home.resolve())
    started = time.monotonic()
    args = ["run", str(app_dir), connection, "--format", "json"]
    if run_config:
        args += ["--run-config", run_config]
    if federation_config:
        args += ["--federation-config", federation_config]
    out = _json_tail(_flwr(args, env, timeout=300))
    if not out.get("success", True) or "run-id" not in out:
        raise RuntimeError(f"flwr run did not start a run: {out}")
    run_id = int(out["run-id"])
    lines: list[str] = []
    stream = subprocess.Popen([flower_bin("flwr"), "log", str(run_id), connection, "--stream"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    status = "unknown"
    # A reader thread, so a run that hangs silently (e.g. waiting for clients) still hits the deadline.
    queue: "Queue[str | None]" = Queue()
    reader = threading.Thread(target=_pump_lines, args=(stream, queue), daemon=True)
    reader.start()
    try:
        deadline = started + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with contextlib.suppress(Exception):
                    _flwr(["stop", str(run_id), connection], env, timeout=60)
                raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s (stopped it)")
            try:
                line = queue.get(timeout=min(remaining, 1.0))
            except Empty:
                continue
            if line is None:
                break
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        # The stream can end a moment before the status is final; poll briefly.
        for _ in range(60):
            status = run_status(run_id, connection, env)
            if status.startswith("finished"):
                break
            time.sleep(1.0)
    finally:
        stop_process(stream, grace=2.0)
    return RunOutcome(run_id, status, time.monotonic() - started, "".join(lines))


def _pump_lines(proc: subprocess.Popen, queue: "Queue[str | None]") -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        queue.put(line)
    queue.put(None)


def run_status(run_id: int, connection: str, env: dict[str, str]) -> str:
    out = _json_tail(_flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, timeout=60))
    runs = out.get("runs") or []
    if not runs:
        return "unknown"
    run = runs[0]
    status = run.get("status", "unknown")
    return status


def simulate(*, app_dir: Path = PROJECT_ROOT, flwr_home: Path | None = None, num_supernodes: int = 5,
             cpus_per_client: int = 1, gpus_per_client: float = 0.0, run_config: str = "",
             timeout: float = 3600.0, echo: bool = True) -> RunOutcome:
    """One simulation run on a fresh, owned SuperLink."""
    flwr_home = (flwr_home or app_dir / ".flwr-home").resolve()
    fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
           f"client-resources-num-gpus={gpus_per_client}")
    with superlink(flwr_home, simulation=True) as (conn, _port, _proc):
        return submit_and_wait(app_dir, conn, flwr_home, run_config=run_config, federation_config=fed,
                               timeout=timeout, echo=echo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", type=Path, default=PROJECT_ROOT, help="Flower app directory")
    parser.add_argument("--flwr-home", type=Path, default=None, help="FLWR_HOME (default: <app>/.flwr-home)")
    parser.add_argument("--num-supernodes", type=int, default=5)
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0,
                        help="GPU fraction per ClientApp, e.g. 0.25 packs 4 clients on one GPU")
    parser.add_argument("--run-config", default="", help='overrides, e.g. "method=\'fedprox\' num-server-rounds=3"')
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is abandoned")
    args = parser.parse_args(argv)
    outcome = simulate(app_dir=args.app, flwr_home=args.flwr_home, num_supernodes=args.num_supernodes,
                       cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                       run_config=args.run_config, timeout=args.timeout)
    print(f"[pollen] run {outcome.run_id}: {outcome.status} in {outcome.wall_time_s:.1f}s", flush=True)
    return 0 if outcome.completed else 1


if __name__ == "__main__":
    sys.exit(main())


# --- real fleets (deploy/fleet.py): SuperNodes, node registration, TLS health -----------------------

def wait_healthy_tls(port: int, ca_cert: str | Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Like :func:`wait_healthy` for a SuperLink serving HTTPS, trusting only ``ca_cert``.

    A fixed sleep is not enough on a loaded machine: the TLS SuperLink can take several seconds to
    bind, and ``flwr supernode register`` sent earlier fails instead of retrying.
    """
    import ssl

    context = ssl.create_default_context(cafile=str(ca_cert))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited early with code {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=2, context=context) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"TLS SuperLink on port {port} not healthy after {timeout:.0f}s")


def supernode_args(superlink_address: str, *, port: int, node_config: str = "",
                   root_certificates: str | Path | None = None,
                   auth_private_key: str | Path | None = None) -> list[str]:
    """The ``flower-supernode`` command line: insecure unless a root certificate is given."""
    args = [flower_bin("flower-supernode"), "--superlink", superlink_address, "--port", str(port)]
    if root_certificates is None:
        if auth_private_key is not None:
            raise ValueError("auth_private_key needs TLS: pass root_certificates as well")
        args.append("--insecure")
    else:
        args += ["--root-certificates", str(root_certificates)]
    if auth_private_key is not None:
        args += ["--auth-supernode-private-key", str(auth_private_key)]
    if node_config:
        args += ["--node-config", node_config]
    return args


def start_supernode(flwr_home: Path, superlink_address: str, log_path: Path, *, node_config: str = "",
                    port: int | None = None, root_certificates: str | Path | None = None,
                    auth_private_key: str | Path | None = None,
                    extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start one ``flower-supernode`` in its own process group (stop it with :func:`stop_process`).

    Every ClientApp it runs is a child in that group, so stopping the group leaves nothing behind.
    ``extra_env`` is how a SuperNode gets its GPU (``CUDA_VISIBLE_DEVICES``).
    """
    flwr_home = flwr_home.resolve()
    env = flower_env(flwr_home)
    env.update(extra_env or {})
    args = supernode_args(superlink_address, port=port or free_port(), node_config=node_config,
                          root_certificates=root_certificates, auth_private_key=auth_private_key)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        return subprocess.Popen(args, cwd=flwr_home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


@contextlib.contextmanager
def supernode(flwr_home: Path, superlink_address: str, log_path: Path, **kwargs) -> Iterator[subprocess.Popen]:
    """A SuperNode owned by the caller (arguments as :func:`start_supernode`), stopped on exit."""
    proc = start_supernode(flwr_home, superlink_address, log_path, **kwargs)
    try:
        yield proc
    finally:
        stop_process(proc)


def list_supernodes(connection: str, flwr_home: Path) -> list[dict]:
    """``flwr supernode ls`` as dicts with ``node-id`` and ``status`` (registered/online/offline/...)."""
    env = flower_env(flwr_home.resolve())
    out = _json_tail(_flwr(["supernode", "ls", connection, "--format", "json"], env, timeout=60))
    return list(out.get("nodes") or [])


def register_supernode(connection: str, flwr_home: Path, public_key: str | Path) -> int:
    """Register a SuperNode's public key with a SuperLink that runs ``--enable-supernode-auth``."""
    env = flower_env(flwr_home.resolve())
    out = _json_tail(_flwr(["supernode", "register", str(public_key), connection, "--format", "json"], env,
                           timeout=60))
    if not out.get("success", False) or "node-id" not in out:
        raise RuntimeError(f"flwr supernode register {public_key} failed: {out}")
    return int(out["node-id"])


def wait_for_supernodes(connection: str, flwr_home: Path, count: int, *, timeout: float = 120.0,
                        procs: Sequence[subprocess.Popen] = ()) -> list[str]:
    """Block until ``count`` SuperNodes are online; returns their node ids.

    Submitting before then lets round 1 start with whichever nodes happen to be connected. Fails early
    when one of ``procs`` (the SuperNodes being waited for) exits.
    """
    deadline = time.monotonic() + timeout
    online: list[str] = []
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"SuperNode pid {dead[0].pid} exited with code {dead[0].returncode} "
                               "before coming online (see its log)")
        online = [str(n["node-id"]) for n in list_supernodes(connection, flwr_home) if n.get("status") == "online"]
        if len(online) >= count:
            return online
        time.sleep(1.0)
    raise TimeoutError(f"only {len(online)} of {count} SuperNodes online after {timeout:.0f}s")
