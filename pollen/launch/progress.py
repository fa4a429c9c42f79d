"""What the launcher shows while a run goes: a live bar on a terminal, the plain lines everywhere else.

The ServerApp prints one ``[pollen] round k/N | ... | elapsed ..., ETA ...`` line per round; the launcher
streams the run's log. On a terminal those lines scroll above a bar that says the phase (waiting for round 1
while SuperLink, Ray and the actors start) and then ``k/N`` with elapsed time and ETA, so a user sees
movement from the first second. Piped or redirected output (CI, logs, ``tee``) gets exactly the streamed
lines, nothing redrawn: a log file never holds control characters. ``POLLEN_PROGRESS=plain`` forces the
plain form on a terminal.
"""

from __future__ import annotations

import os
import re
import sys
from typing import IO, Any

ROUND_LINE = re.compile(r"\[pollen\] round (\d+)/(\d+)\b")


def parse_round(line: str) -> tuple[int, int] | None:
    """``(k, N)`` of a ServerApp round line, else None."""
    match = ROUND_LINE.search(line)
    return (int(match.group(1)), int(match.group(2))) if match else None


def wants_live(stream: IO[str] | None = None, env: dict[str, str] | None = None) -> bool:
    """A live bar only on an interactive terminal, and not when ``POLLEN_PROGRESS=plain`` or ``TERM=dumb``."""
    stream = sys.stdout if stream is None else stream
    env = dict(os.environ) if env is None else env
    if env.get("POLLEN_PROGRESS", "").lower() == "plain" or env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class RunProgress:
    """Echo the run's log lines; on a terminal, keep a bar of the rounds below them.

    Use as a context manager around the log stream: :meth:`line` for every streamed line.
    """

    def __init__(self, live: bool | None = None, stream: IO[str] | None = None, waiting: str = "waiting for round 1",
                 console: Any = None) -> None:
        self.stream = sys.stdout if stream is None else stream
        self.live = wants_live(self.stream) if live is None else live
        self.waiting = waiting
        self._console = console
        self._progress: Any = None
        self._waiting: Any = None
        self._rounds: Any = None

    def __enter__(self) -> RunProgress:
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = self._console or Console(file=self.stream)
            self._progress = Progress(SpinnerColumn(), TextColumn("[pollen] {task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                                      TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
            self._progress.start()
            self._waiting = self._progress.add_task(self.waiting, total=None)
        return self

    def line(self, text: str) -> None:
        if self._progress is None:
            self.stream.write(text)
            self.stream.flush()
            return
        self._progress.console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        done = parse_round(text)
        if done is None:
            return
        k, total = done
        if self._rounds is None:  # the start-up phase ends (its elapsed stays shown); rounds get their own
            # bar, started at the round before this one so a resumed run's ETA counts only rounds run here
            self._progress.update(self._waiting, description="start-up", total=1, completed=1)
            self._rounds = self._progress.add_task("rounds", total=total, completed=k - 1)
        self._progress.update(self._rounds, completed=k, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
