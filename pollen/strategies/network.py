"""A simulated network: slow clients, dropouts and a round deadline, all drawn from the run's seed.

A simulation answers every message at once; a fleet does not. This module says, for one round, which
sampled clients never answer (*dropped*), when each other client's reply reaches the server on a
*simulated clock*, and which replies come after the round's deadline (*late*). The clock is simulated, so a
run stays as fast as before and two runs with one seed drop, delay and aggregate the same clients: every
draw is a function of ``(seed, what, round, partition)`` alone, never of a shared RNG's position, node ids
or arrival order.

The model (pure functions; :class:`NetworkModel` holds the run keys):

* **speed profile** — a fixed share ``slow_fraction`` of the clients is slow, chosen once from the seed
  (:func:`slow_partitions`: exactly ``round(slow_fraction × n)`` of the ``n`` partitions); a slow client
  takes ``slowdown`` times as long;
* **work** — a client's simulated time in a round is its training work, ``num-examples × local-epochs ×
  sample_time`` seconds (``sample_time``: simulated seconds per example and epoch at normal speed), times
  its slowdown, times a per-round factor ``exp(spread·Z − spread²/2)`` (``Z`` standard normal: a lognormal
  jitter of mean 1; ``spread = 0`` none). Transfers are not timed;
* **dropout** — each sampled client drops out of a round with probability ``dropout``, independently: it
  never receives the round's instruction (its node does no work) and never answers;
* **deadline** — the server waits until every sampled client has answered or ``deadline`` simulated
  seconds have passed (no deadline: the round's own reply timeout, ``Strategy.start``'s ``timeout``, 3600 s
  by default — what a Flower server without a deadline waits for a client that never answers). Replies
  after it are late: the node trained, its reply is not used. A dropped client makes the server wait the
  whole deadline. If fewer than ``min_arrived`` replies arrived in time the round aggregates none of them
  (:func:`close_round`).

Evaluation is a measurement, not part of the federation's timeline: it is never dropped or timed.
On a deployment (a fleet) nothing is simulated: the deadline is the wall-clock wait for training replies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pollen.settings import RunConfig
from pollen.settings.common import NetworkKeys, RunKeys, TrainingKeys

# what each draw is for: one independent stream per purpose
_SLOW, _DROP, _JITTER = 1, 2, 3
NO_DEADLINE_WAIT_S = 3600.0  # Strategy.start's default timeout: how long a server without a deadline waits


def _uniform(seed: int, what: int, *keys: int) -> float:
    """One U[0, 1) draw that depends on ``(seed, what, keys)`` only."""
    return float(np.random.default_rng([int(seed), what, *(int(k) for k in keys)]).random())


def _normal(seed: int, what: int, *keys: int) -> float:
    return float(np.random.default_rng([int(seed), what, *(int(k) for k in keys)]).standard_normal())


@dataclass(frozen=True)
class NetworkModel:
    """The simulated network of a run (module docstring); all zero: no simulation (every client answers at
    once, as before)."""

    dropout: float = NetworkKeys.client_dropout
    slow_fraction: float = NetworkKeys.client_slow_fraction
    slowdown: float = NetworkKeys.client_slowdown
    spread: float = NetworkKeys.client_time_spread
    sample_time: float = NetworkKeys.client_sample_time
    local_epochs: int = TrainingKeys.local_epochs
    deadline: float = NetworkKeys.round_timeout  # 0: none
    seed: int = RunKeys.seed

    @classmethod
    def of(cls, cfg: RunConfig) -> NetworkModel:
        """The simulated network and the round deadline of a run config (docs/stragglers.md)."""
        return cls(cfg.client_dropout, cfg.client_slow_fraction, cfg.client_slowdown, cfg.client_time_spread,
                   cfg.client_sample_time, cfg.local_epochs, cfg.round_timeout, cfg.seed)

    def __post_init__(self) -> None:
        checks = ((0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}"),
                  (0.0 <= self.slow_fraction <= 1.0, f"slow_fraction must be in [0, 1], got {self.slow_fraction}"),
                  (self.slowdown >= 1.0, f"slowdown must be >= 1, got {self.slowdown}"),
                  (self.spread >= 0.0, f"spread must be >= 0, got {self.spread}"),
                  (self.sample_time > 0.0, f"sample_time must be > 0, got {self.sample_time}"),
                  (self.local_epochs >= 1, f"local_epochs must be >= 1, got {self.local_epochs}"),
                  (self.deadline >= 0.0, f"deadline must be >= 0, got {self.deadline}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def simulated(self) -> bool:
        """Whether anything is simulated: a dropout, slow clients, jitter or a deadline."""
        return self.dropout > 0 or self.slow_fraction > 0 or self.spread > 0 or self.deadline > 0

    @property
    def faults(self) -> bool:
        """Whether clients drop out or differ in speed (only a simulation can do that to them)."""
        return self.dropout > 0 or self.slow_fraction > 0 or self.spread > 0

    def drops(self, server_round: int, partition: int) -> bool:
        """Whether ``partition`` drops out of ``server_round``."""
        return self.dropout > 0 and _uniform(self.seed, _DROP, server_round, partition) < self.dropout

    def factor(self, server_round: int, partition: int) -> float:
        """The per-round lognormal time factor of ``partition`` (mean 1)."""
        if self.spread == 0:
            return 1.0
        z = _normal(self.seed, _JITTER, server_round, partition)
        return math.exp(self.spread * z - self.spread ** 2 / 2)

    def duration(self, server_round: int, partition: int, num_examples: int, slow: bool) -> float:
        """Simulated seconds from the round's instruction to this client's reply at the server."""
        work = max(int(num_examples), 0) * self.local_epochs * self.sample_time
        return work * (self.slowdown if slow else 1.0) * self.factor(server_round, partition)

    def wait_s(self, timeout: float = NO_DEADLINE_WAIT_S) -> float:
        """How long the server waits for training replies: the deadline, else the wait's own ``timeout``."""
        return self.deadline if self.deadline > 0 else float(timeout)


