"""What every Pollen strategy shares on Flower's Message API: sampling, reply screening, round reports.

:class:`PollenStrategy` is a :class:`flwr.serverapp.strategy.Strategy`; ``strategy.start(grid=...,
initial_arrays=..., num_rounds=...)`` runs it from any ``@app.main()`` ServerApp. Subclasses say what
a reply must hold (``decode_train_reply``) and how accepted replies combine (``aggregate_accepted``);
this class makes sure no reply reaches that code unchecked:

* error replies are counted as failures with their reason;
* the metrics the strategy acts on must be good or the reply is refused: ``num-examples`` a whole
  number within ``max_examples``, ``partition-id`` a whole number; a metric it only reports (a loss, an
  accuracy, any other key) that is not a finite number in its range is dropped alone, with a WARNING
  naming the client, key and value — the reply, its model update included, still counts;
* a node's ``partition-id`` is a claim, never proof: answering first does not make it true. A node
  keeps the partition it first claimed (a changed claim is rejected). When two connected nodes
  claim one partition, neither is trusted: the partition is *quarantined* — every reply claiming it
  is rejected, a WARNING names the nodes and the partition each round, and the round report keeps
  it (``quarantined``) — until one of them leaves the grid. Once a claimant has left, its claim
  lapses: that is how a SuperNode restarted on the same state folder carries on. The operator can
  pin partitions to node ids (``partition_pins``): a pinned partition is served by its pinned node
  only, whoever else claims it. The identity query (``identify``) follows the same rules, and so does
  the simulation engine's node → partition assignment, a provisional claim until the node's first reply
  confirms it (a contradiction drops the assignment: every node is then asked);
* a failure (an error reply, or no reply before the timeout) is recorded once, under the node the
  message was *sent to* (its partition when known): in a deployment the SuperLink itself writes the
  error reply for a node that has gone, so the reply's source would name the SuperLink;
* arrays are checked from their metadata before decoding (:mod:`pollen.protocol.screening`);
* replies are handled in partition order (:meth:`PollenStrategy.reply_order`), never in arrival order:
  every sum, average, the GLFC proxy's pool and the per-client results then come out the same, to the
  bit, whichever node answers first.

A rejected reply is logged as a WARNING naming the client, the key and the reason, and kept in the
round report (:meth:`take_round_report`). A round in which nobody was accepted is a WARNING with the
first reasons; more such rounds than ``max_empty_rounds`` raise :class:`NoTrainingError`, so a run
that trains nobody never looks like a success.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from pollen.log import LOGGER
from pollen.protocol.identity import PARTITION_ID, decode_identity_reply, query_content
from pollen.protocol.records import ARRAYS, CONFIG, METRICS, record_bytes
from pollen.protocol.screening import (
    COMMON_METRICS,
    PayloadBounds,
    check_metrics,
    metric_bounds,
    screen_metrics,
)
from pollen.strategies.aggregation import (
    DEFAULT_TRIM_FRACTION,
    average_arrays,
    check_aggregation,
    robust_arrays,
)
from pollen.strategies.metrics import aggregate_metrics

SIMULATION_NODE_WAIT_S = 5.0
REASON_CHARS = 2000  # a ClientApp traceback's last lines (long data paths included), bounded for metrics.jsonl
# Flower's FedAvg options whose only meaningful value is the one Pollen's wire contract fixes.
FLOWER_FIXED_OPTIONS = {"weighted_by_key": "num-examples", "arrayrecord_key": ARRAYS, "configrecord_key": CONFIG}
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


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


class NoTrainingError(RuntimeError):
    """Raised when more rounds than allowed trained nobody: the run has failed."""


@dataclass
class Accepted:
    """One screened reply: who sent it, its decoded payload, its metrics and example count."""

    node_id: int
    label: str
    payload: Any
    metrics: dict[str, Any]
    num_examples: int


@dataclass
class RoundReport:
    """What crossed the wire in one round and what became of it (for logs and results files)."""

    round: int
    sampled: int = 0
    evaluated: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    accepted: int = 0
    fit_clients: dict[str, dict] = field(default_factory=dict)
    evaluate_clients: dict[str, dict] = field(default_factory=dict)
    rejected: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    quarantined: list[dict] = field(default_factory=list)  # {"partition", "nodes"}: claimed by several
    # {"stage", "client", "key", "value", "reason"}: a metric left out (client None: the round could not
    # average it), the reply it came with counted
    dropped_metrics: list[dict] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


def _plain(metrics: Any) -> dict[str, Any]:
    return {str(k): (list(v) if isinstance(v, list) else v) for k, v in dict(metrics).items()}


class PollenStrategy(Strategy):
    """Base class: node sampling, message building, screening and reporting (module docstring).

    Args:
        fraction_train / fraction_evaluate: share of connected nodes sampled per round (as Flower's).
        min_train_nodes / min_evaluate_nodes: at least this many sampled (when connected).
        min_available_nodes: wait for this many nodes before sampling — at most ``node_wait_s``
            seconds, then fail naming both numbers instead of hanging.
        evaluate_every: evaluate every this many rounds and always in round ``num_rounds``.
        max_examples: the largest ``num-examples`` (and class count) a client may claim.
        max_empty_rounds: rounds allowed to train nobody before the run fails.
        seed: seeds this strategy's own sampling RNG (never the global ``random``).
        aggregation / trim_fraction: ``mean`` (the family's weighted mean), ``median`` or
            ``trimmed-mean`` (:mod:`pollen.strategies.aggregation`: breakdown points and cost).
        bounds: the declared payload bounds (:class:`~pollen.protocol.screening.PayloadBounds`).
        partition_pins: ``{partition: node id}`` the operator vouches for; a pinned partition is
            served by that node only (module docstring).
        train_metrics_aggr_fn / evaluate_metrics_aggr_fn: Flower's: ``fn(contents, "num-examples") ->
            MetricRecord`` replaces the clients' mean ± std; ``contents`` holds one
            ``RecordDict({"metrics": MetricRecord})`` per accepted reply, its metrics as screened.
        weighted_by_key / arrayrecord_key / configrecord_key: Flower's; only the values of Pollen's
            wire contract (``FLOWER_FIXED_OPTIONS``) are accepted.

    Any other keyword is refused with a TypeError that lists the supported ones.
    """

    family = "base"

    def __init__(self, *, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 1, min_evaluate_nodes: int = 1, min_available_nodes: int = 1,
                 evaluate_every: int = 1, num_rounds: int | None = None, max_examples: int = 10_000_000,
                 max_empty_rounds: int = 0, node_wait_s: float = 120.0, seed: int = 0,
                 identify_nodes: bool = False, query_timeout: float | None = None, aggregation: str = "mean",
                 trim_fraction: float = DEFAULT_TRIM_FRACTION, bounds: PayloadBounds | None = None,
                 partition_pins: Mapping[int, int] | None = None,
                 train_metrics_aggr_fn: MetricsAggrFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
                 weighted_by_key: str = "num-examples", arrayrecord_key: str = ARRAYS, configrecord_key: str = CONFIG,
                 **unsupported: Any):
        if unsupported:
            raise TypeError(f"{type(self).__name__} does not support {', '.join(sorted(unsupported))}; "
                            f"its options: {', '.join(self.supported_options())} (docs/strategies.md, "
                            "'Differences from Flower's FedAvg/FedProx')")
        given = {"weighted_by_key": weighted_by_key, "arrayrecord_key": arrayrecord_key,
                 "configrecord_key": configrecord_key}
        for option, chosen in given.items():
            if chosen != FLOWER_FIXED_OPTIONS[option]:
                raise ValueError(f"{option} must be {FLOWER_FIXED_OPTIONS[option]!r}, got {chosen!r}: Pollen's "
                                 "wire contract fixes it (docs/strategies.md)")
        for option, fn in (("train_metrics_aggr_fn", train_metrics_aggr_fn),
                           ("evaluate_metrics_aggr_fn", evaluate_metrics_aggr_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{option} must be a callable (contents, weighted_by_key) -> MetricRecord")
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        for name, value in (("min_train_nodes", min_train_nodes), ("min_available_nodes", min_available_nodes),
                            ("evaluate_every", evaluate_every), ("max_examples", max_examples)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if min_evaluate_nodes < 0 or max_empty_rounds < 0 or node_wait_s < 0:
            raise ValueError("min_evaluate_nodes, max_empty_rounds and node_wait_s must be >= 0")
        check_aggregation(aggregation, trim_fraction)
        pins = dict(partition_pins or {})
        for pid, node in pins.items():
            if isinstance(pid, bool) or isinstance(node, bool) or int(pid) != pid or int(node) != node or pid < 0:
                raise ValueError(f"partition_pins maps partition ids >= 0 to node ids, got {pid!r}: {node!r}")
        if len(set(pins.values())) != len(pins):
            raise ValueError(f"partition_pins pins one node to several partitions: {pins}")
        self.aggregation = aggregation
        self.trim_fraction = float(trim_fraction)
        self.bounds = bounds if bounds is not None else PayloadBounds()
        self.pins = {int(p): int(n) for p, n in pins.items()}
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.evaluate_every = evaluate_every
        self.num_rounds = num_rounds
        self.max_examples = int(max_examples)
        self.max_empty_rounds = max_empty_rounds
        self.node_wait_s = node_wait_s
        self.rng = random.Random(seed)
        self.empty_rounds = 0
        self.partition_of: dict[int, int] = {n: p for p, n in self.pins.items()}  # node id -> its (first) claim
        self.node_of: dict[int, int] = dict(self.pins)  # partition -> the one node trusted to serve it
        self.claims: dict[int, set[int]] = {p: {n} for p, n in self.pins.items()}  # partition -> claimants
        self._outbox: list[Message] = []  # the messages of the current send: whom each reply answers
        self.grid: Grid | None = None  # the grid last sampled from: tells whether a node has left
        self.identify_nodes = identify_nodes  # ask partitions (QUERY) before sampling a fraction of nodes
        self.query_timeout = query_timeout
        self.timeout: float | None = None  # start()'s, the default wait for query replies
        self._queried: set[int] = set()
        # node id -> the partition the simulation engine assigned it: a claim no reply of the node has confirmed
        self._provisional: dict[int, int] = {}
        self._engine_refuted = False  # a reply contradicted the engine's order: from now on every node is asked
        self._settled = False  # the simulation's node registration was seen to have finished
        self.reports: dict[int, RoundReport] = {}

    @classmethod
    def supported_options(cls) -> list[str]:
        """The keyword options of this class and the classes it builds on, in name order."""
        names: set[str] = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object or not issubclass(klass, PollenStrategy):
                continue
            names.update(p.name for p in inspect.signature(init).parameters.values()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)
        return sorted(names)

    # ------------------------------------------------------------------ sampling and messages
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
            if len(nodes) >= needed and (not simulation or self._settled or nodes == previous):
                self._settled = True
                return nodes
            previous = nodes
            now = time.monotonic()
            if now >= deadline and len(nodes) >= needed:  # still growing after the wait: take what is there
                self._settled = True
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

    def sample(self, grid: Grid, fraction: float, minimum: int, server_round: int | None = None) -> list[int]:
        """``max(fraction × connected, minimum)`` node ids, drawn with the strategy's own RNG.

        Node ids are new in every run; with ``identify_nodes`` the draw runs over the nodes ordered by the
        partition they serve, so the same seed samples the same partitions in every run.
        """
        nodes = self.wait_for_nodes(grid, max(self.min_available_nodes, minimum))
        size = min(len(nodes), max(int(len(nodes) * fraction), minimum, 1))
        if self.identify_nodes and size < len(nodes) and server_round is not None:
            self.identify(server_round, grid, nodes)
            nodes = sorted(nodes, key=lambda n: (n not in self.partition_of, self.partition_of.get(n, 0), n))
        return sorted(self.rng.sample(nodes, size))

    def identify(self, server_round: int, grid: Grid, node_ids: Iterable[int]) -> None:
        """Learn the partition of each node whose partition is unknown and register it as that node's claim.

        Under Flower's simulation engine the engine's own node → partition assignment is read from the grid
        (:func:`engine_partitions`) and registered as each node's *provisional* claim, without a message:
        thousands of simultaneous queries cost minutes there (the engine scans every pending message for
        every node each poll), and even two wait for the whole engine start. The check moves into the
        replies: every train or evaluate reply carries ``partition-id``, and a provisional node's first
        one confirms its claim (:meth:`_settle_provisional`). A reply that contradicts the engine's order
        is a WARNING, all claims still provisional are dropped, and from then on the engine's assignment
        is never used again in this run: every unknown node gets one query, as everywhere else. Either way
        a partition learnt here is a claim under the rules of every reply (module docstring): pins win, a
        changed claim is refused, two connected claimants quarantine the partition, and each later train
        or evaluate reply's ``partition-id`` must match it.
        """
        unknown = sorted(n for n in node_ids if n not in self.partition_of and n not in self._queried)
        if not unknown:
            return
        engine = None if self._engine_refuted else engine_partitions(grid)
        if engine is not None and all(n in engine for n in unknown):
            self._queried.update(unknown)  # a refused claim (another node's pin) is not read again each round
            for n in unknown:
                self._provisional[n] = engine[n]
                self._register_claim(n, engine[n])
            self._warn_quarantine(server_round)
            return
        self._query(server_round, grid, unknown)

    def _query(self, server_round: int, grid: Grid, node_ids: Sequence[int]) -> dict[int, int]:
        """One query to each of ``node_ids``; registers the valid claims and returns them (``{node: partition}``,
        refused claims included: what each node said, not what it was granted)."""
        if not node_ids:
            return {}
        self._queried.update(node_ids)
        messages = [Message(content=query_content(server_round), message_type=MessageType.QUERY, dst_node_id=n)
                    for n in node_ids]
        timeout = self.query_timeout if self.query_timeout is not None else self.timeout
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        replies = self._record_failures(server_round, "query", messages, replies)
        self._prune_claims()
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
                self._register_claim(node, pid)
            verdicts.append((node, pid, reason))
        self._warn_quarantine(server_round)
        quarantined = self.quarantined()
        for node, pid, reason in verdicts:
            if reason is None and pid is not None:
                reason = self._check_partition(node, {PARTITION_ID: pid}, quarantined)
            if reason is not None or pid is None:
                self.reject(server_round, "query", self.label(node), reason or "no partition id")
        return said

    def partition_claim_reason(self, pid: int) -> str | None:
        """Why a node may not serve partition ``pid`` (``None``: it may); strategies with a plan override it."""
        return None

    def evaluates(self, server_round: int) -> bool:
        return server_round % self.evaluate_every == 0 or server_round == self.num_rounds

    def report(self, server_round: int) -> RoundReport:
        if server_round not in self.reports:
            self.reports[server_round] = RoundReport(server_round)
        return self.reports[server_round]

    def take_round_report(self, server_round: int) -> RoundReport:
        """The report of ``server_round``, removed from the strategy (rounds are reported once)."""
        return self.reports.pop(server_round, None) or RoundReport(server_round)

    def build_messages(self, server_round: int, node_ids: Sequence[int], message_type: str,
                       content_for: Callable[[int], RecordDict]) -> list[Message]:
        messages = [Message(content=content_for(n), message_type=message_type, dst_node_id=n) for n in node_ids]
        self._outbox = messages  # the grid sets their ids when it sends them: screening maps replies back
        rep = self.report(server_round)
        rep.bytes_down += sum(record_bytes(m.content) for m in messages)
        if message_type == MessageType.TRAIN:
            rep.sampled += len(messages)
        else:
            rep.evaluated += len(messages)
        return messages

    @staticmethod
    def round_config(config: ConfigRecord | None, server_round: int, **extra: Any) -> ConfigRecord:
        """A fresh ConfigRecord per message: Flower reuses the caller's ``train_config`` every round."""
        out = ConfigRecord(dict(config or {}))
        out["server-round"] = server_round
        for key, value in extra.items():
            out[key] = value
        return out

    # ------------------------------------------------------------------ screening
    def reply_order(self, node_id: int) -> tuple[int, int, int]:
        """Sort key of a node's reply: its partition, then (unidentified nodes last) its node id.

        Float sums depend on the order of their terms, and replies arrive in whatever order the nodes
        finish; node ids are new in every run, partitions are not. Ordering here, where replies are
        collected, is what makes two runs of one command write the same numbers.
        """
        pid = self.partition_of.get(node_id)
        return (0, pid, node_id) if pid is not None else (1, node_id, node_id)

    def label(self, node_id: int) -> str:
        pid = self.partition_of.get(node_id)
        return f"partition {pid}" if pid is not None else f"node {node_id}"

    def reject(self, server_round: int, stage: str, label: str, reason: str) -> None:
        LOGGER.warning("round %d %s: rejected reply from %s: %s", server_round, stage, label, reason)
        self.report(server_round).rejected.append(
            {"round": server_round, "stage": stage, "client": label, "reason": reason[:REASON_CHARS]})

    # ------------------------------------------------------------------ failures, named by destination
    def _record_failures(self, server_round: int, stage: str, sent: Sequence[Message],
                         replies: Iterable[Message]) -> list[Message]:
        """Record (and log, once each) every error reply and every message of ``sent`` that got no reply,
        under the node the message was sent to; return the replies that are not errors, in :meth:`reply_order`.

        A reply names the message it answers (``reply_to_message_id``); in a deployment an error reply for a
        node that has gone is written by the SuperLink, so its source is the SuperLink, never the node.
        Where the grid set no message ids (a test grid), the reply's source stands in for the destination.
        """
        rep = self.report(server_round)
        dst_of = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent if m.metadata.message_id}
        answered: set[int] = set()
        good: list[Message] = []
        addressed = [(dst_of.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id)), msg)
                     for msg in replies]
        for node, msg in sorted(addressed, key=lambda pair: self.reply_order(pair[0])):  # stable: ties keep arrival
            answered.add(node)
            if not msg.has_error():
                good.append(msg)
                continue
            code, reason = int(msg.error.code), str(msg.error.reason)
            self._failure(rep, stage, node, code, reason)
        for m in sorted(sent, key=lambda m: self.reply_order(int(m.metadata.dst_node_id))):
            node = int(m.metadata.dst_node_id)
            if node not in answered:
                self._failure(rep, stage, node, None, "no reply before the round timeout")
        return good

    def _failure(self, rep: RoundReport, stage: str, node: int, code: int | None, reason: str) -> None:
        label = self.label(node)
        rep.failures.append({"stage": stage, "client": label, "node": node, "code": code,
                             "reason": reason[-REASON_CHARS:]})
        last = reason.strip().splitlines()[-1:] if reason.strip() else [""]
        hint = ("; its ClientApp must answer QUERY messages with metrics['partition-id']"
                if stage == "query" and code is not None else "")
        who = label if label == f"node {node}" else f"{label} (node {node})"
        LOGGER.warning("round %d %s: %s failed%s: %s%s", rep.round, stage, who,
                       "" if code is None else f" (error {code})", last[0][:500], hint)

    # ------------------------------------------------------------------ partition claims
    def _prune_claims(self) -> None:
        """The claims of nodes that have left the grid lapse (a restarted SuperNode returns under a new id);
        a pinned node's never does."""
        if self.grid is None:
            return
        live = set(self.grid.get_node_ids())
        for pid, nodes in self.claims.items():
            gone = {n for n in nodes if n not in live and self.pins.get(pid) != n}
            if gone:
                LOGGER.info("partition %d: node(s) %s left the grid; their claim lapses", pid, sorted(gone))
                nodes -= gone
                for n in gone:
                    self.partition_of.pop(n, None)
                    self._provisional.pop(n, None)
                self._refresh_owner(pid)

    def _refresh_owner(self, pid: int) -> None:
        """``node_of[pid]``: the pinned node, else the sole claimant; nobody when several claim it."""
        nodes = self.claims.get(pid, set())
        if pid in self.pins:
            self.node_of[pid] = self.pins[pid]
        elif len(nodes) == 1:
            self.node_of[pid] = next(iter(nodes))
        else:
            self.node_of.pop(pid, None)

    def _register_claim(self, node_id: int, pid: int) -> None:
        """Record that ``node_id`` claims ``pid`` — unless the claim is refused outright (another node's pin,
        a changed claim, a partition outside the plan), which then claims nothing."""
        pinned = self.pins.get(pid)
        if pinned is not None and pinned != node_id:
            return
        if self.partition_of.get(node_id, pid) != pid or self.partition_claim_reason(pid) is not None:
            return
        self.partition_of[node_id] = pid
        self.claims.setdefault(pid, set()).add(node_id)
        self._refresh_owner(pid)

    def _settle_provisional(self, server_round: int, node_id: int, pid: int) -> None:
        """A reply of ``node_id`` says ``pid``: a provisional claim (the engine's) it matches is confirmed; one
        it contradicts means the engine's order does not hold for this Flower. Then a WARNING, every claim
        still provisional is dropped (so this node's reply counts as an unknown node's would), and the
        engine's assignment is not used again: :meth:`identify` asks every unknown node."""
        assigned = self._provisional.pop(node_id, None)
        if assigned is None or assigned == pid:
            return
        LOGGER.warning("round %d: node %d answered partition %d, but the simulation engine assigned it partition "
                       "%d: the engine's node order does not hold; its assignment is dropped and every node "
                       "will be asked its partition", server_round, node_id, pid, assigned)
        self._engine_refuted = True
        self._provisional[node_id] = assigned
        for node, engine_pid in self._provisional.items():
            self._queried.discard(node)
            if self.partition_of.get(node) == engine_pid:
                del self.partition_of[node]
                self.claims.get(engine_pid, set()).discard(node)
                self._refresh_owner(engine_pid)
        self._provisional.clear()

    def quarantined(self) -> dict[int, list[int]]:
        """``{partition: claiming node ids}`` for every unpinned partition that several nodes claim."""
        return {pid: sorted(nodes) for pid, nodes in sorted(self.claims.items())
                if len(nodes) > 1 and pid not in self.pins}

    def _warn_quarantine(self, server_round: int) -> None:
        """A WARNING per quarantined partition, once per round, kept in the round report."""
        rep = self.report(server_round)
        logged = {q["partition"] for q in rep.quarantined}
        for pid, nodes in self.quarantined().items():
            if pid in logged:
                continue
            rep.quarantined.append({"partition": pid, "nodes": nodes})
            LOGGER.warning("round %d: partition %d is claimed by nodes %s: quarantined, none of them is trusted "
                           "(pin the partition to its node with partition-pins)", server_round, pid, nodes)

    def _check_partition(self, node_id: int, metrics: dict[str, Any],
                         quarantined: dict[int, list[int]] | None = None) -> str | None:
        """Why this node's reply may not count for the partition it claims (or claimed before).
        ``quarantined``: :meth:`quarantined`, computed once per batch of replies by the caller."""
        claimed = self.partition_of.get(node_id)
        target = claimed
        if PARTITION_ID in metrics:
            pid = int(metrics[PARTITION_ID])
            pinned = self.pins.get(pid)
            if pinned is not None and pinned != node_id:
                return f"partition {pid} is pinned to node {pinned}, not to this node ({node_id})"
            if claimed is not None and claimed != pid:
                return f"partition-id {pid} differs from partition {claimed} this node claimed before"
            reason = self.partition_claim_reason(pid)
            if reason is not None:
                return reason
            target = pid
        if quarantined is None:
            quarantined = self.quarantined()
        nodes = quarantined.get(target) if target is not None else None
        if nodes:
            return (f"partition {target} is quarantined: nodes {nodes} all claim it, so none is trusted "
                    f"(this is node {node_id}; pin the partition with partition-pins)")
        return None

    def screen(self, server_round: int, stage: str, replies: Iterable[Message],
               decode: Callable[[Message, dict[str, Any]], tuple[Any, str | None]]) -> list[Accepted]:
        """Failures recorded by destination, partition claims registered (all of the round's replies before
        any is judged, so the order of answers decides nothing), bad replies rejected with a reason, the
        rest decoded by ``decode`` and returned in :meth:`reply_order`."""
        rep = self.report(server_round)
        wanted = MessageType.TRAIN if stage == "train" else MessageType.EVALUATE
        sent = [m for m in self._outbox if m.metadata.message_type == wanted]
        self._outbox = []
        good = self._record_failures(server_round, stage, sent, replies)
        self._prune_claims()
        bounds = metric_bounds(self.max_examples, evaluate=stage == "evaluate")
        first: set[int] = set()
        for msg in good:  # claims first: one per node and round, from metrics that pass screening
            node = int(msg.metadata.src_node_id)
            if node in first:
                continue
            first.add(node)
            rec = msg.content.get(METRICS)
            if not isinstance(rec, MetricRecord):
                continue
            claim = rec.get(PARTITION_ID)
            if isinstance(claim, (int, float)) and screen_metrics(rec, bounds).reason is None:
                self._settle_provisional(server_round, node, int(claim))  # the engine's claim confirmed, or not
                self._register_claim(node, int(claim))  # the metrics pass: a well-formed whole number
        self._warn_quarantine(server_round)
        quarantined = self.quarantined()
        accepted: list[Accepted] = []
        seen: set[int] = set()
        # round 1's claims were only just registered: order again, by the partitions now known
        for msg in sorted(good, key=lambda m: self.reply_order(int(m.metadata.src_node_id))):
            node = int(msg.metadata.src_node_id)
            rep.bytes_up += record_bytes(msg.content)
            label = self.label(node)
            if node in seen:
                self.reject(server_round, stage, label, "a second reply from the same node in one round")
                continue
            seen.add(node)
            metrics_rec = msg.content.get(METRICS)
            if not isinstance(metrics_rec, MetricRecord):
                self.reject(server_round, stage, label, f"no MetricRecord under '{METRICS}'")
                continue
            screened = screen_metrics(metrics_rec, bounds)
            reason = screened.reason
            metrics = screened.kept
            if reason is None:
                reason = self._check_partition(node, metrics, quarantined)
            if reason is None and PARTITION_ID in metrics:  # a consistent claim names the client
                label = f"partition {int(metrics[PARTITION_ID])}"
            if reason is None:  # the family's decoder sees the metrics as sent (its own keys are its rule)
                payload, reason = decode(msg, _plain(metrics_rec))
            if reason is not None:
                self.reject(server_round, stage, label, reason)
                continue
            label = self.label(node)
            for key, value, why in screened.dropped:
                self.drop_metric(server_round, stage, label, node, key, value, why)
            accepted.append(Accepted(node, label, payload, metrics, int(metrics["num-examples"])))
            target = rep.fit_clients if stage == "train" else rep.evaluate_clients
            target[label] = metrics
        return accepted

    def drop_metric(self, server_round: int, stage: str, label: str, node: int, key: str, value: Any,
                    reason: str) -> None:
        """A WARNING naming the client, the key and the value, kept in the round report; the reply counts."""
        who = label if label == f"node {node}" else f"{label} (node {node})"
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        LOGGER.warning("round %d %s: dropped metric '%s' = %s from %s, the rest of its reply counts: %s",
                       server_round, stage, key, shown, who, reason)
        self.report(server_round).dropped_metrics.append(
            {"stage": stage, "client": label, "key": key, "value": value, "reason": reason[:REASON_CHARS]})

    def client_metrics(self, server_round: int, stage: str,
                       reports: Sequence[tuple[float, Accepted]]) -> dict[str, Any]:
        """The round's client metrics: ``train/evaluate_metrics_aggr_fn`` when given, else the weighted mean
        plus mean ± std over clients (lists element-wise; a list the round cannot average is a WARNING)."""
        fn = self.train_metrics_aggr_fn if stage == "train" else self.evaluate_metrics_aggr_fn
        if fn is not None:
            contents = [RecordDict({METRICS: MetricRecord(a.metrics)}) for _, a in reports]
            return dict(fn(contents, FLOWER_FIXED_OPTIONS["weighted_by_key"])) if contents else {}
        out, refused = aggregate_metrics([(w, a.metrics) for w, a in reports])
        for key, reason in refused.items():
            LOGGER.warning("round %d %s: metric '%s' left out of the round's metrics: %s", server_round, stage,
                           key, reason)
            self.report(server_round).dropped_metrics.append(
                {"stage": stage, "client": None, "key": key, "value": None, "reason": reason})
        return out

    def combine(self, client_arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
        """The accepted clients' arrays combined by the strategy's ``aggregation``: the family's weighted
        mean (``weights``), or the unweighted median / trimmed mean (:mod:`pollen.strategies.aggregation`)."""
        if self.aggregation == "mean":
            return average_arrays(client_arrays, weights)
        return robust_arrays(client_arrays, self.aggregation, self.trim_fraction)

    def close_train_round(self, server_round: int, accepted: Sequence[Accepted]) -> None:
        """Count the round; an empty one is a WARNING, too many of them fail the run."""
        rep = self.report(server_round)
        rep.accepted = len(accepted)
        if accepted:
            return
        self.empty_rounds += 1
        reasons = [f"{r['client']}: {r['reason']}" for r in rep.rejected[:3]]
        reasons += [f"{f['client']}: {f['reason'].strip().splitlines()[-1] if f['reason'].strip() else ''}"
                    for f in rep.failures[:3]]
        if not rep.sampled:
            reasons.append("no node was sampled")
        text = "; ".join(reasons) or "no reply arrived before the round timeout"
        LOGGER.warning("round %d trained nobody (%d sampled, %d rejected, %d failed): %s", server_round,
                       rep.sampled, len(rep.rejected), len(rep.failures), text)
        if self.empty_rounds > self.max_empty_rounds:
            raise NoTrainingError(f"round {server_round} trained nobody ({rep.sampled} sampled, "
                                  f"{len(rep.rejected)} rejected, {len(rep.failures)} failed): {text}")

    def train_metrics(self, server_round: int, accepted: Sequence[Accepted], **extra: float) -> MetricRecord:
        """Round metrics: counts of accepted/rejected/failed plus client metrics' mean ± std."""
        rep = self.report(server_round)
        out: dict[str, Any] = {"accepted": len(accepted), "rejected": len(rep.rejected),
                               "failures": len([f for f in rep.failures if f["stage"] == "train"])}
        out.update(self.client_metrics(server_round, "train", [(a.num_examples, a) for a in accepted]))
        out.update(extra)
        rep.fit = dict(out)
        return MetricRecord(out)

    # ------------------------------------------------------------------ evaluate (shared)
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate <= 0 or not self.evaluates(server_round):
            return []
        nodes = self.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes, server_round)
        content = self.evaluate_content(server_round, arrays, config)
        return self.build_messages(server_round, nodes, MessageType.EVALUATE, lambda _n: content)

    def evaluate_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """What evaluating clients receive; by default the current global arrays."""
        return RecordDict({ARRAYS: arrays, CONFIG: self.round_config(config, server_round)})

    def evaluate_weight(self, accepted: Accepted) -> float:
        """Weight of one client's evaluate metrics: its number of test examples."""
        return float(accepted.num_examples)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        accepted = self.screen(server_round, "evaluate", replies, lambda _m, _x: (None, None))
        if not accepted:
            return None
        out = self.client_metrics(server_round, "evaluate", [(self.evaluate_weight(a), a) for a in accepted])
        self.report(server_round).evaluate = dict(out)
        return MetricRecord(out)

    def summary(self) -> None:
        LOGGER.info("%r", self)

    # ------------------------------------------------------------------ checkpoint state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(named arrays, JSON-able values)``: everything needed to continue after a restart.

        Partition bindings are not kept: a restarted run's nodes have new node ids and bind anew.
        """
        version, internal, gauss = self.rng.getstate()
        return {}, {"rng": [version, list(internal), gauss], "empty-rounds": self.empty_rounds}

    def restore(self, arrays: dict[str, np.ndarray], values: dict[str, Any]) -> None:
        version, internal, gauss = values["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.empty_rounds = int(values["empty-rounds"])

    # ------------------------------------------------------------------ the round loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              first_round: int = 1) -> Result:
        """Flower's ``Strategy.start`` loop, able to continue from ``first_round`` (a resumed run).

        Same order, ``Result`` and INFO lines as Flower's: ``evaluate_fn(0, initial_arrays)`` (fresh runs
        only), then per round train → aggregate → evaluate → aggregate → ``evaluate_fn(round, arrays)``,
        each round's aggregated metrics logged as Flower's strategies log them. Flower's closing dump of
        every round's metrics is left out: ``Result`` holds them.
        """
        if not 1 <= first_round <= num_rounds:
            raise ValueError(f"first_round must be in 1..{num_rounds}, got {first_round}")
        LOGGER.info("Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        LOGGER.info("")
        started = time.time()
        self.timeout = timeout
        result = Result()
        arrays = initial_arrays
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        if evaluate_fn is not None and first_round == 1:
            res = evaluate_fn(0, arrays)
            LOGGER.info("Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        for server_round in range(first_round, num_rounds + 1):
            LOGGER.info("")
            LOGGER.info("[ROUND %d/%d]", server_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(server_round, arrays, train_config, grid), timeout=timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if train_metrics is not None:
                LOGGER.info("\t└──> Aggregated MetricRecord: %s", train_metrics)
                result.train_metrics_clientapp[server_round] = train_metrics
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(server_round, arrays, evaluate_config, grid), timeout=timeout)
            eval_metrics = self.aggregate_evaluate(server_round, replies)
            if eval_metrics is not None:
                LOGGER.info("\t└──> Aggregated MetricRecord: %s", eval_metrics)
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
            if evaluate_fn is not None:
                LOGGER.info("Global evaluation")
                res = evaluate_fn(server_round, arrays)
                LOGGER.info("\t└──> MetricRecord: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[server_round] = res
        LOGGER.info("")
        LOGGER.info("Strategy execution finished in %.2fs", time.time() - started)
        return result
