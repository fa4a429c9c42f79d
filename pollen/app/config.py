"""The app's one validation of a run config: the declarations first, then what needs the app's registries.

:func:`pollen.settings.read_run_config` checks every key against its declaration (type, range, choices,
unknown keys, another method's keys); this module hands it the registered methods, tasks and models,
then checks what the declarations cannot say: the partition pins, a user-data task's folder, the task's
kind, the DP keys against the method (:func:`check_privacy`), secure aggregation against the method
(:func:`check_secure_aggregation`) and the method family's own rules
(``MethodSpec.validate``, which holds the family's privacy rules too). :func:`validated_run_config` does
it once per process and run config. The typed values themselves (:class:`RunConfig`,
:class:`NodeConfig`, :class:`ConfigError`, ``DEFAULTS``) live in :mod:`pollen.settings`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from pollen.app.registry import METHODS, check_task_kind, registered_choices
from pollen.models.catalog import FIRST_BATCHNORM, MODEL_NAMES
from pollen.privacy.config import PrivacyConfig, cross_sample_refusal
from pollen.protocol.identity import parse_partition_pins
from pollen.settings import DEFAULTS, ConfigError, NodeConfig, RunConfig, read_run_config, with_class_names
from pollen.settings import parse_node_config as _read_node_config
from pollen.settings.common import PrivacyKeys, SecureAggregationKeys
from pollen.settings.keys import declared_keys

__all__ = ["DEFAULTS", "ConfigError", "NodeConfig", "RunConfig", "check_privacy", "check_private_evaluation",
           "check_secure_aggregation", "evaluates_on_clients", "parse_node_config",
           "parse_run_config", "validated_run_config"]


def parse_run_config(raw: Mapping[str, Any] | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from a Flower run config, filling gaps from the declared defaults.

    Unknown method or task names are checked against the registries, so the error lists what exists.
    """
    cfg = read_run_config(raw, {name: spec.keys for name, spec in METHODS.items()}, registered_choices())
    try:
        parse_partition_pins(cfg.partition_pins)
    except ValueError as err:
        raise ConfigError(f"run config key 'partition-pins' = {cfg.partition_pins!r} is invalid: {err}") from None
    cfg = _check_user_task(cfg)
    spec = METHODS[cfg.method]
    check_task_kind(spec, cfg.task)
    check_privacy(cfg)
    check_secure_aggregation(cfg)
    if spec.validate is not None:
        spec.validate(cfg)
    if cfg.dp_mode != "off":  # last: a private run's own errors (a key its mode ignores) are named first
        check_private_evaluation(cfg)
    return cfg


def parse_node_config(raw: Mapping[str, Any]) -> NodeConfig:
    """Validate the node config (a ``model`` must be a known architecture); a SuperNode started without
    its keys fails here, naming them."""
    return _read_node_config(raw, MODEL_NAMES)


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


def _check_user_task(cfg: RunConfig) -> RunConfig:
    """User-data keys with another task are a mistake; with a user-data task, parse the class names and
    resolve the input format now (from the keys or the run's data-dir), so a bad folder fails before any
    round. ``cfg`` with its ``class_names``."""
    from pollen.datasets.tasks import TaskError, TaskOptions, resolve_task
    from pollen.datasets.user_data import UserDataError, parse_classes
    from pollen.datasets.user_tasks import USER_KEYS, USER_TASKS

    try:
        cfg = with_class_names(cfg, parse_classes(cfg.classes))
    except UserDataError as err:
        raise ConfigError(f"run config key 'classes': {err}") from err
    if cfg.task not in USER_TASKS:
        given = cfg.to_dict()
        foreign = sorted(k for k in USER_KEYS if given[k] != DEFAULTS[k])
        if foreign:
            raise ConfigError(f"run config key(s) {foreign} are read only by tasks {', '.join(USER_TASKS)}; "
                              f"task is '{cfg.task}': remove them")
        return cfg
    try:
        resolve_task(cfg.task, TaskOptions.of(cfg))
    except (TaskError, UserDataError) as err:
        raise ConfigError(str(err)) from err
    return cfg


