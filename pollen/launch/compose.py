"""The run config a launch submits: which app, which keys it declares, what the user asked for — parsed as
Flower parses it, checked before anything starts, written back so Flower reads it unchanged.

``flwr run`` refuses an unknown key only after its SuperLink started, as "[code: 15] Invalid run
configuration" without the key; :func:`compose_run_config` names it (with close matches) first, and
:func:`fitting_node_count` refuses a SuperNode count the method cannot run on, naming the key.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pollen import RUNS_DIR
from pollen.launch.errors import LaunchConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def load_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as Flower flattens them: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def is_flower_app(path: Path) -> bool:
    """Whether ``path`` holds a ``pyproject.toml`` with a ``[tool.flwr.app]`` table."""
    try:
        data = load_toml(Path(path) / "pyproject.toml")
    except (OSError, ValueError):
        return False
    return isinstance(data.get("tool", {}).get("flwr", {}).get("app"), Mapping)


def package_checkout(module_file: str | Path = __file__) -> Path | None:
    """The source checkout that holds this package (``<root>/pollen/launch/compose.py``), if it is a Flower app.

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
        data = load_toml(path)
    except OSError as err:
        raise LaunchConfigError(f"--app {app_dir}: cannot read {path}: {err}") from err
    except ValueError as err:
        raise LaunchConfigError(f"--app {app_dir}: {path} is not valid TOML: {err}") from err
    app = data.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, Mapping):
        raise LaunchConfigError(f"--app {app_dir}: {path} has no [tool.flwr.app] table; not a Flower app")
    return flatten(app.get("config") or {})


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
            return flatten(load_toml(path))
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
        return flatten(tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs)))
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
    """Results root when neither ``--out-dir`` nor the run config's ``out-dir`` names one: ``$POLLEN_OUT_DIR``,
    else ``./runs`` — where ``make run`` writes from a checkout, ``pollen fleet`` too, and ``pollen runs`` looks."""
    return Path(os.environ.get("POLLEN_OUT_DIR") or RUNS_DIR).expanduser().resolve()


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
