"""The processes one launch started, found by PID and stopped as a whole (Linux reads ``/proc``).

A launch (``pollen.launch.launcher``) or a fleet (``deploy/fleet.py``) marks the environment of every process
it starts; :class:`ProcessTree` finds them again — descendants, marked processes that left their
parent's session, and late Ray agents in a member's process group — and stops them on success,
failure, timeout and Ctrl-C, checking start times so a reused PID is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# Every process a launch starts carries this variable (the launch's token, ':'-joined when launches nest),
# so its whole tree is found by PID even after a process left its parent's session or was re-parented.
LAUNCH_MARK = "POLLEN_LAUNCH_ID"


class ProcessTree:
    """Every process one launch started, found by PID and stopped as a whole.

    Members are the descendants of the registered roots (by parent PID), every process whose
    environment carries this launch's :data:`LAUNCH_MARK` token, and every process started since the
    launch in the process group of a member: ``flwr-serverapp`` runs in its own session and Ray daemons
    outlive their parent, so neither process groups nor parent links alone find them; and a Ray agent
    that renamed itself (``ray::DashboardAgent``) has overwritten the environment ``/proc`` shows, so
    only its group still ties it to the launch once its parent is gone. Each member is remembered with
    its start time, so a reused PID is never signalled. Linux reads ``/proc``; elsewhere only the roots'
    process groups are known.
    """

    def __init__(self, label: str = "pollen", *, token: str | None = None, since: int | None = None):
        """A new launch's tree, or (``token``, ``since``) the tree of another process's launch: the
        watchdog finds its launcher's processes by the same mark."""
        self.token = token or f"{label}-{os.getpid()}-{secrets.token_hex(6)}"
        self.roots: list[int] = []
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, name)
        me = proc_stat(os.getpid())
        # start time (clock ticks): nothing older is ours
        self._since = since if since is not None else (me[3] if me is not None else 0)
        self._lock = threading.Lock()

    def mark(self, env: dict[str, str]) -> dict[str, str]:
        """Tag an environment for a process this launch starts (nested launches keep outer tokens)."""
        outer = env.get(LAUNCH_MARK, "")
        if self.token not in outer.split(":"):
            env[LAUNCH_MARK] = f"{outer}:{self.token}" if outer else self.token
        return env

    def add_root(self, pid: int) -> None:
        with self._lock:
            if pid not in self.roots:
                self.roots.append(pid)
        info = proc_stat(pid)
        if info is not None:
            self.seen.setdefault(pid, (info[3], ""))  # named later: it may not have exec'd yet

    def members(self) -> dict[int, tuple[int, str]]:
        """The launch's live processes now (zombies excluded): pid -> (start time, name)."""
        table = proc_table()
        if table is None:  # no /proc: the roots whose group still answers
            return {pid: self.seen.get(pid, (0, "?")) for pid in self.roots if group_alive(pid)}
        children: dict[int, list[int]] = {}
        for pid, (_state, ppid, _pgrp, _start, _name) in table.items():
            children.setdefault(ppid, []).append(pid)
        found: set[int] = set()
        stack = [pid for pid in self.roots if pid in table]
        while stack:
            pid = stack.pop()
            if pid in found:
                continue
            found.add(pid)
            stack.extend(children.get(pid, ()))
        needle = f"{self.token}".encode()
        me = os.getpid()
        for pid in table:
            if pid in found or pid == me:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if needle in environ and LAUNCH_MARK.encode() in environ:
                found.add(pid)
        found |= self._group_mates(table, found)
        found.discard(me)
        live = {}
        for pid in found:
            state, _ppid, _pgrp, start, name = table[pid]
            if state in ("Z", "X"):
                continue
            live[pid] = (start, display_name(pid, name))
        with self._lock:
            for pid, info in live.items():
                known = self.seen.get(pid)
                if known is None or not known[1] or known[0] != info[0]:  # new, unnamed, or a reused PID
                    self.seen[pid] = info
        return live

    def _group_mates(self, table: dict[int, tuple[str, int, int, int, str]], found: set[int]) -> set[int]:
        """Processes started since the launch whose process group is led by a member, found now or
        seen before. A group outlives its leader, and Linux gives no new process a PID that still
        names a group, so a group ID that was a member's PID is that member's group, unless a live
        process with that PID started at another time (the PID was reused before the group formed)."""
        leaders = set(found)
        for pid, (start, _name) in self.seen.items():
            now = table.get(pid)
            if now is None or now[3] == start:
                leaders.add(pid)
        return {pid for pid, (_state, _ppid, pgrp, start, _name) in table.items()
                if pgrp in leaders and start >= self._since and pid not in found}

    def alive(self, pids: Sequence[int] | None = None) -> list[int]:
        """Which of ``pids`` (default: every process seen) still run, as the same process (start time)."""
        wanted = list(self.seen) if pids is None else list(pids)
        out = []
        for pid in wanted:
            info = proc_stat(pid)
            if info is None:
                if proc_table() is None and group_alive(pid):
                    out.append(pid)
                continue
            state, _ppid, _pgrp, start, _name = info
            known = self.seen.get(pid)
            if state in ("Z", "X") or (known is not None and known[0] != start):
                continue
            out.append(pid)
        return sorted(out)

    def kill_named(self, names: Sequence[str]) -> list[int]:
        """SIGKILL the members called one of ``names`` now; their PIDs. For an interrupt: the engine stops
        before anything else, so no round finishes after the user asked to stop (what a round writes is
        atomic, as after a whole-tree SIGKILL)."""
        killed = [pid for pid, (_start, name) in self.members().items() if name in names]
        for pid in killed:
            self._signal(pid, signal.SIGKILL)
        self._wait_gone(killed, 5.0)
        return killed

    def terminate(self, grace: float = 10.0, patience: float = 5.0) -> list[int]:
        """Stop the whole tree: SIGTERM the roots' groups, then every member left, then SIGKILL.

        Returns the PIDs still alive afterwards (empty when everything is gone). Signals are held off
        meanwhile when called from the main thread, so a second Ctrl-C cannot cut the teardown short.
        """
        with signals_held():
            self.members()  # records every current member (and its start time) in self.seen
            roots = self.alive(self.roots)  # a root already gone: its PID may belong to someone else now
            for pid in roots:
                signal_group(pid, signal.SIGTERM)  # the SuperLink first: it stops its own children
            self._wait_gone(roots, grace)
            for sig, wait in ((signal.SIGTERM, patience), (signal.SIGKILL, 5.0)):
                live = set(self.members()) | set(self.alive())  # alive(): every process ever seen, even
                if not live:                                     # one its dying parent left to PID 1
                    break
                for pid in live:
                    self._signal(pid, sig)
                self._wait_gone(sorted(live), wait)
            self._sweep_late_spawns()
            return sorted(set(self.members()) | set(self.alive()))

    def kill(self) -> list[int]:
        """SIGKILL the whole tree at once, for a launch whose work is all on disk: a graceful stop only
        costs time then (the simulation's Ray shutdown holds Ray's daemons for ~3 s, and two Ray agents
        ignore SIGTERM once their driver is gone). Returns the PIDs still alive afterwards."""
        with signals_held():
            live = set(self.members()) | set(self.alive(self.roots))
            for pid in self.alive(self.roots):
                signal_group(pid, signal.SIGKILL)
            for pid in live:
                self._signal(pid, signal.SIGKILL)
            self._wait_gone(sorted(live), 5.0)
            self._sweep_late_spawns()
            return sorted(set(self.members()) | set(self.alive()))

    def _sweep_late_spawns(self, quiet: float = 0.6, limit: float = 15.0) -> None:
        """Kill members that appear after the main pass (a process forked while its parent was being
        stopped, e.g. a Ray worker), until no member has been seen for ``quiet`` seconds. A child exists
        in ``/proc`` as soon as its parent's fork returns, and every parent is gone by now, so a few
        scans with nothing found are enough; each scan that finds one starts the wait again."""
        deadline = time.monotonic() + limit
        calm_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - calm_since < quiet:
            live = sorted(set(self.members()) | set(self.alive()))
            if live:
                for pid in live:
                    self._signal(pid, signal.SIGKILL)
                self._wait_gone(sorted(live), 1.0)
                calm_since = time.monotonic()
            else:
                time.sleep(0.2)

    def _signal(self, pid: int, sig: int) -> None:
        info = proc_stat(pid)
        known = self.seen.get(pid)
        if info is not None and known is not None and known[0] != info[3]:
            return  # the PID now belongs to another process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def _wait_gone(self, pids: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    def describe(self, pids: Sequence[int] | None = None) -> str:
        """``name(pid)`` for ``pids`` (default: every process seen), for messages."""
        pids = sorted(self.seen) if pids is None else pids
        return ", ".join(f"{self.seen.get(p, (0, '?'))[1] or '?'}({p})" for p in pids)