# The DP keys but leak-audit: set away from their defaults, they mean nothing with dp-mode = 'off'.
DP_KEYS = tuple(k for k in declared_keys(PrivacyKeys) if k != "leak-audit")


def check_privacy(cfg: RunConfig) -> None:
    """The rules between the DP keys, and whether the method supports the mode and the leak audit, before
    anything starts. What a family adds (a key its release ignores) is its ``validate``."""
    spec = METHODS[cfg.method]
    family = spec.family
    if cfg.leak_audit and not spec.leak_audit:
        measured = sorted({s.family for s in METHODS.values() if s.leak_audit})
        siblings = sorted(s.name for s in METHODS.values() if s.leak_audit and s.family == family)
        within = f" (of family {family!r} only {', '.join(siblings)})" if siblings else ""
        raise ConfigError(f"run config key 'leak-audit' = true has no measure for method {cfg.method!r} (family "
                          f"{family!r}); it is for the families {', '.join(measured)}{within}")
    if cfg.dp_mode == "off":
        given = cfg.to_dict()
        stray = sorted(k for k in DP_KEYS if given[k] != DEFAULTS[k])
        if stray:
            raise ConfigError(f"run config key(s) {stray} have no effect with dp-mode = 'off'; set dp-mode or "
                              "remove them")
        return
    try:
        PrivacyConfig.of(cfg)  # its constructor checks the rules
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.dp_mode not in spec.dp_modes:
        supported = sorted(m for m, other in METHODS.items() if cfg.dp_mode in other.dp_modes)
        raise ConfigError(f"run config key 'dp-mode' = {cfg.dp_mode!r} is not available for method {cfg.method!r} "
                          f"(family {family!r}); it is for: {', '.join(supported) or 'no method yet'}")
    if cfg.dp_mode == "sample":
        _refuse_cross_sample_models(cfg)


def evaluates_on_clients(cfg: RunConfig) -> bool:
    """Whether the run's clients answer evaluate messages with their own figures (``fraction-evaluate``;
    GLFC evaluates on the server)."""
    return cfg.fraction_evaluate > 0 and METHODS[cfg.method].client_evaluation


def check_private_evaluation(cfg: RunConfig) -> None:
    """Evaluation under DP is a decision: evaluate replies are computed from the clients' data (accuracy,
    loss and test-set size, every round), so a private run whose clients evaluate must say how."""
    evaluates = evaluates_on_clients(cfg)
    if not evaluates and cfg.dp_evaluate != "refuse":
        why = ("fraction-evaluate = 0" if METHODS[cfg.method].client_evaluation else
               f"method {cfg.method!r} evaluates on the server")
        raise ConfigError(f"run config key 'dp-evaluate' = {cfg.dp_evaluate!r} has no effect: no client evaluates "
                          f"({why}); remove it")
    if evaluates and cfg.dp_evaluate == "refuse":
        raise ConfigError(
            f"dp-mode = {cfg.dp_mode!r} with fraction-evaluate = {cfg.fraction_evaluate:g}: every round the clients "
            "would send evaluate replies computed from their data (accuracy, loss, test-set size) outside the ε "
            "ledger. Choose one: fraction-evaluate = 0 (no client evaluation), dp-evaluate = 'noised' (only the "
            "accuracies leave, noised and accounted in the ledger; σ covers the evaluations too), or "
            "dp-evaluate = 'unprotected' (they leave as they are, outside ε; summary.json records it)")
    if cfg.dp_evaluate == "noised" and cfg.dp_mode not in ("payload", "sample"):
        raise ConfigError(f"run config key 'dp-evaluate' = 'noised' is for dp-mode 'payload' or 'sample', not "
                          f"{cfg.dp_mode!r}: set fraction-evaluate = 0 or dp-evaluate = 'unprotected'")


# The families whose train payload is a sum (pollen.secagg.payloads), and why the others cannot be summed.
SECURE_FAMILIES = ("weights", "prototypes", "logits")
NOT_A_SUM = {"glfc": "GLFC's proxy needs each client's prototype-gradient sets, not their sum",
             "local": "nothing is aggregated"}


