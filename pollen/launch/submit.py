"""One run on a SuperLink: ``flwr run`` the app, stream its log until the run ends, and say how it ended.

``flwr run`` exits 0 even when the ServerApp crashes. :func:`submit_and_wait` reads the final status with
``flwr ls`` and the failure reason from the run folder's ``summary.json``; a Pollen ServerApp's own
``summary.json`` ends the wait without Flower's wind-down (:class:`AppEnd`).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from pollen.launch.console import RUN_LOG, RunLog, on_console
from pollen.launch.errors import LaunchInterrupted
from pollen.launch.fab import staged_app
from pollen.launch.processes import ProcessTree, stop_process
from pollen.launch.progress import RunProgress
from pollen.launch.superlinks import flower_bin, flower_env

# How long a run may take before the launcher stops it: a guard against a hung run, not a budget. The
# README's FCCL command ran past one hour on a shared 2-core machine (its last round stopped by the old
# 3600 s default), so the default leaves room for the paper-sized commands.
DEFAULT_TIMEOUT_S = 6 * 3600.0

# The processes that run the rounds (the simulation engine: ServerApp and Ray driver); an interrupt stops
# them first.
ENGINE_PROCESSES = ("flwr-simulation",)


@dataclass
class RunOutcome:
    run_id: int
    status: str
    wall_time_s: float
    log: str
    summary: dict[str, Any] | None = None  # <out-dir>/<run-id>/summary.json, when the app wrote one
    failure_reason: str | None = None
    results_dir: Path | None = None
    processes: list[str] = field(default_factory=list)  # "name(pid)" of every process the launch saw
    leftover: list[int] = field(default_factory=list)  # PIDs still alive after teardown (should be empty)
    teardown_s: float | None = None  # stopping the SuperLink and the rest of the tree
    status_from: str = "flower"  # "app": the ServerApp's summary.json ended the wait (see AppEnd)

    @property
    def completed(self) -> bool:
        if self.status != "finished:completed":
            return False
        return self.summary is None or self.summary.get("status", "completed") == "completed"

    @property
    def verdict(self) -> str:
        """``completed``, ``failed``, ``stopped``... (the part after ``finished:``), or the raw status."""
        if self.status == "finished:completed" and not self.completed:
            return "failed"
        return self.status.split(":", 1)[1] if self.status.startswith("finished:") else self.status


def flwr_call(args: Sequence[str], env: dict[str, str], timeout: float, cwd: Path | None = None,
          watch: Callable[[], None] | None = None) -> str:
    """One ``flwr`` CLI call; ``watch`` runs every half second meanwhile (it raises to abandon the call)."""
    proc = subprocess.Popen([flower_bin("flwr"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if watch is not None:
                    watch()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"`flwr {args[0]}` did not answer within {timeout:.0f}s") from None
    finally:
        if proc.poll() is None:
            stop_process(proc, grace=1.0)
    if proc.returncode != 0:
        raise RuntimeError(f"flwr {' '.join(args)} failed ({proc.returncode}):\n{stdout}\n{stderr}")
    return stdout


def json_tail(text: str) -> dict:
    start = text.find("{")
    if start < 0:
        raise RuntimeError(f"no JSON in flwr output:\n{text}")
    return json.loads(text[start:])


# The last line of a Python traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): .+$", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def read_summary(run_dir: Path | None) -> dict[str, Any] | None:
    if run_dir is None:
        return None
    path = Path(run_dir) / "summary.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def failure_reason(summary: Mapping[str, Any] | None, details: str, log: str) -> str | None:
    """Why a run did not complete: the ServerApp's own ``failure-reason`` in summary.json, else Flower's
    status details, else the last exception line of the run's log."""
    if summary and summary.get("failure-reason"):
        return str(summary["failure-reason"])
    if details and details.strip():
        return details.strip()
    found = _EXCEPTION_LINE.findall(_ANSI.sub("", log))
    return found[-1].strip() if found else None


