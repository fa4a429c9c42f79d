"""Run Pollen under a SuperLink this process owns, and report whether the run really completed.

``flwr run`` exits 0 even when the ServerApp crashes, and its managed local SuperLink outlives the
command. This launcher checks the run config against the app's keys before anything starts, starts its
own ``flower-superlink`` (simulation, or deployment for ``deploy/``) with a private ``FLWR_HOME``,
submits the app with ``flwr run``, streams the run's log, reads the final status with ``flwr ls`` (and
the failure reason from the run folder's ``summary.json``) and always stops every process the launch
started, by PID: the SuperLink, ``flower-superexec``, ``flwr-simulation``/``flwr-serverapp``/
``flwr-clientapp`` and the run's private Ray instance — also when the launcher itself is killed (its
watchdog, :class:`~pollen.launch.processes.Watchdog`). From the command line a Pollen run gets a named,
locked folder (``YYYYMMDD-HHMMSS-<method>-<task>``, ``latest``; :mod:`pollen.launch.runs`), and
``summary.json`` on every exit path. Used by ``make run``, the tests and the benchmarks::

    pollen run --num-supernodes 5 --run-config "method='fedprox' num-server-rounds=3"

Exit codes: 0 only for ``finished:completed``; 1 the run failed, was stopped or its status is unknown;
2 bad options or run config, an out-dir that cannot be written, a run folder another launcher holds or
a resume that does not match its folder (nothing was started); 3 the SuperLink died; 124 timeout;
128 + signal when interrupted (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from pollen.app.results import write_stopped_summary
from pollen.launch.fab import staged_app
from pollen.launch.processes import ProcessTree, Watchdog, signals_held
from pollen.launch.progress import RunProgress
from pollen.launch.runs import (
    RunFolderError,
    RunLock,
    check_free_space,
    create_run_dir,
    link_latest,
    read_launch_info,
    recorded_supernodes,
    run_name,
    space_needed,
    write_launch_info,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

EXIT_COMPLETED = 0
EXIT_NOT_COMPLETED = 1
EXIT_USAGE = 2
EXIT_SUPERLINK_DIED = 3
EXIT_TIMEOUT = 124



class LaunchError(RuntimeError):
    """The launch cannot go on (no app, a process failed to start); the message says why."""


class LaunchConfigError(LaunchError, ValueError):
    """Bad options or run config, found before anything was started."""


class SuperLinkDied(LaunchError):
    """The SuperLink process exited while the launch still needed it."""

    def __init__(self, proc: subprocess.Popen, log_path: Path | None = None):
        code = proc.returncode
        how = f"code {code}" if code is None or code >= 0 else f"code {code} ({_signal_name(-code)})"
        text = f"SuperLink (pid {proc.pid}) died with {how}"
        if log_path is not None:
            text += f"; its log: {log_path}"
        super().__init__(text)
        self.pid, self.returncode = proc.pid, code


# How long a run may take before the launcher stops it: a guard against a hung run, not a budget. The
# README's FCCL command ran past one hour on a shared 2-core machine (its last round stopped by the old
# 3600 s default), so the default leaves room for the paper-sized commands.
DEFAULT_TIMEOUT_S = 6 * 3600.0

# The processes that run the rounds (the simulation engine: ServerApp and Ray driver); an interrupt stops
# them first.
ENGINE_PROCESSES = ("flwr-simulation",)


class LaunchInterrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP arrived: unwind so every process gets stopped, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {_signal_name(signum)}")
        self.signum = signum


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- the app: where it is, which run keys it declares ------------------------------------------------

def _load_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as Flower flattens them: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def is_flower_app(path: Path) -> bool:
    """Whether ``path`` holds a ``pyproject.toml`` with a ``[tool.flwr.app]`` table."""
    try:
        data = _load_toml(Path(path) / "pyproject.toml")
    except (OSError, ValueError):
        return False
    return isinstance(data.get("tool", {}).get("flwr", {}).get("app"), Mapping)


def package_checkout(module_file: str | Path = __file__) -> Path | None:
    """The source checkout that holds this package (``<root>/pollen/launch/launcher.py``), if it is a Flower app.

    ``None`` for an installed package: ``site-packages`` is not an app.
    """
    root = Path(module_file).resolve().parents[2]
    return root if is_flower_app(root) else None


# The checkout this module was imported from, or None when Pollen is installed (not a checkout).
PROJECT_ROOT: Path | None = package_checkout()


def default_app_dir(cwd: str | Path | None = None, module_file: str | Path = __file__) -> Path:
    """The app to run when ``--app`` is not given: the current directory if it is a Flower app, else
    the checkout containing the ``pollen`` package, else a :class:`LaunchConfigError` saying what to do."""
    here = Path(cwd if cwd is not None else os.getcwd()).resolve()
    if is_flower_app(here):
        return here
    checkout = package_checkout(module_file)
    if checkout is not None:
        return checkout
    raise LaunchConfigError(
        f"no Flower app to run: {here} has no pyproject.toml with a [tool.flwr.app] table, and the pollen "
        f"package ({Path(module_file).resolve().parents[1]}) is installed, not inside a checkout; "
        "run from the app directory or pass --app DIR")


def app_run_config(app_dir: Path) -> dict[str, Any]:
    """The app's run keys with their defaults (``[tool.flwr.app.config]``, flattened as Flower does)."""
    path = Path(app_dir) / "pyproject.toml"
    try:
        data = _load_toml(path)
    except OSError as err:
        raise LaunchConfigError(f"--app {app_dir}: cannot read {path}: {err}") from err
    except ValueError as err:
        raise LaunchConfigError(f"--app {app_dir}: {path} is not valid TOML: {err}") from err
    app = data.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, Mapping):
        raise LaunchConfigError(f"--app {app_dir}: {path} has no [tool.flwr.app] table; not a Flower app")
    return _flatten(app.get("config") or {})


