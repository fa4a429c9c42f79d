"""Binary logistic regression in numpy with named parameters (the honest client's work)."""

from __future__ import annotations

import numpy as np

WEIGHT, BIAS = "w", "b"


def initial_state(num_features: int) -> dict[str, np.ndarray]:
    return {WEIGHT: np.zeros(num_features, np.float32), BIAS: np.zeros(1, np.float32)}


def partition(seed: int, pid: int, split: int, num_features: int) -> tuple[np.ndarray, np.ndarray]:
    truth = np.random.default_rng([seed, 1]).normal(size=num_features)
    rng = np.random.default_rng([seed, 70 + pid, split])
    x = rng.normal(size=(32, num_features))
    return x, (x @ truth > 0).astype(np.float64)


def local_train(state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int,
                lr: float) -> dict[str, np.ndarray]:
    w, b = state[WEIGHT].astype(np.float64), float(state[BIAS][0])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
        w = w - lr * x.T @ (p - y) / len(y)
        b = b - lr * float((p - y).mean())
    return {WEIGHT: w.astype(np.float32), BIAS: np.array([b], np.float32)}


def evaluate_state(state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = 1.0 / (1.0 + np.exp(-(x @ state[WEIGHT].astype(np.float64) + float(state[BIAS][0]))))
    loss = float(-(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)).mean())
    return loss, float(((p > 0.5) == (y > 0.5)).mean())
