"""Run folders a person can find and trust: sortable names, one writer at a time, ``latest``, federation.

The launcher names a new run ``YYYYMMDD-HHMMSS-<method>-<task>`` (the Flower run id is recorded inside
``summary.json``), points ``<out-dir>/latest`` at it and records the federation it ran on
(``launch.json``: SuperNodes, resources), so ``--resume`` restores it instead of guessing. While a
launcher works on a folder it holds an exclusive lock on ``<run>/.lock`` (``flock``): a second launcher
on the same folder is refused at once, naming the holder's PID. The kernel drops the lock when the
holding process dies however it dies, so a lock left by a killed launcher is taken over without a
stale-file check; the launcher's watchdog inherits the same lock and keeps it until it has stopped the
run of a killed launcher, so nobody resumes a folder that a leftover server still writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollen.launch.processes import pid_alive

LOCK_FILE = ".lock"
LAUNCH_FILE = "launch.json"
LATEST = "latest"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class RunFolderError(RuntimeError):
    """A run folder cannot be created, locked or read; the message names it and says why."""


def run_name(method: str, task: str, when: float | None = None) -> str:
    """``YYYYMMDD-HHMMSS-<method>-<task>`` (local time): names sort by start time, and say what ran."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return "-".join(_SAFE.sub("_", part) for part in (stamp, method, task))


def create_run_dir(out_dir: Path, name: str) -> Path:
    """A new, empty run folder ``out_dir/name`` (``name-2``, ``-3``… when taken); a folder that cannot be
    created is a :class:`RunFolderError` naming it, before anything starts."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"out-dir {out_dir} cannot be created: {err.strerror or err}") from err
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise RunFolderError(f"out-dir {out_dir} is not writable by this user")
    for attempt in range(1, 1000):
        path = out_dir / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise RunFolderError(f"out-dir {out_dir}: cannot create {path.name}: {err.strerror or err}") from err
    raise RunFolderError(f"out-dir {out_dir}: 999 runs named {name} already")


MIN_FREE_BYTES = 256 * 2**20  # a new run: config, metrics, plots, a few small checkpoints and node states


def space_needed(run_dir: Path | None) -> int:
    """Bytes a run needs free before it starts: a fixed floor for a new run; for a resumed one, room
    for another round of everything it keeps (its newest checkpoint and one state of every node, each
    written beside the old one before that is pruned), twice over."""
    if run_dir is None:
        return MIN_FREE_BYTES
    run_dir = Path(run_dir)
    checkpoints = sorted((run_dir / "checkpoints").glob("round-*.safetensors"))
    newest = checkpoints[-1].stat().st_size if checkpoints else 0
    node_state = 0
    for node in (run_dir / "nodes").glob("partition-*"):
        rounds = sorted(p for p in node.glob("round-*") if p.is_dir())
        if rounds:
            node_state += sum(f.stat().st_size for f in rounds[-1].iterdir() if f.is_file())
    return max(MIN_FREE_BYTES, 2 * (newest + node_state))


def check_free_space(folder: Path, needed: int) -> None:
    """``RunFolderError`` before anything starts when ``folder``'s file system has less than ``needed``."""
    import shutil

    existing = Path(folder).resolve()
    while not existing.exists() and existing != existing.parent:  # a new out-dir: its file system
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise RunFolderError(f"{folder}: {free / 2**20:.0f} MiB free, the run needs about {needed / 2**20:.0f} MiB "
                             "(checkpoints and node states); free some space or choose another --out-dir")


def link_latest(run_dir: Path) -> Path:
    """Point ``<out-dir>/latest`` at ``run_dir`` (relative, replaced atomically)."""
    run_dir = Path(run_dir)
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.symlink(run_dir.name, tmp)
        os.replace(tmp, link)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise RunFolderError(f"cannot link {link} -> {run_dir.name}: {err.strerror or err}") from err
    return link


@dataclass
class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock``, with the holder's PID written in the file."""

    run_dir: Path
    fd: int = -1
    taken_over: dict[str, Any] | None = None  # the previous holder's record when it was a dead process

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / LOCK_FILE

    def acquire(self, **info: Any) -> RunLock:
        """Take the lock now or raise :class:`RunFolderError` naming the holder; ``info`` is recorded."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderError(f"{self.run_dir}: cannot create {LOCK_FILE}: {err.strerror or err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path)
            os.close(fd)
            raise RunFolderError(f"{self.run_dir} is in use by another launcher ({describe_holder(holder)}); one "
                                 "launcher writes a run folder at a time") from None
        previous = read_holder(self.path)
        self.taken_over = previous or None
        record = {"pid": os.getpid(), "started": time.time(), **info}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self.fd = fd
        return self

    def note(self, **info: Any) -> None:
        """Add to the holder record (e.g. the watchdog's PID)."""
        record = {**read_holder(self.path), **info}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing our descriptor drops our share of the lock
            self.fd = -1


def read_holder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    pid = holder.get("pid")
    if pid is None:
        return "holder unknown"
    alive = pid_alive(int(pid))
    text = f"launcher PID {pid}" + ("" if alive else " (no longer running)")
    if holder.get("watchdog") is not None and not alive:
        text += f"; its watchdog PID {holder['watchdog']} is still stopping that run"
    return text


def write_launch_info(run_dir: Path, info: dict[str, Any]) -> None:
    (Path(run_dir) / LAUNCH_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def read_launch_info(run_dir: Path) -> dict[str, Any]:
    """``launch.json`` of a run folder; ``{}`` for folders of older launchers (nothing recorded)."""
    path = Path(run_dir) / LAUNCH_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise RunFolderError(f"{path}: unreadable ({err})") from err
    return data if isinstance(data, dict) else {}


def recorded_supernodes(run_dir: Path) -> int | None:
    """The SuperNodes a run ran with: ``launch.json``, else (older runs) its ``nodes/partition-*`` folders."""
    value = read_launch_info(run_dir).get("num-supernodes")
    if isinstance(value, int) and value > 0:
        return value
    nodes = [p for p in (Path(run_dir) / "nodes").glob("partition-*") if p.is_dir()]
    return len(nodes) or None
