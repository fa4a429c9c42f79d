"""A client's privacy budget between rounds: its append-only ledger on disk
(:class:`~pollen.privacy.ledger.LedgerFile`), the stopping rule, the metrics each round reports. No torch.
"""

from __future__ import annotations

import re

from pollen.privacy.accounting import Ledger, Release, rdp_epsilon
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


class AccountingError(RuntimeError):
    """The PLD accountant's ε is above the RDP bound of the same releases: one of them is wrong, and
    nothing is released on either figure."""


class Budget:
    """The ledger of one client, read from its file; ``max_epsilon`` > 0 caps it (0: no cap)."""

    def __init__(self, ledger: LedgerFile, delta: float, max_epsilon: float, who: str = "this client"):
        self.file, self.max_epsilon, self.who = ledger, max_epsilon, who
        self.ledger = Ledger(delta, ledger.releases())

    def check(self, *releases: Release) -> float:
        """ε after ``releases``; raises :class:`BudgetExhausted` (saying so) when it would pass the cap."""
        after = self.ledger.epsilon_after(*releases)
        # the independent, looser RDP bound, at every release: a PLD figure above it fails loudly
        bound = rdp_epsilon([*self.ledger.releases, *releases], self.ledger.delta)
        if bound is not None and after > bound * (1 + 1e-6):
            raise AccountingError(f"{self.who}: the PLD accountant's epsilon {after!r} is above the RDP bound "
                                  f"{bound!r} of the same {self.ledger.count + sum(r.count for r in releases)} "
                                  f"release(s) (delta {self.ledger.delta:g}): nothing is released")
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
