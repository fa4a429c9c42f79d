"""Record names and conversions every family shares, on both sides of the wire.

A message's ``content`` is a :class:`~flwr.app.RecordDict` with Flower's usual names: ``arrays``
(an ArrayRecord), ``config`` (server → client ConfigRecord) and ``metrics`` (client → server
MetricRecord, always with ``num-examples``). Families add named arrays inside ``arrays``; never a
positional list.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NUM_EXAMPLES = "num-examples"


def array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays as an ArrayRecord (C-contiguous copies are made only when needed).

    ``np.require`` keeps 0-d arrays 0-d (BatchNorm's step counter); ``np.ascontiguousarray`` would
    turn them into shape ``(1,)`` and the server would rightly refuse the reply.
    """
    return ArrayRecord({str(k): Array(np.require(v, requirements="C")) for k, v in arrays.items()})


def _plain_number(value: Any) -> int | float | None:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return None


def metric_record(num_examples: int, metrics: Mapping[str, Any] | None = None) -> MetricRecord:
    """A MetricRecord from plain or numpy numbers (and lists of them); other values are left out.

    Flower's MetricRecord refuses ``np.float32``/``np.int64``, bools and mixed lists: numbers are
    cast here (a list of whole numbers stays ints, a list with any float becomes floats) so a client
    can pass what torch/numpy gave it. Strings, None and nested values are dropped.
    """
    out: dict[str, int | float | list] = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, (list, tuple, np.ndarray)):
            items = [_plain_number(v) for v in value]
            numbers = [v for v in items if v is not None]
            if items and len(numbers) == len(items):
                out[key] = numbers if all(isinstance(v, int) for v in numbers) else [float(v) for v in numbers]
            continue
        number = _plain_number(value)
        if number is not None:
            out[key] = number
    out[NUM_EXAMPLES] = int(num_examples)
    return MetricRecord(out)


def reply_content(arrays: ArrayRecord | Mapping[str, np.ndarray], num_examples: int,
                  metrics: Mapping[str, Any] | None = None, **extra_records: ArrayRecord) -> RecordDict:
    """The content of a client reply: named arrays, metrics with ``num-examples``, extra records."""
    rec = arrays if isinstance(arrays, ArrayRecord) else array_record(arrays)
    content = RecordDict({ARRAYS: rec, METRICS: metric_record(num_examples, metrics)})
    for name, record in extra_records.items():
        content[name] = record
    return content


def record_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a message: what actually travels for it."""
    total = 0
    for record in content.array_records.values():
        total += sum(len(a.data) for a in record.values())
    return total


def finite_float(value: Any, default: float = math.nan) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def config_of(content: RecordDict) -> dict[str, Any]:
    """The message's config as a plain dict (empty when it has none)."""
    return dict(content.get(CONFIG) or {})


def arrays_of(content: RecordDict, key: str = ARRAYS) -> ArrayRecord:
    """The ArrayRecord under ``key`` (empty when the message has none)."""
    rec = content.get(key)
    return rec if isinstance(rec, ArrayRecord) else ArrayRecord()


@dataclass(frozen=True)
class Evaluation:
    """Client side, every family: what an evaluate message is answered with (metrics only). ``loss``
    ``None``: not released (an evaluate reply under differential privacy)."""

    loss: float | None
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def content(self) -> RecordDict:
        loss = {} if self.loss is None else {"loss": float(self.loss)}
        return RecordDict({METRICS: metric_record(self.num_examples, {**self.metrics, **loss})})
