"""Screening what a client sends, before any of it is used.

Every check here reads only what a record carries *next to* its data: an :class:`~flwr.app.Array`'s
``dtype``, ``shape`` and byte length are plain attributes, so a reply with the wrong dtype, the wrong
shape or an oversized payload is refused without decoding a single byte. Only replies that pass get
decoded, and then values (finiteness, ranges) are checked on the decoded arrays.

Each check returns ``None`` for a good value or a one-line reason that names the key; strategies drop
the reply with that reason (logged as a WARNING and recorded), and the rest of the round goes on. A
metric the strategy only reports (a loss, an accuracy) is the exception: a bad one is dropped alone
(:func:`screen_metrics`), never the model update it came with.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord

from pollen.settings.common import HostileKeys

# ``np.save`` writes a small header in front of the raw bytes; anything beyond header + data is padding
# a client added on purpose.
_NPY_HEADER_MAX = 4096


@dataclass(frozen=True)
class ArraySpec:
    """Expected shape (``None`` = any size on that axis) and dtype of one named array."""

    key: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"  # a numpy dtype name, "float" (any float width) or "any"
    finite: bool = True
    nonnegative: bool = False
    max_value: float | None = None
    max_abs: float | None = None  # for values whose products must stay finite (distances, margins)


def _shape_text(shape: Sequence[int | None]) -> str:
    return "x".join("*" if s is None else str(s) for s in shape) or "scalar"


def check_array_meta(array: Any, spec: ArraySpec) -> str | None:
    """Type, dtype, shape and byte size of one record entry, from metadata only (nothing decoded)."""
    if not isinstance(array, Array):
        return f"'{spec.key}': not an Array ({type(array).__name__})"
    if array.stype != "numpy.ndarray":
        return f"'{spec.key}': serialisation {array.stype!r} is not 'numpy.ndarray'"
    shape = tuple(array.shape)
    if len(shape) != len(spec.shape) or any(w is not None and g != w for g, w in zip(shape, spec.shape)):
        return f"'{spec.key}': shape {_shape_text(shape)} != expected {_shape_text(spec.shape)}"
    try:
        dtype = np.dtype(array.dtype)
    except TypeError:
        return f"'{spec.key}': unknown dtype {array.dtype!r}"
    if spec.dtype == "float" and dtype.kind != "f":
        return f"'{spec.key}': dtype {dtype} is not a float type"
    if spec.dtype not in ("float", "any") and dtype != np.dtype(spec.dtype):
        return f"'{spec.key}': dtype {dtype} != expected {spec.dtype}"
    if dtype.kind not in "biuf":
        return f"'{spec.key}': dtype {dtype} is not numeric"
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not expected <= len(array.data) <= expected + _NPY_HEADER_MAX:
        return f"'{spec.key}': {len(array.data)} bytes for a {_shape_text(shape)} {dtype} array"
    return None


def check_array_values(key: str, value: np.ndarray, spec: ArraySpec) -> str | None:
    """Finiteness and range of one decoded array."""
    if spec.finite and value.dtype.kind == "f" and not np.isfinite(value).all():
        return f"'{key}': contains NaN or infinite values"
    if spec.nonnegative and value.size and value.min() < 0:
        return f"'{key}': contains negative values"
    if spec.max_value is not None and value.size and value.max() > spec.max_value:
        return f"'{key}': value {value.max()} above the plausible maximum {spec.max_value:g}"
    if spec.max_abs is not None and value.size:
        finite = value[np.isfinite(value)] if value.dtype.kind == "f" else value
        if finite.size and np.abs(finite).max() > spec.max_abs:
            return f"'{key}': magnitude {np.abs(finite).max():g} above the plausible maximum {spec.max_abs:g}"
    return None


def decode_record(record: Any, specs: Sequence[ArraySpec], *,
                  allow_extra: bool = False) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """``(arrays by key, None)`` when ``record`` holds exactly ``specs``, else ``(None, reason)``.

    Keys, dtypes, shapes and sizes are checked before anything is decoded; values after.
    """
    if not isinstance(record, ArrayRecord):
        return None, f"expected an ArrayRecord, got {type(record).__name__}"
    wanted = [s.key for s in specs]
    missing = [k for k in wanted if k not in record]
    if missing:
        return None, f"missing key(s) {missing}"
    extra = [k for k in record if k not in wanted]
    if extra and not allow_extra:
        return None, f"unexpected key(s) {extra[:5]}"
    for spec in specs:
        reason = check_array_meta(record[spec.key], spec)
        if reason is not None:
            return None, reason
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            value = record[spec.key].numpy()
        except Exception as err:  # corrupt bytes behind valid metadata
            return None, f"'{spec.key}': undecodable ({type(err).__name__})"
        if value.shape != tuple(record[spec.key].shape) or value.dtype != np.dtype(record[spec.key].dtype):
            return None, f"'{spec.key}': data disagrees with its declared dtype/shape"
        reason = check_array_values(spec.key, value, spec)
        if reason is not None:
            return None, reason
        out[spec.key] = value
    return out, None


@dataclass(frozen=True)
class MetricBound:
    """Range of one known metric; ``integer`` demands a whole number.

    ``reported``: a value the strategy only reports (a loss, an accuracy). A bad one is dropped from the
    round's metrics with a WARNING and the reply still counts; a bad value of any other bounded key (the
    ``num-examples`` weight, the ``partition-id`` claim: values the strategy acts on) refuses the reply.
    """

    low: float | None = None
    high: float | None = None
    integer: bool = False
    required: bool = False
    reported: bool = False


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Sane finite ranges for every metric value: a number beyond them is no measurement, and summing a few
# (the round's weighted means) would overflow. 2**53: the largest magnitude at which a float still holds
# every integer (52-bit digests fit); losses (any key ending in "loss") far below, so a mean stays finite.
MAX_METRIC_ABS = 2.0**53
MAX_LOSS_ABS = 1e12

# Any metric whose name ends in ``accuracy`` is a fraction.
ACCURACY = MetricBound(0.0, 1.0, reported=True)


def _bound_for(key: str, bounds: Mapping[str, MetricBound]) -> MetricBound | None:
    if key in bounds:
        return bounds[key]
    return ACCURACY if key.endswith("accuracy") else None


def check_metric(key: str, value: Any, bound: MetricBound | None) -> str | None:
    """``None`` for a good value of one metric, else the reason naming the key: a finite number (or list
    of them) within ``MAX_METRIC_ABS`` (keys ending in ``loss``: ``MAX_LOSS_ABS``), and within ``bound``
    (a list only where the bound is ``reported``: each element)."""
    values: list[Any] = value if isinstance(value, list) else [value]
    for v in values:
        if not _finite_number(v):
            return f"metric '{key}' = {v!r} is not a finite number"
        cap = MAX_LOSS_ABS if key.endswith("loss") else MAX_METRIC_ABS
        if abs(v) > cap:
            return f"metric '{key}' = {v!r} is beyond the sane range ±{cap:g}"
    if bound is None:
        return None
    if isinstance(value, list) and not bound.reported:
        return f"metric '{key}' must be a single number, got a list"
    for v in values:
        if bound.integer and not isinstance(v, int) and float(v) != int(v):
            return f"metric '{key}' = {v!r} is not a whole number"
        if bound.low is not None and v < bound.low:
            return f"metric '{key}' = {v!r} is below {bound.low:g}"
        if bound.high is not None and v > bound.high:
            return f"metric '{key}' = {v!r} is above {bound.high:g}"
    return None


def check_metrics(metrics: Any, bounds: Mapping[str, MetricBound]) -> str | None:
    """The strict rule: the first bad metric (:func:`check_metric`) refuses the reply. Keys ending in
    ``accuracy`` are checked by :func:`check_accuracy_keys`, not here."""
    if not isinstance(metrics, (MetricRecord, dict)):
        return f"metrics: expected a MetricRecord, got {type(metrics).__name__}"
    for key, spec in bounds.items():
        if spec.required and key not in metrics:
            return f"metric '{key}' is missing"
    for key, value in metrics.items():
        reason = check_metric(key, value, bounds.get(key))
        if reason is not None:
            return reason
    return None


@dataclass
class MetricScreen:
    """What :func:`screen_metrics` made of one reply's metrics."""

    kept: dict[str, Any]  # the metrics that count
    dropped: list[tuple[str, Any, str]]  # (key, value, reason) of each reported metric left out
    reason: str | None  # why the whole reply is refused, else None


