"""Which node serves which partition: claims, pins and quarantine, as a pure record (no grid, no messages).

A node's ``partition-id`` is a claim, never proof: answering first does not make it true.

* A node keeps the partition it first claimed; a changed claim is refused.
* When two connected nodes claim one unpinned partition, the partition is *disputed*: neither is
  trusted, and the partition is *quarantined* for the rest of the run — every reply claiming it is
  refused and its claimants are not sampled (:meth:`PartitionBook.suspects`). When a claimant leaves,
  the others inherit nothing (a WARNING says so): otherwise an impostor would only have to outlast
  the node it copies.
* A claimant of an undisputed partition that has left the grid lapses (:meth:`PartitionBook.prune`);
  that is how a SuperNode restarted on the same state folder carries on (after the SuperLink has
  dropped the old one: a new claim while the old node is still connected is a dispute).
* ``pins`` (``{partition: node id}``, the operator's word): a pinned partition is served by its pinned
  node only, whoever else claims it, and is never quarantined.
* Flower's simulation engine assigns partitions itself; its assignment is a node's *provisional* claim
  (:meth:`PartitionBook.assume`) until the node's first reply confirms it (:meth:`PartitionBook.confirm`).
  A reply that contradicts it drops every provisional claim, and the engine is not trusted again.

The strategy (:class:`~pollen.strategies.base.PollenStrategy`) feeds the book what nodes say and asks it
who may serve what; the book never sends or reads a message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pollen.log import LOGGER

Quarantine = dict[int, list[int]]  # partition -> the node ids that claim it


def check_pins(pins: Mapping[int, int] | None) -> dict[int, int]:
    """``{partition: node id}`` as whole numbers, or a ValueError naming the bad entry."""
    out: dict[int, int] = {}
    for pid, node in dict(pins or {}).items():
        if isinstance(pid, bool) or isinstance(node, bool) or int(pid) != pid or int(node) != node or pid < 0:
            raise ValueError(f"partition_pins maps partition ids >= 0 to node ids, got {pid!r}: {node!r}")
        out[int(pid)] = int(node)
    if len(set(out.values())) != len(out):
        raise ValueError(f"partition_pins pins one node to several partitions: {out}")
    return out


class PartitionBook:
    """Claims, pins and quarantine of one run (module docstring).

    ``plan(pid)``: why a partition cannot be served at all (outside a strategy's plan), else ``None``.
    """

    def __init__(self, pins: Mapping[int, int] | None = None,
                 plan: Callable[[int], str | None] | None = None):
        self.pins = check_pins(pins)
        self.plan = plan if plan is not None else (lambda _pid: None)
        self.partition_of: dict[int, int] = {n: p for p, n in self.pins.items()}  # node -> its (first) claim
        self.node_of: dict[int, int] = dict(self.pins)  # partition -> the one node trusted to serve it
        self.claims: dict[int, set[int]] = {p: {n} for p, n in self.pins.items()}  # partition -> claimants
        self.disputed: dict[int, set[int]] = {}  # partition -> every node that has claimed it, once several did
        self.provisional: dict[int, int] = {}  # node -> the engine's assignment, not yet confirmed by a reply
        self.asked: set[int] = set()  # nodes asked their partition (or assigned one by the engine) once
        self.engine_refuted = False  # a reply contradicted the engine: its assignment is not used again

    # ---------------------------------------------------------------- what nodes say
    def claim(self, node: int, pid: int) -> None:
        """Record that ``node`` claims ``pid`` — unless the claim is refused outright (another node's pin, a
        changed claim, a partition outside the plan), which then claims nothing."""
        pinned = self.pins.get(pid)
        if pinned is not None and pinned != node:
            return
        if self.partition_of.get(node, pid) != pid or self.plan(pid) is not None:
            return
        self.partition_of[node] = pid
        claimants = self.claims.setdefault(pid, set())
        claimants.add(node)
        if pid in self.disputed or len(claimants) > 1:
            self.disputed.setdefault(pid, set()).update(claimants)
        self._refresh_owner(pid)

    def assume(self, assignment: Mapping[int, int]) -> None:
        """The simulation engine's ``{node: partition}``: provisional claims, each confirmed by a reply."""
        self.asked.update(assignment)  # a refused claim (another node's pin) is not read again each round
        for node, pid in assignment.items():
            self.provisional[node] = pid
            self.claim(node, pid)

    def confirm(self, server_round: int, node: int, pid: int) -> None:
        """A reply of ``node`` says ``pid``: a provisional claim it matches is confirmed. One it contradicts
        means the engine's order does not hold for this Flower: a WARNING, every claim still provisional is
        dropped (the node then counts as an unknown node would) and the engine is not used again."""
        assigned = self.provisional.pop(node, None)
        if assigned is None or assigned == pid:
            return
        LOGGER.warning("round %d: node %d answered partition %d, but the simulation engine assigned it partition "
                       "%d: the engine's node order does not hold; its assignment is dropped and every node "
                       "will be asked its partition", server_round, node, pid, assigned)
        self.engine_refuted = True
        self.provisional[node] = assigned
        for other, engine_pid in self.provisional.items():
            self.asked.discard(other)
            if self.partition_of.get(other) == engine_pid:
                del self.partition_of[other]
                self.claims.get(engine_pid, set()).discard(other)
                self._undispute(engine_pid, other)
                self._refresh_owner(engine_pid)
        self.provisional.clear()

    def _undispute(self, pid: int, node: int) -> None:
        """``node``'s claim on ``pid`` was the engine's word, not the node's: it disputes nothing."""
        nodes = self.disputed.get(pid)
        if nodes is None:
            return
        nodes.discard(node)
        if len(nodes) < 2:
            del self.disputed[pid]

    def prune(self, live: Iterable[int]) -> None:
        """The claims of nodes no longer in ``live`` lapse (a restarted SuperNode returns under a new id);
        a pinned node's never does. A disputed partition stays quarantined: a WARNING, no inheritance."""
        connected = set(live)
        for pid, nodes in self.claims.items():
            gone = {n for n in nodes if n not in connected and self.pins.get(pid) != n}
            if not gone:
                continue
            if pid in self.disputed:
                LOGGER.warning("partition %d: node(s) %s, claimant(s) of this quarantined partition, left the grid; "
                               "it stays quarantined for the rest of the run and no other claimant inherits it "
                               "(pin it to its node with partition-pins)", pid, sorted(gone))
            else:
                LOGGER.info("partition %d: node(s) %s left the grid; their claim lapses", pid, sorted(gone))
            nodes -= gone
            for n in gone:
                self.partition_of.pop(n, None)
                self.provisional.pop(n, None)
            self._refresh_owner(pid)

    def _refresh_owner(self, pid: int) -> None:
        """``node_of[pid]``: the pinned node, else the sole claimant of an undisputed partition; else nobody."""
        nodes = self.claims.get(pid, set())
        if pid in self.pins:
            self.node_of[pid] = self.pins[pid]
        elif len(nodes) == 1 and pid not in self.disputed:
            self.node_of[pid] = next(iter(nodes))
        else:
            self.node_of.pop(pid, None)

    # ---------------------------------------------------------------- who may serve what
    def quarantined(self) -> Quarantine:
        """``{partition: the node ids that have claimed it}`` for every disputed partition (for the run)."""
        return {pid: sorted(nodes) for pid, nodes in sorted(self.disputed.items()) if pid not in self.pins}

    def suspects(self) -> set[int]:
        """The nodes that claim a quarantined partition: never sampled."""
        return {node for node, pid in self.partition_of.items() if pid in self.disputed and pid not in self.pins}

    def refusal(self, node: int, pid: int | None, quarantined: Quarantine | None = None) -> str | None:
        """Why ``node``'s reply may not count for ``pid`` (the partition it names now; ``None``: it names
        none) or for the partition it claimed before; ``None`` when it may. ``quarantined``:
        :meth:`quarantined`, when the caller has it at hand for a batch of replies."""
        claimed = self.partition_of.get(node)
        target = claimed
        if pid is not None:
            pinned = self.pins.get(pid)
            if pinned is not None and pinned != node:
                return f"partition {pid} is pinned to node {pinned}, not to this node ({node})"
            if claimed is not None and claimed != pid:
                return f"partition-id {pid} differs from partition {claimed} this node claimed before"
            reason = self.plan(pid)
            if reason is not None:
                return reason
            target = pid
        if quarantined is None:
            quarantined = self.quarantined()
        nodes = quarantined.get(target) if target is not None else None
        if nodes:
            return (f"partition {target} is quarantined: nodes {nodes} have claimed it, so none is trusted for "
                    f"the rest of the run (this is node {node}; pin the partition with partition-pins)")
        return None

    def unknown(self, nodes: Iterable[int]) -> list[int]:
        """The nodes of ``nodes`` whose partition is neither known nor already asked, in id order."""
        return sorted(n for n in nodes if n not in self.partition_of and n not in self.asked)

    def label(self, node: int) -> str:
        pid = self.partition_of.get(node)
        return f"partition {pid}" if pid is not None else f"node {node}"

    def order(self, node: int) -> tuple[int, int, int]:
        """Sort key of a node's reply: its partition, then (unidentified nodes last) its node id.

        Float sums depend on the order of their terms, and replies arrive in whatever order the nodes
        finish; node ids are new in every run, partitions are not. Ordering by it is what makes two runs
        of one command write the same numbers.
        """
        pid = self.partition_of.get(node)
        return (0, pid, node) if pid is not None else (1, node, node)