def check_secure_aggregation(cfg: RunConfig) -> None:
    """Before anything starts: the secagg keys only with secure aggregation, and secure aggregation only for a
    family whose payload is a sum, with the plain mean (robust aggregation cannot see inside masked vectors)
    and without per-release DP noise (sized for a server that reads each release)."""
    family = METHODS[cfg.method].family
    given = cfg.to_dict()
    if (cfg.dp_mode == "distributed") != (cfg.dp_min_honest > 0):
        raise ConfigError("dp-mode = 'distributed' and dp-min-honest (the honest clients its guarantee counts on, "
                          f">= 1) go together; got dp-mode = {cfg.dp_mode!r}, dp-min-honest = {cfg.dp_min_honest}")
    if cfg.dp_mode == "distributed":
        if not cfg.secure_aggregation:
            raise ConfigError("dp-mode = 'distributed' needs secure-aggregation = true: its noise hides a client "
                              "only in a sum the server cannot take apart")
        if cfg.dp_clip > cfg.secagg_clipping_range:
            raise ConfigError(f"dp-clip = {cfg.dp_clip} is above secagg-clipping-range = "
                              f"{cfg.secagg_clipping_range}: the clipped contribution would not fit the quantizer")
    if not cfg.secure_aggregation:
        stray = sorted(k for k in declared_keys(SecureAggregationKeys)
                       if k not in ("secure-aggregation", "dp-min-honest") and given[k] != DEFAULTS[k])
        if stray:
            raise ConfigError(f"run config key(s) {stray} have no effect with secure-aggregation = false; set it "
                              "or remove them")
        return
    if family not in SECURE_FAMILIES:
        raise ConfigError(f"secure-aggregation = true is not available for method {cfg.method!r} (family "
                          f"{family!r}): {NOT_A_SUM.get(family, 'its payload is not a sum')}")
    if cfg.aggregation != "mean":
        raise ConfigError(f"secure-aggregation = true needs aggregation = 'mean', got {cfg.aggregation!r}: "
                          "robust aggregation cannot see inside masked vectors (each client's values are "
                          "clipped to ± secagg-clipping-range instead; docs/secure-aggregation.md)")
    if family == "logits" and cfg.extra.get("fccl-average-weights"):
        raise ConfigError("secure-aggregation = true with fccl-average-weights = true: only the logits are summed "
                          "securely, the models would travel in clear")
    if cfg.dp_mode == "payload":
        raise ConfigError("secure-aggregation = true with dp-mode = 'payload': that noise is sized for a server "
                          "that reads each release; under secure aggregation use dp-mode = 'sample', or none")


def _refuse_cross_sample_models(cfg: RunConfig) -> None:
    """DP-SGD needs per-sample gradients: a model with BatchNorm is refused now, naming the layer and
    the fix, not at the first round.

    Read from :mod:`pollen.models.catalog` (no torch, no model built; a test builds every model against
    it); only a model the catalog does not describe (one added with ``register_model``) is built, on the
    meta device. DP-SGD checks the module it trains again (:func:`pollen.privacy.dpsgd.dp_sgd`)."""
    from pollen.datasets.tasks import TaskOptions, resolve_task

    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    for name in [cfg.model] if cfg.model else sorted({task.default_model, *task.partition_models}):
        layer = FIRST_BATCHNORM[name] if name in FIRST_BATCHNORM else _built_first_batchnorm(cfg, task, name)
        if layer is not None:
            fitting = [m for m in MODEL_NAMES if FIRST_BATCHNORM[m] is None]
            raise ConfigError(f"run config key 'dp-mode' = 'sample': {cross_sample_refusal(name, *layer)}; "
                              f"Pollen's models without BatchNorm: {', '.join(fitting)} (run key 'model')")


def _built_first_batchnorm(cfg: RunConfig, task: Any, name: str) -> tuple[str, str] | None:
    """The first BatchNorm layer of a model the catalog does not describe: built (shapes only) to know."""
    import torch

    from pollen.models.spec import choose_model
    from pollen.privacy.dpsgd import first_cross_sample_layer

    with torch.device("meta"):
        return first_cross_sample_layer(choose_model(cfg, task, name=name).build())
