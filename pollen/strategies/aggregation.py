"""How accepted client values combine, coordinate by coordinate: weighted mean, median or trimmed mean.

Screening (:mod:`pollen.protocol.screening`) refuses absurd values, but a hostile node can still send
values that are plausible in size and wrong. The weighted mean follows any single client as far as
it likes; the two robust rules do not:

* ``mean`` (weighted by ``num-examples`` or uniform, the strategy's weighting): breakdown point 0 —
  one hostile client can drag it arbitrarily far. O(n) per coordinate for n clients.
* ``median``: breakdown point just under 1/2 — ``floor((n - 1) / 2)`` hostile clients of n cannot
  drag it outside the honest clients' range. O(n) per coordinate (``np.median`` partitions, no sort).
* ``trimmed-mean``: drops the ``k = floor(trim_fraction · n)`` smallest and largest values of each
  coordinate and averages the rest; breakdown point ``k / n`` — ``k`` hostile clients cannot drag it
  outside the honest range. O(n log n) per coordinate (one sort along the clients).

Both robust rules need every client's values at once (an n × size float64 stack per array), where
the mean needs one running sum. They weigh clients equally: a client's claimed ``num-examples`` is
itself an unverified number, and a robust rule that trusted it could be outweighed by one claim.
With fewer than three clients the median is the mean; ``trim_fraction < 0.5`` always leaves at least
one value (``2k < n``), and with ``k = 0`` the trimmed mean is the unweighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollen.settings import AGGREGATIONS
from pollen.settings.common import HostileKeys

# The run key's default (0.2 drops one value at each end from five clients; 0.1 would drop nothing below
# ten: the smallest federations still get a trimmed mean that one hostile client cannot move).
DEFAULT_TRIM_FRACTION = HostileKeys.trim_fraction


def average_arrays(client_arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
    """Weighted mean of each array position across clients, in float64, cast back to the input dtype.

    Integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are rounded, so the result keeps the
    exact dtypes the clients use.
    """
    if not client_arrays:
        raise ValueError("average_arrays needs at least one client")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(client_arrays),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {len(client_arrays)} non-negative numbers with a positive sum")
    w = w / w.sum()
    out = []
    for position in zip(*client_arrays):
        acc = sum(wi * a.astype(np.float64) for wi, a in zip(w, position))
        ref = position[0]
        if ref.dtype.kind in "iu":  # round, and clip so the float64 mean never wraps the integer type
            info = np.iinfo(ref.dtype)
            with np.errstate(invalid="ignore"):
                out.append(np.clip(np.rint(acc), float(info.min), float(info.max)).astype(ref.dtype))
                if len(client_arrays) == 1:  # one client: its own value, exactly (float64 has 53 bits)
                    out[-1] = position[0].copy()
        else:
            out.append(acc.astype(ref.dtype))
    return out


def check_aggregation(aggregation: str, trim_fraction: float) -> None:
    """Refuse an unknown rule or a trim fraction outside [0, 0.5), naming the value."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if isinstance(trim_fraction, bool) or not isinstance(trim_fraction, (int, float)) \
            or not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be a number in [0, 0.5), got {trim_fraction!r}")


def trim_count(n: int, trim_fraction: float) -> int:
    """Values dropped at each end of ``n``: ``floor(trim_fraction · n)`` (< n / 2 for a fraction < 0.5)."""
    return int(trim_fraction * n)


def robust_stack(values: Sequence[np.ndarray], aggregation: str, trim_fraction: float = 0.0) -> np.ndarray:
    """The coordinate-wise median or trimmed mean of equally shaped arrays, in float64.

    ``values`` are the clients' arrays (one per client); the result has their shape.
    """
    if not values:
        raise ValueError("robust aggregation needs at least one client")
    shape = np.shape(values[0])
    for i, v in enumerate(values):
        if np.shape(v) != shape:
            raise ValueError(f"client {i}: shape {np.shape(v)} != {shape}")
    stack = np.stack([np.asarray(v, dtype=np.float64) for v in values])
    if aggregation == "median":
        return np.median(stack, axis=0)
    if aggregation == "trimmed-mean":
        k = trim_count(len(values), trim_fraction)
        ordered = np.sort(stack, axis=0)
        return ordered[k:len(values) - k].mean(axis=0)
    raise ValueError(f"robust_stack computes 'median' or 'trimmed-mean', got {aggregation!r}")


def _cast_like(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Back to ``like``'s dtype; integers rounded and clipped so the float never wraps the type."""
    if like.dtype.kind in "iu":
        info = np.iinfo(like.dtype)
        return np.clip(np.rint(value), float(info.min), float(info.max)).astype(like.dtype)
    return value.astype(like.dtype)


def robust_arrays(client_arrays: Sequence[Sequence[np.ndarray]], aggregation: str,
                  trim_fraction: float = 0.0) -> list[np.ndarray]:
    """Each array position of the clients' lists combined by ``aggregation`` (median or trimmed mean),
    cast back to the first client's dtype (integers rounded, as :func:`average_arrays` does)."""
    if not client_arrays:
        raise ValueError("robust aggregation needs at least one client")
    return [_cast_like(robust_stack(list(position), aggregation, trim_fraction), position[0])
            for position in zip(*client_arrays)]