def submit_and_wait(app_dir: Path, connection: str, flwr_home: Path, *, run_config: str = "",
                    federation_config: str = "", timeout: float = DEFAULT_TIMEOUT_S, echo: bool = True,
                    out_dir: Path | None = None, watch: Callable[[], None] | None = None,
                    tree: ProcessTree | None = None, run_dir: Path | None = None,
                    on_run_id: Callable[[int], None] | None = None, verbose: bool = False,
                    run_log: RunLog | None = None) -> RunOutcome:
    """``flwr run`` + stream the log until the run ends + read its final status (and, with ``run_dir``
    or ``out_dir`` (then ``out_dir/<run-id>``), the run's summary.json and failure reason).
    ``on_run_id`` is told the Flower run id as soon as the run is submitted.

    Every streamed line goes to ``run_log`` (else to ``run.log`` in the run folder, once known); with ``echo``
    the console gets Pollen's lines and the WARNINGs and ERRORs, and every line with ``verbose``
    (:func:`~pollen.launch.console.on_console`).

    ``watch`` is called about once a second throughout (e.g. to notice a dead SuperLink); whatever it
    raises ends the wait. A run still going at ``timeout`` is stopped and :class:`TimeoutError` raised.
    """
    env = flower_env(flwr_home.resolve(), tree=tree)
    started = time.monotonic()
    deadline = started + timeout
    options = ["--run-config", run_config] if run_config else []
    if federation_config:
        options += ["--federation-config", federation_config]
    # `flwr run` packs the app into a FAB; given a copy of just the files it packs, it does not list a .venv
    with staged_app(Path(app_dir)) as packed:
        try:
            out = json_tail(flwr_call(["run", str(packed), connection, "--format", "json", *options], env,
                                      timeout=min(300.0, timeout), watch=watch))
        except TimeoutError as err:
            raise TimeoutError(f"the run was not even submitted within {min(300.0, timeout):.0f}s ({err})") from None
        except RuntimeError as err:
            if type(err) is not RuntimeError or packed == Path(app_dir):  # e.g. SuperLinkDied: as it is
                raise
            raise RuntimeError(str(err).replace(str(packed), str(app_dir))) from None  # the app, not its copy
    if not out.get("success", True) or "run-id" not in out:
        raise RuntimeError(f"flwr run did not start a run: {out}")
    run_id = int(out["run-id"])
    if on_run_id is not None:
        on_run_id(run_id)
    results_dir = Path(run_dir) if run_dir is not None else (Path(out_dir) / str(run_id) if out_dir else None)
    own_log = run_log is None and results_dir is not None
    if own_log:
        assert results_dir is not None
        run_log = RunLog(results_dir / RUN_LOG, tee=False).__enter__()  # left in the finally below
    ended = AppEnd(results_dir, run_id)
    lines: list[str] = []
    stream = subprocess.Popen([flower_bin("flwr"), "log", str(run_id), connection, "--stream"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    status, details = "unknown", ""
    # A reader thread, so a run that hangs silently (e.g. waiting for clients) still hits the deadline.
    queue: Queue[str | None] = Queue()
    reader = threading.Thread(target=_pump_lines, args=(stream, queue), daemon=True)
    reader.start()
    progress = RunProgress(live=None if echo else False,
                           stream=run_log.console if run_log is not None else None).__enter__()  # left below
    try:
        while True:
            if watch is not None:
                watch()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with contextlib.suppress(Exception):
                    flwr_call(["stop", str(run_id), connection], env, timeout=30, watch=watch)
                raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s (stopped it)")
            if ended.over():
                break
            try:
                line = queue.get(timeout=min(remaining, ended.poll_s))
            except Empty:
                continue
            if line is None:
                break
            lines.append(line)
            ended.saw(line)
            if run_log is not None:
                run_log.record(line)
            if echo and on_console(line, verbose):
                progress.line(line)
        if ended.summary is not None:  # the app's own word; Flower's wind-down is not waited for
            status = "finished:completed" if ended.summary["status"] == "completed" else "finished:failed"
        else:  # the stream can end a moment before the status is final; poll briefly
            for _ in range(60):
                if watch is not None:
                    watch()
                status, details = run_status_details(run_id, connection, env, watch=watch)
                if status.startswith("finished"):
                    break
                time.sleep(1.0)
    except (LaunchInterrupted, KeyboardInterrupt):
        if tree is not None:  # Ctrl-C: the simulation stops at once, not after the SuperLink's grace period
            tree.kill_named(ENGINE_PROCESSES)
        raise
    finally:
        progress.__exit__()
        stop_process(stream, grace=2.0)
        if own_log and run_log is not None:
            run_log.__exit__()
    log = "".join(lines)
    summary = read_summary(results_dir)
    outcome = RunOutcome(run_id, status, time.monotonic() - started, log, summary=summary, results_dir=results_dir,
                         status_from="app" if ended.summary is not None else "flower")
    if not outcome.completed:
        outcome.failure_reason = failure_reason(summary, details, log)
    return outcome


class AppEnd:
    """Whether a Pollen ServerApp has finished its run, from its run folder.

    At its end the ServerApp writes ``summary.json`` (atomic, naming the Flower run) after every model and
    checkpoint, then the optional files (the plot, a tracker's upload), then prints its closing line
    (``...; summary: <path>``). Once the summary names this run, the launcher waits for that line (for at
    most ``grace`` seconds, in case the line is lost) and stops: Flower's own wind-down (the simulation's
    Ray shutdown, the log stream's end, the final status) costs seconds and writes nothing of the run's.
    An app that writes no such summary (not Pollen's) is waited for as before.
    """

    grace = 30.0

    def __init__(self, results_dir: Path | None, run_id: int):
        self.path = None if results_dir is None else Path(results_dir) / "summary.json"
        self.run_id = run_id
        self.summary: dict[str, Any] | None = None
        self._found_at = 0.0
        self._closing_line = False
        self._seen: tuple[int, int, int] | None = None
        self.poll_s = 0.25 if self.path is not None else 1.0

    def saw(self, line: str) -> None:
        if line.startswith("[pollen] ") and line.rstrip().endswith("summary.json"):
            self._closing_line = True

    def over(self) -> bool:
        if self.path is None:
            return False
        if self.summary is None:
            try:
                stat = self.path.stat()
            except OSError:
                return False
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if seen == self._seen:
                return False
            self._seen = seen
            found = read_summary(self.path.parent)
            if not found or found.get("flower-run-id") != self.run_id or found.get("status") not in ("completed",
                                                                                                    "failed"):
                return False
            self.summary, self._found_at = found, time.monotonic()
        return self._closing_line or time.monotonic() - self._found_at > self.grace


def _pump_lines(proc: subprocess.Popen, queue: Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        queue.put(line)
    queue.put(None)


def run_status_details(run_id: int, connection: str, env: dict[str, str],
                       watch: Callable[[], None] | None = None) -> tuple[str, str]:
    """(status, status details) of a run, from ``flwr ls``."""
    out = json_tail(flwr_call(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, timeout=60,
                           watch=watch))
    runs = out.get("runs") or []
    if not runs:
        return "unknown", ""
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details") or "")


def run_status(run_id: int, connection: str, env: dict[str, str]) -> str:
    return run_status_details(run_id, connection, env)[0]

