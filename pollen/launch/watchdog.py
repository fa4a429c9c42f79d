"""The run dies with its launcher: a small process that stops the launch's tree when the launcher dies.

Run as ``python -m pollen.launch.watchdog SPEC`` by :class:`Watchdog`; nothing else starts it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pollen.launch.errors import signals_held
from pollen.launch.processes import LAUNCH_MARK, ProcessTree


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
        env = {k: v for k, v in os.environ.items() if k != LAUNCH_MARK}
        spec = {"token": tree.token, "since": tree.since, "home": str(home) if home else None,
                "run_dir": str(run_dir) if run_dir else None, "launcher": os.getpid(), "started": started}
        self.proc = subprocess.Popen([sys.executable, "-m", "pollen.launch.watchdog", json.dumps(spec)],
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the launcher's to handle
    sys.exit(watch(json.loads(sys.argv[1]), sys.stdin.buffer))
