"""A client's privacy budget between rounds: its append-only ledger on disk
(:class:`~pollen.privacy.ledger.LedgerFile`), the stopping rule, the metrics each round reports. No torch.
"""

from __future__ import annotations

import re

from pollen.privacy.accounting import Ledger, Release
from pollen.privacy.ledger import LedgerFile

EPSILON, DELTA = "dp-epsilon", "dp-delta"  # reply metrics, every private round
# Beside a replace-one ε (client-level releases), the add/remove one, named: the weaker claim, which
# assumes the release of a client without data (zeros) is what its dataset is compared with.
EPSILON_ADD_REMOVE = "dp-epsilon-add-remove"
# A client that stops sends an error, not metrics: its reason ends with the ε its ledger holds, exactly,
# so the run's summary still counts every release it made (epsilon_in_refusal reads it back).
_SPENT = re.compile(r"\[(.+?) spent epsilon ([0-9.eE+-]+)\]")


def epsilon_in_refusal(reason: str) -> tuple[str, float] | None:
    """(who, the ε it had spent) when a client stopped releasing, read off its error reason; ``None``
    when the reason is not a stop of :class:`BudgetExhausted`. ``who`` is the client's own name for
    itself (``partition 3``): the server may not know which partition a node that never replied serves."""
    found = _SPENT.search(reason)
    return (found.group(1), float(found.group(2))) if found else None


class BudgetExhausted(RuntimeError):
    """The client's next release would exceed ``dp-max-epsilon``: it stops releasing."""


class Budget:
    """The ledger of one client, read from its file; ``max_epsilon`` > 0 caps it (0: no cap)."""

    def __init__(self, ledger: LedgerFile, delta: float, max_epsilon: float, who: str = "this client"):
        self.file, self.max_epsilon, self.who = ledger, max_epsilon, who
        self.ledger = Ledger(delta, ledger.releases())

    def check(self, *releases: Release) -> float:
        """ε after ``releases``; raises :class:`BudgetExhausted` (saying so) when it would pass the cap."""
        after = self.ledger.epsilon_after(*releases)
        if self.max_epsilon > 0 and after > self.max_epsilon:
            raise BudgetExhausted(
                f"{self.who} stops releasing: after {self.ledger.count} release(s) at epsilon "
                f"{self.ledger.epsilon():.4g}, the next would reach {after:.4g} > dp-max-epsilon = "
                f"{self.max_epsilon:g} (delta {self.ledger.delta:g}; ledger {self.file.path}) "
                f"[{self.who} spent epsilon {self.ledger.epsilon()!r}]")
        return after

    def spend(self, *releases: Release) -> dict[str, float]:
        """Compose ``releases`` (after :meth:`check`), append them to the ledger file — before the reply
        that carries them leaves — and return the round's metrics."""
        epsilon = self.check(*releases)
        self.file.append(*releases)
        for release in releases:
            self.ledger.add(release)
        metrics = {EPSILON: epsilon, DELTA: self.ledger.delta}
        if self.ledger.neighbour == "replace-one":
            metrics[EPSILON_ADD_REMOVE] = self.ledger.epsilon("add-remove")
        return metrics
