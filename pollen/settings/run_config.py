"""The run configuration as one typed value, and what a SuperNode says about itself.

Flower hands every app a flat ``context.run_config`` (the keys of ``[tool.flwr.app.config]``, possibly
overridden with ``--run-config``). :func:`read_run_config` checks every key against its declaration —
the common keys of :mod:`pollen.settings.common` and each method family's own — and returns one frozen
:class:`RunConfig`, before any data is loaded or any model trained, so a typo fails in the first second
with a message that names the key and the allowed values. What needs more than the declarations (the
registries of methods and tasks, a user-data folder, the family's rules) is checked by the app's one
validation function, ``pollen.app.config.parse_run_config``, which calls this first.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollen.settings.common import (
    CheckpointKeys,
    HostileKeys,
    NetworkKeys,
    PathKeys,
    PrivacyKeys,
    RunKeys,
    SamplingKeys,
    SecureAggregationKeys,
    TaskKeys,
    TrackingKeys,
    TrainingKeys,
    UserDataKeys,
    WeightKeys,
)
from pollen.settings.errors import ConfigError
from pollen.settings.keys import Key, check_value, declared_keys, derived, field_keys


# The sections, first to last (dataclass fields follow the reverse of the bases' order).
@dataclass(frozen=True)
class RunConfig(SecureAggregationKeys, PrivacyKeys, TrackingKeys, NetworkKeys, HostileKeys, CheckpointKeys, WeightKeys,
                UserDataKeys, TaskKeys, TrainingKeys, SamplingKeys, PathKeys, RunKeys):
    """Validated run configuration: every common key as a field of its name (``num-server-rounds`` ->
    ``num_server_rounds``; every key: ``docs/usage.md``), the method's own keys in ``extra``."""

    class_names: tuple[str, ...] = derived(())  # the parsed ``classes`` (a file's lines, or the list)
    # The method's own keys (prefixed, e.g. ``proto-lambda``), checked; its settings class reads them.
    extra: Mapping[str, Any] = derived(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The run config with Flower's key spelling, as written to ``config.json``."""
        out = {key: getattr(self, name) for name, key in field_keys(RunConfig).items()}
        out["data-root"] = self.data_root or ""
        out["model"] = self.model or ""
        out.update(self.extra)
        return out


# Every common run key: default, range, help.
COMMON: dict[str, Key] = declared_keys(RunConfig)
# Every common run key with its default.
DEFAULTS: dict[str, Any] = {key: spec.default for key, spec in COMMON.items()}
# Common keys that name a folder every node reads: resolved against the working directory when set.
PATHS = ("data-dir",)


def field_name(key: str) -> str:
    """The :class:`RunConfig` field of a common run key: ``num-server-rounds`` -> ``num_server_rounds``."""
    return key.replace("-", "_")


def read_run_config(raw: Mapping[str, Any] | None, method_keys: Mapping[str, Mapping[str, Key]],
                    registered: Mapping[str, Sequence[str]]) -> RunConfig:
    """Every key of ``raw`` checked against its declaration, gaps filled with the declared defaults.

    ``method_keys`` names each method's own keys (``method -> key -> Key``); ``registered`` the allowed
    values of the keys whose choices are a registry (``task``, ``model``; ``method`` is ``method_keys``).
    Refused, naming the key: an unknown key, a value of the wrong type or out of range, a key of another
    method set away from its default, and what one key's range cannot say (``run-name``, ``shot-shots``
    against ``shot-stdev``, ``image-*`` lists).
    """
    family_keys: dict[str, Key] = {}
    for keys in method_keys.values():
        family_keys.update(keys)
    declared = {**COMMON, **family_keys}
    merged = {key: spec.default for key, spec in declared.items()}
    if raw:
        unknown = sorted(k for k in raw if k not in merged)
        if unknown:
            raise ConfigError(f"unknown run config key(s) {unknown}; known keys: {', '.join(sorted(merged))}")
        merged.update(raw)
    choices = {**registered, "method": sorted(method_keys)}

    def value(key: str) -> Any:  # strings are stripped of spaces around them
        raw_value = merged[key]
        return check_value(key, declared[key], raw_value.strip() if isinstance(raw_value, str) else raw_value, choices)

    method = value("method")
    fields = {field_name(key): value(key) for key in COMMON}
    data_root = fields["data_root"] or os.environ.get("POLLEN_DATA_ROOT") or None
    fields.update(
        data_root=str(Path(data_root).expanduser()) if data_root else None, model=fields["model"] or None,
        image_channels=_channels(fields["image_channels"]),
        image_mean=_float_list("image-mean", fields["image_mean"], positive=False),
        image_std=_float_list("image-std", fields["image_std"], positive=True),
        **{field_name(key): _path(fields[field_name(key)]) for key in PATHS})
    own = method_keys[method]
    _refuse_other_methods_keys(method, own, family_keys, merged)
    cfg = RunConfig(**fields, extra={key: value(key) for key in own})  # config.json: shared keys + this method's
    if cfg.run_name in (".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"run config key 'run-name' = {cfg.run_name!r} is invalid: expected a folder name "
                          "(no '/', not '.' or '..')")
    if cfg.shot_shots - cfg.shot_stdev < 1:
        raise ConfigError(
            f"run config keys 'shot-shots' = {cfg.shot_shots} and 'shot-stdev' = {cfg.shot_stdev} "
            "allow clients with fewer than 1 sample per class: need shot-shots - shot-stdev >= 1")
    return cfg


def _refuse_other_methods_keys(method: str, own: Collection[str], family_keys: Mapping[str, Key],
                               merged: Mapping[str, Any]) -> None:
    """A key of another method set away from its default is a mistake (``proto-lambda`` with fedavg)."""
    foreign = sorted(k for k, spec in family_keys.items() if k not in own and merged[k] != spec.default)
    if foreign:
        raise ConfigError(f"run config key(s) {foreign} belong to another method and have no effect with "
                          f"method '{method}'; remove them")


def floats(text: str) -> tuple[float, ...]:
    """``"0.5"`` or ``"0.49,0.48,0.45"`` as numbers; ``""`` as none."""
    return tuple(float(v) for v in text.split(",")) if text.strip() else ()


def _float_list(key: str, value: str, positive: bool) -> str:
    """A comma-separated list of finite numbers, one per channel, kept as given."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")

    if not value:
        return ""
    try:
        numbers = floats(value)
    except ValueError:
        raise bad("comma-separated numbers, one per channel") from None
    if len(numbers) not in (1, 3) or not all(n == n and abs(n) != float("inf") for n in numbers):
        raise bad("1 or 3 finite comma-separated numbers, one per channel")
    if positive and min(numbers) <= 0:
        raise bad("numbers > 0")
    return value


def _channels(value: int) -> int:
    if value not in (0, 1, 3):
        raise ConfigError(f"run config key 'image-channels' = {value!r} is invalid: expected 0 (detect), 1 (grey) "
                          "or 3 (RGB)")
    return value


def _path(value: str) -> str:
    return str(Path(value).expanduser().resolve()) if value else ""


def with_class_names(cfg: RunConfig, names: Sequence[str]) -> RunConfig:
    """``cfg`` with the parsed class names of its ``classes`` key."""
    return dataclasses.replace(cfg, class_names=tuple(names))


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode's ``--node-config`` (or the simulation engine) says about this client."""

    partition_id: int
    num_partitions: int
    data_root: str | None = None
    model: str | None = None
    state_dir: str | None = None
    data_dir: str | None = None  # this node's own data folder (the user-data tasks), used whole
    public_dir: str | None = None  # this node's copy of the public folder (logit methods, fccl-public = folder)


def parse_node_config(raw: Mapping[str, Any], model_names: Collection[str] | None = None) -> NodeConfig:
    """Validate the node config; a SuperNode started without its keys fails here, naming them. A ``model``
    must be one of ``model_names`` (when given)."""
    missing = [k for k in ("partition-id", "num-partitions") if k not in raw]
    if missing:
        raise ConfigError(
            f"node config is missing {', '.join(repr(k) for k in missing)}: start the SuperNode with "
            "--node-config \"partition-id=<i> num-partitions=<n>\" (simulation sets them itself)")
    pid, num = raw["partition-id"], raw["num-partitions"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, num)):
        raise ConfigError(f"node config partition-id/num-partitions must be integers, got "
                          f"{pid!r}/{num!r}")
    if num < 1 or not 0 <= pid < num:
        raise ConfigError(f"node config needs 0 <= partition-id < num-partitions, got {pid} and {num}")
    data_root = str(raw.get("data-root", "") or "").strip() or None
    model = str(raw.get("model", "") or "").strip() or None
    if model is not None and model_names is not None and model not in model_names:
        raise ConfigError(f"node config 'model' = {model!r} is invalid: expected one of " + ", ".join(model_names))
    state_dir = raw.get("state-dir", "")
    if not isinstance(state_dir, str):
        raise ConfigError(f"node config 'state-dir' must be a path (string), got {state_dir!r}")
    return NodeConfig(partition_id=pid, num_partitions=num, data_root=data_root, model=model,
                      state_dir=state_dir.strip() or None, data_dir=_node_path(raw, "data-dir"),
                      public_dir=_node_path(raw, "public-dir"))


def _node_path(raw: Mapping[str, Any], key: str) -> str | None:
    """An optional node-config path that must exist on this node (absolute, ``~`` expanded)."""
    value = raw.get(key, "")
    if not isinstance(value, str):
        raise ConfigError(f"node config {key!r} must be a path (string), got {value!r}")
    path = str(Path(value.strip()).expanduser().resolve()) if value.strip() else None
    if path is not None and not os.path.exists(path):
        raise ConfigError(f"node config {key!r} = {path!r}: no such file or folder on this node")
    return path
