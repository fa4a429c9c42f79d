"""Synthetic seeded data and a fixed random embedding (numpy only).

Partition ``p`` never holds class ``p % C`` (so class-wise averaging over holders matters); features
are Gaussian around per-class centres; the embedding ``tanh(x @ W)`` is the same on every node.
"""

from __future__ import annotations

import numpy as np


def centres(seed: int, num_classes: int, num_features: int) -> np.ndarray:
    return np.random.default_rng([seed, 999]).normal(size=(num_classes, num_features)) * 2.0


def embedding_matrix(seed: int, num_features: int, embed_dim: int) -> np.ndarray:
    return np.random.default_rng([seed, 12345]).normal(size=(num_features, embed_dim)) / np.sqrt(num_features)


def partition(seed: int, pid: int, split: int, size: int, num_classes: int,
              num_features: int) -> tuple[np.ndarray, np.ndarray]:
    """(features size×F, labels size) of partition ``pid``; split 0 = train, 1 = test."""
    rng = np.random.default_rng([seed, pid, split])
    allowed = [c for c in range(num_classes) if c != pid % num_classes]
    labels = rng.choice(allowed, size=size)
    x = centres(seed, num_classes, num_features)[labels] + 0.5 * rng.normal(size=(size, num_features))
    return x, labels


def embed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.tanh(x @ w)


def class_means(emb: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
    protos = np.zeros((num_classes, emb.shape[1]), dtype=np.float64)
    for c in range(num_classes):
        if counts[c]:
            protos[c] = emb[labels == c].mean(axis=0)
    return protos, counts
