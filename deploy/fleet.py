"""Run a Pollen method on a local fleet: one SuperLink and N SuperNodes, insecure or TLS + node auth.

Unlike simulation, every client is a real ``flower-supernode`` process with its own
``--node-config`` (partition id, and optionally data root and model), talking to a real
``flower-superlink`` over the network stack, exactly as on separate machines. The script

1. checks the run config (method, sizes, keys) before starting anything,
2. with ``--tls``: writes a CA, a server certificate and one key pair per SuperNode
   (:mod:`deploy.certs`), starts the SuperLink with ``--enable-supernode-auth`` and registers every
   node key with ``flwr supernode register``,
3. starts the SuperNodes and waits until all of them are online,
4. submits the app with ``flwr run``, streams its log, reads the final status with ``flwr ls``,
5. watches the SuperLink throughout: if it dies, says so (``SuperLink (pid N) died with code X``) within
   about a second and exits 3,
6. stops every process it started (SuperLink, SuperNodes, ``flower-superexec``, ServerApp and ClientApp
   processes, wherever they went: found by PID through the fleet's environment mark), after the run,
   on failure, on timeout, on Ctrl-C and on SIGTERM, and checks by PID that none is left,
7. prints the status (and a failed run's reason, from ``summary.json``) and wall times and writes them to
   ``<out-dir>/<run-id>/fleet.json``.

The exit code is 0 only for ``finished:completed``. Example (``make fleet`` wraps it)::

    python -m deploy.fleet --method fedprox --num-supernodes 3 --rounds 2 --tls \\
        --run-config "local-epochs=1 fedprox-mu=0.1"

deploy/README.md explains the same steps for SuperNodes on different machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python deploy/fleet.py`: make `deploy` and `pollen` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import certs, supernodes  # noqa: E402
from pollen.app.config import ConfigError, RunConfig, parse_run_config  # noqa: E402
from pollen.launch import launcher as launch  # noqa: E402
from pollen.launch import processes
from pollen.protocol.identity import format_partition_pins  # noqa: E402

# The checkout holding the pollen package (None when Pollen is installed); the app to run is
# launch.default_app_dir(): the current directory if it is a Flower app, else this checkout.
PROJECT_ROOT = launch.PROJECT_ROOT
DEFAULT_OUT_DIR = (PROJECT_ROOT or Path.cwd()) / "runs"

# Exit codes besides 0 (completed) and 128 + signal number (interrupted).
EXIT_NOT_COMPLETED = 1
EXIT_USAGE = 2
EXIT_SUPERLINK_DIED = launch.EXIT_SUPERLINK_DIED  # 3
EXIT_TIMEOUT = 124
# The last line of a Python traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): .+$", re.M)


class FleetInterrupted(Exception):
    """SIGTERM/SIGHUP arrived: unwind so every process gets stopped, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# --- pure helpers: config strings and the node plan ---------------------------------------------------

def format_config(values: Mapping[str, Any]) -> str:
    """``k=v`` pairs as ``flwr run --run-config`` and ``flower-supernode --node-config`` parse them
    (:func:`pollen.launch.launcher.format_run_config`, with this tool's error type)."""
    try:
        return launch.format_run_config(values)
    except launch.LaunchConfigError as err:
        raise ConfigError(str(err)) from err


