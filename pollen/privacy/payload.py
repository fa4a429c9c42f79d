"""``dp-mode = payload`` on one client: the mechanism each family calls once, where it builds its
reply, with the budget check and the ledger around it. No torch: callers pass numpy arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pollen.privacy.accounting import Release
from pollen.privacy.budget import Budget
from pollen.privacy.config import PrivacyConfig, release_unit
from pollen.privacy.evaluation import spend_evaluation
from pollen.privacy.ledger import LedgerFile
from pollen.privacy.mechanisms import (
    PrototypeRelease,
    release_glfc,
    release_logits,
    release_prototypes,
    release_update,
    secure_rng,
)


class PayloadPrivacy:
    """σ for the run's planned releases (given, or calibrated to the target ε), the client's ledger
    (``ledger``, on disk), and one method per payload kind that releases, composes and reports ε. ``kind``
    (``prototypes``, ``weights``, ``logits``, ``glfc``) says what one release protects
    (:func:`~pollen.privacy.config.release_unit`)."""

    def __init__(self, config: PrivacyConfig, planned_releases: int, ledger: LedgerFile, who: str, kind: str):
        if config.mode != "payload":
            raise ValueError(f"PayloadPrivacy needs dp-mode = 'payload', got {config.mode!r}")
        self.config, self.planned_releases, self.ledger, self.who = config, planned_releases, ledger, who
        self.unit = release_unit(kind, config.mode)

    @functools.cached_property
    def noise_multiplier(self) -> float:
        return self.config.payload_noise_multiplier(self.planned_releases, self.unit)

    @functools.cached_property
    def budget(self) -> Budget:
        return Budget(self.ledger, self.config.delta, self.config.cap, self.who)

    def _release(self) -> Release:
        return Release(self.noise_multiplier, unit=self.unit)

    def check(self) -> None:
        """Raise :class:`~pollen.privacy.budget.BudgetExhausted` before any work when the next release
        would pass ``dp-max-epsilon``."""
        self.budget.check(self._release())

    def evaluation(self, metrics: Mapping[str, Any], num_examples: int, rng: np.random.Generator | None = None
                   ) -> tuple[dict[str, float], int]:
        """An evaluate reply as a release (``dp-evaluate = noised``): its noisy accuracies and ε metrics,
        and the ``num-examples`` it may report (:mod:`pollen.privacy.evaluation`)."""
        return spend_evaluation(self.budget, self._release(), self.unit, metrics, num_examples, rng or secure_rng())

    def prototypes(self, embeddings: np.ndarray, labels: np.ndarray, num_classes: int,
                   rng: np.random.Generator | None = None) -> tuple[PrototypeRelease, dict[str, float]]:
        """Noisy per-class sums and counts of all classes, and the round's ``dp-epsilon``/``dp-delta``."""
        released = release_prototypes(embeddings, labels, num_classes, self.config.clip, self.noise_multiplier,
                                      rng or secure_rng())
        return released, self.budget.spend(self._release())

    def update(self, broadcast: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray],
               rng: np.random.Generator | None = None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A model state by name (in ``trained``'s order): float entries (parameters and BatchNorm
        statistics alike: both come from the data) become broadcast + clipped, noisy update; integer
        entries (batch counters, which would count the samples) go back as received. And the round's ε
        metrics."""
        floats = _float_entries(broadcast, trained)
        released, _norm = release_update({k: trained[k] for k in floats}, {k: broadcast[k] for k in floats},
                                         self.config.clip, self.noise_multiplier, rng or secure_rng())
        return _with_floats(broadcast, trained, released), self.budget.spend(self._release())

    def logits(self, logits: np.ndarray, rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict[str, float]]:
        """Public-set logits with rows clipped and noise over the whole matrix, float32, and ε metrics."""
        released, _clipped = release_logits(logits, self.config.clip, self.noise_multiplier, rng or secure_rng())
        return released.astype(np.float32), self.budget.spend(self._release())

    def glfc(self, broadcast: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray],
             gradient_sets: Sequence[Mapping[str, np.ndarray]], max_sets: int, rng: np.random.Generator | None = None
             ) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], dict[str, float]]:
        """GLFC: the model state as in :meth:`update` and each gradient set (by parameter name) clipped,
        one mechanism sized for ``max_sets`` sets; float32 gradient sets, and ε metrics."""
        floats = _float_entries(broadcast, trained)
        model, sets = release_glfc({k: trained[k] for k in floats}, {k: broadcast[k] for k in floats},
                                   list(gradient_sets), max_sets, self.config.clip, self.noise_multiplier,
                                   rng or secure_rng())
        released_sets = [{name: released[name].astype(np.float32) for name in grads}
                         for grads, released in zip(gradient_sets, sets)]
        return _with_floats(broadcast, trained, model), released_sets, self.budget.spend(self._release())


def _float_entries(broadcast: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray]) -> list[str]:
    if set(broadcast) != set(trained):
        raise ValueError(f"the trained state's names differ from the broadcast's: "
                         f"{sorted(set(trained) ^ set(broadcast))[:5]}")
    return [k for k, a in trained.items() if np.asarray(a).dtype.kind == "f"]


def _with_floats(broadcast: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray],
                 released: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The broadcast state (in ``trained``'s order) with its float entries replaced by the released ones,
    in the trained dtypes."""
    return {k: released[k].astype(np.asarray(trained[k]).dtype) if k in released else np.array(broadcast[k], copy=True)
            for k in trained}
