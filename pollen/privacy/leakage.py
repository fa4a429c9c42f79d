"""What the server could learn from a client's release, measured against the truth. Pure numpy.

Each measure comes with its *random-guess floor*: the score of a server that ignores the release and
guesses (the uniform histogram; every class present). A release leaks what a measure gains over its
floor; with ``dp-mode = payload`` the gain should shrink as σ grows.
"""

from __future__ import annotations

import numpy as np


def _histogram(counts: np.ndarray, name: str) -> np.ndarray:
    """Non-negative counts as a distribution; all-zero (an estimate with nothing left) is uniform."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not np.isfinite(c).all():
        raise ValueError(f"{name} must be a non-empty finite vector, got shape {c.shape}")
    c = np.clip(c, 0.0, None)
    total = c.sum()
    return c / total if total > 0 else np.full(c.size, 1.0 / c.size)


def total_variation(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """TV distance ½·Σ|p − q| of the two histograms (negative entries, e.g. noisy counts, count as 0)."""
    p, q = _histogram(p_counts, "p_counts"), _histogram(q_counts, "q_counts")
    if p.shape != q.shape:
        raise ValueError(f"histograms differ in length: {p.size} and {q.size}")
    return 0.5 * float(np.abs(p - q).sum())


def histogram_leak(true_counts: np.ndarray, released_counts: np.ndarray) -> tuple[float, float]:
    """(TV of the label histogram read off the released counts, TV of the uniform guess: the floor)."""
    uniform = np.ones(np.shape(true_counts))
    return total_variation(true_counts, released_counts), total_variation(true_counts, uniform)


def presence_f1(true_counts: np.ndarray, predicted_present: np.ndarray) -> float:
    """F1 of the predicted set of held classes against the classes with a positive true count."""
    truth = np.asarray(true_counts) > 0
    pred = np.asarray(predicted_present, dtype=bool)
    if truth.shape != pred.shape:
        raise ValueError(f"presence vectors differ in shape: {truth.shape} and {pred.shape}")
    hits = int((truth & pred).sum())
    denominator = int(truth.sum() + pred.sum())
    return 2.0 * hits / denominator if denominator else 1.0


def presence_leak(true_counts: np.ndarray, released_counts: np.ndarray,
                  threshold: float) -> tuple[float, float]:
    """(F1 of "held = released count >= threshold", F1 of guessing every class held: the floor)."""
    released = np.asarray(released_counts, dtype=np.float64)
    return presence_f1(true_counts, released >= threshold), presence_f1(true_counts, np.ones(released.shape, bool))


def softmax_histogram_leak(public_logits: np.ndarray, true_counts: np.ndarray) -> tuple[float, float]:
    """(TV between the mean softmax of the public-set logits and the client's label histogram, TV of
    the uniform guess: the floor). A model trained on skewed labels predicts them more often."""
    z = np.asarray(public_logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] != np.size(true_counts) or not np.isfinite(z).all():
        raise ValueError(f"public logits must be finite N0×{np.size(true_counts)}, got shape {z.shape}")
    e = np.exp(z - z.max(axis=1, keepdims=True))
    mean_softmax = (e / e.sum(axis=1, keepdims=True)).mean(axis=0)
    return histogram_leak(true_counts, mean_softmax)
