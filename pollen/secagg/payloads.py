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
VALUE, INTEGER, WEIGHT = "value", "integer", "weight"  # how a part is read back (scaled / whole / weight)
WEIGHT_PART, CLASS_WEIGHTS, LOGITS, CONTRIBUTORS = "weight", "class-weights", "logits", "contributors"


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
        out[part.name] = field.dequantize(chunk, q.clipping_range, q.levels) if part.role == VALUE else chunk
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