# --- run config: parse like Flower, check keys, write back --------------------------------------------

# Flower's own pattern (flwr.common.config.parse_config_args): key=(quoted string | non-space run).
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_run_config(text: str) -> dict[str, Any]:
    """``--run-config`` as ``flwr run`` reads it: ``k=v`` pairs (values TOML) or one ``.toml`` file.

    Unlike Flower, text that is not a ``k=v`` pair is an error instead of being dropped silently.
    """
    text = (text or "").strip()
    if not text:
        return {}
    if text.endswith(".toml") and "=" not in text:
        path = Path(text).expanduser()
        try:
            return _flatten(_load_toml(path))
        except OSError as err:
            raise LaunchConfigError(f"--run-config file {path}: {err}") from err
        except ValueError as err:
            raise LaunchConfigError(f"--run-config file {path} is not valid TOML: {err}") from err
    leftover = _PAIR.sub(" ", text).split()
    if leftover:
        raise LaunchConfigError(
            f"--run-config {text!r}: cannot read {' '.join(leftover)!r}: expected space-separated key=value "
            "pairs with quoted strings, e.g. \"method='fedprox' lr=0.1\"")
    pairs = _PAIR.findall(text)
    try:
        return _flatten(tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs)))
    except ValueError as err:
        raise LaunchConfigError(
            f"--run-config {text!r} could not be parsed ({err}): values must be TOML (numbers, true/false, "
            "quoted strings), e.g. \"method='fedprox' lr=0.1\"") from err


def check_run_config_keys(values: Mapping[str, Any], known: Mapping[str, Any], app_dir: Path) -> None:
    """Refuse keys the app does not declare, naming each and suggesting close matches.

    Flower refuses them too, but only after the SuperLink started, as "[code: 15] Invalid run
    configuration" without the key.
    """
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    names = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
        names.append(f"'{key}'" + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""))
    plural = "s" if len(unknown) > 1 else ""
    raise LaunchConfigError(
        f"unknown run config key{plural} {', '.join(names)}: the app at {app_dir} declares "
        f"{len(known)} keys in [tool.flwr.app.config] of its pyproject.toml")


def format_run_config(values: Mapping[str, Any]) -> str:
    """``k=v`` pairs that :func:`parse_run_config` (and ``flwr run --run-config``, ``flower-supernode
    --node-config``) read back unchanged. Flower reads each value as TOML: strings are quoted and may not
    hold both quote kinds; numbers and booleans are TOML literals; NaN and infinities are refused."""
    parts = []
    for key, value in values.items():
        if not key or any(c.isspace() or c == "=" for c in key):
            raise LaunchConfigError(f"config key {key!r} is invalid: expected a non-empty key without spaces or '='")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise LaunchConfigError(f"config key '{key}' = {value!r} is invalid: expected a finite number")
            text = repr(value)
        elif isinstance(value, str):
            if any(c in value for c in "\n\r"):
                raise LaunchConfigError(f"config key '{key}' = {value!r} is invalid: expected a single-line string")
            if "'" not in value:
                text = f"'{value}'"  # TOML literal string: no escapes, so paths with backslashes survive
            elif '"' not in value and "\\" not in value:
                text = f'"{value}"'
            else:
                raise LaunchConfigError(f"config key '{key}' = {value!r} is invalid: it holds a single quote and "
                                        "a double quote or backslash, which Flower's parser cannot carry")
        else:
            raise LaunchConfigError(f"config key '{key}' = {value!r} is invalid: expected a bool, int, float or "
                                    "string")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def default_out_dir() -> Path:
    """Results root when neither ``--out-dir`` nor the run config's ``out-dir`` names one."""
    return Path(os.environ.get("POLLEN_OUT_DIR") or "pollen-runs").expanduser().resolve()


DEFAULT_SUPERNODES = 5


def fitting_node_count(app_dir: Path, values: Mapping[str, Any], asked: int | None) -> int:
    """The SuperNodes to start: what Pollen's method/task needs, refused early when ``asked`` differs.

    Other apps (and Pollen configs without a requirement) get ``asked`` or the default. A config Pollen
    refuses is reported here, naming the key, before anything starts.
    """
    if not (app_dir / "pollen" / "app" / "registry.py").is_file():
        return asked or DEFAULT_SUPERNODES
    from pollen.app.config import ConfigError
    from pollen.app.config import parse_run_config as parse_pollen_config
    from pollen.app.registry import METHODS

    merged = {**app_run_config(app_dir), **values}
    try:
        cfg = parse_pollen_config(merged)
    except ConfigError as err:
        raise LaunchConfigError(str(err)) from err
    needed = METHODS[cfg.method].required_nodes(cfg)
    if needed is None:
        return asked or DEFAULT_SUPERNODES
    if asked is not None and asked != needed:
        raise LaunchConfigError(f"method '{cfg.method}' on task '{cfg.task}' needs exactly {needed} SuperNodes, "
                                f"got --num-supernodes {asked}; drop the option to use {needed}")
    return needed


