"""``dp-mode = sample`` on one client, apart from torch: σ for the client's planned DP-SGD steps, the
ledger, and the prototype release that follows DP training (FedProto).

What DP-SGD trains is private; what a method computes from the trained model alone is post-processing.
Prototypes are not: they are sums over the training records' embeddings. So the prototype family also
releases them through the Gaussian mechanism (each embedding clipped to ``dp-clip``, one record = one
row: for a model given, one record moves one sum by <= clip and one count by 1), composed in the same
ledger; adaptive composition makes the two one guarantee per record.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.privacy.accounting import Release, calibrate_noise_multiplier
from pollen.privacy.budget import Budget
from pollen.privacy.config import PrivacyConfig
from pollen.privacy.evaluation import spend_evaluation
from pollen.privacy.ledger import LedgerFile
from pollen.privacy.mechanisms import PrototypeRelease, release_prototypes, secure_rng


def steps_and_rate(num_records: int, batch_size: int, epochs: int) -> tuple[int, float]:
    """(DP-SGD steps a round, sampling rate q): an epoch is ⌈n / batch⌉ steps at q = min(1, batch / n)."""
    if num_records < 1 or batch_size < 1 or epochs < 1:
        raise ValueError(f"DP-SGD needs >= 1 record, batch and epoch, got {num_records}, {batch_size}, {epochs}")
    return epochs * math.ceil(num_records / batch_size), min(1.0, batch_size / num_records)


class SamplePrivacy:
    """One client's DP-SGD plan: ``planned_rounds`` rounds of ``epochs`` over ``num_records`` records in
    batches of ``batch_size`` (plus one prototype release a round when ``prototypes``)."""

    def __init__(self, config: PrivacyConfig, planned_rounds: int, ledger: LedgerFile, who: str, *,
                 num_records: int, batch_size: int, epochs: int, prototypes: bool):
        if config.mode != "sample":
            raise ValueError(f"SamplePrivacy needs dp-mode = 'sample', got {config.mode!r}")
        self.config, self.planned_rounds, self.ledger, self.who = config, planned_rounds, ledger, who
        self.steps, self.rate = steps_and_rate(num_records, batch_size, epochs)
        self.with_prototypes = prototypes

    @functools.cached_property
    def noise_multiplier(self) -> float:
        """σ of every DP-SGD step and prototype release: given, or calibrated to the target ε."""
        if self.config.noise_multiplier > 0:
            return self.config.noise_multiplier
        return calibrate_noise_multiplier(self.config.target_epsilon, self.config.delta, self.planned_rounds,
                                          self.rate, self.steps, int(self.with_prototypes) + self.config.evaluations)

    @functools.cached_property
    def budget(self) -> Budget:
        return Budget(self.ledger, self.config.delta, self.config.cap, self.who)

    def round_releases(self) -> list[Release]:
        """What one round composes: the DP-SGD steps, then the prototype release."""
        out = [Release(self.noise_multiplier, self.rate, self.steps)]
        if self.with_prototypes:
            out.append(Release(self.noise_multiplier))
        return out

    def check(self) -> None:
        """Raise :class:`~pollen.privacy.budget.BudgetExhausted` before training when this round's
        releases would pass ``dp-max-epsilon``."""
        self.budget.check(*self.round_releases())

    def prototypes(self, embeddings: np.ndarray, labels: np.ndarray, num_classes: int,
                   rng: np.random.Generator | None = None) -> PrototypeRelease:
        """The prototype release after DP training (its cost is spent with the round's steps)."""
        return release_prototypes(embeddings, labels, num_classes, self.config.clip, self.noise_multiplier,
                                  rng or secure_rng())

    def evaluation(self, metrics: Mapping[str, Any], num_examples: int, rng: np.random.Generator | None = None
                   ) -> tuple[dict[str, float], int]:
        """An evaluate reply as a release (``dp-evaluate = noised``), one record the unit: its noisy
        accuracies and ε metrics, and the ``num-examples`` it may report (:mod:`pollen.privacy.evaluation`)."""
        return spend_evaluation(self.budget, Release(self.noise_multiplier), "record", metrics, num_examples,
                                rng or secure_rng())

    def spend(self, trained: Release) -> dict[str, float]:
        """Compose what DP-SGD reports it ran (and the prototype release), persist, return ε metrics."""
        planned = self.round_releases()
        return self.budget.spend(trained, *planned[1:])
