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
            role, ints = _quantized(name, arrays[name], q)  # a fresh array: weighted in place
            ints *= w
            parts.append((name, role, ints))
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
# | kind | the contribution (L2 norm <= dp-clip: by construction, else clipped) | the server's aggregate |
# |---|---|---|
# | weights | the update: each float array − the broadcast | broadcast + Σ / (q·m) |
# | prototypes | ``a_c·p_c`` (C×d), ``a_c·β`` (C): :func:`prototype_contribution` | :func:`prototype_estimate` |
# | logits | the logits (N0×C) | Σ / (q·m) |
#
# Every client weighs the same (client-level DP). ``m`` is the number of clients in the sum and ``q`` the
# probability that each contributed its update (``dp-sampling``; the others contributed zeros): ``q·m`` is the
# expected number of updates in the sum, so the aggregate does not depend on who was sampled.

PRESENCE_ERROR = 0.5  # a class's noisy prototype is used when its expected error is at most this share of its bound


def prototype_split(clip: float, dim: int) -> tuple[float, float]:
    """``(B, β)``: how a prototype contribution of L2 norm ``clip`` splits its budget between the d prototype
    coordinates (each class's prototype clipped to ``B``) and the class's weight coordinate (``β`` per unit of
    weight), ``B² + β² = clip²``.

    Why this split: the server's estimate of a class prototype is ``U / (W / β)`` — numerator ``U = Σ a·p``
    (d coordinates), denominator ``W = Σ a·β`` — both with noise of std σ per coordinate. To first order its
    error is ``(n_U − g·n_W/β) / A`` (``A = Σ a``), of expected squared norm ``σ² (d + |g|²/β²) / A²`` ≤
    ``σ² (d + B²/β²) / A²``. Relative to the prototype's scale B that is ``σ² (d/B² + 1/β²) / A²``, smallest
    under ``B² + β² = clip²`` at ``B² = clip² √d / (√d + 1)``: then ``(√d + 1)² σ² / (clip² A²)``, against
    ``2 (d + 1) σ² / (clip² A²)`` for an even split (1.57× the variance at d = 50)."""
    root = math.sqrt(dim)
    return clip * math.sqrt(root / (root + 1)), clip / math.sqrt(root + 1)


