"""A client's privacy budget between rounds: its ledger in the node's state, the stopping rule, the
metrics each round reports. No torch: the store is anything with ``load_values``/``save_values``
(Pollen's ``ClientState``, persisted with the node's state so a restarted node continues its ledger).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pollen.privacy.accounting import Ledger, Release

LEDGER_KEY = "dp-ledger"  # context.state key of the ledger
EPSILON, DELTA = "dp-epsilon", "dp-delta"  # reply metrics, every private round


class ValueStore(Protocol):
    def save_values(self, key: str, values: Mapping[str, Any]) -> None: ...

    def load_values(self, key: str, default: Mapping[str, Any] | None = None) -> dict[str, Any]: ...


class BudgetExhausted(RuntimeError):
    """The client's next release would exceed ``dp-max-epsilon``: it stops releasing."""


class Budget:
    """The ledger of one client, read from and written back to its store."""

    def __init__(self, store: ValueStore, delta: float, max_epsilon: float, who: str = "this client"):
        self.store, self.max_epsilon, self.who = store, max_epsilon, who
        saved = store.load_values(LEDGER_KEY, {})
        self.ledger = Ledger.from_dict(saved) if saved else Ledger(delta)
        if self.ledger.delta != delta:
            raise ValueError(f"{who}: the stored privacy ledger is at delta {self.ledger.delta}, the run's "
                             f"'dp-delta' is {delta}; a ledger cannot change delta midway")

    def check(self, *releases: Release) -> float:
        """ε after ``releases``; raises :class:`BudgetExhausted` (saying so) when it would pass the cap."""
        after = self.ledger.epsilon_after(*releases)
        if self.max_epsilon > 0 and after > self.max_epsilon:
            raise BudgetExhausted(
                f"{self.who} stops releasing: after {self.ledger.count} release(s) at epsilon "
                f"{self.ledger.epsilon():.4g}, the next would reach {after:.4g} > dp-max-epsilon = "
                f"{self.max_epsilon:g} (delta {self.ledger.delta:g})")
        return after

    def spend(self, *releases: Release) -> dict[str, float]:
        """Compose ``releases`` (after :meth:`check`), persist the ledger, and return the round's metrics."""
        epsilon = self.check(*releases)
        for release in releases:
            self.ledger.add(release)
        self.store.save_values(LEDGER_KEY, self.ledger.to_dict())
        return {EPSILON: epsilon, DELTA: self.ledger.delta}
