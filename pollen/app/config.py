"""Typed, validated run configuration.

Flower hands every app a flat ``context.run_config`` (the keys of ``[tool.flwr.app.config]``, possibly
overridden with ``--run-config``). This module turns it into one frozen :class:`RunConfig`, checking
every key *before* any data is loaded or any model trained, so a typo fails in the first second with
a message that names the key and the allowed values.

``DEFAULTS`` mirrors ``pyproject.toml`` (a test keeps them equal) so unit tests and library users
need no Flower context at all.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pollen.app.errors import ConfigError
from pollen.app.run_keys import COMMON
from pollen.privacy.config import PrivacyConfig
from pollen.protocol.identity import parse_partition_pins

if TYPE_CHECKING:
    from pollen.models import ModelSpec

# Every common run key with its default (declared in run_keys.COMMON; pyproject.toml repeats them).
DEFAULTS: dict[str, Any] = {key: spec.default for key, spec in COMMON.items()}

# Width used when ``model-width = 0`` ("let the profile decide"). The small nets (FedProto's CNN, DLG's
# LeNet) are already CPU-sized and always keep their paper width unless ``model-width`` says otherwise.
PROFILE_WIDTH = {"quick": 0.25, "paper": 1.0}


def _key_error(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")


def _value(raw: Mapping[str, Any], key: str) -> Any:
    """``raw[key]`` checked against the key's documented type and range (strings stripped)."""
    from pollen.app.run_keys import check

    value = raw[key]
    return check(key, value.strip() if isinstance(value, str) else value)


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration (every key: ``docs/usage.md``)."""

    method: str
    task: str
    profile: str
    num_server_rounds: int
    seed: int
    data_root: str | None
    download: bool
    out_dir: str
    fraction_fit: float
    fraction_evaluate: float
    min_available_clients: int
    device: str
    torch_threads: int
    model: str | None
    model_width: float
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    max_train_samples: int
    dirichlet_alpha: float
    shot_ways: int
    shot_shots: int
    shot_stdev: int
    shot_test_per_class: int
    shot_split: str
    avg_weighting: str
    fedprox_mu: float
    max_empty_rounds: int = DEFAULTS["max-empty-rounds"]
    sample_by_partition: bool = DEFAULTS["sample-by-partition"]
    checkpoint_every: int = DEFAULTS["checkpoint-every"]
    checkpoint_keep: int = DEFAULTS["checkpoint-keep"]
    resume_from: str = DEFAULTS["resume-from"]
    run_name: str = DEFAULTS["run-name"]
    # Hostile nodes: how accepted values combine, the payload bounds, operator-pinned partitions.
    aggregation: str = DEFAULTS["aggregation"]
    trim_fraction: float = DEFAULTS["trim-fraction"]
    max_update_norm: float = DEFAULTS["max-update-norm"]
    max_logit_abs: float = DEFAULTS["max-logit-abs"]
    max_grad_norm: float = DEFAULTS["max-grad-norm"]
    partition_pins: str = DEFAULTS["partition-pins"]  # as given: "partition:node-id,..."
    # Differential privacy (docs/privacy.md); PrivacyConfig checks the rules between the keys.
    dp_mode: str = DEFAULTS["dp-mode"]
    dp_clip: float = DEFAULTS["dp-clip"]
    dp_noise_multiplier: float = DEFAULTS["dp-noise-multiplier"]
    dp_target_epsilon: float = DEFAULTS["dp-target-epsilon"]
    dp_delta: float = DEFAULTS["dp-delta"]
    dp_max_epsilon: float = DEFAULTS["dp-max-epsilon"]
    leak_audit: bool = DEFAULTS["leak-audit"]
    # Your own data (tasks image-folder, array): the folder, agreed classes and input format.
    data_dir: str = DEFAULTS["data-dir"]
    classes: str = DEFAULTS["classes"]  # as given: "a,b,c" or a file (class_names: the parsed names)
    test_fraction: float = DEFAULTS["test-fraction"]
    image_size: int = DEFAULTS["image-size"]
    image_channels: int = DEFAULTS["image-channels"]
    image_mean: str = DEFAULTS["image-mean"]
    image_std: str = DEFAULTS["image-std"]
    data_split: str = DEFAULTS["data-split"]
    class_names: tuple[str, ...] = ()
    # Method-specific keys (prefixed in the run config) that a method module validates itself.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def width_for(self, model_name: str) -> float:
        """Model width multiplier: explicit ``model-width``, else the profile's default."""
        if self.model_width > 0:
            return self.model_width
        from pollen.models.catalog import SMALL_MODELS  # no torch: the launcher reads configs without it

        return 1.0 if model_name in SMALL_MODELS else PROFILE_WIDTH[self.profile]

    def model_spec(self, task, name: str | None = None, **options: Any) -> ModelSpec:
        """The model a client of ``task`` trains: ``name`` (default: the ``model`` key, else the task's
        default), the task's classes and input format, this config's width for it."""
        from pollen.models import ModelSpec  # lazily: the launcher reads configs without torch

        name = name or self.model or task.default_model
        return ModelSpec(name, task.num_classes, in_channels=task.fmt.channels, image_size=task.fmt.size,
                         width=self.width_for(name), options=options)

    def task_options(self, node: NodeConfig | None = None):
        """The :class:`~pollen.datasets.tasks.TaskOptions` of this run, as seen by ``node`` (its data
        root and own data folder, when it has them)."""
        from pollen.datasets.tasks import TaskOptions

        return TaskOptions(
            data_root=(node.data_root if node is not None else None) or self.data_root, download=self.download,
            seed=self.seed, dirichlet_alpha=self.dirichlet_alpha, ways=self.shot_ways, shots=self.shot_shots,
            stdev=self.shot_stdev, test_per_class=self.shot_test_per_class, shot_split=self.shot_split,
            max_train_samples=self.max_train_samples, data_dir=self.data_dir or None,
            node_data_dir=node.data_dir if node is not None else None, classes=self.class_names,
            test_fraction=self.test_fraction, image_size=self.image_size, image_channels=self.image_channels,
            image_mean=_floats(self.image_mean), image_std=_floats(self.image_std), data_split=self.data_split)

    @property
    def privacy(self) -> PrivacyConfig:
        """The DP keys as one value (mode, clip, σ or target ε, δ, cap)."""
        return PrivacyConfig(self.dp_mode, self.dp_clip, self.dp_noise_multiplier, self.dp_target_epsilon,
                             self.dp_delta, self.dp_max_epsilon)

    def to_dict(self) -> dict[str, Any]:
        """The run config with Flower's key spelling, as written to ``config.json``."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("extra", "class_names")}
        out["data-root"] = self.data_root or ""
        out["model"] = self.model or ""
        out.update(self.extra)
        return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",")) if text.strip() else ()


def _as_float_list(raw: Mapping[str, Any], key: str, positive: bool) -> str:
    """A comma-separated list of finite numbers (``"0.5"`` or ``"0.49,0.48,0.45"``), kept as given."""
    value = _value(raw, key)
    if not value:
        return ""
    try:
        numbers = _floats(value)
    except ValueError:
        raise _key_error(key, value, "comma-separated numbers, one per channel") from None
    if len(numbers) not in (1, 3) or not all(n == n and abs(n) != float("inf") for n in numbers):
        raise _key_error(key, value, "1 or 3 finite comma-separated numbers, one per channel")
    if positive and min(numbers) <= 0:
        raise _key_error(key, value, "numbers > 0")
    return value


def _path(raw: Mapping[str, Any], key: str) -> str:
    value = _value(raw, key)
    return str(Path(value).expanduser().resolve()) if value else ""


def _user_data(merged: Mapping[str, Any]) -> dict[str, Any]:
    """The user-data keys (tasks image-folder, array), typed; class names parsed (a file is read here)."""
    from pollen.datasets.user_data import UserDataError, parse_classes

    classes = _value(merged, "classes").strip()
    try:
        names = parse_classes(classes)
    except UserDataError as err:
        raise ConfigError(f"run config key 'classes': {err}") from err
    return {"data_dir": _path(merged, "data-dir"), "classes": classes, "class_names": names,
            "test_fraction": _value(merged, "test-fraction"),
            "image_size": _value(merged, "image-size"),
            "image_channels": _check_channels(_value(merged, "image-channels")),
            "image_mean": _as_float_list(merged, "image-mean", positive=False),
            "image_std": _as_float_list(merged, "image-std", positive=True),
            "data_split": _value(merged, "data-split")}


def _check_channels(value: int) -> int:
    if value not in (0, 1, 3):
        raise _key_error("image-channels", value, "0 (detect), 1 (grey) or 3 (RGB)")
    return value


def _check_user_task(cfg: RunConfig, merged: Mapping[str, Any]) -> None:
    """User-data keys with another task are a mistake; with a user-data task, resolve classes and input
    format now (from the keys or the run's data-dir), so a bad folder fails before any round."""
    from pollen.datasets.tasks import TaskError, resolve_task
    from pollen.datasets.user_data import UserDataError
    from pollen.datasets.user_tasks import USER_KEYS, USER_TASKS

    if cfg.task not in USER_TASKS:
        foreign = sorted(k for k in USER_KEYS if merged[k] != DEFAULTS[k])
        if foreign:
            raise ConfigError(f"run config key(s) {foreign} are read only by tasks {', '.join(USER_TASKS)}; "
                              f"task is '{cfg.task}': remove them")
        return
    try:
        resolve_task(cfg.task, cfg.task_options())
    except (TaskError, UserDataError) as err:
        raise ConfigError(str(err)) from err


# Common keys whose text is stripped of spaces around it (paths, names).
STRIPPED = ("out-dir", "resume-from", "run-name", "partition-pins")


def field_name(key: str) -> str:
    """The :class:`RunConfig` field of a common run key: ``num-server-rounds`` -> ``num_server_rounds``."""
    return key.replace("-", "_")


def parse_run_config(raw: Mapping[str, Any] | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from a Flower run config, filling gaps from ``DEFAULTS``.

    Unknown method or task names are checked against the registries, so the error lists what exists.
    """
    merged: dict[str, Any] = dict(DEFAULTS)
    extra_defaults = _method_defaults()
    merged.update(extra_defaults)
    if raw:
        unknown = sorted(k for k in raw if k not in merged)
        if unknown:
            raise ConfigError(
                f"unknown run config key(s) {unknown}; known keys: {', '.join(sorted(merged))}")
        merged.update(dict(raw))


    method = _value(merged, "method")
    task = _value(merged, "task")
    data_root = _value(merged, "data-root").strip() or os.environ.get("POLLEN_DATA_ROOT") or None
    shaped = {  # the keys whose value is more than the checked run-config value
        "method": method, "task": task,
        "data_root": str(Path(data_root).expanduser()) if data_root else None,
        "model": _value(merged, "model") or None,
        **{name: _value(merged, key).strip() for key in STRIPPED for name in [field_name(key)]},
        **_user_data(merged),
    }
    plain = {field_name(key): _value(merged, key) for key in COMMON if field_name(key) not in shaped}
    cfg = RunConfig(**plain, **shaped,
                    extra={k: merged[k] for k in _own_keys(method)})  # config.json: shared keys + this method's only
    if cfg.run_name in (".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"run config key 'run-name' = {cfg.run_name!r} is invalid: expected a folder name "
                          "(no '/', not '.' or '..')")
    try:
        parse_partition_pins(cfg.partition_pins)
    except ValueError as err:
        raise ConfigError(f"run config key 'partition-pins' = {cfg.partition_pins!r} is invalid: {err}") from None
    if cfg.shot_shots - cfg.shot_stdev < 1:
        raise ConfigError(
            f"run config keys 'shot-shots' = {cfg.shot_shots} and 'shot-stdev' = {cfg.shot_stdev} "
            "allow clients with fewer than 1 sample per class: need shot-shots - shot-stdev >= 1")
    _check_user_task(cfg, merged)
    from pollen.app.registry import validate_method_config

    _refuse_other_methods_keys(method, merged, extra_defaults)
    _check_privacy(cfg, merged)
    validate_method_config(cfg)
    return cfg


def validated_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """:func:`parse_run_config`, once per process per run config: what the ServerApp, every message of a
    ClientApp and the in-process runner call. Every message of a run carries the same run config, and a
    process that hosts the ServerApp and ClientApps (the in-process runner, tests) meets it in each, so
    the checks and their side effects (a user-data task's ``data-dir`` scanned, a public folder counted)
    happen once; a config that fails is checked again (nothing is cached for it). Keyed by every key and
    value, and by the two things outside them it reads (``POLLEN_DATA_ROOT``, the working directory that
    relative paths resolve against); at most 8 configs are kept. A value that cannot be hashed (Flower
    never sends one) is parsed every time."""
    try:
        items = tuple(sorted(raw.items()))
        hash(items)
    except TypeError:
        return parse_run_config(raw)
    return _validated(items, os.environ.get("POLLEN_DATA_ROOT"), os.getcwd())


@functools.lru_cache(maxsize=8)
def _validated(items: tuple[tuple[str, Any], ...], data_root_env: str | None, cwd: str) -> RunConfig:
    return parse_run_config(dict(items))


DP_KEYS = ("dp-mode", "dp-clip", "dp-noise-multiplier", "dp-target-epsilon", "dp-delta", "dp-max-epsilon")


def _check_privacy(cfg: RunConfig, merged: Mapping[str, Any]) -> None:
    """The rules between the DP keys, and whether the method supports the mode, before anything starts."""
    from pollen.app.registry import METHODS

    spec = METHODS[cfg.method]
    family = spec.family
    if cfg.leak_audit and not spec.leak_audit:
        measured = sorted({s.family for s in METHODS.values() if s.leak_audit})
        siblings = sorted(s.name for s in METHODS.values() if s.leak_audit and s.family == family)
        within = f" (of family {family!r} only {', '.join(siblings)})" if siblings else ""
        raise ConfigError(f"run config key 'leak-audit' = true has no measure for method {cfg.method!r} (family "
                          f"{family!r}); it is for the families {', '.join(measured)}{within}")
    if cfg.dp_mode == "off":
        stray = sorted(k for k in DP_KEYS if merged[k] != DEFAULTS[k])
        if stray:
            raise ConfigError(f"run config key(s) {stray} have no effect with dp-mode = 'off'; set dp-mode or "
                              "remove them")
        return
    try:
        cfg.privacy  # noqa: B018 - its constructor checks the rules
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.dp_mode not in spec.dp_modes:
        supported = sorted(m for m, other in METHODS.items() if cfg.dp_mode in other.dp_modes)
        raise ConfigError(f"run config key 'dp-mode' = {cfg.dp_mode!r} is not available for method {cfg.method!r} "
                          f"(family {family!r}); it is for: {', '.join(supported) or 'no method yet'}")
    if family == "weights" and cfg.avg_weighting != "uniform":
        raise ConfigError(f"run config key 'avg-weighting' = {cfg.avg_weighting!r} weights clients by their sample "
                          f"counts, which dp-mode = {cfg.dp_mode!r} does not release: set avg-weighting = 'uniform'")
    if cfg.method == "solo" and not cfg.extra.get("fccl-average-weights"):
        raise ConfigError("method 'solo' sends nothing to the server, so dp-mode has nothing to privatize: "
                          "set dp-mode = 'off'")
    if family == "logits" and cfg.extra.get("fccl-average-weights"):
        raise ConfigError("run config key 'fccl-average-weights' = true also sends model weights, which "
                          "dp-mode = 'payload' does not privatize for the logit family: set it to false")
    if family == "prototypes" and cfg.extra.get("proto-local-protos") == "training":
        raise ConfigError("run config key 'proto-local-protos' = 'training' releases training-time features, but "
                          f"dp-mode = {cfg.dp_mode!r} clips the embeddings of a pass after training: set "
                          "proto-local-protos = 'post-pass'")
    if cfg.dp_mode == "sample":
        _refuse_cross_sample_models(cfg)


def _refuse_cross_sample_models(cfg: RunConfig) -> None:
    """DP-SGD needs per-sample gradients: a model with BatchNorm is refused now, naming the layer and
    the fix, not at the first round.

    Read from :mod:`pollen.models.catalog` (no torch, no model built; a test builds every model against
    it); only a model the catalog does not describe (one added with ``register_model``) is built, on the
    meta device. DP-SGD checks the module it trains again (:func:`pollen.privacy.dpsgd.dp_sgd`)."""
    from pollen.datasets.tasks import resolve_task
    from pollen.models.catalog import FIRST_BATCHNORM, MODEL_NAMES
    from pollen.privacy.config import cross_sample_refusal

    task = resolve_task(cfg.task, cfg.task_options())
    for name in [cfg.model] if cfg.model else sorted({task.default_model, *task.partition_models}):
        layer = FIRST_BATCHNORM[name] if name in FIRST_BATCHNORM else _built_first_batchnorm(cfg, task, name)
        if layer is not None:
            fitting = [m for m in MODEL_NAMES if FIRST_BATCHNORM[m] is None]
            raise ConfigError(f"run config key 'dp-mode' = 'sample': {cross_sample_refusal(name, *layer)}; "
                              f"Pollen's models without BatchNorm: {', '.join(fitting)} (run key 'model')")


def _built_first_batchnorm(cfg: RunConfig, task: Any, name: str) -> tuple[str, str] | None:
    """The first BatchNorm layer of a model the catalog does not describe: built (shapes only) to know."""
    import torch

    from pollen.privacy.dpsgd import first_cross_sample_layer

    with torch.device("meta"):
        return first_cross_sample_layer(cfg.model_spec(task, name).build())


def _refuse_other_methods_keys(method: str, merged: Mapping[str, Any], extra_defaults: Mapping[str, Any]) -> None:
    """A key of another method set away from its default is a mistake (``proto-lambda`` with fedavg)."""
    from pollen.app.registry import METHODS

    own = set(METHODS[method].defaults)
    foreign = sorted(k for k, v in extra_defaults.items() if k not in own and merged[k] != v)
    if foreign:
        raise ConfigError(f"run config key(s) {foreign} belong to another method and have no effect with "
                          f"method '{method}'; remove them")


def _method_defaults() -> dict[str, Any]:
    from pollen.app.registry import method_defaults

    return method_defaults()


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


def parse_node_config(raw: Mapping[str, Any]) -> NodeConfig:
    """Validate the node config; a SuperNode started without its keys fails here, naming them."""
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
    if model is not None:
        from pollen.models.catalog import MODEL_NAMES

        if model not in MODEL_NAMES:
            raise ConfigError(f"node config 'model' = {model!r} is invalid: expected one of "
                              + ", ".join(MODEL_NAMES))
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


def _own_keys(method: str) -> list[str]:
    from pollen.app.registry import METHODS

    return list(METHODS[method].keys)
