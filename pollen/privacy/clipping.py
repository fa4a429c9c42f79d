"""L2 clipping: what bounds a release's sensitivity. Pure numpy, float64 inside.

Each function returns the clipped values and the norms before clipping, so a caller can report how
often clipping bit (a clip far below the typical norm destroys signal; far above wastes noise).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def _check_clip(clip: float) -> float:
    clip = float(clip)
    if not np.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip norm must be a finite number > 0, got {clip!r}")
    return clip


def clip_rows(x: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row of the 2-D ``x`` scaled to L2 norm <= ``clip`` (rows already inside are untouched).

    Returns ``(clipped float64 n×d, norms n)``. Non-finite rows are refused: their norm is undefined
    and a NaN would slip through any bound.
    """
    clip = _check_clip(clip)
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"clip_rows needs a 2-D array (one row per record), got shape {rows.shape}")
    if not np.isfinite(rows).all():
        bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))[:5].tolist()
        raise ValueError(f"rows {bad} have NaN or infinite values; they cannot be clipped")
    norms = np.linalg.norm(rows, axis=1)
    scale = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
    return rows * scale[:, None], norms


def clip_update(reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                clip: float) -> tuple[dict[str, np.ndarray], float]:
    """The update ``reply − broadcast`` over all arrays together, scaled to global L2 norm <= ``clip``.

    The whole update is one vector: clipping arrays one by one would let the norm grow with the
    number of layers. Returns ``(clipped update by name, float64; norm before clipping)``.
    """
    clip = _check_clip(clip)
    if set(reply) != set(broadcast):
        missing, extra = sorted(set(broadcast) - set(reply)), sorted(set(reply) - set(broadcast))
        raise ValueError(f"update names differ from the broadcast: missing {missing[:5]}, unexpected {extra[:5]}")
    update: dict[str, np.ndarray] = {}
    for name in broadcast:
        a, b = np.asarray(reply[name], dtype=np.float64), np.asarray(broadcast[name], dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"update '{name}': shape {a.shape} differs from the broadcast's {b.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"update '{name}' has NaN or infinite values; it cannot be clipped")
        update[name] = a - b
    norm = float(np.sqrt(sum(float(np.sum(u * u)) for u in update.values())))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {name: u * scale for name, u in update.items()}, norm