def resume_config(app_dir: Path, run_dir: Path, overrides: str) -> dict[str, Any]:
    """The saved ``config.json`` of ``run_dir`` (keys the app knows), ``overrides`` on top, and
    ``resume-from``; the ServerApp refuses a resumption whose config changed in any other key."""
    config = Path(run_dir).expanduser().resolve() / "config.json"
    if not config.is_file():
        raise LaunchConfigError(f"--resume {run_dir}: no config.json there; is it a Pollen run folder?")
    try:
        saved = json.loads(config.read_text())
    except ValueError as err:
        raise LaunchConfigError(f"--resume {run_dir}: {config} is not valid JSON ({err})") from err
    from pollen.settings import RESUMABLE_CHANGES

    known = app_run_config(app_dir)
    values = {k: v for k, v in saved.items() if k in known}
    changes = parse_run_config(overrides)
    changed = sorted(k for k, v in changes.items() if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v)
    if changed:
        detail = ", ".join(f"'{k}' = {changes[k]!r} (the run has {saved[k]!r})" for k in changed)
        raise LaunchConfigError(f"--resume {run_dir}: a resumed run keeps its run config; --run-config changes "
                                f"{detail}; only {', '.join(sorted(RESUMABLE_CHANGES - {'resume-from'}))} may "
                                "change (start a new run to change the rest)")
    values.update(changes)
    values["resume-from"] = str(config.parent)
    return values


PRESET_NODES = re.compile(r"^# pollen: num-supernodes = (\d+)\s*$", re.M)


def preset_node_count(run_config: str) -> int | None:
    """The SuperNodes a preset file (``conf/*.toml`` given as ``--run-config``) asks for in its
    ``# pollen: num-supernodes = N`` line; ``None`` for ``k=v`` pairs or a file without the line."""
    text = (run_config or "").strip()
    if not text.endswith(".toml") or "=" in text:
        return None
    try:
        found = PRESET_NODES.findall(Path(text).expanduser().read_text())
    except OSError:
        return None  # parse_run_config reports the unreadable file
    return int(found[0]) if found else None


def compose_run_config(app_dir: Path, run_config: str | Mapping[str, Any] = "", *,
                       out_dir: str | Path | None = None, data_root: str | Path | None = None
                       ) -> tuple[dict[str, Any], Path | None]:
    """The run config to submit, checked against the app's keys before anything starts.

    ``out_dir``/``data_root`` become the ``out-dir``/``data-root`` run keys (absolute paths); giving a key
    both ways with different values is an error. When the app has an ``out-dir`` key that ends up empty,
    it is set to :func:`default_out_dir`: the ServerApp runs in the SuperLink's working directory (the
    private FLWR_HOME, removed after the run), so a relative default would lose the results.
    Returns the values and the results root (``None`` when the app has no ``out-dir`` key).
    """
    known = app_run_config(app_dir)
    values = dict(run_config) if isinstance(run_config, Mapping) else parse_run_config(run_config)
    check_run_config_keys(values, known, app_dir)
    for key, option, given in (("out-dir", "--out-dir", out_dir), ("data-root", "--data-root", data_root)):
        if given is None or given == "":
            continue
        if key not in known:
            raise LaunchConfigError(f"{option}: the app at {app_dir} has no '{key}' run key")
        path = str(Path(given).expanduser().resolve())
        if key in values and str(values[key]) != path and str(values[key]) != str(given):
            raise LaunchConfigError(f"run config key '{key}' given twice: {values[key]!r} in --run-config and "
                                    f"{str(given)!r} as {option}")
        values[key] = path
    results = None
    if "out-dir" in known:
        current = str(values.get("out-dir", known["out-dir"]) or "").strip()
        if not current:
            values["out-dir"] = current = str(default_out_dir())
        elif not Path(current).expanduser().is_absolute():
            values["out-dir"] = current = str(Path(current).expanduser().resolve())
        results = Path(current).expanduser()
    return values, results


# --- processes: environment, the launch's process tree, stopping everything --------------------------

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


