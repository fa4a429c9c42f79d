"""What a reply contributes to a secure sum, per payload kind, and how the server reads the sum back.

Only sums can be aggregated securely, so every kind is written as one: integer *parts* whose totals the
server learns, and nothing else.

| kind | parts (client → sum) | the server's aggregate |
|---|---|---|
| ``weights`` | each array ``a`` of ``arrays``: ``w · q(a)``; ``weight``: ``w`` | ``Σ w·a / Σ w`` per array |
| ``prototypes`` | ``prototypes``: ``w_c · q(p_c)``; ``class-weights``: ``w_c`` | ``Σ w_c·p_c / Σ w_c`` per class |
| ``logits`` | ``logits``: ``q(l)`` (N0×C); ``contributors``: 1 | ``Σ l / contributors`` |
| ``sum`` | each array of ``arrays``: ``q(a)`` | ``Σ a`` |

``w`` is ``num-examples`` (weighting ``samples``) or 1 (``uniform``); ``w_c`` the class count or 1 for a
class held. ``q`` is :func:`pollen.secagg.field.quantize`; integer arrays (a BatchNorm counter) are summed
as whole numbers, clipped to the same magnitude. A weight above ``max_weight`` is refused, so the sum's
largest magnitude is known before the round starts (:func:`sum_bound`). FedProto and BD-FedProto
aggregate exactly as without secure aggregation (count-weighted class means), within quantization.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from pollen.protocol.prototypes import CLASS_COUNTS, PROTOTYPES
from pollen.protocol.records import ARRAYS, METRICS, NUM_EXAMPLES
from pollen.protocol.secagg import Layout, Part
from pollen.secagg import field

KINDS = ("weights", "prototypes", "logits", "sum")
SAMPLES = "samples"
WEIGHTINGS = (SAMPLES, "uniform")
# how a part is read back: scaled by the step / a whole number / a weight / a privatized value (scaled)
VALUE, INTEGER, WEIGHT, NOISY = "value", "integer", "weight", "noisy"
WEIGHT_PART, CLASS_WEIGHTS, LOGITS, CONTRIBUTORS = "weight", "class-weights", "logits", "contributors"
CLASS_SHARES = "class-shares"


@dataclass(frozen=True)
class Quantization:
    """The fixed point all clients of a round share: values clipped to ``±clipping_range`` in
    ``levels`` steps, weights at most ``max_weight``."""

    clipping_range: float
    levels: int
    max_weight: int

    def __post_init__(self):
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ValueError(f"secagg-clipping-range must be a finite number > 0, got {self.clipping_range!r}")
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 2:
            raise ValueError(f"secagg-quantization must be a whole number >= 2, got {self.levels!r}")
        if isinstance(self.max_weight, bool) or not isinstance(self.max_weight, int) or self.max_weight < 1:
            raise ValueError(f"the largest weight must be a whole number >= 1, got {self.max_weight!r}")


def _arrays(content: RecordDict) -> dict[str, np.ndarray]:
    record = content.get(ARRAYS)
    if not isinstance(record, ArrayRecord) or len(record) == 0:
        raise ValueError(f"the reply has no '{ARRAYS}' record to aggregate")
    return {k: a.numpy() for k, a in record.items()}


def _num_examples(content: RecordDict) -> int:
    metrics = content.get(METRICS)
    value = metrics.get(NUM_EXAMPLES) if isinstance(metrics, MetricRecord) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"the reply's metric '{NUM_EXAMPLES}' must be a whole number >= 0, got {value!r}")
    return int(value)


def _check_weight(w: np.ndarray | int, q: Quantization, what: str) -> None:
    if np.any(np.asarray(w) > q.max_weight):
        raise ValueError(f"{what} {int(np.max(w)):,} is above the largest weight secure aggregation accepts "
                         f"({q.max_weight:,}): the sum could overflow the ring")


def _quantized(name: str, array: np.ndarray, q: Quantization) -> tuple[str, np.ndarray]:
    if array.dtype.kind in "iub":
        bound = q.levels // 2
        return INTEGER, np.clip(array.astype(np.int64), -bound, bound)
    if array.dtype.kind != "f":
        raise ValueError(f"array '{name}' has dtype {array.dtype}: only numbers can be summed")
    return VALUE, field.quantize(array, q.clipping_range, q.levels)


def contribution(kind: str, weighting: str, content: RecordDict,
                 q: Quantization) -> tuple[Layout, list[np.ndarray]]:
    """Client side: a train reply's content as the integer parts it adds to the secure sum."""
    parts: list[tuple[str, str, np.ndarray]] = []
    if kind in ("weights", "sum"):
        arrays = _arrays(content)
        w = 1
        if kind == "weights" and weighting == "samples":
            w = _num_examples(content)
            _check_weight(w, q, f"'{NUM_EXAMPLES}'")
        for name in sorted(arrays):
            role, ints = _quantized(name, arrays[name], q)
            parts.append((name, role, ints * w))
        if kind == "weights":
            parts.append((WEIGHT_PART, WEIGHT, np.array(w, dtype=np.int64)))
    elif kind == "prototypes":
        arrays = _arrays(content)
        if PROTOTYPES not in arrays or CLASS_COUNTS not in arrays:
            raise ValueError(f"a prototype reply needs '{PROTOTYPES}' and '{CLASS_COUNTS}' to aggregate securely")
        protos, counts = arrays[PROTOTYPES], np.asarray(arrays[CLASS_COUNTS])
        if protos.ndim != 2 or counts.shape != (protos.shape[0],) or counts.dtype.kind not in "iu" \
                or np.any(counts < 0):
            raise ValueError(f"'{PROTOTYPES}' {protos.shape} and '{CLASS_COUNTS}' {counts.shape} "
                             f"({counts.dtype}) must be C×d and C whole numbers >= 0")
        held = counts > 0
        w_c = counts.astype(np.int64) if weighting == "samples" else held.astype(np.int64)
        _check_weight(w_c, q, f"a '{CLASS_COUNTS}' entry")
        rows = np.where(held[:, None], protos, 0.0)  # rows of absent classes carry nothing (and may be NaN)
        parts.append((PROTOTYPES, VALUE, field.quantize(rows, q.clipping_range, q.levels) * w_c[:, None]))
        parts.append((CLASS_WEIGHTS, WEIGHT, w_c))
    elif kind == "logits":
        arrays = _arrays(content)
        if LOGITS not in arrays:
            raise ValueError(f"a logit reply needs '{LOGITS}' to aggregate securely")
        parts.append((LOGITS, VALUE, field.quantize(arrays[LOGITS], q.clipping_range, q.levels)))
        parts.append((CONTRIBUTORS, WEIGHT, np.array(1, dtype=np.int64)))
    else:
        raise ValueError(f"unknown secure aggregation kind {kind!r}; one of {', '.join(KINDS)}")
    layout = tuple(Part(name, tuple(int(d) for d in ints.shape), role) for name, role, ints in parts)
    return layout, [np.asarray(ints, dtype=np.int64) for _, _, ints in parts]


