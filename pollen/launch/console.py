"""What a run says, on the console and in ``<run folder>/run.log``.

The console gets one line per round by default: the ServerApp's ``[pollen]`` lines (its start, each round,
its end), the WARNINGs and ERRORs of the run (a rejected reply, a failed client) and the launcher's own
lines; Flower's INFO lines (its own round blocks, aggregated records, start-up) go to ``run.log`` only, and
to the console too with ``--verbose``. ``run.log`` keeps everything: every line of the run's log stream and
every line the launcher printed, without terminal control characters, appended to on ``--resume``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import IO, Any

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RUN_LOG = "run.log"
SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")


def add_console_options(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` and ``--verbose``, as every launcher that streams a run's log offers them."""
    parser.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    parser.add_argument("--verbose", action="store_true",
                        help="show every line of the run's log (Flower's own too) instead of one per round, Pollen's "
                             "lines and the warnings; run.log in the run folder keeps them all either way")


def on_console(line: str, verbose: bool = False) -> bool:
    """Whether a line of the run's log stream is shown on the console (``verbose``: all of them)."""
    if verbose:
        return True
    text = ANSI.sub("", line).lstrip()
    return text.startswith("[pollen]") or text.startswith(SHOWN_LEVELS)


class _Tee:
    """A text stream that writes to the console stream it replaces and, without control characters, to the
    run log."""

    def __init__(self, original: IO[str], log: IO[str]):
        self.original = original
        self._log = log

    def write(self, text: str) -> int:
        try:
            self._log.write(ANSI.sub("", text))
        except (OSError, ValueError):  # a full disk or a closed log: the console still gets it
            pass
        return self.original.write(text)

    def flush(self) -> None:
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass
        self.original.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the console's
        return getattr(self.original, name)


class RunLog:
    """``run.log`` of one launch; as a context manager it also copies everything this process prints there.

    :meth:`record` appends a line of the run's log stream, shown on the console or not; what the launcher
    prints reaches the file through the copied ``sys.stdout``/``sys.stderr`` (``tee=True``).
    """

    def __init__(self, path: Path, tee: bool = True):
        self.path = Path(path)
        self.tee = tee
        self._file: IO[str] | None = None
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> RunLog:
        fresh = not self.path.exists()
        try:
            self._file = self.path.open("a", encoding="utf-8", errors="replace")
        except OSError as err:
            print(f"[pollen] warning: no {self.path.name} in {self.path.parent}: {err.strerror or err}",
                  file=sys.stderr, flush=True)
            return self
        if not fresh:
            self._file.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')}: launched again ---\n")
        if self.tee:
            self._saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)  # type: ignore
        return self

    @property
    def console(self) -> IO[str]:
        """The console itself (not copied here): for a live progress bar, which the log must not get."""
        return getattr(sys.stdout, "original", sys.stdout)

    def record(self, line: str) -> None:
        if self._file is not None:
            try:
                self._file.write(ANSI.sub("", line))
            except (OSError, ValueError):  # a full disk: the run's own files matter more than its log
                pass

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