def slow_partitions(partitions: Iterable[int], fraction: float, seed: int) -> frozenset[int]:
    """Exactly ``round(fraction × n)`` of the ``n`` partitions (half up), chosen by the seed: those whose draw
    is smallest. The same partitions for the same seed and partition set, whatever order they come in."""
    parts = sorted(set(int(p) for p in partitions))
    count = math.floor(fraction * len(parts) + 0.5)
    ranked = sorted(parts, key=lambda p: (_uniform(seed, _SLOW, p), p))
    return frozenset(ranked[:count])


@dataclass
class RoundTiming:
    """One round on the simulated clock: who answered in time, who came late (by how much), who dropped."""

    arrived: list[str] = field(default_factory=list)
    late: dict[str, float] = field(default_factory=dict)  # client -> simulated seconds past the deadline
    dropped: list[str] = field(default_factory=list)
    below_minimum: bool = False  # fewer than min_arrived in time: the round aggregates none of them
    round_s: float = 0.0  # simulated seconds the server waited


def close_round(arrivals: Mapping[str, float | None], wait_s: float, min_arrived: int = 1) -> RoundTiming:
    """The deadline rule. ``arrivals``: client -> simulated arrival time, ``None`` for a client that dropped.

    A reply counts if it arrived by ``wait_s``; the server stops waiting when every client has answered, else
    at ``wait_s``; fewer than ``min_arrived`` replies in time: ``below_minimum`` (none is aggregated).
    """
    timing = RoundTiming()
    for client, at in arrivals.items():  # in the caller's order (the strategy's: by partition)
        if at is None:
            timing.dropped.append(client)
        elif at <= wait_s:
            timing.arrived.append(client)
        else:
            timing.late[client] = at - wait_s
    answered = [at for at in arrivals.values() if at is not None]
    everyone = not timing.dropped and not timing.late
    timing.round_s = max(answered, default=0.0) if everyone else wait_s
    timing.below_minimum = len(timing.arrived) < min_arrived
    return timing