def proc_stat(pid: int) -> tuple[str, int, int, int, str] | None:
    """(state, ppid, pgrp, start time, comm) of a process from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    try:
        return fields[0], int(fields[1]), int(fields[2]), int(fields[19]), head.partition("(")[2]
    except (IndexError, ValueError):
        return None


def proc_table() -> dict[int, tuple[str, int, int, int, str]] | None:
    root = Path("/proc")
    if not (root / "self" / "stat").exists():
        return None
    table = {}
    for entry in root.iterdir():
        if entry.name.isdigit():
            info = proc_stat(int(entry.name))
            if info is not None:
                table[int(entry.name)] = info
    return table


def display_name(pid: int, comm: str) -> str:
    """A readable process name: the console script for Python processes (``flwr-simulation``), else comm."""
    try:
        argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return comm
    if not argv:
        return comm
    first = os.path.basename(argv[0].decode(errors="replace"))
    if first.startswith("python"):
        rest = iter(a.decode(errors="replace") for a in argv[1:])
        for arg in rest:
            if arg == "-m":
                return next(rest, first)
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return first.split()[0] if first else comm


def _answers(send, target: int) -> bool:
    """Whether signal 0 reaches ``target`` (a process someone else owns still exists)."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    return _answers(os.killpg, pgid)