def parse_config_string(text: str) -> dict[str, Any]:
    """Parse a ``k=v`` string exactly as ``flwr run --run-config`` will (Flower's own parser)."""
    from flwr.common.config import parse_config_args

    if not text.strip():
        return {}
    if text.strip().endswith(".toml"):
        raise ConfigError("--run-config takes 'key=value ...' pairs here, not a TOML file")
    try:
        return dict(parse_config_args([text]))
    except Exception as err:  # click.ClickException: the message says what format is expected
        raise ConfigError(f"--run-config {text!r} could not be parsed: {err}") from err


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode of the fleet: its name, its ``--node-config`` values and (optionally) its GPU."""

    name: str
    config: Mapping[str, Any]
    gpu: str | None = None

    @property
    def node_config(self) -> str:
        return format_config(self.config)

    @property
    def env(self) -> dict[str, str]:
        """One SuperNode per GPU: its ClientApps see exactly one device, as ``cuda:0``."""
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}


def plan_nodes(num_supernodes: int, *, data_root: str | None = None, models: Sequence[str] = (),
               gpus: Sequence[str] = (), data_dirs: Sequence[str] = (),
               public_dirs: Sequence[str] = ()) -> list[NodeSpec]:
    """Node configs for a fleet: partition ``i`` of ``num_supernodes`` on SuperNode ``i``.

    ``models`` is empty (the task decides), one name for every node, or one per node (heterogeneous
    methods); ``gpus`` is assigned round-robin, so 4 nodes on ``0,1`` put two SuperNodes per GPU.
    ``data_dirs`` is empty or one folder per node: node config ``data-dir``, that node's own data
    (the user-data tasks; docs/data.md). ``public_dirs`` is empty, one folder for every node or one per
    node: node config ``public-dir``, each node's copy of the public images (logit methods with
    ``fccl-public = "folder"``; the copies must hold the same files).
    """
    if isinstance(num_supernodes, bool) or not isinstance(num_supernodes, int) or num_supernodes < 1:
        raise ConfigError(f"--num-supernodes = {num_supernodes!r} is invalid: expected an integer >= 1")
    models = [m.strip() for m in models if m.strip()]
    if models:
        from pollen.models import MODEL_NAMES

        bad = [m for m in models if m not in MODEL_NAMES]
        if bad:
            raise ConfigError(f"--models {bad} not known: expected names from {', '.join(MODEL_NAMES)}")
        if len(models) not in (1, num_supernodes):
            raise ConfigError(f"--models lists {len(models)} names for {num_supernodes} SuperNodes: "
                              "give one name for all, or exactly one per SuperNode")
    gpus = [g.strip() for g in gpus if g.strip()]
    data_dirs = _folders("--data-dirs", data_dirs, num_supernodes, one_for_all=False)
    public_dirs = _folders("--public-dirs", public_dirs, num_supernodes, one_for_all=True)
    nodes = []
    for i in range(num_supernodes):
        config: dict[str, Any] = {"partition-id": i, "num-partitions": num_supernodes}
        if data_root:
            config["data-root"] = str(Path(data_root).expanduser().resolve())
        if models:
            config["model"] = models[i] if len(models) > 1 else models[0]
        if data_dirs:
            config["data-dir"] = data_dirs[i]
        if public_dirs:
            config["public-dir"] = public_dirs[i] if len(public_dirs) > 1 else public_dirs[0]
        nodes.append(NodeSpec(name=f"supernode_{i}", config=config, gpu=gpus[i % len(gpus)] if gpus else None))
    return nodes


def _folders(option: str, values: Sequence[str], num_supernodes: int, *, one_for_all: bool) -> list[str]:
    """Existing folders, absolute: none, one per SuperNode, or (``one_for_all``) one for every node."""
    folders = [str(Path(v.strip()).expanduser().resolve()) for v in values if v.strip()]
    if folders and len(folders) != num_supernodes and not (one_for_all and len(folders) == 1):
        raise ConfigError(f"{option} lists {len(folders)} folders for {num_supernodes} SuperNodes: give "
                          + ("one for all or " if one_for_all else "") + "exactly one per SuperNode")
    missing = [f for f in folders if not Path(f).exists()]
    if missing:
        raise ConfigError(f"{option}: no such file or folder: {', '.join(missing)}")
    return folders


def compose_run_config(*, method: str | None, rounds: int | None, out_dir: str | Path | None,
                       data_root: str | None, user: str = "", num_supernodes: int) -> tuple[dict[str, Any], RunConfig]:
    """The run config the fleet submits: the user's pairs plus the fleet options, validated here.

    A key given both as an option and inside ``--run-config`` with different values is an error,
    not a silent override. Refuses ``min-available-clients`` above the fleet size: Flower would wait
    24 h for clients that never come.
    """
    values = parse_config_string(user)
    for key, value in (("method", method), ("num-server-rounds", rounds)):
        if value is None:
            continue
        if key in values and values[key] != value:
            raise ConfigError(f"run config key '{key}' given twice: {values[key]!r} in --run-config "
                              f"and {value!r} as an option")
        values[key] = value
    if "out-dir" not in values:
        values["out-dir"] = str(Path(out_dir or DEFAULT_OUT_DIR).expanduser().resolve())
    if data_root and "data-root" not in values:
        values["data-root"] = str(Path(data_root).expanduser().resolve())
    cfg = parse_run_config(values)
    if cfg.min_available_clients > num_supernodes:
        raise ConfigError(f"run config key 'min-available-clients' = {cfg.min_available_clients} exceeds the "
                          f"{num_supernodes} SuperNodes: expected at most {num_supernodes}")
    return values, cfg


# --- the fleet ---------------------------------------------------------------------------------------

@dataclass
class SuperNode:
    """A running SuperNode process and where its log goes."""

    spec: NodeSpec
    proc: subprocess.Popen
    log_path: Path
    key: certs.NodeKey | None = None
    registered_id: int | None = None
    stopped: bool = False  # stopped on purpose (fault injection), not a crash
    death_reported: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class FleetReport:
    """What one fleet run did, in seconds; written as ``fleet.json`` next to the run's results."""

    method: str
    num_supernodes: int
    tls: bool
    status: str = "not started"
    failure_reason: str | None = None
    run_id: int | None = None
    superlink_pid: int | None = None
    results_dir: str | None = None
    startup_s: float | None = None
    run_s: float | None = None
    teardown_s: float | None = None
    total_s: float | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    client_errors: dict[str, list[str]] = field(default_factory=dict)
    processes: list[str] = field(default_factory=list)  # "name(pid)" of every process seen
    leftover: list[int] = field(default_factory=list)  # PIDs alive after teardown (should be empty)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Fleet:
    """One SuperLink plus SuperNodes, all owned by this object and stopped by :meth:`close`.

    Use as a context manager. With ``tls=True`` the SuperLink serves HTTPS with a fresh CA and
    authenticates SuperNodes: :meth:`add_supernode` writes each node's key pair and registers it
    (``register=False`` starts a node with a key the SuperLink has never seen, which it refuses).
    Every process started carries the fleet's :class:`processes.ProcessTree` mark, so :meth:`close` stops
    the whole tree by PID (also ServerApp/ClientApp processes in other sessions) and :attr:`leftover`
    says what survived (nothing, normally). FLWR_HOME is ``<work_dir>/flwr-home``: private to the fleet.
    """

    def __init__(self, work_dir: Path, *, tls: bool = False, hosts: Sequence[str] = (), echo: bool = True):
        self.work_dir = Path(work_dir).resolve()
        self.flwr_home = self.work_dir / "flwr-home"
        self.log_dir = self.work_dir / "logs"
        self.cert_dir = self.work_dir / "certs"
        self.tls = tls
        self.hosts = tuple(hosts)
        self.echo = echo
        self.credentials: certs.ServerCredentials | None = None
        self.connection: str | None = None
        self.port: int | None = None
        self.superlink_proc: subprocess.Popen | None = None
        self.supernodes: list[SuperNode] = []
        self.teardown_s: float | None = None
        self.superlink_death_reported = False  # said once, when first noticed
        self.tree = processes.ProcessTree("fleet")
        self.leftover: list[int] = []
        self._stack = contextlib.ExitStack()

    # lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _say(self, text: str) -> None:
        if self.echo:
            print(f"[fleet] {text}", flush=True)

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the SuperLink is not running: use the Fleet as a context manager")
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the SuperLink (plus certificates for TLS) and wait until it answers."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        root = None
        if self.tls:
            self.credentials = certs.write_server_credentials(self.cert_dir, self.hosts, force=True)
            root = str(self.credentials.ca_cert)
            extra = ["--ssl-ca-certfile", root, "--ssl-certfile", str(self.credentials.server_cert),
                     "--ssl-keyfile", str(self.credentials.server_key), "--enable-supernode-auth"]
        self.connection, self.port, self.superlink_proc = self._stack.enter_context(
            launch.superlink(self.flwr_home, simulation=False, extra_args=extra, connection="fleet",
                             root_certificates=root, tree=self.tree))
        self._stack.callback(self._stop_supernodes)  # the SuperNodes stop before the SuperLink
        mode = "TLS + SuperNode auth" if self.tls else "insecure"
        self._say(f"SuperLink {self.address} ({mode}) pid {self.superlink_proc.pid}, "
                  f"log {self.superlink_log}")

    @property
    def conn(self) -> str:
        """The ``flwr`` connection name of this fleet's SuperLink (once started)."""
        if self.connection is None:
            raise RuntimeError("the SuperLink is not running: use the Fleet as a context manager")
        return self.connection

    @property
    def superlink_log(self) -> Path:
        return self.flwr_home / f"superlink-{self.port}.log"

    def check(self) -> None:
        """Raise :class:`launch.SuperLinkDied` if the SuperLink has exited; report (once) each SuperNode
        that died without being stopped on purpose. Called about once a second while waiting."""
        if self.superlink_proc is not None and self.superlink_proc.poll() is not None:
            err = launch.SuperLinkDied(self.superlink_proc, self.superlink_log)
            if not self.superlink_death_reported:  # now, not after the (slow) teardown that follows
                self.superlink_death_reported = True
                print(f"[fleet] {err}", file=sys.stderr, flush=True)
            raise err
        for node in self.supernodes:
            code = node.proc.poll() if node.proc is not None else None
            if code is not None and not node.stopped and not node.death_reported:
                node.death_reported = True
                how = f"code {code}" if code >= 0 else f"code {code} ({launch._signal_name(-code)})"
                print(f"[fleet] warning: {node.spec.name} (pid {node.pid}) died with {how}; the run goes on "
                      "without it", file=sys.stderr, flush=True)

    def partition_pins(self) -> dict[int, int]:
        """``{partition: node id}`` of every registered SuperNode (TLS): the id its registered key was given,
        for run config ``partition-pins`` — then no other node can serve that partition. Two registered
        nodes configured with one partition are refused by name: which of them to trust is the operator's
        call."""
        pins: dict[int, int] = {}
        names: dict[int, str] = {}
        for node in self.supernodes:
            if node.registered_id is None or "partition-id" not in node.spec.config:
                continue
            pid = int(node.spec.config["partition-id"])
            if pid in pins:
                raise ConfigError(f"partition {pid} is configured on two registered SuperNodes ({names[pid]} and "
                                  f"{node.spec.name}): pin it by hand with run config partition-pins")
            pins[pid], names[pid] = node.registered_id, node.spec.name
        return pins

    def add_supernode(self, spec: NodeSpec, *, register: bool = True) -> SuperNode:
        """Start one SuperNode; with TLS, write its key pair and (unless ``register=False``) register it."""
        key = registered = None
        root = None
        if self.tls:
            assert self.credentials is not None
            root = self.credentials.ca_cert
            key = certs.write_node_key(self.cert_dir / "keys", spec.name, force=True)
            if register:
                registered = supernodes.register_supernode(self.conn, self.flwr_home, key.public_key)
        log_path = self.log_dir / f"{spec.name}.log"
        proc = supernodes.start_supernode(self.flwr_home, self.address, log_path, node_config=spec.node_config,
                                      root_certificates=root, auth_private_key=key.private_key if key else None,
                                      extra_env=spec.env, tree=self.tree)
        node = SuperNode(spec, proc, log_path, key, registered)
        self.supernodes.append(node)
        gpu = f", CUDA_VISIBLE_DEVICES={spec.gpu}" if spec.gpu is not None else ""
        self._say(f"{spec.name} pid {proc.pid} --node-config {shlex.quote(spec.node_config)}{gpu}")
        return node

    def wait_for_nodes(self, count: int | None = None, timeout: float = 180.0) -> list[str]:
        """Wait until ``count`` (default: all started) SuperNodes are online."""
        count = len(self.supernodes) if count is None else count
        ids = supernodes.wait_for_supernodes(self.conn, self.flwr_home, count, timeout=timeout,
                                             procs=[n.proc for n in self.supernodes],
                                             logs=[n.log_path for n in self.supernodes], watch=self.check)
        self._say(f"{len(ids)} SuperNodes online")
        return ids

    def run(self, run_config: Mapping[str, Any], *, timeout: float = launch.DEFAULT_TIMEOUT_S, echo: bool | None = None,
            app_dir: Path | None = None) -> launch.RunOutcome:
        """``flwr run`` the app on this fleet and wait for its final status (and a failed run's reason,
        from ``<out-dir>/<run-id>/summary.json``). Raises :class:`launch.SuperLinkDied` within about a
        second of the SuperLink dying."""
        app_dir = Path(app_dir) if app_dir is not None else launch.default_app_dir()
        out_dir = str(run_config.get("out-dir") or "").strip()
        return launch.submit_and_wait(app_dir, self.conn, self.flwr_home, run_config=format_config(run_config),
                                      timeout=timeout, echo=self.echo if echo is None else echo,
                                      out_dir=Path(out_dir) if out_dir else None, watch=self.check, tree=self.tree)

    def stop_supernode(self, node: SuperNode, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Stop one SuperNode's process group now (fault injection); ``close`` skips it later."""
        node.stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=grace)
        launch.stop_process(node.proc, grace=1.0)

    def _stop_supernodes(self, grace: float = 10.0) -> None:
        """SIGTERM every SuperNode's process group at once, wait up to ``grace`` seconds for them all
        together, then SIGKILL what is left of each group (:func:`launch.stop_process`). A SuperNode
        takes 2-4 s to exit: one after the other, a fleet's nodes added that up."""
        running = [n.proc for n in self.supernodes if n.proc is not None and n.proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for node in reversed(self.supernodes):
            if node.proc is not None:
                launch.stop_process(node.proc, grace=0.0)

    def process_groups(self) -> list[int]:
        """Process-group ids of everything started (each process leads its own group)."""
        groups = [self.superlink_proc.pid] if self.superlink_proc is not None else []
        return groups + [n.pid for n in self.supernodes]

    def close(self) -> None:
        """Stop SuperNodes, then the SuperLink (reverse start order), then whatever else of the fleet's
        process tree is left; signals (and the timeout alarm) are held off meanwhile."""
        began = time.monotonic()
        with processes.signals_held((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)):
            try:
                self._stack.close()
            finally:
                self.leftover = self.tree.terminate(grace=5.0)
                self.teardown_s = round(time.monotonic() - began, 2)
        if self.leftover:
            print(f"[fleet] warning: still running after teardown: {self.tree.describe(self.leftover)}",
                  file=sys.stderr, flush=True)

    def processes(self) -> list[str]:
        """``name(pid)`` of every process of the fleet seen so far."""
        return [f"{name or '?'}({pid})" for pid, (_start, name) in sorted(self.tree.seen.items())]

    def client_errors(self) -> dict[str, list[str]]:
        """Exceptions raised by ClientApps, per SuperNode, from the SuperNode logs (distinct, in order).

        The server only learns that a client failed; the reason (e.g. a ``ConfigError`` naming a missing
        node-config key) is in the traceback the SuperNode logged.
        """
        found: dict[str, list[str]] = {}
        for node in self.supernodes:
            if not node.log_path.exists():
                continue
            lines = _EXCEPTION_LINE.findall(node.log_path.read_text(errors="replace"))
            if lines:
                found[node.spec.name] = list(dict.fromkeys(line.strip() for line in lines))
        return found

    def log_tails(self, lines: int = 25) -> str:
        """The end of every log, for a failure report."""
        paths = [self.superlink_log] if self.port is not None else []
        paths += [n.log_path for n in self.supernodes]
        out = []
        for path in paths:
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)


