"""A local fleet: one SuperLink and N SuperNodes, each a real process talking over the network stack as on
separate machines, insecure or TLS + SuperNode authentication, all owned by one :class:`Fleet`.

Every process the fleet starts carries its :class:`~pollen.launch.processes.ProcessTree` mark, so
:meth:`Fleet.close` stops the whole tree by PID (also ServerApp/ClientApp processes in other sessions).
The SuperLink is watched throughout (:meth:`Fleet.check`); ``pollen fleet`` (:mod:`pollen.launch.fleet.cli`)
is the command around it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollen.app.config import ConfigError
from pollen.launch.compose import default_app_dir
from pollen.launch.console import RunLog
from pollen.launch.errors import SuperLinkDied, exit_description, signals_held
from pollen.launch.fleet import certs, supernodes
from pollen.launch.fleet.plan import NodeSpec, format_config
from pollen.launch.processes import ProcessTree, stop_process
from pollen.launch.submit import DEFAULT_TIMEOUT_S, RunOutcome, flwr_call, submit_and_wait
from pollen.launch.superlinks import flower_env, start_superlink, stop_orphaned_apps, superlink

# The last line of a Python traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): .+$", re.M)


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


class Fleet:
    """One SuperLink plus SuperNodes, all owned by this object and stopped by :meth:`close`.

    Use as a context manager. With ``tls=True`` the SuperLink serves HTTPS with a fresh CA and
    authenticates SuperNodes: :meth:`add_supernode` writes each node's key pair and registers it
    (``register=False`` starts a node with a key the SuperLink has never seen, which it refuses).
    Every process started carries the fleet's :class:`~pollen.launch.processes.ProcessTree` mark, so :meth:`close` stops
    the whole tree by PID (also ServerApp/ClientApp processes in other sessions) and :attr:`leftover`
    says what survived (nothing, normally). FLWR_HOME is ``<work_dir>/flwr-home``: private to the fleet.

    The SuperLink keeps its state in ``<work_dir>/superlink.db`` (``--database``: runs, registered node
    keys and the ids they were given), so :meth:`restart_superlink` brings a SuperLink that died back on
    the same port, with the same certificates and the same registered nodes, and the SuperNodes (which
    retry their connection) carry on with their keys.
    """

    def __init__(self, work_dir: Path, *, tls: bool = False, hosts: Sequence[str] = (), echo: bool = True):
        self.work_dir = Path(work_dir).resolve()
        self.flwr_home = self.work_dir / "flwr-home"
        self.database = self.work_dir / "superlink.db"
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
        self.run_id: int | None = None  # the Flower run last submitted
        self.tree = ProcessTree("fleet")
        self.leftover: list[int] = []
        self._superlink_args: list[str] = []
        self._root: str | None = None
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
        extra = ["--database", str(self.database)]
        root = None
        if self.tls:
            self.credentials = certs.write_server_credentials(self.cert_dir, self.hosts, force=True)
            root = str(self.credentials.ca_cert)
            extra += ["--ssl-ca-certfile", root, "--ssl-certfile", str(self.credentials.server_cert),
                      "--ssl-keyfile", str(self.credentials.server_key), "--enable-supernode-auth"]
        self._superlink_args, self._root = extra, root
        self.connection, self.port, self.superlink_proc = self._stack.enter_context(
            superlink(self.flwr_home, simulation=False, extra_args=extra, connection="fleet",
                      root_certificates=root, tree=self.tree))
        self._stack.callback(self._stop_supernodes)  # the SuperNodes stop before the SuperLink
        mode = "TLS + SuperNode auth" if self.tls else "insecure"
        self._say(f"SuperLink {self.address} ({mode}) pid {self.superlink_proc.pid}, "
                  f"log {self.superlink_log}")

    def restart_superlink(self) -> subprocess.Popen:
        """Start the SuperLink again after it died: first what is left of the dead one (its process group,
        and the ServerApp and ClientApp processes still attached to its port), then a new one on the same
        port with the same arguments (certificates, node authentication, ``--database``). The SuperNodes
        reconnect by themselves; the run the dead SuperLink held is gone with its ServerApp."""
        if self.superlink_proc is None or self.port is None:
            raise RuntimeError("the SuperLink was never started: use the Fleet as a context manager")
        stop_process(self.superlink_proc, grace=0.0)
        stop_orphaned_apps(self.port)
        self.superlink_proc = start_superlink(self.flwr_home, self.port, simulation=False,
                                              extra_args=self._superlink_args, root_certificates=self._root,
                                              tree=self.tree)
        self.superlink_death_reported = False
        self._say(f"SuperLink {self.address} restarted: pid {self.superlink_proc.pid}, database {self.database}")
        return self.superlink_proc

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
        """Raise :class:`~pollen.launch.errors.SuperLinkDied` if the SuperLink has exited; report (once) each SuperNode
        that died without being stopped on purpose. Called about once a second while waiting."""
        if self.superlink_proc is not None and self.superlink_proc.poll() is not None:
            err = SuperLinkDied(self.superlink_proc, self.superlink_log)
            if not self.superlink_death_reported:  # now, not after the (slow) teardown that follows
                self.superlink_death_reported = True
                print(f"[fleet] {err}", file=sys.stderr, flush=True)
            raise err
        for node in self.supernodes:
            code = node.proc.poll() if node.proc is not None else None
            if code is not None and not node.stopped and not node.death_reported:
                node.death_reported = True
                print(f"[fleet] warning: {node.spec.name} (pid {node.pid}) died with {exit_description(code)}; "
                      "the run goes on "
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
        """Wait until ``count`` (default: every SuperNode still running) SuperNodes are online."""
        running = [n for n in self.supernodes if not n.stopped and n.proc.poll() is None]
        count = len(running) if count is None else count
        ids = supernodes.wait_for_supernodes(self.conn, self.flwr_home, count, timeout=timeout,
                                             procs=[n.proc for n in running],
                                             logs=[n.log_path for n in running], watch=self.check)
        self._say(f"{len(ids)} SuperNodes online")
        return ids

    def run(self, run_config: Mapping[str, Any], *, timeout: float = DEFAULT_TIMEOUT_S, echo: bool | None = None,
            app_dir: Path | None = None, run_dir: Path | None = None, verbose: bool = False,
            run_log: RunLog | None = None) -> RunOutcome:
        """``flwr run`` the app on this fleet and wait for its final status (and a failed run's reason, from
        the run folder's summary.json: ``run_dir``, else ``<out-dir>/<run-id>``). Raises
        :class:`~pollen.launch.errors.SuperLinkDied` within about a second of the SuperLink dying."""
        app_dir = Path(app_dir) if app_dir is not None else default_app_dir()
        out_dir = str(run_config.get("out-dir") or "").strip()
        self.run_id = None
        return submit_and_wait(app_dir, self.conn, self.flwr_home, run_config=format_config(run_config),
                               timeout=timeout, echo=self.echo if echo is None else echo,
                               out_dir=Path(out_dir) if out_dir else None, watch=self.check, tree=self.tree,
                               run_dir=run_dir, on_run_id=lambda run_id: setattr(self, "run_id", run_id),
                               verbose=verbose, run_log=run_log)

    def stop_run(self, run_id: int) -> bool:
        """``flwr stop`` a run (e.g. the one a dead SuperLink held, so no SuperNode pulls its messages any
        more); False when the SuperLink would not (it may know the run as finished already)."""
        try:
            flwr_call(["stop", str(run_id), self.conn], flower_env(self.flwr_home), timeout=60, watch=self.check)
        except (RuntimeError, TimeoutError):
            return False
        return True

    def stop_supernode(self, node: SuperNode, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Stop one SuperNode's process group now (fault injection); ``close`` skips it later."""
        node.stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=grace)
        stop_process(node.proc, grace=1.0)

    def _stop_supernodes(self, grace: float = 10.0) -> None:
        """SIGTERM every SuperNode's process group at once, wait up to ``grace`` seconds for them all
        together, then SIGKILL what is left of each group (:func:`~pollen.launch.processes.stop_process`). A SuperNode
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
                stop_process(node.proc, grace=0.0)

    def process_groups(self) -> list[int]:
        """Process-group ids of everything started (each process leads its own group)."""
        groups = [self.superlink_proc.pid] if self.superlink_proc is not None else []
        return groups + [n.pid for n in self.supernodes]

    def close(self) -> None:
        """Stop SuperNodes, then the SuperLink (reverse start order), then whatever else of the fleet's
        process tree is left; signals (and the timeout alarm) are held off meanwhile."""
        began = time.monotonic()
        with signals_held((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)):
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