def pid_alive(pid: int) -> bool:
    return _answers(os.kill, pid)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def signals_held(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Hold ``signals`` (default SIGINT/SIGTERM/SIGHUP) off while a teardown runs (main thread only; nests).

    A signal arriving meanwhile is recorded and re-raised once the block ends, so it reaches whatever
    handler was installed before (e.g. :func:`signals_raise`) only after every process was stopped; a
    second Ctrl-C cannot leave half a tree running. (Masking the signal would not do: Python runs its
    handlers in the main thread even when another thread, e.g. a log reader, took the signal.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum, _frame):
        pending.append(signum)

    previous = {}
    for s in signals:
        with contextlib.suppress(ValueError, OSError):
            previous[s] = signal.signal(s, record)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])


# --- the watchdog: the run dies with its launcher -------------------------------------------------------

class Watchdog:
    """A small process that stops the launch's tree when the launcher dies, however it dies.

    SIGKILL gives the launcher no chance to clean up, and a parent-death signal would reach only its
    direct children (the SuperLink), not the simulation process, ``flwr-serverapp`` or Ray, which live
    in other sessions. So the launcher starts this watchdog first, in its own session and without the
    launch's mark (the teardown never stops it), and keeps the write end of a pipe to it: the kernel
    closes that pipe when the launcher dies, the watchdog reads end-of-file at once and stops every
    process carrying the launch's mark (:class:`ProcessTree`, by PID and start time), removes the
    private ``FLWR_HOME`` and writes ``summary.json`` (``interrupted``). A launcher that ends normally
    says ``done`` first and the watchdog leaves quietly. The watchdog also inherits the run folder's
    lock, so the folder stays locked until the run of a killed launcher is really stopped.
    """

    def __init__(self, tree: ProcessTree, *, home: Path | None = None, run_dir: Path | None = None,
                 lock_fd: int | None = None, started: float | None = None):
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items() if k != LAUNCH_MARK}
        spec = {"token": tree.token, "since": tree._since, "home": str(home) if home else None,
                "run_dir": str(run_dir) if run_dir else None, "launcher": os.getpid(), "started": started}
        self.proc = subprocess.Popen([sys.executable, "-m", "pollen.launch.processes", json.dumps(spec)],
                                     stdin=subprocess.PIPE, env=env, start_new_session=True,
                                     pass_fds=(lock_fd,) if lock_fd is not None else ())
        self.pid = self.proc.pid

    def tell(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()

    def root(self, pid: int) -> None:
        self.tell(f"root {pid}")

    def run_id(self, run_id: int) -> None:
        self.tell(f"run-id {run_id}")

    def run_dir(self, path: Path) -> None:
        self.tell(f"run-dir {path}")

    def done(self) -> None:
        """The launcher stopped everything itself: the watchdog leaves without touching anything."""
        self.tell("done")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)


def watch(spec: dict, lines) -> int:
    """The watchdog's loop: ``lines`` is the pipe from the launcher; end-of-file without ``done`` means
    the launcher died. Returns the process exit code (0 either way)."""
    import shutil

    tree = ProcessTree(token=spec["token"], since=int(spec["since"]))
    run_id = None
    for raw in lines:
        word, _, value = raw.decode(errors="replace").strip().partition(" ")
        if word == "done":
            return 0
        if word == "root":
            tree.add_root(int(value))
        elif word == "run-id":
            run_id = int(value)
        elif word == "run-dir":
            spec["run_dir"] = value
    with signals_held():
        left = tree.terminate(grace=2.0, patience=2.0)
    if spec.get("home"):
        shutil.rmtree(spec["home"], ignore_errors=True)
    if spec.get("run_dir"):
        from pollen.app.results import write_stopped_summary

        with contextlib.suppress(OSError):
            write_stopped_summary(Path(spec["run_dir"]), "interrupted",
                                  f"the launcher (PID {spec['launcher']}) died; its watchdog stopped the run"
                                  + (f" (still alive: {tree.describe(left)})" if left else ""), run_id,
                                  since=spec.get("started"))
    return 0


if __name__ == "__main__":
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the launcher's to handle
    sys.exit(watch(json.loads(sys.argv[1]), sys.stdin.buffer))