def groups_alive(groups: Sequence[int]) -> list[int]:
    """The process groups among ``groups`` that still have a running (non-zombie) member.

    Zombies are skipped: a process whose parent died is reaped by init, and a container's init may
    never do it, yet a zombie holds no port, memory or CPU.
    """
    wanted = set(groups)
    proc_root = Path("/proc")
    if not proc_root.is_dir():  # not Linux: fall back to "can the group be signalled"
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.append(pgid)
        return alive
    running: set[int] = set()
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) in wanted and fields[0] not in ("Z", "X"):
            running.add(int(fields[2]))
    return [g for g in groups if g in running]


# --- command line ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _signals_raise(timeout: float) -> Iterator[None]:
    """SIGTERM/SIGHUP raise :class:`FleetInterrupted` (SIGINT already raises KeyboardInterrupt), and
    a real-time alarm raises :class:`TimeoutError` after ``timeout`` seconds.

    The alarm is what makes ``--timeout`` hold even when the run hangs silently (e.g. waiting for
    clients that never come): a blocked log stream alone would never notice.
    """
    def on_signal(signum, _frame):
        raise FleetInterrupted(signum)

    def on_alarm(_signum, _frame):
        raise TimeoutError(f"the fleet run did not finish within {timeout:.0f}s")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in previous.items():
            signal.signal(s, h)


