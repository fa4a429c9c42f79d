"""A round's training exchange through the simulated network (or a fleet's deadline): who drops, who is late.

:class:`NetworkExchange` is what :meth:`PollenStrategy.exchange <pollen.strategies.base.PollenStrategy.exchange>`
does with training messages when a run sets ``client-dropout``, ``client-slow-fraction``, ``client-time-spread``
or ``round-timeout`` (the model and its rules: :mod:`pollen.strategies.network`):

* :meth:`NetworkExchange.send` — the clients that drop out of the round are not sent their message (their
  node does no work); each is recorded;
* the grid's ``send_and_receive`` carries the rest;
* :meth:`NetworkExchange.receive` — each reply's simulated arrival (its reported ``num-examples``, the
  client's speed and the round's jitter), the deadline rule, the late replies withheld from aggregation,
  the simulated clock advanced. Withheld or never-sent messages leave the strategy's outbox, so they are
  recorded as *missing* (``network.missing`` of the round in ``metrics.jsonl``: who, why — ``dropped``,
  ``late``, ``unused`` when fewer than ``min-train-clients`` arrived — and how late), never as failures.

Every draw is keyed by the client's *partition*, which the strategy learns before the first send (the
simulation engine's assignment, or one query per node), so two runs with one seed drop and delay the same
clients. On a deployment grid (a fleet) nothing is simulated: dropouts and speeds are refused, and
``round-timeout`` is the wall-clock wait for training replies; a reply not there by then is ``late``, by
an unknown amount.

A strategy that runs its own exchange (secure aggregation's stages) calls :meth:`send` with the messages
of its first stage and :meth:`receive` with each stage's replies; a client missing at a later stage is
one its own protocol must recover from (SecAgg+: the dropout recovery of its unmasking stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from flwr.app import Message, MetricRecord
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol.records import METRICS
from pollen.strategies.network import NetworkModel, RoundTiming, close_round, slow_partitions


class PollenStrategy(Protocol):
    """What the exchange reads and records on the strategy (:class:`pollen.strategies.base.PollenStrategy`)."""

    @property
    def partition_of(self) -> dict[int, int]: ...

    book: Any  # pollen.strategies.partitions.PartitionBook: order(node) sorts by partition
    sim_clock_s: float  # the simulated clock, which the exchange advances
    replies: Any  # pollen.strategies.replies.ReplyScreen: outbox, the messages replies map back to

    def identify(self, server_round: int, grid: Grid, node_ids: Iterable[int]) -> None: ...

    def label(self, node_id: int) -> str: ...

    def report(self, server_round: int) -> Any: ...

DEPLOYMENT_GRIDS = ("HttpGrid", "GrpcGrid")  # a SuperLink's grid: real nodes, real time


FLEET_FAULTS = ("client-dropout, client-slow-fraction and client-time-spread simulate a network and apply in "
                "simulation only; a fleet has its own: set them to 0 (round-timeout is the wall-clock deadline there)")


def is_deployment(grid: Grid) -> bool:
    """Whether ``grid`` reaches real SuperNodes (a fleet) rather than a simulation or an in-process test."""
    return type(grid).__name__ in DEPLOYMENT_GRIDS


def _examples(msg: Message) -> int:
    """The ``num-examples`` a reply reports (0 when it has none that is a number: screening rejects it)."""
    rec = msg.content.get(METRICS) if not msg.has_error() else None
    value = rec.get("num-examples") if isinstance(rec, MetricRecord) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0


class NetworkExchange:
    """The simulated network of one run, applied to each round's training messages (module docstring).

    The clock is the strategy's ``sim_clock_s`` (simulated seconds since round 1, in its checkpoint: a resumed
    run's clock goes on where it stopped)."""

    def __init__(self, model: NetworkModel, min_arrived: int = 1):
        self.model = model
        self.min_arrived = int(min_arrived)
        self._slow: frozenset[int] | None = None
        self._dropped: dict[int, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------------ who is who
    def _key(self, strategy: PollenStrategy, node: int) -> int:
        """The partition that keys a node's draws (its node id, unreproducibly, if it never said)."""
        pid = strategy.partition_of.get(node)
        return pid if pid is not None else node

    def _slow_set(self, strategy: PollenStrategy, grid: Grid, server_round: int) -> frozenset[int]:
        if self._slow is None:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            strategy.identify(server_round, grid, nodes)
            self._slow = slow_partitions([self._key(strategy, n) for n in nodes], self.model.slow_fraction,
                                         self.model.seed)
        return self._slow

    # ------------------------------------------------------------------ the two halves of an exchange
    def send(self, strategy: PollenStrategy, server_round: int, messages: Sequence[Message],
             grid: Grid) -> list[Message]:
        """The messages that go out: those of clients that drop out of this round are withheld and recorded."""
        messages = list(messages)
        if is_deployment(grid) and self.model.faults:
            raise ValueError(FLEET_FAULTS)
        nodes = [int(m.metadata.dst_node_id) for m in messages]  # partitions name the missing (one query each)
        strategy.identify(server_round, grid, [n for n in nodes if n not in strategy.partition_of])
        if is_deployment(grid):
            return messages
        self._slow_set(strategy, grid, server_round)
        dropped = [m for m in messages
                   if self.model.drops(server_round, self._key(strategy, int(m.metadata.dst_node_id)))]
        self._dropped[server_round] = [{"client": strategy.label(int(m.metadata.dst_node_id)),
                                        "node": int(m.metadata.dst_node_id), "why": "dropped",
                                        "late-by-s": None, "sim-time-s": None} for m in dropped]
        self._forget(strategy, dropped)
        return [m for m in messages if m not in dropped]

    def receive(self, strategy: PollenStrategy, server_round: int, sent: Sequence[Message],
                replies: Iterable[Message], grid: Grid, timeout: float) -> list[Message]:
        """The replies that count: in time (simulated clock, or a fleet's wall clock) and enough of them."""
        replies = list(replies)
        dst_of = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent if m.metadata.message_id}

        def node_of(msg: Message) -> int:
            return dst_of.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))

        deployment = is_deployment(grid)
        wait = self.model.wait_s(timeout)
        ordered = sorted(replies, key=lambda m: strategy.book.order(node_of(m)))
        arrivals: dict[str, float | None] = {}
        reply_of: dict[str, Message] = {}
        for msg in ordered:
            if msg.has_error():  # a failure stays a failure, whenever it came
                continue
            node = node_of(msg)
            label = strategy.label(node)
            key = self._key(strategy, node)
            arrivals[label] = 0.0 if deployment else self.model.duration(
                server_round, key, _examples(msg), key in (self._slow or frozenset()))
            reply_of[label] = msg
        missing = list(self._dropped.pop(server_round, []))
        answered = {node_of(m) for m in replies}
        if deployment:  # what did not come by the wall-clock deadline is late, by an unknown amount
            late_msgs = [m for m in sent if int(m.metadata.dst_node_id) not in answered]
            missing += [{"client": strategy.label(int(m.metadata.dst_node_id)), "node": int(m.metadata.dst_node_id),
                         "why": "late", "late-by-s": None, "sim-time-s": None} for m in late_msgs]
            self._forget(strategy, late_msgs)
        for entry in missing:
            if entry["why"] == "dropped":
                arrivals[entry["client"]] = None
        timing = close_round(arrivals, wait, self.min_arrived)
        withheld = dict(timing.late)
        if timing.below_minimum:
            withheld.update(dict.fromkeys(timing.arrived, 0.0))
        kept: list[Message] = []
        for msg in replies:
            label = strategy.label(node_of(msg))
            if label in withheld and reply_of.get(label) is msg:
                continue
            kept.append(msg)
        for label, late_by in withheld.items():
            node = node_of(reply_of[label])
            at = arrivals[label]
            missing.append({"client": label, "node": node, "why": "late" if label in timing.late else "unused",
                            "late-by-s": None if deployment else round(late_by, 6),
                            "sim-time-s": None if deployment or at is None else round(at, 6)})
        self._forget(strategy, [m for m in sent if int(m.metadata.dst_node_id) in {e["node"] for e in missing}])
        round_s = 0.0 if deployment else timing.round_s
        strategy.sim_clock_s += round_s
        strategy.report(server_round).network = {
            "sim-round-s": None if deployment else round(round_s, 6),
            "sim-clock-s": None if deployment else round(strategy.sim_clock_s, 6),
            "deadline-s": self.model.deadline or None,
            "arrived": 0 if timing.below_minimum else len(timing.arrived),
            "missing": sorted(missing, key=lambda e: strategy.book.order(e["node"]))}
        self._log(server_round, timing, missing, len(sent) + sum(e["why"] == "dropped" for e in missing))
        return kept

    def exchange(self, strategy: PollenStrategy, server_round: int, messages: Iterable[Message], grid: Grid,
                 timeout: float) -> list[Message]:
        """:meth:`send`, the grid's ``send_and_receive`` (a fleet: until the deadline), :meth:`receive`."""
        out = self.send(strategy, server_round, list(messages), grid)
        wait = self.model.deadline if is_deployment(grid) and self.model.deadline > 0 else timeout
        replies = grid.send_and_receive(messages=out, timeout=wait)
        return self.receive(strategy, server_round, out, replies, grid, timeout)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _forget(strategy: PollenStrategy, messages: Sequence[Message]) -> None:
        """Take messages out of the outbox: a client missing by the network's rules is not a failure."""
        gone = {id(m) for m in messages}
        strategy.replies.outbox = [m for m in strategy.replies.outbox if id(m) not in gone]

    def _log(self, server_round: int, timing: RoundTiming, missing: list[dict[str, Any]], sampled: int) -> None:
        if timing.below_minimum and timing.arrived:
            LOGGER.warning("round %d: %d of %d sampled client(s) answered by the deadline, fewer than "
                           "min-train-clients = %d: none is aggregated", server_round, len(timing.arrived),
                           sampled, self.min_arrived)
        if not missing:
            return
        shown = ", ".join(f"{e['client']} {e['why']}" + (f" by {e['late-by-s']:.2f}s" if e["late-by-s"] else "")
                          for e in missing[:8])
        LOGGER.info("round %d: %d of %d sampled client(s) missing (%s%s); simulated round %.2fs", server_round,
                    len(missing), sampled, shown, ", ..." if len(missing) > 8 else "", timing.round_s)
