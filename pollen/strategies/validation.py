"""Checks on what clients send, before any of it touches the aggregate.

A strategy describes the arrays it expects; :func:`check_arrays` returns ``None`` for a good reply or
a one-line reason for a bad one. Strategies drop bad replies, log the reason and count them in the
round's metrics — one broken or malicious client never poisons or stops a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pollen.log import LOGGER


@dataclass(frozen=True)
class ArraySpec:
    """Expected shape (``None`` = any size on that axis) and dtype kind of one payload array."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"  # "float32", "int64", or "float" (any float width) / "any"
    finite: bool = True
    nonnegative: bool = False


def check_arrays(arrays: Sequence[np.ndarray], specs: Sequence[ArraySpec]) -> str | None:
    """``None`` if ``arrays`` match ``specs`` one to one, else the first problem found."""
    if len(arrays) != len(specs):
        return f"expected {len(specs)} arrays, got {len(arrays)}"
    for arr, spec in zip(arrays, specs):
        if not isinstance(arr, np.ndarray):
            return f"{spec.name}: not an ndarray ({type(arr).__name__})"
        if len(arr.shape) != len(spec.shape) or any(
                want is not None and got != want for got, want in zip(arr.shape, spec.shape)):
            want = "x".join("*" if s is None else str(s) for s in spec.shape) or "scalar"
            return f"{spec.name}: shape {arr.shape} != expected {want}"
        if spec.dtype == "float" and arr.dtype.kind != "f":
            return f"{spec.name}: dtype {arr.dtype} is not a float type"
        if spec.dtype not in ("float", "any") and arr.dtype != np.dtype(spec.dtype):
            return f"{spec.name}: dtype {arr.dtype} != expected {spec.dtype}"
        if spec.finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"{spec.name}: contains NaN or infinite values"
        if spec.nonnegative and arr.size and arr.min() < 0:
            return f"{spec.name}: contains negative values"
    return None


def specs_like(arrays: Sequence[np.ndarray], prefix: str = "param") -> list[ArraySpec]:
    """Specs that demand exactly the shapes and dtypes of ``arrays`` (e.g. the current global model)."""
    return [ArraySpec(f"{prefix}[{i}]", tuple(a.shape), str(a.dtype)) for i, a in enumerate(arrays)]


@dataclass
class Rejection:
    """A dropped reply: who sent it (partition id when known) and why."""

    server_round: int
    client: str
    reason: str

    def as_dict(self) -> dict:
        return {"round": self.server_round, "client": self.client, "reason": self.reason}


def client_label(metrics: dict | None, fallback: str) -> str:
    """Name a client by its partition id when it reported one, else by Flower's node id."""
    value = (metrics or {}).get("partition-id")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"partition {value}"
    if isinstance(value, float) and value.is_integer():
        return f"partition {int(value)}"
    return f"node {fallback}"  # a missing or malformed id never crashes the server


def log_rejection(rej: Rejection) -> None:
    LOGGER.warning("round %d: dropped reply from %s: %s", rej.server_round, rej.client, rej.reason)