def build_parser() -> argparse.ArgumentParser:
    from pollen.app.registry import METHODS

    parser = argparse.ArgumentParser(
        prog="python -m deploy.fleet",
        description="Run a Pollen method on a local SuperLink + N SuperNodes fleet (insecure or TLS + node auth).",
        epilog="Registered methods (family: method): "
               + ", ".join(sorted({f"{s.family}: {s.name}" for s in METHODS.values()})))
    parser.add_argument("--method", default=None,
                        help="method to run (default: the run config's, else fedavg); "
                             f"one of {', '.join(sorted(METHODS))}")
    parser.add_argument("--num-supernodes", type=int, default=2, help="SuperNodes to start (partition i of N each)")
    parser.add_argument("--rounds", type=int, default=None, help="num-server-rounds (default: the run config's)")
    parser.add_argument("--run-config", default="", help="extra run config pairs, e.g. \"local-epochs=1 lr=0.1\"")
    parser.add_argument("--tls", action="store_true",
                        help="HTTPS with a fresh CA and SuperNode authentication (keys written and registered)")
    parser.add_argument("--host", action="append", default=[],
                        help="with --tls: extra DNS name/IP for the server certificate (repeatable)")
    parser.add_argument("--data-root", default=None, help="dataset root given to every SuperNode (node config)")
    parser.add_argument("--data-dirs", default="",
                        help="comma-separated data folders, one per SuperNode: node config data-dir, each node's own "
                             "data (the user-data tasks; see docs/data.md)")
    parser.add_argument("--public-dirs", default="",
                        help="comma-separated public image folders, one for all SuperNodes or one per SuperNode: "
                             "node config public-dir (logit methods, fccl-public='folder'; same files everywhere)")
    parser.add_argument("--models", default="",
                        help="comma-separated model names: one for all SuperNodes or one per SuperNode")
    parser.add_argument("--gpus", default="",
                        help="comma-separated GPU indices assigned round-robin as CUDA_VISIBLE_DEVICES "
                             "(one SuperNode per GPU); run config device='auto' (default) or 'cuda' then trains on it")
    parser.add_argument("--pin-partitions", action="store_true",
                        help="with --tls: pin each partition to the node id its registered key was given "
                             "(run config partition-pins), so no other node can claim it")
    parser.add_argument("--timeout", type=float, default=launch.DEFAULT_TIMEOUT_S,
                        help="seconds before the run is abandoned")
    parser.add_argument("--out-dir", default=None, help=f"results root (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="folder for FLWR_HOME, certificates and logs (default: a fresh temporary folder)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the work folder after a completed run (it is always kept after a failure)")
    parser.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        nodes = plan_nodes(args.num_supernodes, data_root=args.data_root, models=args.models.split(","),
                           gpus=args.gpus.split(","), data_dirs=args.data_dirs.split(","),
                           public_dirs=args.public_dirs.split(","))
        values, cfg = compose_run_config(method=args.method, rounds=args.rounds, out_dir=args.out_dir,
                                         data_root=args.data_root, user=args.run_config,
                                         num_supernodes=args.num_supernodes)
        if args.host and not args.tls:
            raise ConfigError("--host only applies to the TLS server certificate: add --tls")
        if args.pin_partitions and not args.tls:
            raise ConfigError("--pin-partitions pins partitions to registered node keys: add --tls")
        if args.timeout <= 0:
            raise ConfigError(f"--timeout = {args.timeout} is invalid: expected seconds > 0")
        try:
            app_dir = launch.default_app_dir()
        except launch.LaunchConfigError as err:
            raise ConfigError(str(err)) from err
        if args.work_dir is not None and (args.work_dir.resolve() == app_dir
                                          or app_dir in args.work_dir.resolve().parents):
            raise ConfigError(f"--work-dir {args.work_dir} is inside the app directory {app_dir}: "
                              "`flwr run` would pack its files into the app; choose a folder outside it")
    except ConfigError as err:
        print(f"[fleet] error: {err}", file=sys.stderr)
        return EXIT_USAGE

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pollen-fleet-"))
    report = FleetReport(method=cfg.method, num_supernodes=len(nodes), tls=args.tls)
    code = EXIT_NOT_COMPLETED
    fleet = Fleet(work_dir, tls=args.tls, hosts=args.host)
    started = time.monotonic()
    with _signals_raise(args.timeout):
        try:
            try:
                with fleet:
                    for spec in nodes:
                        fleet.add_supernode(spec)
                    fleet.wait_for_nodes(timeout=min(300.0, args.timeout))
                    report.startup_s = round(time.monotonic() - started, 2)
                    if args.pin_partitions:
                        values = {**values, "partition-pins": format_partition_pins(fleet.partition_pins())}
                    outcome = fleet.run(values, timeout=args.timeout, echo=not args.quiet, app_dir=app_dir)
                    report.run_id, report.status = outcome.run_id, outcome.status
                    report.failure_reason = outcome.failure_reason
                    report.run_s = round(outcome.wall_time_s, 2)
                    code = 0 if outcome.completed else EXIT_NOT_COMPLETED
            except TimeoutError as err:  # the alarm, or a wait inside the fleet
                report.status, code = f"timeout: {err}", EXIT_TIMEOUT
            except launch.SuperLinkDied as err:
                report.status, code = f"error: {err}", EXIT_SUPERLINK_DIED
                if not fleet.superlink_death_reported:
                    print(f"[fleet] {err}", file=sys.stderr, flush=True)
            except FleetInterrupted as err:
                report.status, code = str(err), 128 + err.signum
            except KeyboardInterrupt:
                report.status, code = "interrupted by SIGINT", 128 + signal.SIGINT
            except (RuntimeError, OSError, certs.CertError) as err:
                report.status, code = f"error: {err}", EXIT_NOT_COMPLETED
        except (FleetInterrupted, KeyboardInterrupt, TimeoutError) as err:  # a second signal, while unwinding
            signum = err.signum if isinstance(err, FleetInterrupted) else signal.SIGINT
            report.status = f"{report.status}; then interrupted again ({type(err).__name__})"
            code = EXIT_TIMEOUT if isinstance(err, TimeoutError) and code == 0 else code or 128 + signum
    ended = time.monotonic()
    report.teardown_s = fleet.teardown_s
    report.total_s = round(ended - started, 2)
    report.superlink_pid = fleet.superlink_proc.pid if fleet.superlink_proc is not None else None
    report.nodes = [{"name": n.spec.name, "pid": n.pid, "node-config": n.spec.node_config, "gpu": n.spec.gpu,
                     "exit-code": n.proc.returncode} for n in fleet.supernodes]
    report.client_errors = fleet.client_errors()
    report.processes, report.leftover = fleet.processes(), fleet.leftover
    if report.leftover and code == 0:
        code = EXIT_NOT_COMPLETED
    if report.run_id is not None:
        run_dir = Path(values["out-dir"]) / str(report.run_id)
        if run_dir.is_dir():
            report.results_dir = str(run_dir)
            (run_dir / "fleet.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    _print_report(report, fleet, code)
    left = groups_alive(fleet.process_groups())
    if left:
        print(f"[fleet] warning: process groups still alive after teardown: {left}", file=sys.stderr)
    elif not fleet.leftover and report.processes:
        print(f"[fleet] stopped the fleet's {len(report.processes)} processes: none left (checked by PID)",
              flush=True)
    if code == 0 and not args.keep_logs and args.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        print(f"[fleet] logs, certificates and FLWR_HOME kept in {work_dir}")
    return code


def _print_report(report: FleetReport, fleet: Fleet, code: int) -> None:
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}s"

    print(f"[fleet] {report.method} on {report.num_supernodes} SuperNodes "
          f"({'TLS + node auth' if report.tls else 'insecure'}): run {report.run_id}: {report.status}", flush=True)
    if report.run_id is not None and code != 0 and report.status.startswith("finished:"):
        verdict = report.status.split(":", 1)[1]
        verdict = "failed" if verdict == "completed" else verdict  # summary.json says failed
        print(f"[fleet] run {report.run_id} {verdict}: {report.failure_reason or 'no reason recorded'}",
              file=sys.stderr, flush=True)
    print(f"[fleet] wall time: fleet up {secs(report.startup_s)} | run {secs(report.run_s)} | "
          f"teardown {secs(report.teardown_s)} | total {secs(report.total_s)}", flush=True)
    if report.results_dir:
        summary_path = Path(report.results_dir) / "summary.json"
        extra = ""
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            acc = summary.get("final-accuracy") or {}
            if acc.get("mean") is not None:
                extra += f" | final {acc.get('metric')} {acc['mean']:.4f}"
            extra += f" | failures {summary.get('failures-total', 0)} rejected {summary.get('rejected-total', 0)}"
        print(f"[fleet] results: {report.results_dir}{extra}", flush=True)
    for name, errors in report.client_errors.items():
        for error in errors[:3]:
            print(f"[fleet] ClientApp error on {name}: {error}", flush=True)
    if code != 0:
        print(fleet.log_tails(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    print("note: `python -m deploy.fleet` is now `pollen fleet`; this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(main())
