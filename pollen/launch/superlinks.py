"""A SuperLink the launch owns: started in its own process group with a private ``FLWR_HOME``, known healthy
only when it answers ``/health`` from the port it holds itself, and stopped with everything it spawned.

``flwr run``'s managed local SuperLink outlives the command and is shared by whoever uses the same
``FLWR_HOME``; this one belongs to one launch (a simulation, :mod:`pollen.launch.simulation`, or a fleet,
:mod:`pollen.launch.fleet`), which stops it by PID on every exit path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pollen.launch.errors import SuperLinkDied, signals_held
from pollen.launch.processes import ProcessTree, listening_on, proc_cmdline, proc_table, stop_process


def flower_env(flwr_home: Path, *, tree: ProcessTree | None = None, ray_address: str = "local") -> dict[str, str]:
    """Environment for every Flower process: isolated home, offline, no per-run ``uv sync``, and Ray told
    where to go (``local``: start a private instance, never attach to a cluster recorded on the machine)."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "RAY_ADDRESS": ray_address or "local",
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
    })
    if tree is not None:
        tree.mark(env)
    return env


def free_port() -> int:
    """A port free right now (the OS picks it). Another process may take it before it is used: callers
    that start a server on it retry with a fresh one when the server cannot bind (see :func:`superlink`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_bin(name: str) -> str:
    """A Flower command from this Python's environment (``.venv/bin/flwr``), else from ``PATH``."""
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


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0, log_path: Path | None = None,
                 ca_cert: str | Path | None = None) -> None:
    """Until the SuperLink ``proc`` answers ``/health`` on ``port`` (HTTPS trusting only ``ca_cert`` when
    given) from a socket it holds itself; :class:`SuperLinkDied` if it exits first.

    A fixed sleep is not enough on a loaded machine: a TLS SuperLink can take several seconds to bind, and
    ``flwr supernode register`` sent earlier fails instead of retrying.
    """
    context = None
    if ca_cert is not None:
        import ssl

        context = ssl.create_default_context(cafile=str(ca_cert))
    url = f"{'https' if context else 'http'}://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SuperLinkDied(proc, log_path)
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                if resp.status == 200 and listening_on(proc.pid, port) is not False:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"{'TLS ' if context else ''}SuperLink on port {port} not healthy after {timeout:.0f}s")


def superlink_log(flwr_home: Path, port: int) -> Path:
    """Where the SuperLink serving ``port`` logs (appended to across restarts)."""
    return Path(flwr_home) / f"superlink-{port}.log"


def _port_taken(log_path: Path) -> bool:
    with contextlib.suppress(OSError):
        text = log_path.read_text(errors="replace").lower()
        return "address already in use" in text or "errno 98" in text or "port is already" in text
    return False


def start_superlink(flwr_home: Path, port: int, *, simulation: bool, extra_args: Sequence[str] = (),
                    root_certificates: str | None = None, tree: ProcessTree,
                    ray_address: str = "local") -> subprocess.Popen:
    """One ``flower-superlink`` on ``port``, healthy when this returns (:class:`SuperLinkDied` or
    :class:`TimeoutError` otherwise). Started in its own process group from a neutral working directory
    (``flwr_home``: Ray workers get the SuperLink's cwd on sys.path), a root of ``tree``; its log is
    appended to, so a restart on the same port keeps what the one before said."""
    flwr_home = Path(flwr_home).resolve()
    args = [flower_bin("flower-superlink"), "--port", str(port), "--disable-runtime-dependency-installation"]
    if root_certificates is None and "--ssl-certfile" not in extra_args:
        args.append("--insecure")
    if simulation:
        args.append("--simulation")
    args.extend(extra_args)
    log_path = superlink_log(flwr_home, port)
    with log_path.open("a") as log:
        proc = subprocess.Popen(args, cwd=flwr_home, env=flower_env(flwr_home, tree=tree, ray_address=ray_address),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree.add_root(proc.pid)
    wait_healthy(port, proc, log_path=log_path, ca_cert=root_certificates)
    return proc


@contextlib.contextmanager
def superlink(flwr_home: Path, *, simulation: bool, port: int | None = None,
              extra_args: Sequence[str] = (), connection: str = "pollen",
              root_certificates: str | None = None, tree: ProcessTree | None = None,
              ray_address: str = "local") -> Iterator[tuple[str, int, subprocess.Popen]]:
    """A SuperLink owned by the caller; yields (connection name, port, process) and stops it after.

    With ``tree`` the caller stops the whole tree (:meth:`ProcessTree.terminate`); without, this does it
    on exit. A free port taken by someone else between choosing and binding is retried with another.
    """
    flwr_home = Path(flwr_home).resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    own_tree = tree is None
    tree = tree or ProcessTree()
    proc = None
    chosen = port
    try:
        for attempt in range(5):
            chosen = port or free_port()
            write_connection(flwr_home, connection, f"127.0.0.1:{chosen}", root_certificates=root_certificates)
            try:
                proc = start_superlink(flwr_home, chosen, simulation=simulation, extra_args=extra_args,
                                       root_certificates=root_certificates, tree=tree, ray_address=ray_address)
                break
            except SuperLinkDied:
                if port is None and attempt < 4 and _port_taken(superlink_log(flwr_home, chosen)):
                    continue  # lost the race for the free port: try another one
                raise
        assert proc is not None and chosen is not None
        yield connection, chosen, proc
    finally:
        with signals_held():
            if proc is not None and own_tree:  # else the caller's ProcessTree.terminate stops it with the rest
                stop_process(proc)
            if own_tree:
                left = tree.terminate()
                if left:
                    print(f"[pollen] warning: still running after teardown: {tree.describe(left)}",
                          file=sys.stderr, flush=True)
            if chosen is not None:
                stop_orphaned_apps(chosen)


def stop_orphaned_apps(port: int) -> list[int]:
    """Kill ServerApp/ClientApp processes still attached to the SuperLink that served ``port``.

    ``flwr-serverapp`` runs in its own session, so stopping the SuperLink's process group misses it;
    a run interrupted mid-flight (timeout, Ctrl-C) otherwise leaves it waiting forever. Linux only
    (reads /proc); elsewhere nothing is done. (:class:`ProcessTree` finds these too, by their mark.)
    """
    needle = f"127.0.0.1:{port}".encode()
    killed = []
    for pid in proc_table() or {}:
        argv = proc_cmdline(pid) or []
        if any(a.endswith((b"flwr-serverapp", b"flwr-clientapp")) for a in argv[:2]) and needle in argv:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def superlink_watch(proc: subprocess.Popen, log_path: Path | None = None) -> Callable[[], None]:
    """A ``watch`` for :func:`pollen.launch.submit.submit_and_wait`: raises :class:`SuperLinkDied` once
    ``proc`` has exited."""
    def check() -> None:
        if proc.poll() is not None:
            raise SuperLinkDied(proc, log_path)
    return check