def flower_env(flwr_home: Path, *, tree: ProcessTree | None = None, ray_address: str = "local") -> dict[str, str]:
    """Environment for every Flower process: isolated home, offline, no per-run ``uv sync``, and Ray told
    where to go (``local``: start a private instance, never attach to a cluster recorded on the machine)."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "RAY_ADDRESS": ray_address or "local",
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
    })
    if tree is not None:
        tree.mark(env)
    return env


def free_port() -> int:
    """A port free right now (the OS picks it). Another process may take it before it is used: callers
    that start a server on it retry with a fresh one when the server cannot bind (see :func:`superlink`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def write_connection(flwr_home: Path, name: str, address: str, *, root_certificates: str | None = None,
                     make_default: bool = True) -> None:
    """Add (or replace) one SuperLink connection in ``$FLWR_HOME/config.toml``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    sections: dict[str, list[str]] = {}
    current = None
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("["):
                current = line.strip()
                sections[current] = []
            elif current is not None and line.strip():
                sections[current].append(line)
    body = [f'address = "{address}"']
    body.append(f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true")
    sections[f"[superlink.{name}]"] = body
    default = sections.get("[superlink]", [])
    if make_default or not default:
        default = [f'default = "{name}"']
    sections["[superlink]"] = default
    ordered = ["[superlink]"] + sorted(k for k in sections if k != "[superlink]")
    path.write_text("\n".join(f"{key}\n" + "\n".join(sections[key]) + "\n" for key in ordered))


def _listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening TCP socket on ``port`` (None: cannot tell, not Linux).

    A /health answer alone is not proof: after losing the race for a free port, the answer may come from
    another SuperLink (another launch) that owns it.
    """
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


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0, log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SuperLinkDied(proc, log_path)
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200 and _listens_on(proc.pid, port) is not False:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink on port {port} not healthy after {timeout:.0f}s")


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group (the process and what it spawned), then SIGKILL stragglers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _port_taken(log_path: Path) -> bool:
    with contextlib.suppress(OSError):
        text = log_path.read_text(errors="replace").lower()
        return "address already in use" in text or "errno 98" in text or "port is already" in text
    return False


@contextlib.contextmanager
def superlink(flwr_home: Path, *, simulation: bool, port: int | None = None,
              extra_args: Sequence[str] = (), connection: str = "pollen",
              root_certificates: str | None = None, tree: ProcessTree | None = None,
              ray_address: str = "local") -> Iterator[tuple[str, int, subprocess.Popen]]:
    """A SuperLink owned by the caller; yields (connection name, port, process) and stops it after.

    Started in its own process group from a neutral working directory (``flwr_home``). With ``tree``
    the caller stops the whole tree (:meth:`ProcessTree.terminate`); without, this does it on exit.
    A free port taken by someone else between choosing and binding is retried with another.
    """
    flwr_home = flwr_home.resolve()
    own_tree = tree is None
    tree = tree or ProcessTree()
    env = flower_env(flwr_home, tree=tree, ray_address=ray_address)
    proc = None
    chosen = port
    try:
        for attempt in range(5):
            chosen = port or free_port()
            write_connection(flwr_home, connection, f"127.0.0.1:{chosen}", root_certificates=root_certificates)
            args = [flower_bin("flower-superlink"), "--port", str(chosen), "--disable-runtime-dependency-installation"]
            if root_certificates is None and "--ssl-certfile" not in extra_args:
                args.append("--insecure")
            if simulation:
                args.append("--simulation")
            args.extend(extra_args)
            log_path = flwr_home / f"superlink-{chosen}.log"
            with log_path.open("w") as log:
                # A neutral cwd: Ray workers get the SuperLink's cwd on sys.path (FLOWER.md, traps).
                proc = subprocess.Popen(args, cwd=flwr_home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            tree.add_root(proc.pid)
            try:
                if root_certificates is None:
                    wait_healthy(chosen, proc, log_path=log_path)
                else:
                    wait_healthy_tls(chosen, root_certificates, proc, log_path=log_path)
                break
            except SuperLinkDied:
                if port is None and attempt < 4 and _port_taken(log_path):
                    continue  # lost the race for the free port: try another one
                raise
        assert proc is not None and chosen is not None
        yield connection, chosen, proc
    finally:
        with signals_held():
            if proc is not None and own_tree:  # else the caller's ProcessTree.terminate stops it with the rest
                stop_process(proc)
            if own_tree:
                left = tree.terminate()
                if left:
                    print(f"[pollen] warning: still running after teardown: {tree.describe(left)}",
                          file=sys.stderr, flush=True)
            if chosen is not None:
                stop_orphaned_apps(chosen)


def stop_orphaned_apps(port: int) -> list[int]:
    """Kill ServerApp/ClientApp processes still attached to the SuperLink that served ``port``.

    ``flwr-serverapp`` runs in its own session, so stopping the SuperLink's process group misses it;
    a run interrupted mid-flight (timeout, Ctrl-C) otherwise leaves it waiting forever. Linux only
    (reads /proc); elsewhere nothing is done. (:class:`ProcessTree` finds these too, by their mark.)
    """
    needle = f"127.0.0.1:{port}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith((b"flwr-serverapp", b"flwr-clientapp")) for a in argv[:2]) and needle in argv:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


# --- one run: submit, stream, status, reason -----------------------------------------------------------

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
                    on_run_id: Callable[[int], None] | None = None) -> RunOutcome:
    """``flwr run`` + stream the log until the run ends + read its final status (and, with ``run_dir``
    or ``out_dir`` (then ``out_dir/<run-id>``), the run's summary.json and failure reason).
    ``on_run_id`` is told the Flower run id as soon as the run is submitted.

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
    ended = AppEnd(results_dir, run_id)
    lines: list[str] = []
    stream = subprocess.Popen([flower_bin("flwr"), "log", str(run_id), connection, "--stream"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    status, details = "unknown", ""
    # A reader thread, so a run that hangs silently (e.g. waiting for clients) still hits the deadline.
    queue: Queue[str | None] = Queue()
    reader = threading.Thread(target=_pump_lines, args=(stream, queue), daemon=True)
    reader.start()
    progress = RunProgress(live=None if echo else False).__enter__()  # left in the finally below
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
            if echo:
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
    log = "".join(lines)
    summary = read_summary(results_dir)
    outcome = RunOutcome(run_id, status, time.monotonic() - started, log, summary=summary, results_dir=results_dir,
                         status_from="app" if ended.summary is not None else "flower")
    if not outcome.completed:
        outcome.failure_reason = failure_reason(summary, details, log)
    return outcome


class AppEnd:
    """Whether a Pollen ServerApp has finished its run, from its run folder.

    Its last act is an atomic ``summary.json`` naming the Flower run, after every model, checkpoint and
    plot, so once that file names this run the launcher stops waiting: Flower's own wind-down (the
    simulation's Ray shutdown, the log stream's end, the final status) costs seconds and writes nothing of
    the run's. The app's closing line (``...; summary: <path>``) is still read from the stream, for at most
    ``grace`` seconds. An app that writes no such summary (not Pollen's) is waited for as before.
    """

    grace = 2.0

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


def superlink_watch(proc: subprocess.Popen, log_path: Path | None = None) -> Callable[[], None]:
    """A ``watch`` for :func:`submit_and_wait`: raises :class:`SuperLinkDied` once ``proc`` has exited."""
    def check() -> None:
        if proc.poll() is not None:
            raise SuperLinkDied(proc, log_path)
    return check


def _tree_watch(tree: ProcessTree, proc: subprocess.Popen, log_path: Path | None,
                every: float = 5.0) -> Callable[[], None]:
    """:func:`superlink_watch` that also records the tree's members every ``every`` seconds (for the
    report of what was stopped; the teardown finds every member again by itself)."""
    check = superlink_watch(proc, log_path)
    last = [0.0]

    def watch() -> None:
        check()
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            tree.members()
    return watch


def check_ray_cpus(ray_cpus: int, cpus_per_client: int, ray_address: str | None) -> None:
    """``--ray-cpus`` sizes a private Ray instance: at least one ClientApp must fit, and a cluster is
    not resized by a run that attaches to it."""
    if ray_address not in (None, "local"):
        raise LaunchConfigError(f"--ray-cpus {ray_cpus} with --ray-address {ray_address}: a cluster's CPUs are "
                                "set where its nodes start (ray start --num-cpus); leave --ray-cpus out")
    if ray_cpus < cpus_per_client:
        raise LaunchConfigError(f"--ray-cpus {ray_cpus}: expected at least --cpus-per-client ({cpus_per_client}), "
                                "or no ClientApp could run")


def ray_line(ray_address: str | None) -> str:
    if ray_address and ray_address != "local":
        return f"[pollen] Ray: attaching to the cluster at {ray_address} (--ray-address)"
    inherited = os.environ.get("RAY_ADDRESS", "")
    note = f"; RAY_ADDRESS={inherited} from the environment ignored" if inherited and inherited != "local" else ""
    return ("[pollen] Ray: a private local instance for this run (RAY_ADDRESS=local, never a cluster recorded "
            f"on this machine); pass --ray-address ADDR to attach to a cluster{note}")


def simulate(*, app_dir: Path | None = None, flwr_home: Path | None = None, num_supernodes: int = 5,
             cpus_per_client: int = 1, gpus_per_client: float = 0.0,
             run_config: str | Mapping[str, Any] = "", timeout: float = DEFAULT_TIMEOUT_S, echo: bool = True,
             out_dir: str | Path | None = None, data_root: str | Path | None = None,
             ray_address: str | None = None, ray_cpus: int | None = None, run_dir: Path | None = None,
             lock_fd: int | None = None) -> RunOutcome:
    """One simulation run on a fresh, owned SuperLink, its whole process tree stopped afterwards.

    The run config is checked against the app's keys first (:class:`LaunchConfigError`, nothing
    started). ``flwr_home`` defaults to a private temporary folder, removed at the end; a given one is
    kept. ``ray_address`` ``None``/``"local"`` starts a private Ray instance, anything else attaches to
    that cluster. ``ray_cpus`` caps the private instance's CPUs (Flower's ``init-args-num-cpus``): one
    ClientApp actor per ``cpus_per_client`` of them. Raises :class:`TimeoutError`, :class:`SuperLinkDied`
    or :class:`LaunchInterrupted` (under :func:`signals_raise`) after stopping everything.

    ``run_dir`` is the run's folder when the caller chose it (the CLI: a named run, or ``--resume``),
    else ``out-dir/<run-id>``. A :class:`~pollen.launch.processes.Watchdog` (holding ``lock_fd``, the run
    folder's lock, when given) stops the tree if this process dies; on every path where the ServerApp
    wrote no ``summary.json`` for this launch, one is written here (``interrupted`` or ``failed``).
    """
    app_dir = (Path(app_dir) if app_dir is not None else default_app_dir()).resolve()
    values, results_root = compose_run_config(app_dir, run_config, out_dir=out_dir, data_root=data_root)
    ray_address = ray_address or "local"
    fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
           f"client-resources-num-gpus={gpus_per_client}")
    if ray_cpus is not None:
        check_ray_cpus(ray_cpus, cpus_per_client, ray_address)
        fed += f" init-args-num-cpus={ray_cpus}"
    private_home = flwr_home is None
    home = (Path(tempfile.mkdtemp(prefix="pollen-flwr-")) if flwr_home is None else Path(flwr_home)).resolve()
    tree = ProcessTree()
    outcome: RunOutcome | None = None
    cluster_info = None
    if echo:
        print(ray_line(ray_address), flush=True)
        print(f"[pollen] FLWR_HOME {home}" + (" (private, removed at the end)" if private_home else ""), flush=True)
    teardown_from: float | None = None
    started_at = time.time()
    where: dict[str, Any] = {"run_dir": Path(run_dir) if run_dir is not None else None, "run_id": None}
    watchdog = Watchdog(tree, home=home if private_home else None, run_dir=run_dir, lock_fd=lock_fd,
                        started=started_at)

    def submitted(run_id: int) -> None:
        where["run_id"] = run_id
        watchdog.run_id(run_id)
        if where["run_dir"] is None and results_root is not None:
            found = results_root / str(run_id)
            where["run_dir"] = found
            watchdog.run_dir(found)
        if echo:
            print(f"[pollen] run {run_id} submitted; waiting for round 1 (the simulation starts Ray with "
                  f"{num_supernodes} ClientApp actor(s) first)", flush=True)

    try:
        try:
            try:
                if ray_address != "local":  # look before attaching: unreachable or too small is exit 2
                    from pollen.launch import cluster
                    try:
                        cluster_info = cluster.attach(ray_address, source="--ray-address", echo=echo,
                                                      cpus_per_client=cpus_per_client, gpus_per_client=gpus_per_client)
                    except cluster.ClusterUnfit as err:  # not this module's class when launch runs as __main__
                        raise LaunchConfigError(str(err)) from None
                phase = time.monotonic()
                with superlink(home, simulation=True, tree=tree, ray_address=ray_address) as (conn, port, proc):
                    if echo:
                        print(f"[pollen] SuperLink up on port {port} ({time.monotonic() - phase:.1f}s); submitting "
                              f"the app for {num_supernodes} SuperNode(s)", flush=True)
                    log_path = home / f"superlink-{port}.log"
                    kept_log = None if private_home else log_path  # a private home is removed: no pointer to it
                    outcome = submit_and_wait(app_dir, conn, home, run_config=format_run_config(values),
                                              federation_config=fed, timeout=timeout, echo=echo,
                                              out_dir=results_root, watch=_tree_watch(tree, proc, kept_log), tree=tree,
                                              run_dir=run_dir, on_run_id=submitted)
                    if not outcome.completed and outcome.failure_reason is None:
                        outcome.failure_reason = failure_reason(None, "", log_path.read_text(errors="replace"))
                    teardown_from = time.monotonic()
            except SuperLinkDied:
                if private_home:  # its log goes with the private home: show its end now
                    for log_file in home.glob("superlink-*.log"):
                        tail = log_file.read_text(errors="replace").splitlines()[-15:]
                        print("[pollen] last lines of the SuperLink's log:\n" + "\n".join(tail), file=sys.stderr,
                              flush=True)
                raise
            finally:
                # A run whose ServerApp wrote its summary has everything on disk: nothing to stop gracefully.
                left = tree.kill() if outcome is not None and outcome.status_from == "app" else tree.terminate()
                if outcome is not None:
                    outcome.teardown_s = round(time.monotonic() - teardown_from, 2) if teardown_from else None
                    outcome.processes = [f"{name or '?'}({pid})" for pid, (_s, name) in sorted(tree.seen.items())]
                    outcome.leftover = left
                if left:
                    print(f"[pollen] warning: still running after teardown: {tree.describe(left)}",
                          file=sys.stderr, flush=True)
        finally:
            if private_home:
                shutil.rmtree(home, ignore_errors=True)
    except BaseException as err:
        if where["run_dir"] is not None:
            stopped = isinstance(err, (LaunchInterrupted, TimeoutError, KeyboardInterrupt))
            status = "interrupted" if stopped else "failed"
            reason = str(err) if not isinstance(err, TimeoutError) else f"timeout: {err}"
            write_stopped_summary(where["run_dir"], status, reason or type(err).__name__, where["run_id"],
                                  since=started_at)
        raise
    finally:
        watchdog.done()
    if not outcome.completed and outcome.results_dir is not None and outcome.results_dir.is_dir():
        write_stopped_summary(outcome.results_dir, "failed", outcome.failure_reason or outcome.status,
                              outcome.run_id, since=started_at)
    if cluster_info is not None:  # where the ClientApps ran, from Ray's records of this run's job
        cluster.placement(cluster_info, list(tree.seen), echo=echo, run_dir=outcome.results_dir)
    return outcome


# --- command line --------------------------------------------------------------------------------------

class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown for every option that has one (``None``/``False`` defaults are described in words)."""

    def _get_help_string(self, action):
        if action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


def _catalog() -> str:
    """Registered methods (by family) and tasks, and the main run keys' defaults, for ``--help``; never
    fails (it imports the whole registry, so only for help)."""
    lines = []
    try:
        from pollen.app.registry import METHODS

        families: dict[str, list[str]] = {}
        kinds: dict[str, tuple[str, ...]] = {}
        for spec in METHODS.values():
            families.setdefault(spec.family, []).append(spec.name)
            kinds[spec.family] = spec.task_kinds
        lines.append("methods: (run key 'method', by family, with the kinds of task they run on; README.md has "
                     "the papers)")
        lines += [f"  {family:<11} {', '.join(names)}  [{' / '.join(kinds[family])} tasks]"
                  for family, names in families.items()]
    except Exception as err:  # noqa: BLE001 - help must print whatever is broken
        lines.append(f"methods: (not listed: {type(err).__name__}: {err})")
    try:
        from pollen.datasets.tasks import TASK_KINDS, TASKS

        lines.append("tasks: (run key 'task', by kind)")
        width = max(len(name) for name in TASKS)
        for kind, (name, meaning) in TASK_KINDS.items():
            lines.append(f" {kind}: {name} ({meaning})")
            for name, task in TASKS.items():
                if task.kind == kind:
                    text = " ".join(str(getattr(task, "description", "")).split())
                    lines.append(f"  {name:<{width}}  {text}")
    except Exception as err:  # noqa: BLE001
        lines.append(f"tasks: (not listed: {type(err).__name__}: {err})")
    try:
        from pollen.app.config import DEFAULTS

        main = ("method", "task", "num-server-rounds", "seed", "local-epochs", "batch-size", "lr", "device",
                "max-train-samples", "data-root", "out-dir")
        pairs = format_run_config({k: DEFAULTS[k] for k in main if k in DEFAULTS})
        lines.append("run keys (defaults of the most used; every key with its range: docs/usage.md):")
        lines.append("  " + pairs)
    except Exception as err:  # noqa: BLE001
        lines.append(f"run keys: (not listed: {type(err).__name__}: {err})")
    return "\n".join(lines)


def build_parser(catalog: bool = False) -> argparse.ArgumentParser:
    epilog = ("exit codes: 0 finished:completed; 1 run failed/stopped/unknown; 2 bad options or run config, "
              "out-dir not writable, run folder held by another launcher, resume not matching its folder "
              "(nothing started); 3 SuperLink died; 124 timeout; 130/143 interrupted (Ctrl-C/SIGTERM)")
    if catalog:
        epilog = _catalog() + "\n\n" + epilog
    parser = argparse.ArgumentParser(prog="pollen run", description=__doc__.split("\n\n")[0],
                                     epilog=epilog, formatter_class=_HelpFormatter)
    parser.add_argument("--app", type=Path, default=None,
                        help="Flower app directory (default: the current directory if its pyproject.toml has "
                             "[tool.flwr.app], else the checkout holding the pollen package)")
    parser.add_argument("--flwr-home", type=Path, default=None,
                        help="FLWR_HOME to use and keep (default: a private temporary folder, removed at the end)")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help="simulated SuperNodes (clients); default: what the task or method needs "
                             "(FCCL's domain tasks: one per domain; GLFC: its final population), else 5")
    parser.add_argument("--cpus-per-client", type=int, default=None,
                        help="CPUs Ray reserves per ClientApp (default 1; on --resume, the run's)")
    parser.add_argument("--gpus-per-client", type=float, default=None,
                        help="GPU fraction per ClientApp, e.g. 0.25 packs 4 clients on one GPU (default 0; on "
                             "--resume, the run's)")
    parser.add_argument("--run-config", default="",
                        help="run keys of [tool.flwr.app.config], e.g. \"method='fedprox' num-server-rounds=3\" "
                             "(or one .toml file); unknown keys are refused before anything starts")
    parser.add_argument("--out-dir", default=None,
                        help="results root, the 'out-dir' run key; results land in "
                             "OUT_DIR/YYYYMMDD-HHMMSS-<method>-<task>/, OUT_DIR/latest points at the newest (default: "
                             "the run config's out-dir, else $POLLEN_OUT_DIR, else ./pollen-runs)")
    parser.add_argument("--data-root", default=None,
                        help="dataset root, the 'data-root' run key (default: the run config's, else "
                             "$POLLEN_DATA_ROOT as the app reads it)")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="CPUs the private Ray instance may use (default: all it finds); at most "
                             "RAY_CPUS / cpus-per-client ClientApps run at once, each in an actor of its own "
                             "that imports torch once. Not with --ray-address: a cluster has its own")
    parser.add_argument("--ray-address", default=None,
                        help="attach the simulation to this Ray cluster (default: start a private local Ray, "
                             "RAY_ADDRESS=local, ignoring any cluster recorded on this machine)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (e.g. OUT_DIR/latest) from its last valid checkpoint, "
                             "with its config.json and SuperNodes (--run-config may change only num-server-rounds, "
                             "paths, device, torch-threads; no --out-dir: it stays in RUN_DIR)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before the run is stopped (exit 124; it can be resumed)")
    parser.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    args = build_parser(catalog=wants_help).parse_args(argv)
    lock: RunLock | None = None
    try:
        if args.num_supernodes is not None and args.num_supernodes < 1:
            raise LaunchConfigError(f"--num-supernodes {args.num_supernodes}: expected at least 1")
        if args.cpus_per_client is not None and args.cpus_per_client < 1:
            raise LaunchConfigError(f"--cpus-per-client {args.cpus_per_client}: expected at least 1")
        if args.ray_cpus is not None:
            check_ray_cpus(args.ray_cpus, args.cpus_per_client or 1, args.ray_address)
        if args.gpus_per_client is not None and not 0.0 <= args.gpus_per_client:
            raise LaunchConfigError(f"--gpus-per-client {args.gpus_per_client}: expected >= 0")
        if not args.timeout > 0:
            raise LaunchConfigError(f"--timeout {args.timeout}: expected seconds > 0")
        app_dir = args.app.resolve() if args.app is not None else default_app_dir()
        if not is_flower_app(app_dir):
            raise LaunchConfigError(f"--app {args.app}: {app_dir} has no pyproject.toml with [tool.flwr.app]")
        run_dir: Path | None = None
        if args.resume:
            run_dir, run_config, lock = check_resume(app_dir, args)
        else:
            run_config = args.run_config
            if args.num_supernodes is None:  # a preset file names the nodes it needs
                args.num_supernodes = preset_node_count(args.run_config)
        values, results_root = compose_run_config(app_dir, run_config, out_dir=args.out_dir, data_root=args.data_root)
        args.num_supernodes = fitting_node_count(app_dir, values, args.num_supernodes)
        args.cpus_per_client = 1 if args.cpus_per_client is None else args.cpus_per_client
        args.gpus_per_client = 0.0 if args.gpus_per_client is None else args.gpus_per_client
        if results_root is not None and "run-name" in app_run_config(app_dir):  # a Pollen app: named, locked
            run_dir, lock = prepare_run_dir(app_dir, values, results_root, run_dir, args, lock)
    except (LaunchConfigError, RunFolderError) as err:
        if lock is not None:
            lock.release()
        print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        return _launch(args, app_dir, values, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()


def check_resume(app_dir: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any], RunLock]:
    """Everything ``--resume`` needs, checked before anything starts: the folder, locked for this launcher
    first (another launcher writing it is refused at once, and nothing is read while it writes), its config
    (changed keys refused by name), its federation (SuperNodes and resources from ``launch.json``, a
    different ``--num-supernodes`` refused), every hashed file intact and a valid checkpoint."""
    run_dir = Path(args.resume).expanduser().resolve()
    if args.out_dir is not None:
        raise LaunchConfigError(f"--out-dir {args.out_dir} with --resume {args.resume}: a resumed run continues in its "
                                f"own folder {run_dir}; drop --out-dir (copy the folder to resume it elsewhere)")
    if not run_dir.is_dir():
        raise LaunchConfigError(f"--resume {args.resume}: no such folder")
    lock = RunLock(run_dir).acquire(argv=sys.argv[1:])
    try:
        run_config = _resume_checks(app_dir, args, run_dir)
    except BaseException:
        lock.release()
        raise
    return run_dir, run_config, lock


