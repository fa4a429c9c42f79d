"""Binary logistic regression in numpy, with named parameters like a state dict.

Partition ``p`` has ``30 + 20 p`` training samples, so sample-weighted FedAvg differs from a plain
mean. ``step-count`` is a 0-d int64 counter of local steps (averaged like BatchNorm's counter).
"""

from __future__ import annotations

import numpy as np

WEIGHT, BIAS, STEPS = "linear.weight", "linear.bias", "step-count"


def initial_state(num_features: int) -> dict[str, np.ndarray]:
    return {WEIGHT: np.zeros(num_features, np.float32), BIAS: np.zeros(1, np.float32),
            STEPS: np.array(0, dtype=np.int64)}


def train_size(pid: int) -> int:
    return 30 + 20 * pid


def partition(seed: int, pid: int, split: int, num_features: int) -> tuple[np.ndarray, np.ndarray]:
    truth = np.random.default_rng([seed, 1]).normal(size=num_features)
    rng = np.random.default_rng([seed, 50 + pid, split])
    size = train_size(pid) if split == 0 else 40
    x = rng.normal(size=(size, num_features)) + 0.2 * pid
    y = (x @ truth + 0.3 * rng.normal(size=size) > 0).astype(np.float64)
    return x, y


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def local_train(state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int,
                lr: float) -> tuple[dict[str, np.ndarray], float]:
    w = state[WEIGHT].astype(np.float64)
    b = float(state[BIAS].astype(np.float64)[0])
    for _ in range(steps):
        p = _sigmoid(x @ w + b)
        w = w - lr * x.T @ (p - y) / len(y)
        b = b - lr * float((p - y).mean())
    loss, _ = evaluate_state({WEIGHT: w, BIAS: np.array([b])}, x, y)
    return {WEIGHT: w.astype(np.float32), BIAS: np.array([b], np.float32),
            STEPS: np.array(int(state[STEPS]) + steps, dtype=np.int64)}, loss


def evaluate_state(state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = _sigmoid(x @ state[WEIGHT].astype(np.float64) + float(state[BIAS][0]))
    loss = float(-(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)).mean())
    return loss, float(((p > 0.5) == (y > 0.5)).mean())


# --- prototypes: synthetic classes, a fixed random embedding; partition p never holds class p % C ------------

def proto_partition(seed: int, pid: int, size: int, num_classes: int, num_features: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 70 + pid])
    centres = np.random.default_rng([seed, 999]).normal(size=(num_classes, num_features)) * 2.0
    labels = rng.choice([c for c in range(num_classes) if c != pid % num_classes], size=size)
    return centres[labels] + 0.5 * rng.normal(size=(size, num_features)), labels


def class_means(seed: int, pid: int, size: int, num_classes: int, num_features: int,
                embed_dim: int) -> tuple[np.ndarray, np.ndarray]:
    x, labels = proto_partition(seed, pid, size, num_classes, num_features)
    w = np.random.default_rng([seed, 12345]).normal(size=(num_features, embed_dim)) / np.sqrt(num_features)
    emb = np.tanh(x @ w)
    counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
    protos = np.zeros((num_classes, embed_dim))
    for c in range(num_classes):
        if counts[c]:
            protos[c] = emb[labels == c].mean(axis=0)
    return protos, counts
