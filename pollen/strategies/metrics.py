"""Aggregation of client-reported metrics into round metrics.

Flower's default averages *every* key, ids included. Here identifiers (``partition-id``) are skipped,
and each numeric metric gets a sample-weighted mean plus the unweighted mean and standard deviation
over clients (papers report "mean ± std over clients").
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

ID_KEYS = frozenset({"partition-id", "num-partitions", "server-round", "num-examples"})


def _number(value: object) -> bool:
    """Finite int/float (not bool): anything else a client sends is skipped, never a crash."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mean_std_metrics(reports: Sequence[tuple[int, Mapping[str, object]]]) -> dict[str, float]:
    """``{key: weighted mean, key-client-mean: mean, key-client-std: population std}`` per metric."""
    keys = sorted({k for _, m in reports for k, v in m.items() if k not in ID_KEYS and _number(v)})
    out: dict[str, float] = {}
    for key in keys:
        pairs = [(n, float(m[key])) for n, m in reports if _number(m.get(key))]
        total = sum(n for n, _ in pairs)
        values = [v for _, v in pairs]
        mean = sum(values) / len(values)
        out[key] = sum(n * v for n, v in pairs) / total if total > 0 else mean
        out[f"{key}-client-mean"] = mean
        out[f"{key}-client-std"] = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return out
