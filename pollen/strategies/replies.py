"""What became of every reply of a round: failures, screening, rejections, metrics and the round report.

:class:`ReplyScreen` holds no grid: it is handed the messages a strategy sent and the replies that came
back, and judges them with the run's :class:`~pollen.strategies.partitions.PartitionBook`.

* a failure (an error reply, or no reply before the timeout) is recorded once, under the node the
  message was *sent to* (its partition when known): in a deployment the SuperLink itself writes the
  error reply for a node that has gone, so the reply's source would name the SuperLink;
* the metrics the strategy acts on must be good or the reply is refused: ``num-examples`` a whole
  number within ``max_examples``, ``partition-id`` a whole number; a metric it only reports (a loss, an
  accuracy, any other key) that is not a finite number in its range is dropped alone, with a WARNING
  naming the client, key and value — the reply, its model update included, still counts;
* every reply's partition claim is registered before any reply is judged, so the order of answers
  decides nothing; then each reply must be allowed to speak for its partition (the book's rules);
* arrays are decoded by the family's ``decode`` (:mod:`pollen.protocol.screening` underneath);
* replies are handled in partition order (:meth:`PartitionBook.order`), never in arrival order: every
  sum, average, the GLFC proxy's pool and the per-client results come out the same, to the bit,
  whichever node answers first.

A rejected reply is logged as a WARNING naming the client, the key and the reason, and kept in the round
report (:class:`RoundReport`). A round in which nobody was accepted is a WARNING with the first
reasons; more such rounds than ``max_empty_rounds`` raise :class:`NoTrainingError`, so a run that trains
nobody never looks like a success.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MessageType, MetricRecord, RecordDict

from pollen.log import LOGGER
from pollen.protocol.identity import PARTITION_ID
from pollen.protocol.records import METRICS, record_bytes
from pollen.protocol.screening import metric_bounds, screen_metrics
from pollen.strategies.metrics import aggregate_metrics
from pollen.strategies.partitions import PartitionBook, Quarantine
from pollen.strategies.spread import Outlier

REASON_CHARS = 2000  # a ClientApp traceback's last lines (long data paths included), bounded for metrics.jsonl
WEIGHT_KEY = "num-examples"  # Flower's weighted_by_key, fixed by Pollen's wire contract
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
Decode = Callable[[Message, dict[str, Any]], tuple[Any, "str | None"]]


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
    # the simulated network's round (pollen.strategies.exchange): clock, deadline, who was missing and why
    network: dict[str, Any] = field(default_factory=dict)
    # {measure: {"replies", "median", "max-ratio"}}: how the round's accepted train replies spread
    # (pollen.strategies.spread); a reply above outlier-factor × the median is in ``rejected``
    spread: dict[str, dict] = field(default_factory=dict)
    secure: dict[str, Any] = field(default_factory=dict)  # a secure round's stages (pollen.secagg.server.SecureSum)
    fit: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


def _plain(metrics: Any) -> dict[str, Any]:
    return {str(k): (list(v) if isinstance(v, list) else v) for k, v in dict(metrics).items()}


def _who(label: str, node: int) -> str:
    return label if label == f"node {node}" else f"{label} (node {node})"


class ReplyScreen:
    """The round reports of one run and the rules that fill them (module docstring)."""

    def __init__(self, book: PartitionBook, *, max_examples: int, max_empty_rounds: int = 0,
                 train_metrics_aggr_fn: MetricsAggrFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggrFn | None = None):
        self.book = book
        self.max_examples = int(max_examples)
        self.max_empty_rounds = max_empty_rounds
        self.aggr_fn = {"train": train_metrics_aggr_fn, "evaluate": evaluate_metrics_aggr_fn}
        self.empty_rounds = 0
        self.reports: dict[int, RoundReport] = {}
        self.outbox: list[Message] = []  # the messages of the current send: whom each reply answers

    def report(self, server_round: int) -> RoundReport:
        if server_round not in self.reports:
            self.reports[server_round] = RoundReport(server_round)
        return self.reports[server_round]

    def take(self, server_round: int) -> RoundReport:
        """The report of ``server_round``, removed (rounds are reported once)."""
        return self.reports.pop(server_round, None) or RoundReport(server_round)

    def sending(self, server_round: int, message_type: str, messages: Sequence[Message]) -> None:
        """Messages about to go out: counted, and kept so that replies map back to their destination."""
        self.outbox = list(messages)  # the grid sets their ids when it sends them
        rep = self.report(server_round)
        rep.bytes_down += sum(record_bytes(m.content) for m in messages)
        if message_type == MessageType.TRAIN:
            rep.sampled += len(messages)
        else:
            rep.evaluated += len(messages)

    # ---------------------------------------------------------------- verdicts, logged and kept
    def reject(self, server_round: int, stage: str, label: str, reason: str, **extra: Any) -> None:
        """A WARNING naming the client and the reason, kept in the round report (``extra`` too)."""
        LOGGER.warning("round %d %s: rejected reply from %s: %s", server_round, stage, label, reason)
        self.report(server_round).rejected.append(
            {"round": server_round, "stage": stage, "client": label, "reason": reason[:REASON_CHARS], **extra})

    def drop_metric(self, server_round: int, stage: str, label: str, node: int, key: str, value: Any,
                    reason: str) -> None:
        """A WARNING naming the client, the key and the value, kept in the round report; the reply counts."""
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        LOGGER.warning("round %d %s: dropped metric '%s' = %s from %s, the rest of its reply counts: %s",
                       server_round, stage, key, shown, _who(label, node), reason)
        self.report(server_round).dropped_metrics.append(
            {"stage": stage, "client": label, "key": key, "value": value, "reason": reason[:REASON_CHARS]})

    def note_quarantine(self, server_round: int) -> Quarantine:
        """A WARNING per quarantined partition, once per round, kept in the round report; returns them."""
        rep = self.report(server_round)
        logged = {q["partition"] for q in rep.quarantined}
        quarantined = self.book.quarantined()
        for pid, nodes in quarantined.items():
            if pid in logged:
                continue
            rep.quarantined.append({"partition": pid, "nodes": nodes})
            LOGGER.warning("round %d: partition %d is claimed by nodes %s: quarantined for the rest of the run, none "
                           "of them is trusted or sampled (pin the partition to its node with partition-pins)",
                           server_round, pid, nodes)
        return quarantined

    # ---------------------------------------------------------------- failures, named by destination
    def failures(self, server_round: int, stage: str, sent: Sequence[Message],
                 replies: Iterable[Message]) -> list[Message]:
        """Record (and log, once each) every error reply and every message of ``sent`` that got no reply,
        under the node the message was sent to; return the replies that are not errors, in partition order.

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
        for node, msg in sorted(addressed, key=lambda pair: self.book.order(pair[0])):  # stable: ties keep arrival
            answered.add(node)
            if not msg.has_error():
                good.append(msg)
                continue
            self._failure(rep, stage, node, int(msg.error.code), str(msg.error.reason))
        for m in sorted(sent, key=lambda m: self.book.order(int(m.metadata.dst_node_id))):
            node = int(m.metadata.dst_node_id)
            if node not in answered:
                self._failure(rep, stage, node, None, "no reply before the round timeout")
        return good

    def _failure(self, rep: RoundReport, stage: str, node: int, code: int | None, reason: str) -> None:
        label = self.book.label(node)
        rep.failures.append({"stage": stage, "client": label, "node": node, "code": code,
                             "reason": reason[-REASON_CHARS:]})
        last = reason.strip().splitlines()[-1:] if reason.strip() else [""]
        hint = ("; its ClientApp must answer QUERY messages with metrics['partition-id']"
                if stage == "query" and code is not None else "")
        LOGGER.warning("round %d %s: %s failed%s: %s%s", rep.round, stage, _who(label, node),
                       "" if code is None else f" (error {code})", last[0][:500], hint)

    # ---------------------------------------------------------------- screening
    def screen(self, server_round: int, stage: str, replies: Iterable[Message], decode: Decode,
               live: Iterable[int] | None = None) -> list[Accepted]:
        """Failures recorded by destination, partition claims registered (all of the round's replies before
        any is judged), bad replies rejected with a reason, the rest decoded by ``decode`` and returned in
        partition order. ``live``: the connected node ids, whose absence lapses a claim (``None``: unknown)."""
        rep = self.report(server_round)
        wanted = MessageType.TRAIN if stage == "train" else MessageType.EVALUATE
        sent = [m for m in self.outbox if m.metadata.message_type == wanted]
        self.outbox = []
        good = self.failures(server_round, stage, sent, replies)
        if live is not None:
            self.book.prune(live)
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
                self.book.confirm(server_round, node, int(claim))  # the engine's claim confirmed, or not
                self.book.claim(node, int(claim))  # the metrics pass: a well-formed whole number
        quarantined = self.note_quarantine(server_round)
        accepted: list[Accepted] = []
        seen: set[int] = set()
        # round 1's claims were only just registered: order again, by the partitions now known
        for msg in sorted(good, key=lambda m: self.book.order(int(m.metadata.src_node_id))):
            node = int(msg.metadata.src_node_id)
            rep.bytes_up += record_bytes(msg.content)
            label = self.book.label(node)
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
            named = int(metrics[PARTITION_ID]) if reason is None and PARTITION_ID in metrics else None
            if reason is None:
                reason = self.book.refusal(node, named, quarantined)
            if reason is None and named is not None:  # a consistent claim names the client
                label = f"partition {named}"
            if reason is None:  # the family's decoder sees the metrics as sent (its own keys are its rule)
                payload, reason = decode(msg, _plain(metrics_rec))
            if reason is not None:
                self.reject(server_round, stage, label, reason)
                continue
            label = self.book.label(node)
            for key, value, why in screened.dropped:
                self.drop_metric(server_round, stage, label, node, key, value, why)
            accepted.append(Accepted(node, label, payload, metrics, int(metrics[WEIGHT_KEY])))
            target = rep.fit_clients if stage == "train" else rep.evaluate_clients
            target[label] = metrics
        return accepted

    def refuse_outliers(self, server_round: int, accepted: Sequence[Accepted], outliers: Sequence[Outlier],
                        factor: float) -> list[Accepted]:
        """``accepted`` less the replies :func:`~pollen.strategies.spread.far_outside` named, each refused with
        a WARNING naming its node, partition and ratio, and kept in the round's ``rejected`` records."""
        rep = self.report(server_round)
        for o in outliers:
            a = accepted[o.index]
            ratio = o.ratio if math.isfinite(o.ratio) else None
            self.reject(server_round, "train", a.label,
                        f"{o.measure} {o.size:.4g} is {o.ratio:.4g} × the round's median {o.median:.4g}, far outside "
                        f"the round's spread (outlier-factor = {factor:g}; {_who(a.label, a.node_id)})",
                        node=a.node_id, measure=o.measure, ratio=ratio)
            rep.fit_clients.pop(a.label, None)
        refused = {o.index for o in outliers}
        return [a for i, a in enumerate(accepted) if i not in refused]

    # ---------------------------------------------------------------- the round's numbers
    def client_metrics(self, server_round: int, stage: str,
                       reports: Sequence[tuple[float, Accepted]]) -> dict[str, Any]:
        """The round's client metrics: the stage's ``*_metrics_aggr_fn`` when given, else the weighted mean
        plus mean ± std over clients (lists element-wise; a list the round cannot average is a WARNING)."""
        fn = self.aggr_fn[stage]
        if fn is not None:
            contents = [RecordDict({METRICS: MetricRecord(a.metrics)}) for _, a in reports]
            return dict(fn(contents, WEIGHT_KEY)) if contents else {}
        out, refused = aggregate_metrics([(w, a.metrics) for w, a in reports])
        for key, reason in refused.items():
            LOGGER.warning("round %d %s: metric '%s' left out of the round's metrics: %s", server_round, stage,
                           key, reason)
            self.report(server_round).dropped_metrics.append(
                {"stage": stage, "client": None, "key": key, "value": None, "reason": reason})
        return out

    def train_metrics(self, server_round: int, accepted: Sequence[Accepted], **extra: float) -> MetricRecord:
        """Round metrics: counts of accepted/rejected/failed plus client metrics' mean ± std."""
        rep = self.report(server_round)
        out: dict[str, Any] = {"accepted": len(accepted), "rejected": len(rep.rejected),
                               "failures": len([f for f in rep.failures if f["stage"] == "train"])}
        out.update(self.client_metrics(server_round, "train", [(a.num_examples, a) for a in accepted]))
        out.update(extra)
        rep.fit = dict(out)
        return MetricRecord(out)

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