def flatten(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(p) for p in parts]) if parts else np.zeros(0, dtype=np.int64)


def length(layout: Layout) -> int:
    return sum(p.size for p in layout)


def sum_bound(kind: str, weighting: str, num_nodes: int, q: Quantization) -> int:
    """The largest magnitude any coordinate of ``num_nodes`` clients' sum can reach."""
    weighted = kind in ("weights", "prototypes") and weighting == "samples"
    return num_nodes * (q.max_weight if weighted else 1) * max(q.levels // 2, 1)


def unflatten(layout: Layout, total: np.ndarray, q: Quantization) -> dict[str, np.ndarray]:
    """Server side: the signed integer totals as named sums — values in float64, the rest as int64."""
    out: dict[str, np.ndarray] = {}
    start = 0
    for part in layout:
        chunk = total[start:start + part.size].reshape(part.shape)
        start += part.size
        out[part.name] = field.dequantize(chunk, q.clipping_range, q.levels) if part.role in (VALUE, NOISY) else chunk
    return out


def mean_of_sums(kind: str, sums: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The aggregate a family's strategy wants from the sums (module table); empty classes stay 0."""
    if kind == "weights":
        total = int(sums[WEIGHT_PART])
        if total <= 0:
            raise ValueError("the securely summed weights are 0: nothing to average")
        return {k: v / total for k, v in sums.items() if k != WEIGHT_PART}
    if kind == "prototypes":
        w = np.asarray(sums[CLASS_WEIGHTS], dtype=np.float64)
        protos = np.zeros_like(sums[PROTOTYPES])
        held = w > 0
        protos[held] = sums[PROTOTYPES][held] / w[held, None]
        return {PROTOTYPES: protos, CLASS_WEIGHTS: sums[CLASS_WEIGHTS]}
    if kind == "logits":
        n = int(sums[CONTRIBUTORS])
        if n <= 0:
            raise ValueError("no contributor in the securely summed logits")
        return {LOGITS: sums[LOGITS] / n}
    return dict(sums)


# --- distributed DP (dp-mode = distributed): what one client contributes, and what the server makes of it ---
#
# | kind | the contribution vector (clipped as a whole to dp-clip by the client) | the server's aggregate |
# |---|---|---|
# | weights | the update: each float array − the broadcast | broadcast + Σ / survivors |
# | prototypes | ``s_c·p_c`` (C×d), ``s_c·B`` (C); s_c class share, p_c clipped to B = clip/√2 | Σ s_c·p_c / Σ s_c |
# | logits | the logits (N0×C) | Σ / survivors |
#
# Every client weighs the same (client-level DP); for prototypes the shares sum to 1 per client, so the
# vector's norm is at most clip by construction (Σ s_c² (|p_c|² + B²) <= 2 B² = clip²).


def _float_names(arrays: Mapping[str, np.ndarray]) -> list[str]:
    return sorted(k for k, a in arrays.items() if a.dtype.kind == "f")


def dp_vector(kind: str, content: RecordDict, broadcast: RecordDict | None,
              clip: float) -> tuple[Layout, np.ndarray]:
    """Client side: the float vector a reply contributes under distributed DP (table above) and its layout."""
    parts: list[tuple[str, np.ndarray]] = []
    if kind == "weights":
        arrays = _arrays(content)
        ref = broadcast.get(ARRAYS) if broadcast is not None else None
        if not isinstance(ref, ArrayRecord):
            raise ValueError("distributed DP on weights needs the broadcast model to form the update")
        for name in _float_names(arrays):
            if name not in ref or tuple(ref[name].shape) != arrays[name].shape:
                raise ValueError(f"array '{name}' of the reply is not in the broadcast model (or has another shape)")
            parts.append((name, arrays[name].astype(np.float64) - ref[name].numpy().astype(np.float64)))
    elif kind == "prototypes":
        arrays = _arrays(content)
        protos, counts = arrays[PROTOTYPES].astype(np.float64), np.asarray(arrays[CLASS_COUNTS], dtype=np.float64)
        total = counts.sum()
        shares = counts / total if total > 0 else counts
        bound = clip / math.sqrt(2)
        norms = np.linalg.norm(np.where(counts[:, None] > 0, protos, 0.0), axis=1)
        scaled = np.where((counts > 0)[:, None], protos * np.minimum(1.0, bound / np.maximum(norms, 1e-30))[:, None],
                          0.0)
        parts += [(PROTOTYPES, shares[:, None] * scaled), (CLASS_SHARES, shares * bound)]
    elif kind == "logits":
        parts.append((LOGITS, _arrays(content)[LOGITS].astype(np.float64)))
    else:
        raise ValueError(f"distributed DP has no contribution of kind {kind!r}")
    layout = tuple(Part(name, tuple(int(d) for d in v.shape), NOISY) for name, v in parts)
    return layout, np.concatenate([v.ravel() for _, v in parts])


def dp_aggregate(kind: str, sums: Mapping[str, np.ndarray], survivors: int, clip: float,
                 broadcast: Mapping[str, np.ndarray] | None = None, noise_std: float = 0.0) -> dict[str, np.ndarray]:
    """Server side: the family's aggregate from the noisy sums of ``survivors`` clients (table above). For
    prototypes a class counts as present when its summed share is above 3 stds of its noise (and 1/2)."""
    if survivors < 1:
        raise ValueError("no survivor in the noisy sum")
    if kind == "weights":
        base = dict(broadcast or {})
        return {**base, **{k: base[k] + v / survivors for k, v in sums.items()}}
    if kind == "prototypes":
        bound = clip / math.sqrt(2)
        weight = np.asarray(sums[CLASS_SHARES], dtype=np.float64) / bound
        present = weight > max(0.5, 3 * noise_std / bound)
        protos = np.zeros_like(sums[PROTOTYPES])
        protos[present] = sums[PROTOTYPES][present] / weight[present, None]
        return {PROTOTYPES: protos, CLASS_WEIGHTS: present.astype(np.int64)}
    if kind == "logits":
        return {LOGITS: sums[LOGITS] / survivors}
    raise ValueError(f"distributed DP has no aggregate of kind {kind!r}")