def prototype_contribution(prototypes: np.ndarray, counts: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """One client's prototype contribution under distributed DP: ``(a_c·p̃_c (C×d), a_c·β (C))``.

    ``a_c = n_c / ‖n‖₂`` — the class counts normalized in L2, not L1: ``Σ a_c² = 1`` whatever the client holds,
    so the vector's norm is at most ``clip`` (``Σ a_c² (|p̃_c|² + β²) ≤ B² + β²``), and a client with k classes
    gives each ``1/√k`` instead of ``1/k`` of its weight (k times the signal variance under the same noise);
    ``p̃_c`` is the class prototype clipped to ``B`` (:func:`prototype_split`). Classes it does not hold add 0."""
    protos = np.asarray(prototypes, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    bound, beta = prototype_split(clip, protos.shape[1])
    held = counts > 0
    norm = float(np.linalg.norm(counts))
    a = counts / norm if norm > 0 else np.zeros_like(counts)
    rows = np.where(held[:, None], protos, 0.0)
    lengths = np.linalg.norm(rows, axis=1)
    clipped = rows * np.minimum(1.0, bound / np.maximum(lengths, 1e-300))[:, None]
    return a[:, None] * clipped, a * beta


def prototype_estimate(sums: np.ndarray, weights: np.ndarray, noise_std: float,
                       clip: float) -> tuple[np.ndarray, np.ndarray]:
    """Server side: ``(global prototypes C×d, present C)`` from the noisy sums of :func:`prototype_contribution`
    (noise of std ``noise_std`` per coordinate). A class is present when its estimated weight ``Â = W/β`` is
    positive and the expected error of its prototype, ``σ √(d + B²/β²) / Â`` (:func:`prototype_split`), is at
    most ``PRESENCE_ERROR · B``: a prototype drowned in noise would pull the clients' embeddings towards a
    random point; absent, the clients train without it (and the strategy keeps the class's last prototype)."""
    sums = np.asarray(sums, dtype=np.float64)
    dim = sums.shape[1]
    bound, beta = prototype_split(clip, dim)
    weight = np.asarray(weights, dtype=np.float64) / beta
    error = noise_std * math.sqrt(dim + (bound / beta) ** 2)
    present = (weight > 0) & (error <= PRESENCE_ERROR * bound * weight)
    protos = np.zeros_like(sums)
    protos[present] = sums[present] / weight[present, None]
    return protos, present


def _float_names(arrays: Mapping[str, np.ndarray]) -> list[str]:
    return sorted(k for k, a in arrays.items() if a.dtype.kind == "f")


def dp_layout(kind: str, broadcast: RecordDict | None, shape: Sequence[int] = ()) -> Layout:
    """The layout every client's contribution has under distributed DP (the table above), stated by the server
    before anyone trains: weights from the broadcast model's float arrays; prototypes (``shape`` = C, d) and
    logits (``shape`` = N0, C) from the strategy's sizes."""
    if kind == "weights":
        ref = broadcast.get(ARRAYS) if broadcast is not None else None
        if not isinstance(ref, ArrayRecord) or len(ref) == 0:
            raise ValueError("distributed DP on weights needs the broadcast model to form the update")
        arrays = {k: a.numpy() for k, a in ref.items()}
        return tuple(Part(name, tuple(int(d) for d in arrays[name].shape), NOISY) for name in _float_names(arrays))
    dims = tuple(int(d) for d in shape)
    if len(dims) != 2 or min(dims) < 1:
        raise ValueError(f"distributed DP on {kind} needs the contribution's two sizes, got {tuple(shape)}")
    if kind == "prototypes":
        return Part(PROTOTYPES, dims, NOISY), Part(CLASS_SHARES, dims[:1], NOISY)
    if kind == "logits":
        return (Part(LOGITS, dims, NOISY),)
    raise ValueError(f"distributed DP has no contribution of kind {kind!r}")


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
        if PROTOTYPES not in arrays or CLASS_COUNTS not in arrays:
            raise ValueError(f"a prototype reply needs '{PROTOTYPES}' and '{CLASS_COUNTS}' under distributed DP")
        protos, shares = prototype_contribution(arrays[PROTOTYPES], arrays[CLASS_COUNTS], clip)
        parts += [(PROTOTYPES, protos), (CLASS_SHARES, shares)]
    elif kind == "logits":
        parts.append((LOGITS, _arrays(content)[LOGITS].astype(np.float64)))
    else:
        raise ValueError(f"distributed DP has no contribution of kind {kind!r}")
    layout = tuple(Part(name, tuple(int(d) for d in v.shape), NOISY) for name, v in parts)
    return layout, np.concatenate([v.ravel() for _, v in parts])


def dp_aggregate(kind: str, sums: Mapping[str, np.ndarray], contributions: float, clip: float,
                 broadcast: Mapping[str, np.ndarray] | None = None, noise_std: float = 0.0) -> dict[str, np.ndarray]:
    """Server side: the family's aggregate from the noisy sums (table above); ``contributions`` is ``q·m``, the
    expected number of updates in the sum; ``noise_std`` the sum's noise per coordinate (value units)."""
    if not contributions > 0:
        raise ValueError("no contribution in the noisy sum")
    if kind == "weights":
        base = dict(broadcast or {})
        return {**base, **{k: base[k] + v / contributions for k, v in sums.items()}}
    if kind == "prototypes":
        protos, present = prototype_estimate(sums[PROTOTYPES], sums[CLASS_SHARES], noise_std, clip)
        return {PROTOTYPES: protos, CLASS_WEIGHTS: present.astype(np.int64)}
    if kind == "logits":
        return {LOGITS: sums[LOGITS] / contributions}
    raise ValueError(f"distributed DP has no aggregate of kind {kind!r}")