def _resume_checks(app_dir: Path, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from pollen.app.checkpoints import CheckpointError, latest_checkpoint, verify_files

    run_config = resume_config(app_dir, run_dir, args.run_config)
    info = read_launch_info(run_dir)
    recorded = recorded_supernodes(run_dir)
    if recorded is not None and args.num_supernodes not in (None, recorded):
        raise LaunchConfigError(f"--num-supernodes {args.num_supernodes} with --resume {args.resume}: the run ran on "
                                f"{recorded} SuperNodes (its data was split {recorded} ways); drop the option")
    args.num_supernodes = args.num_supernodes or recorded
    for option, key in (("cpus_per_client", "cpus-per-client"), ("gpus_per_client", "gpus-per-client")):
        saved = info.get(key)
        given = getattr(args, option)
        if saved is not None and given is not None and given != saved:
            print(f"[pollen] note: --{key} {given} (the run had {saved}): resources change speed, not results",
                  flush=True)
        if given is None and saved is not None:
            setattr(args, option, saved)
    problems = verify_files(run_dir)
    if problems:
        raise LaunchConfigError(f"--resume {args.resume}: refusing files that changed since they were written: "
                                + "; ".join(problems))
    try:
        latest_checkpoint(run_dir)
    except CheckpointError as err:
        raise LaunchConfigError(f"--resume {args.resume}: {err}") from err
    return run_config


def prepare_run_dir(app_dir: Path, values: dict[str, Any], results_root: Path, run_dir: Path | None,
                    args: argparse.Namespace, lock: RunLock | None = None) -> tuple[Path, RunLock]:
    """A new run's folder ``YYYYMMDD-HHMMSS-<method>-<task>`` (or the resumed one), locked for this
    launcher, ``latest`` pointing at it, its federation in ``launch.json``. ``values`` gets ``run-name``."""
    check_free_space(run_dir if run_dir is not None else results_root, space_needed(run_dir))
    if run_dir is None:
        merged = {**app_run_config(app_dir), **values}
        name = str(values.get("run-name") or run_name(str(merged.get("method")), str(merged.get("task"))))
        run_dir = create_run_dir(results_root, name)
        values["run-name"] = run_dir.name
    lock = lock or RunLock(run_dir).acquire(argv=sys.argv[1:])
    if lock.taken_over and lock.taken_over.get("pid"):
        print(f"[pollen] note: took over the lock of {run_dir} from launcher PID {lock.taken_over['pid']}, which is "
              "no longer running", flush=True)
    if args.resume:  # the last launch's summary no longer says how the run stands; this launch writes one on
        (run_dir / "summary.json").unlink(missing_ok=True)  # every exit path, and meanwhile the lock says running
    if not (run_dir / "launch.json").exists():
        write_launch_info(run_dir, {"num-supernodes": args.num_supernodes, "cpus-per-client": args.cpus_per_client,
                                    "gpus-per-client": args.gpus_per_client, "ray-address": args.ray_address or "local",
                                    "app": str(app_dir)})
    with contextlib.suppress(RunFolderError):  # a file system without symlinks still runs
        link_latest(run_dir)
    print(f"[pollen] run folder {run_dir}" + (" (resumed)" if args.resume else ""), flush=True)
    return run_dir, lock


def _launch(args: argparse.Namespace, app_dir: Path, values: dict[str, Any], run_dir: Path | None,
            lock: RunLock | None) -> int:
    started = time.monotonic()
    outcome = None
    with signals_raise():
        try:
            outcome = simulate(app_dir=app_dir, flwr_home=args.flwr_home, num_supernodes=args.num_supernodes,
                               cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                               run_config=values, timeout=args.timeout, echo=not args.quiet,
                               ray_address=args.ray_address, ray_cpus=args.ray_cpus, run_dir=run_dir,
                               lock_fd=lock.fd if lock is not None else None)
        except LaunchInterrupted as err:
            print(f"[pollen] {err}: stopped every process of the run after {time.monotonic() - started:.1f}s",
                  file=sys.stderr, flush=True)
            if run_dir is not None:
                print(f"[pollen] {run_dir / 'summary.json'} says interrupted; continue with: pollen run "
                      f"--resume {run_dir}", file=sys.stderr, flush=True)
            return 128 + err.signum
        except TimeoutError as err:
            print(f"[pollen] timeout: {err}", file=sys.stderr, flush=True)
            return EXIT_TIMEOUT
        except SuperLinkDied as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_SUPERLINK_DIED
        except LaunchConfigError as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except (RuntimeError, OSError) as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_NOT_COMPLETED
    results = f"; results {outcome.results_dir}" if outcome.results_dir and outcome.results_dir.is_dir() else ""
    print(f"[pollen] run {outcome.run_id}: {outcome.status} in {outcome.wall_time_s:.1f}s{results}", flush=True)
    if not outcome.completed:
        reason = outcome.failure_reason or "no reason recorded (see the log above)"
        print(f"[pollen] run {outcome.run_id} {outcome.verdict}: {reason}", file=sys.stderr, flush=True)
    if outcome.processes:
        counts: dict[str, int] = {}
        for entry in outcome.processes:
            name = entry.rsplit("(", 1)[0]
            counts[name] = counts.get(name, 0) + 1
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())
        left = f"still alive: {outcome.leftover}" if outcome.leftover else "none left (checked by PID)"
        took = f" in {outcome.teardown_s:.1f}s" if outcome.teardown_s is not None else ""
        print(f"[pollen] stopped the run's processes ({names}){took}: {left}", flush=True)
    if outcome.leftover:
        return EXIT_NOT_COMPLETED
    return EXIT_COMPLETED if outcome.completed else EXIT_NOT_COMPLETED



# --- TLS health (the SuperLink of a real fleet, deploy/fleet.py) -------------------------------------

def wait_healthy_tls(port: int, ca_cert: str | Path, proc: subprocess.Popen, timeout: float = 60.0,
                     log_path: Path | None = None) -> None:
    """Like :func:`wait_healthy` for a SuperLink serving HTTPS, trusting only ``ca_cert``.

    A fixed sleep is not enough on a loaded machine: the TLS SuperLink can take several seconds to
    bind, and ``flwr supernode register`` sent earlier fails instead of retrying.
    """
    import ssl

    context = ssl.create_default_context(cafile=str(ca_cert))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SuperLinkDied(proc, log_path)
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=2, context=context) as resp:
                if resp.status == 200 and _listens_on(proc.pid, port) is not False:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"TLS SuperLink on port {port} not healthy after {timeout:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
