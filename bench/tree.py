"""The processes one launch starts, found by a mark in their environment and sampled while it runs.

A launch's processes are not all its children (Ray and SuperExec start theirs through daemons), so
the studies mark the launch's environment with a fresh token and take every process that inherits
it. One thread scans ``/proc`` while the launch runs; what each study measures of the members is its
own ``sample``.
"""

from __future__ import annotations

import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable

from pollen.launch.processes import proc_cmdline, proc_environ, proc_table


class MarkedTree(ABC):
    """Every process whose environment carries ``<mark>=<token>``, with its role, while the block runs.

    ``classify`` names a process's role from its command line; ``fallback`` is the role it gives a
    process it cannot place. A known process is re-classified whenever it reads as something else than
    the fallback (an idle Ray worker becomes an actor; an exiting process's command line reads empty).
    """

    interval_s = 0.25

    def __init__(self, mark: str, classify: Callable[[int], str], fallback: str) -> None:
        self.mark = mark
        self.token = uuid.uuid4().hex
        self.classify = classify
        self.fallback = fallback
        self.roles: dict[int, str] = {}
        self._members: set[int] = set()
        self._checked: dict[int, list[bytes]] = {}  # pid -> the command line it was checked with
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def env(self) -> dict[str, str]:
        """The environment to launch with: this one plus the mark."""
        return {**os.environ, self.mark: self.token}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def members_now(self) -> list[int]:
        """The marked processes alive at this scan, their roles updated."""
        needle = f"{self.mark}={self.token}".encode()
        alive = []
        for pid in proc_table() or {}:
            if pid not in self._members:
                # checked again whenever its command line changes: a child forked by flower-superexec
                # shows the environment it execs flwr-simulation with only then
                command = proc_cmdline(pid)
                if command is None or self._checked.get(pid) == command:
                    continue
                self._checked[pid] = command
                if needle not in (proc_environ(pid) or b""):
                    continue
                self._members.add(pid)
            role = self.classify(pid)
            if pid not in self.roles or role != self.fallback:
                self.roles[pid] = role
            alive.append(pid)
        return alive

    @abstractmethod
    def sample(self, pids: list[int]) -> None:
        """What a study measures of the members at each scan."""

    def wait(self, seconds: float) -> bool:
        """Sleep between samples; True once the block has ended."""
        return self._stop.wait(seconds)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample(self.members_now())
            self.wait(self.interval_s)
