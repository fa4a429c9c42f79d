"""How a launch ends when it does not complete: the exit codes of ``pollen run`` and ``pollen fleet``, the
errors that lead to them, and the signal handling that turns Ctrl-C and SIGTERM into an orderly teardown.

Exit codes: 0 only for ``finished:completed``; 1 the run failed, was stopped or its status is unknown;
2 bad options or run config, an out-dir that cannot be written, a run folder another launcher holds, a
resume that does not match its folder or a machine too small for the run (nothing was started); 3 the
SuperLink died (for a fleet: more often than ``--max-restarts``); 124 timeout; 128 + signal when
interrupted (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

EXIT_COMPLETED = 0
EXIT_NOT_COMPLETED = 1
EXIT_USAGE = 2
EXIT_SUPERLINK_DIED = 3
EXIT_TIMEOUT = 124


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_description(code: int | None) -> str:
    """``code 1``, or ``code -9 (SIGKILL)`` for a process a signal ended (``Popen.returncode`` < 0)."""
    return f"code {code}" if code is None or code >= 0 else f"code {code} ({signal_name(-code)})"


class LaunchError(RuntimeError):
    """The launch cannot go on (no app, a process failed to start); the message says why."""


class LaunchConfigError(LaunchError, ValueError):
    """Bad options or run config, found before anything was started."""


class SuperLinkDied(LaunchError):
    """The SuperLink process exited while the launch still needed it."""

    def __init__(self, proc: subprocess.Popen, log_path: Path | None = None):
        code = proc.returncode
        text = f"SuperLink (pid {proc.pid}) died with {exit_description(code)}"
        if log_path is not None:
            text += f"; its log: {log_path}"
        super().__init__(text)
        self.pid, self.returncode = proc.pid, code


class LaunchInterrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP arrived: unwind so every process gets stopped, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum = signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`LaunchInterrupted` in the main thread, so ``finally``
    blocks stop every process; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame):
        raise LaunchInterrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