def screen_metrics(metrics: Any, bounds: Mapping[str, MetricBound]) -> MetricScreen:
    """The Message-API rule: a bad value of a bounded key that is not ``reported`` refuses the reply
    (``reason``); a bad value of any other key (unknown keys, losses, ``*accuracy``) is dropped, and
    the rest of the reply — its model update included — still counts."""
    if not isinstance(metrics, (MetricRecord, dict)):
        return MetricScreen({}, [], f"metrics: expected a MetricRecord, got {type(metrics).__name__}")
    for key, spec in bounds.items():
        if spec.required and key not in metrics:
            return MetricScreen({}, [], f"metric '{key}' is missing")
    kept: dict[str, Any] = {}
    dropped: list[tuple[str, Any, str]] = []
    for key, value in metrics.items():
        value = list(value) if isinstance(value, list) else value
        bound = _bound_for(key, bounds)
        reason = check_metric(key, value, bound)
        if reason is None:
            kept[key] = value
        elif bound is not None and not bound.reported:
            return MetricScreen({}, [], reason)
        else:
            dropped.append((key, value, reason))
    return MetricScreen(kept, dropped, None)


# Bounds every family shares. ``num-examples`` is capped by the strategy (``max_examples``).
# No federation has 2**31 partitions; a larger claim is absurd, and one above 2**53 would not even survive
# the float comparisons the strategies make, so it is refused here rather than half-accepted later.
MAX_PARTITION_ID = 2**31 - 1
COMMON_METRICS: dict[str, MetricBound] = {
    "partition-id": MetricBound(0, MAX_PARTITION_ID, integer=True),
    "loss": MetricBound(0.0, None, reported=True),
    "train-loss": MetricBound(0.0, None, reported=True),
}


