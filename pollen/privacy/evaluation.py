"""Evaluate replies under DP (``dp-evaluate = noised``): only the accuracies leave, through a Gaussian
mechanism, accounted in the same ledger as the train releases. Pure numpy.

An evaluate reply is computed from the client's data (its test set) like a train reply, so under DP it
is a release too. What it may carry, per unit:

* ``client`` (the client's whole dataset): each of the k accuracies lies in [0, 1], so the vector moves
  by at most √k whatever the data (removing the client: the release of zeros); noise std σ·√k on each,
  the noisy value clipped back to [0, 1] (post-processing).
* ``record`` and ``row-given-model`` (one record, or one row given the model): the accuracies are shares
  of the reply's n test records, so the release is the k correct counts and n itself, each moved by at
  most 1 when one record is added or removed: Δ = √(k + 1), noise std σ·√(k + 1) on each. The client
  divides the noisy counts (post-processing) and reports the noisy n, rounded, as ``num-examples``, so the
  server's example-weighted mean is the pooled noisy share; n itself never leaves.

Nothing else of an evaluate reply leaves under DP: no loss, no test-set size, no per-domain figure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.privacy.accounting import Release
from pollen.privacy.budget import Budget
from pollen.privacy.mechanisms import gaussian_noise


def accuracy_keys(metrics: Mapping[str, Any]) -> list[str]:
    """The metrics a noised evaluate reply releases: the numbers whose key ends in ``accuracy``."""
    return sorted(k for k, v in metrics.items()
                  if k.endswith("accuracy") and isinstance(v, (int, float)) and not isinstance(v, bool))


def release_evaluation(metrics: Mapping[str, Any], num_examples: int, unit: str, noise_multiplier: float,
                       rng: np.random.Generator) -> tuple[dict[str, float], int]:
    """The noisy accuracies of an evaluate reply and the ``num-examples`` it reports (module docstring)."""
    keys = accuracy_keys(metrics)
    values = np.clip(np.array([float(metrics[k]) for k in keys], dtype=np.float64), 0.0, 1.0)
    if unit == "client":
        noisy = values + gaussian_noise(values.shape, noise_multiplier * math.sqrt(len(keys) or 1), rng)
        return dict(zip(keys, np.clip(noisy, 0.0, 1.0).tolist())), 1
    n = max(int(num_examples), 0)
    std = noise_multiplier * math.sqrt(len(keys) + 1)
    correct = np.round(values * n) + gaussian_noise(values.shape, std, rng)
    noisy_n = n + float(gaussian_noise((1,), std, rng)[0])
    shares = np.clip(correct / max(noisy_n, 1.0), 0.0, 1.0)
    return dict(zip(keys, shares.tolist())), max(1, int(round(noisy_n)))


def spend_evaluation(budget: Budget, release: Release, unit: str, metrics: Mapping[str, Any], num_examples: int,
                     rng: np.random.Generator) -> tuple[dict[str, float], int]:
    """One noised evaluate reply: the noisy accuracies, composed in the ledger (refused, saying so, when
    it would pass the cap) before they leave, with the ε metrics; and its ``num-examples``."""
    released, num = release_evaluation(metrics, num_examples, unit, release.noise_multiplier, rng)
    return {**released, **budget.spend(release)}, num
