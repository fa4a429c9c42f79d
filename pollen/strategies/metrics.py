"""Aggregation of client-reported metrics into round metrics.

Flower's default averages *every* key, ids included. Here identifiers (``partition-id``) are skipped,
and each numeric metric gets a sample-weighted mean plus the unweighted mean and standard deviation
over clients (papers report "mean ± std over clients"). A list-valued metric (per-class accuracies, say)
gets the same three, element-wise, when every reply that carries it sends a list of one length — as
Flower's ``aggregate_metricrecords`` does; otherwise the round leaves it out, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

# Identifiers, not quantities: never averaged (public-digest: which public images a logit reply is on).
ID_KEYS = frozenset({"partition-id", "num-partitions", "server-round", "num-examples", "public-digest"})


def _number(value: object) -> TypeGuard[int | float]:
    """Finite int/float (not bool): anything else a client sends is skipped, never a crash."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(value: object) -> TypeGuard[list]:
    return isinstance(value, list) and all(_number(v) for v in value)


def aggregate_metrics(reports: Sequence[tuple[float, Mapping[str, object]]], *, lists: bool = True,
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """``({key: weighted mean, key-client-mean: mean, key-client-std: population std}, {key: why it was
    left out})``. Lists (``lists=True``) are averaged element-wise, into lists; a key sent as a number by
    some replies and as a list by others, or as lists of different lengths, is left out with the reason.
    ``lists=False`` skips list values, keeping the numbers (legacy Flower metrics hold no lists)."""
    keys = sorted({k for _, m in reports for k, v in m.items()
                   if k not in ID_KEYS and (_number(v) or (lists and _numbers(v)))})
    out: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for key in keys:
        scalars = [(float(n), [float(v)]) for n, m in reports if _number(v := m.get(key))]
        vectors = [(float(n), [float(x) for x in v]) for n, m in reports if lists and _numbers(v := m.get(key))]
        if scalars and vectors:
            refused[key] = f"a number in {len(scalars)} replies and a list in {len(vectors)}"
            continue
        lengths = sorted({len(v) for _, v in vectors})
        if len(lengths) > 1:
            refused[key] = f"lists of different lengths {lengths} (element-wise means need one length)"
            continue
        pairs = vectors or scalars  # rows: clients, columns: elements (one for a number)
        weights = np.array([n for n, _ in pairs], dtype=np.float64)
        values = np.array([v for _, v in pairs], dtype=np.float64).reshape(len(pairs), len(pairs[0][1]))
        with np.errstate(over="ignore", invalid="ignore"):  # absurd values give inf, never an exception
            mean = values.mean(axis=0)
            total = float(weights.sum())
            weighted = (weights[:, None] * values).sum(axis=0) / total if total > 0 else mean
            std = np.sqrt(((values - mean) ** 2).mean(axis=0))
        for name, stat in ((key, weighted), (f"{key}-client-mean", mean), (f"{key}-client-std", std)):
            out[name] = [float(x) for x in stat] if vectors else float(stat[0])
    return out, refused


def mean_std_metrics(reports: Sequence[tuple[float, Mapping[str, object]]]) -> dict[str, float]:
    """The numbers of :func:`aggregate_metrics` (lists skipped): what a legacy Flower metric can hold."""
    return aggregate_metrics(reports, lists=False)[0]
