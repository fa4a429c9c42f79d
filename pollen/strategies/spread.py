"""Each reply held against its own round: one far outside the round's spread is refused.

The declared bounds (:class:`~pollen.protocol.screening.PayloadBounds`) are an outer wall: fixed
numbers, loose enough for any honest model, so a hostile node stays under them while sending a hundred
times what honest nodes send — and the weighted mean follows it. This rule needs no number of the
model's scale: each reply yields a *size* per measure of its family, and a reply whose size is more than
``factor`` × the round's median size of that measure is refused, named in a WARNING and in the round's
``rejected`` records (its ratio too).

| family | measure (one size per reply) |
|---|---|
| weights, GLFC and homogeneous-logit models | ``‖reply − broadcast‖₂`` over the float entries (the update norm) |
| prototypes | the largest norm of a held class's prototype row |
| logits | the RMS of the logit matrix with each row's mean taken out (softmax ignores a row's shift) |
| GLFC gradient sets | the largest L2 norm of the reply's gradient sets |

Why the median: it is the size of a typical reply of *this* round, so a round in which every client
moves a lot (round 1) is held to its own large median, and no honest client is refused for it. Its
breakdown point: fewer than half the replies that carry a measure can be hostile before they set the
median themselves; with fewer than ``MIN_REPLIES`` such replies a round has no spread to hold them to
and only the declared bounds apply. A hostile node below ``factor`` × the median still counts in full
under ``aggregation = mean``; ``median`` / ``trimmed-mean`` bound what such nodes do
(:mod:`pollen.strategies.aggregation`, docs/strategies.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pollen.settings.common import HostileKeys

DEFAULT_OUTLIER_FACTOR = HostileKeys.outlier_factor  # the run key outlier-factor's default, declared there
MIN_REPLIES = 3  # a median of fewer replies is set by any one of them

UPDATE_NORM = "update norm"
PROTOTYPE_NORM = "prototype norm"
LOGIT_RMS = "centred logit RMS"
GRADIENT_NORM = "gradient-set norm"


@dataclass(frozen=True)
class Outlier:
    """One reply far outside its round: which (its position), by which measure, and how far."""

    index: int
    measure: str
    size: float
    median: float

    @property
    def ratio(self) -> float:
        return self.size / self.median


def check_factor(factor: float) -> float:
    """``factor`` as a float: 0 (the rule is off) or a finite number > 0; else a ValueError naming it. (Below
    about 2 it refuses honest replies: a factor of 1 refuses every reply above the median.)"""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        raise ValueError(f"outlier_factor must be 0 (off) or a finite number > 0, got {factor!r}")
    return float(factor)


def _size(value: float) -> float:
    value = float(value)
    return math.inf if math.isnan(value) else value


def medians(sizes: Sequence[Mapping[str, float]]) -> dict[str, tuple[int, float]]:
    """``{measure: (replies that carry it, their median size)}`` for the round's replies ``sizes[i]``. A NaN
    size counts as infinite: far, and unable to make the median NaN (which would judge nobody)."""
    out: dict[str, tuple[int, float]] = {}
    for measure in sorted({m for s in sizes for m in s}):
        values = [_size(s[measure]) for s in sizes if measure in s]
        out[measure] = (len(values), float(np.median(values)))
    return out


def far_outside(sizes: Sequence[Mapping[str, float]], factor: float) -> list[Outlier]:
    """The replies (by position in ``sizes``) with a size above ``factor`` × the median of its measure.

    ``sizes[i]``: reply i's size per measure (a reply without a measure does not vote on it). A measure
    with fewer than ``MIN_REPLIES`` sizes, or a median of 0, judges nobody; ``factor = 0`` judges nobody.
    A reply far outside in several measures is named once, by its largest ratio.
    """
    if factor == 0:
        return []
    worst: dict[int, Outlier] = {}
    for measure, (count, median) in medians(sizes).items():
        if count < MIN_REPLIES or not median > 0:
            continue
        for i, s in enumerate(sizes):
            size = float(s.get(measure, 0.0))
            if not size <= factor * median:  # NaN or inf is far outside too
                found = Outlier(i, measure, size, median)
                if i not in worst or found.ratio > worst[i].ratio:
                    worst[i] = found
    return [worst[i] for i in sorted(worst)]


def spread_record(sizes: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float | None]]:
    """What a round's spread looked like, per measure: the replies that carry it, their median size and
    the largest ratio to it (how close the round came to the factor), for ``metrics.jsonl``."""
    out: dict[str, dict[str, float | None]] = {}
    for measure, (count, median) in medians(sizes).items():
        top = max(_size(s[measure]) for s in sizes if measure in s)
        ratio = top / median if median > 0 and math.isfinite(top) else None
        out[measure] = {"replies": count, "median": median, "max-ratio": ratio}
    return out


def _float_entries(arrays: Iterable[np.ndarray]) -> Iterable[np.ndarray]:
    return (np.asarray(a, dtype=np.float64) for a in arrays if np.asarray(a).dtype.kind == "f")


def update_norm(state: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray]) -> float:
    """``‖state − broadcast‖₂`` over the float entries both hold, in float64."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for key, base in broadcast.items():
            if key in state and np.asarray(base).dtype.kind == "f":
                total += float(np.square(np.asarray(state[key], np.float64) - np.asarray(base, np.float64)).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def largest_norm(groups: Iterable[Iterable[np.ndarray]]) -> float:
    """The largest L2 norm of a group of arrays (a gradient set, a prototype row), 0 for no group."""
    out = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for group in groups:
            total = sum(float(np.square(a).sum()) for a in _float_entries(group))
            out = max(out, math.sqrt(total) if math.isfinite(total) else math.inf)
    return out


def prototype_size(protos: np.ndarray, counts: np.ndarray) -> float:
    """The largest norm of a held class's prototype row (``counts > 0``)."""
    held = np.asarray(protos)[np.asarray(counts) > 0]
    return largest_norm([row] for row in held)


def logit_size(logits: np.ndarray) -> float:
    """RMS of the logits with each row's mean removed: what a softmax of them can see."""
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        centred = x - x.mean(axis=1, keepdims=True)
        value = float(np.sqrt(np.mean(np.square(centred)))) if centred.size else 0.0
    return value if math.isfinite(value) else math.inf