def metric_bounds(max_examples: int, *, evaluate: bool) -> dict[str, MetricBound]:
    """Bounds for a train or evaluate reply: counts capped (``*accuracy`` keys: :data:`ACCURACY`)."""
    bounds = dict(COMMON_METRICS)
    bounds["num-examples"] = MetricBound(0 if evaluate else 1, max_examples, integer=True, required=True)
    return bounds


def check_accuracy_keys(metrics: Mapping[str, Any]) -> str | None:
    """The strict rule for keys ending in ``accuracy``: a number outside [0, 1] refuses the reply."""
    for key, value in metrics.items():
        if key.endswith("accuracy") and not isinstance(value, list) and _finite_number(value) \
                and not 0.0 <= value <= 1.0:
            return f"metric '{key}' = {value!r} is outside [0, 1]"
    return None


@dataclass(frozen=True)
class PayloadBounds:
    """The declared bound of each payload kind, checked before anything is aggregated (run keys in
    parentheses; prototypes keep ``pollen.protocol.prototypes.MAX_PROTOTYPE_ABS``).

    * ``max_update_norm`` (``max-update-norm``): weights, GLFC models and homogeneous-mode logit models.
      The rule is relative, ``‖reply − broadcast‖₂ ≤ max_update_norm · max(‖broadcast‖₂, 1)`` over the
      float entries: one number then fits models of every size and scale (an absolute per-value bound
      would have to be loose enough for the largest BatchNorm variance of any task), and it measures
      what a client changed rather than what it was given. The floor of 1 keeps a freshly zeroed model
      trainable. Integer entries (BatchNorm's batch counters) are not norm-bounded: they are rounded
      and clipped to their type when averaged.
    * ``max_logit_abs`` (``max-logit-abs``): every public-set logit within ±this.
    * ``max_grad_norm`` (``max-grad-norm``): the L2 norm of each GLFC prototype-gradient set (all LeNet
      parameters of one set together), checked before the proxy sees any of it.

    The defaults leave honest clients orders of magnitude of room (a LeNet gradient set measured at
    norm ≈ 30; an honest round moves a model by well under its own norm) and refuse the absurd: a
    reply of 3e38 is ~1e37 times any broadcast model.

    ``dp``: under differential privacy, the bounds the run's DP keys give
    (:func:`pollen.privacy.bounds.dp_bounds`). Where they size a kind's noise they replace its declared
    bound (:meth:`declared`), and the strategy checks them; prototypes get them on top of theirs.
    """

    max_update_norm: float = HostileKeys.max_update_norm
    max_logit_abs: float = HostileKeys.max_logit_abs
    max_grad_norm: float = HostileKeys.max_grad_norm
    # a pollen.privacy.bounds.DpBounds: the privacy layer builds it and applies it, the contract only carries it
    dp: Any = None

    def __post_init__(self) -> None:
        for name in ("max_update_norm", "max_logit_abs", "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def declared(self) -> PayloadBounds:
        """The bounds the protocol decoders apply: these, or under a DP bound that sizes model, logit
        and gradient noise (``dp-mode = payload``) float64's largest number for those kinds, so the
        decoders refuse only what is not finite and the DP bound, checked next, decides (logits, which
        are float32, against float32's largest)."""
        if self.dp is None or not self.dp.bounds_models:
            return self
        top = sys.float_info.max
        return PayloadBounds(top, float(np.finfo(np.float32).max), top)


def _float_norm(arrays: Iterable[np.ndarray]) -> float:
    """L2 norm over the float entries of ``arrays``, in float64 (inf when even float64 overflows)."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            if a.dtype.kind == "f" and a.size:
                total += float(np.square(a, dtype=np.float64).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def check_update_norm(reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                      max_update_norm: float) -> str | None:
    """``None`` when ``‖reply − broadcast‖₂ ≤ max_update_norm · max(‖broadcast‖₂, 1)`` over the float
    entries both hold (:class:`PayloadBounds`), else the reason with both norms."""
    with np.errstate(over="ignore", invalid="ignore"):
        delta = _float_norm(np.asarray(reply[k], dtype=np.float64) - np.asarray(broadcast[k], dtype=np.float64)
                            for k in broadcast if k in reply and np.asarray(broadcast[k]).dtype.kind == "f")
    scale = max(_float_norm(np.asarray(v) for v in broadcast.values()), 1.0)
    if not delta <= max_update_norm * scale:
        return (f"update norm {delta:.4g} is {delta / scale:.4g} × the broadcast model's norm {scale:.4g}, "
                f"above the bound max-update-norm = {max_update_norm:g}")
    return None


def check_gradient_norm(key: str, arrays: Iterable[np.ndarray], max_grad_norm: float) -> str | None:
    """``None`` when the L2 norm of one gradient set is within ``max_grad_norm``, else the reason."""
    norm = _float_norm(arrays)
    if not norm <= max_grad_norm:
        return f"'{key}': gradient norm {norm:.4g} above the bound max-grad-norm = {max_grad_norm:g}"
    return None
