"""Which nodes a round asks: waiting for enough of them, drawing a sample, learning their partitions.

:class:`NodeSampler` is the part of a strategy that reads the grid's node list and, to learn partitions,
sends identity queries; what it learns goes into the run's
:class:`~pollen.strategies.partitions.PartitionBook` under the book's rules, and what goes wrong with a
query into the :class:`~pollen.strategies.replies.ReplyScreen`'s round report.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol.identity import PARTITION_ID, decode_identity_reply, query_content
from pollen.protocol.records import METRICS
from pollen.protocol.screening import COMMON_METRICS, check_metrics
from pollen.strategies.partitions import PartitionBook
from pollen.strategies.replies import NoTrainingError, ReplyScreen

SIMULATION_NODE_WAIT_S = 5.0


def engine_partitions(grid: Grid) -> dict[int, int] | None:
    """``{node id: partition id}`` as Flower's simulation engine assigned them, without a message; ``None``
    for any other grid.

    The engine registers its SuperNodes one after another in the in-memory link state the ServerApp's
    grid reads, giving the i-th registered node ``partition-id`` i; the state keeps its nodes in
    registration order. Only a grid whose link state holds exactly the connected nodes, in a dict,
    qualifies (tests/test_identity_scale.py registers nodes with the engine's own function and checks
    the result).
    """
    nodes = getattr(getattr(grid, "state", None), "nodes", None)
    if not isinstance(nodes, dict) or not nodes:
        return None
    if set(grid.get_node_ids()) != set(nodes):
        return None
    return {int(node): i for i, node in enumerate(nodes)}


class NodeSampler:
    """Waits for nodes, draws samples with its own RNG and identifies nodes (module docstring).

    ``identify_nodes``: before drawing a fraction, learn every node's partition and draw by partition, so
    the same seed samples the same partitions in every run (node ids are new in each).
    """

    def __init__(self, book: PartitionBook, screen: ReplyScreen, rng: random.Random, *, node_wait_s: float,
                 min_available_nodes: int, identify_nodes: bool):
        self.book = book
        self.screen = screen
        self.rng = rng
        self.node_wait_s = node_wait_s
        self.min_available_nodes = min_available_nodes
        self.identify_nodes = identify_nodes
        self.grid: Grid | None = None  # the grid last sampled from: tells whether a node has left
        self.settled = False  # the simulation's node registration was seen to have finished

    def live(self) -> set[int] | None:
        """The connected node ids (``None`` before any grid was seen)."""
        return None if self.grid is None else set(self.grid.get_node_ids())

    def wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        """Connected node ids once ``needed`` are there; a clear error after ``node_wait_s``.

        Flower's simulation registers all its nodes, one after another, just after the ServerApp starts,
        so there no node comes later: the wait is cut to a few seconds, and the first answer waits until
        the count holds still for one poll — a draw over half-registered nodes would depend on timing.
        """
        simulation = type(grid).__name__ == "InMemoryGrid"
        wait = min(self.node_wait_s, SIMULATION_NODE_WAIT_S) if simulation else self.node_wait_s
        self.grid = grid
        deadline = time.monotonic() + wait
        next_log = 0.0
        previous: list[int] | None = None
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= needed and (not simulation or self.settled or nodes == previous):
                self.settled = True
                return nodes
            previous = nodes
            now = time.monotonic()
            if now >= deadline and len(nodes) >= needed:  # still growing after the wait: take what is there
                self.settled = True
                return nodes
            if now >= deadline:
                raise NoTrainingError(
                    f"only {len(nodes)} node(s) connected after {wait:.0f} s, but "
                    f"min-available-clients / the sample needs {needed}: start more SuperNodes "
                    f"(simulation: num-supernodes) or lower the minimum")
            if now >= next_log:
                LOGGER.info("waiting for nodes: %d connected, %d needed", len(nodes), needed)
                next_log = now + 5.0
            time.sleep(0.1)

    def sample(self, grid: Grid, fraction: float, minimum: int, server_round: int | None = None,
               timeout: float | None = None) -> list[int]:
        """``max(fraction × eligible, minimum)`` node ids, drawn with the sampler's RNG from the connected nodes
        that claim no quarantined partition; with ``identify_nodes`` over them ordered by the partition they
        serve."""
        connected = self.wait_for_nodes(grid, max(self.min_available_nodes, minimum))
        suspects = self.book.suspects()
        nodes = [n for n in connected if n not in suspects]
        size = min(len(nodes), max(int(len(nodes) * fraction), minimum, 1))
        if self.identify_nodes and size < len(nodes) and server_round is not None:
            self.identify(server_round, grid, nodes, timeout)
            of = self.book.partition_of
            nodes = sorted(nodes, key=lambda n: (n not in of, of.get(n, 0), n))
        return sorted(self.rng.sample(nodes, size))

    def identify(self, server_round: int, grid: Grid, node_ids: Iterable[int], timeout: float | None) -> None:
        """Learn the partition of each node whose partition is unknown and register it as that node's claim.

        Under Flower's simulation engine the engine's own node → partition assignment is read from the grid
        (:func:`engine_partitions`) and registered as each node's *provisional* claim, without a message:
        thousands of simultaneous queries cost minutes there (the engine scans every pending message for
        every node each poll), and even two wait for the whole engine start. The check moves into the
        replies: every train or evaluate reply carries ``partition-id``, and a provisional node's first one
        confirms its claim (:meth:`PartitionBook.confirm`); after a contradiction every unknown node gets
        one query, as everywhere else. Either way what is learnt here is a claim under the book's rules.
        """
        unknown = self.book.unknown(node_ids)
        if not unknown:
            return
        engine = None if self.book.engine_refuted else engine_partitions(grid)
        if engine is not None and all(n in engine for n in unknown):
            self.book.assume({n: engine[n] for n in unknown})
            self.screen.note_quarantine(server_round)
            return
        self.query(server_round, grid, unknown, timeout)

    def query(self, server_round: int, grid: Grid, node_ids: Sequence[int], timeout: float | None) -> dict[int, int]:
        """One query to each of ``node_ids``; registers the valid claims and returns them (``{node: partition}``,
        refused claims included: what each node said, not what it was granted)."""
        if not node_ids:
            return {}
        self.book.asked.update(node_ids)
        messages = [Message(content=query_content(server_round), message_type=MessageType.QUERY, dst_node_id=n)
                    for n in node_ids]
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        replies = self.screen.failures(server_round, "query", messages, replies)
        live = self.live()
        if live is not None:
            self.book.prune(live)
        bounds = {PARTITION_ID: COMMON_METRICS[PARTITION_ID]}
        verdicts: list[tuple[int, int | None, str | None]] = []
        said: dict[int, int] = {}
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            pid, reason = decode_identity_reply(msg.content)
            if pid is not None:
                reason = check_metrics(msg.content[METRICS], bounds)
            if pid is not None and reason is None:
                said.setdefault(node, pid)
                self.book.claim(node, pid)
            verdicts.append((node, pid, reason))
        quarantined = self.screen.note_quarantine(server_round)
        for node, pid, reason in verdicts:
            if reason is None and pid is not None:
                reason = self.book.refusal(node, pid, quarantined)
            if reason is not None or pid is None:
                self.screen.reject(server_round, "query", self.book.label(node), reason or "no partition id")
        return said
