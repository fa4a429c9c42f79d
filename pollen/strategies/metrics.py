"""Aggregation of client-reported metrics into round metrics.

Flower's default averages *every* key, ids included. Here identifiers (``partition-id``) are skipped,
and each numeric metric gets a sample-weighted mean plus the unweighted mean and standard deviation
over clients (papers report "mean ± std over clients").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeGuard

import numpy as np

# Identifiers, not quantities: never averaged (public-digest: which public images a logit reply is on).
ID_KEYS = frozenset({"partition-id", "num-partitions", "server-round", "num-examples", "public-digest"})


def _number(value: object) -> TypeGuard[int | float]:
    """Finite int/float (not bool): anything else a client sends is skipped, never a crash."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mean_std_metrics(reports: Sequence[tuple[float, Mapping[str, object]]]) -> dict[str, float]:
    """``{key: weighted mean, key-client-mean: mean, key-client-std: population std}`` per metric."""
    keys = sorted({k for _, m in reports for k, v in m.items() if k not in ID_KEYS and _number(v)})
    out: dict[str, float] = {}
    for key in keys:
        pairs = [(float(n), float(v)) for n, m in reports if _number(v := m.get(key))]
        weights = np.array([n for n, _ in pairs], dtype=np.float64)
        values = np.array([v for _, v in pairs], dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # absurd values give inf, never an exception
            mean = float(values.mean())
            total = float(weights.sum())
            out[key] = float((weights * values).sum() / total) if total > 0 else mean
            out[f"{key}-client-mean"] = mean
            out[f"{key}-client-std"] = float(np.sqrt(((values - mean) ** 2).mean()))
    return out
