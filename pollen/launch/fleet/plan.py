"""What a fleet will run, checked before anything starts: one ``--node-config`` per SuperNode (partition,
data, model, GPU) and the run config the fleet submits.

Both are written as Flower parses them (``k=v`` pairs, :func:`format_config`); a bad value is a
:class:`~pollen.app.config.ConfigError` naming the option or key, before a process starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollen.app.config import ConfigError, RunConfig, parse_run_config
from pollen.launch.compose import default_out_dir, format_run_config
from pollen.launch.errors import LaunchConfigError


def format_config(values: Mapping[str, Any]) -> str:
    """``k=v`` pairs as ``flwr run --run-config`` and ``flower-supernode --node-config`` parse them
    (:func:`pollen.launch.compose.format_run_config`, with this tool's error type)."""
    try:
        return format_run_config(values)
    except LaunchConfigError as err:
        raise ConfigError(str(err)) from err


def parse_config_string(text: str) -> dict[str, Any]:
    """Parse a ``k=v`` string exactly as ``flwr run --run-config`` will (Flower's own parser)."""
    from flwr.common.config import parse_config_args

    if not text.strip():
        return {}
    if text.strip().endswith(".toml"):
        raise ConfigError("--run-config takes 'key=value ...' pairs here, not a TOML file")
    try:
        return dict(parse_config_args([text]))
    except Exception as err:  # click.ClickException: the message says what format is expected
        raise ConfigError(f"--run-config {text!r} could not be parsed: {err}") from err


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode of the fleet: its name, its ``--node-config`` values and (optionally) its GPU."""

    name: str
    config: Mapping[str, Any]
    gpu: str | None = None

    @property
    def node_config(self) -> str:
        return format_config(self.config)

    @property
    def env(self) -> dict[str, str]:
        """One SuperNode per GPU: its ClientApps see exactly one device, as ``cuda:0``."""
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}


def plan_nodes(num_supernodes: int, *, data_root: str | None = None, models: Sequence[str] = (),
               gpus: Sequence[str] = (), data_dirs: Sequence[str] = (),
               public_dirs: Sequence[str] = ()) -> list[NodeSpec]:
    """Node configs for a fleet: partition ``i`` of ``num_supernodes`` on SuperNode ``i``.

    ``models`` is empty (the task decides), one name for every node, or one per node (heterogeneous
    methods); ``gpus`` is assigned round-robin, so 4 nodes on ``0,1`` put two SuperNodes per GPU.
    ``data_dirs`` is empty or one folder per node: node config ``data-dir``, that node's own data
    (the user-data tasks; docs/data.md). ``public_dirs`` is empty, one folder for every node or one per
    node: node config ``public-dir``, each node's copy of the public images (logit methods with
    ``fccl-public = "folder"``; the copies must hold the same files).
    """
    if isinstance(num_supernodes, bool) or not isinstance(num_supernodes, int) or num_supernodes < 1:
        raise ConfigError(f"--num-supernodes = {num_supernodes!r} is invalid: expected an integer >= 1")
    models = [m.strip() for m in models if m.strip()]
    if models:
        from pollen.models import MODEL_NAMES

        bad = [m for m in models if m not in MODEL_NAMES]
        if bad:
            raise ConfigError(f"--models {bad} not known: expected names from {', '.join(MODEL_NAMES)}")
        if len(models) not in (1, num_supernodes):
            raise ConfigError(f"--models lists {len(models)} names for {num_supernodes} SuperNodes: "
                              "give one name for all, or exactly one per SuperNode")
    gpus = [g.strip() for g in gpus if g.strip()]
    data_dirs = _folders("--data-dirs", data_dirs, num_supernodes, one_for_all=False)
    public_dirs = _folders("--public-dirs", public_dirs, num_supernodes, one_for_all=True)
    nodes = []
    for i in range(num_supernodes):
        config: dict[str, Any] = {"partition-id": i, "num-partitions": num_supernodes}
        if data_root:
            config["data-root"] = str(Path(data_root).expanduser().resolve())
        if models:
            config["model"] = models[i] if len(models) > 1 else models[0]
        if data_dirs:
            config["data-dir"] = data_dirs[i]
        if public_dirs:
            config["public-dir"] = public_dirs[i] if len(public_dirs) > 1 else public_dirs[0]
        nodes.append(NodeSpec(name=f"supernode_{i}", config=config, gpu=gpus[i % len(gpus)] if gpus else None))
    return nodes


def _folders(option: str, values: Sequence[str], num_supernodes: int, *, one_for_all: bool) -> list[str]:
    """Existing folders, absolute: none, one per SuperNode, or (``one_for_all``) one for every node."""
    folders = [str(Path(v.strip()).expanduser().resolve()) for v in values if v.strip()]
    if folders and len(folders) != num_supernodes and not (one_for_all and len(folders) == 1):
        raise ConfigError(f"{option} lists {len(folders)} folders for {num_supernodes} SuperNodes: give "
                          + ("one for all or " if one_for_all else "") + "exactly one per SuperNode")
    missing = [f for f in folders if not Path(f).exists()]
    if missing:
        raise ConfigError(f"{option}: no such file or folder: {', '.join(missing)}")
    return folders


def compose_run_config(*, method: str | None, rounds: int | None, out_dir: str | Path | None,
                       data_root: str | None, user: str = "", num_supernodes: int) -> tuple[dict[str, Any], RunConfig]:
    """The run config the fleet submits: the user's pairs plus the fleet options, validated here.

    A key given both as an option and inside ``--run-config`` with different values is an error,
    not a silent override. Refuses ``min-available-clients`` above the fleet size: Flower would wait
    24 h for clients that never come.
    """
    values = parse_config_string(user)
    for key, value in (("method", method), ("num-server-rounds", rounds)):
        if value is None:
            continue
        if key in values and values[key] != value:
            raise ConfigError(f"run config key '{key}' given twice: {values[key]!r} in --run-config "
                              f"and {value!r} as an option")
        values[key] = value
    if "out-dir" not in values:
        values["out-dir"] = str(Path(out_dir or default_out_dir()).expanduser().resolve())
    if data_root and "data-root" not in values:
        values["data-root"] = str(Path(data_root).expanduser().resolve())
    cfg = parse_run_config(values)
    if cfg.min_available_clients > num_supernodes:
        raise ConfigError(f"run config key 'min-available-clients' = {cfg.min_available_clients} exceeds the "
                          f"{num_supernodes} SuperNodes: expected at most {num_supernodes}")
    return values, cfg

