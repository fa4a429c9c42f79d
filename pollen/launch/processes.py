"""The processes one launch started, found by PID and stopped as a whole; the one reader of ``/proc``.

A launch (:mod:`pollen.launch.simulation`) or a fleet (:mod:`pollen.launch.fleet`) marks the environment of
every process it starts; :class:`ProcessTree` finds them again — descendants, marked processes that left
their parent's session, and late Ray agents in a member's process group — and stops them on success,
failure, timeout and Ctrl-C, checking start times so a reused PID is never signalled. Everything Pollen
reads of ``/proc`` is read here; elsewhere than Linux the readers answer ``None``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from pollen.launch.errors import signals_held

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
        self.since = since if since is not None else (me.start if me is not None else 0)
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
            self.seen.setdefault(pid, (info.start, ""))  # named later: it may not have exec'd yet

    def members(self) -> dict[int, tuple[int, str]]:
        """The launch's live processes now (zombies excluded): pid -> (start time, name)."""
        table = proc_table()
        if table is None:  # no /proc: the roots whose group still answers
            return {pid: self.seen.get(pid, (0, "?")) for pid in self.roots if group_alive(pid)}
        children: dict[int, list[int]] = {}
        for pid, info in table.items():
            children.setdefault(info.ppid, []).append(pid)
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
            environ = proc_environ(pid)
            if environ is not None and needle in environ and LAUNCH_MARK.encode() in environ:
                found.add(pid)
        found |= self._group_mates(table, found)
        found.discard(me)
        live = {pid: (table[pid].start, display_name(pid, table[pid].name)) for pid in found
                if table[pid].state not in ("Z", "X")}
        with self._lock:
            for pid, (start, name) in live.items():
                known = self.seen.get(pid)
                if known is None or not known[1] or known[0] != start:  # new, unnamed, or a reused PID
                    self.seen[pid] = (start, name)
        return live

    def _group_mates(self, table: dict[int, ProcStat], found: set[int]) -> set[int]:
        """Processes started since the launch whose process group is led by a member, found now or
        seen before. A group outlives its leader, and Linux gives no new process a PID that still
        names a group, so a group ID that was a member's PID is that member's group, unless a live
        process with that PID started at another time (the PID was reused before the group formed)."""
        leaders = set(found)
        for pid, (start, _name) in self.seen.items():
            now = table.get(pid)
            if now is None or now.start == start:
                leaders.add(pid)
        return {pid for pid, info in table.items()
                if info.pgrp in leaders and info.start >= self.since and pid not in found}

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
            known = self.seen.get(pid)
            if info.state in ("Z", "X") or (known is not None and known[0] != info.start):
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
        if info is not None and known is not None and known[0] != info.start:
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


class ProcStat(NamedTuple):
    """One process as ``/proc/<pid>/stat`` describes it."""

    state: str  # R, S, D, Z (zombie), X (dead), ...
    ppid: int
    pgrp: int
    start: int  # start time in clock ticks after boot: with the PID, who this process is
    name: str  # comm: at most 15 characters
    own_cpu_s: float  # user + system CPU-seconds of the process itself
    cpu_s: float  # the same plus those of the children it has reaped


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: int) -> ProcStat | None:
    """Process ``pid`` from /proc, or None if it is gone (or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    head, _, rest = stat.rpartition(")")  # the name may hold spaces and parentheses
    fields = rest.split()  # from field 3 (state) on
    try:
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]), head.partition("(")[2],
                        sum(int(x) for x in fields[11:13]) / _TICK, sum(int(x) for x in fields[11:15]) / _TICK)
    except (IndexError, ValueError):
        return None


def proc_table() -> dict[int, ProcStat] | None:
    """Every process now, by PID; None where there is no /proc."""
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


def proc_cmdline(pid: int) -> list[bytes] | None:
    """A process's arguments (empty ones dropped), or None when it is gone or unreadable."""
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None


def proc_environ(pid: int) -> bytes | None:
    """A process's environment as NUL-separated ``KEY=value`` bytes, or None when unreadable."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None


def proc_memory(pid: int) -> int | None:
    """Proportional set size in bytes (shared pages, e.g. torch's libraries in every worker, counted once
    over all processes); the resident size where ``smaps_rollup`` is unreadable; None when gone."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def memory_available() -> int | None:
    """Bytes the kernel could give new processes without swapping (``MemAvailable``); None without /proc."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    return None


def tree_cpu(root: int) -> float:
    """CPU-seconds of ``root``'s live descendants, each with the children it has reaped (0 without /proc)."""
    table = proc_table() or {}
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    below: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in below:
                below.add(child)
                todo.append(child)
    return sum(table[pid].cpu_s for pid in below)


def groups_alive(groups: Sequence[int]) -> list[int]:
    """The process groups among ``groups`` that still have a running (non-zombie) member.

    Zombies are skipped: a process whose parent died is reaped by init, and a container's init may
    never do it, yet a zombie holds no port, memory or CPU. Without /proc: the groups a signal reaches.
    """
    table = proc_table()
    if table is None:
        return [g for g in groups if group_alive(g)]
    running = {info.pgrp for info in table.values() if info.state not in ("Z", "X")}
    return [g for g in groups if g in running]


def listening_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening TCP socket on ``port`` (None: cannot tell). A /health answer
    alone is no proof: after a lost race for a free port it may come from another launch's SuperLink."""
    inodes = set()
    for net in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(net).read_text().splitlines()[1:]:
                cols = row.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    if not inodes:
        return None if not Path("/proc/net/tcp").exists() else False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd) in wanted:
                return True
    return False


def display_name(pid: int, comm: str) -> str:
    """A readable process name: the console script for Python processes (``flwr-simulation``), else comm."""
    argv = proc_cmdline(pid)
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
        pass
    return True


def group_alive(pgid: int) -> bool:
    return _answers(os.killpg, pgid)


def pid_alive(pid: int) -> bool:
    return _answers(os.kill, pid)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group (the process and what it spawned), then SIGKILL stragglers."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
