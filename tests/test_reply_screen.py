"""The reply screen alone: real Flower ``Message`` objects, no grid and no strategy
(``pollen.strategies.replies``)."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict

from pollen.strategies.partitions import PartitionBook
from pollen.strategies.replies import NoTrainingError, ReplyScreen
from pollen.testing import set_task_identity


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


def _sent(screen: ReplyScreen, nodes, server_round=1, stage=MessageType.TRAIN) -> dict[int, Message]:
    out = {n: Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(4, np.float32))})}),
                      message_type=stage, dst_node_id=n) for n in nodes}
    for msg in out.values():
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as a grid sets it when it sends
    screen.sending(server_round, stage, list(out.values()))
    return out


def _reply(msg: Message, **metrics) -> Message:
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _keep(msg, _metrics):
    return msg.metadata.src_node_id, None


def test_replies_are_judged_and_handed_on_in_partition_order_whatever_the_arrival():
    screen = ReplyScreen(PartitionBook(), max_examples=100)
    sent = _sent(screen, [30, 20, 10])
    replies = [_reply(sent[10], **{"num-examples": 5, "partition-id": 2}),
               _reply(sent[20], **{"num-examples": 5, "partition-id": 0}),
               _reply(sent[30], **{"num-examples": 5, "partition-id": 1})]
    accepted = screen.screen(1, "train", replies, _keep)
    assert [(a.label, a.payload) for a in accepted] == [("partition 0", 20), ("partition 1", 30), ("partition 2", 10)]
    report = screen.take(1)
    assert report.sampled == 3 and report.bytes_down > 0
    assert list(report.fit_clients) == ["partition 0", "partition 1", "partition 2"]


def test_bad_metrics_refuse_or_drop_and_decoders_refuse_with_their_reason(caplog):
    screen = ReplyScreen(PartitionBook(), max_examples=100)
    sent = _sent(screen, [1, 2, 3, 4])
    replies = [_reply(sent[1], **{"num-examples": 10**6, "partition-id": 0}),  # a count the strategy acts on
               _reply(sent[2], **{"num-examples": 5, "partition-id": 1, "proto-accuracy": 1.5}),  # reported only
               _reply(sent[3], **{"num-examples": 5, "partition-id": 2}),
               _reply(sent[4], **{"num-examples": 5, "partition-id": 3})]
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        accepted = screen.screen(1, "train", replies,
                                 lambda m, _x: (None, "'w': bad") if m.metadata.src_node_id == 3 else (1, None))
    assert [a.label for a in accepted] == ["partition 1", "partition 3"]
    report = screen.take(1)
    assert [(r["client"], r["reason"]) for r in report.rejected] == [  # an unproven claim names no partition
        ("partition 2", "'w': bad"), ("node 1", "metric 'num-examples' = 1000000 is above 100")]
    (dropped,) = report.dropped_metrics
    assert (dropped["client"], dropped["key"], dropped["value"]) == ("partition 1", "proto-accuracy", 1.5)
    assert "metric 'proto-accuracy' = 1.5 is above 1" in dropped["reason"]
    assert "round 1 train: dropped metric 'proto-accuracy' = 1.5 from partition 1 (node 2)" in caplog.text


@pytest.mark.parametrize("order", [(11, 12), (12, 11)])
def test_two_replies_claiming_one_partition_quarantine_it_whichever_comes_first(order, caplog):
    screen = ReplyScreen(PartitionBook(), max_examples=100)
    sent = _sent(screen, [11, 12, 13])
    replies = [_reply(sent[n], **{"num-examples": 5, "partition-id": 0}) for n in order]
    replies.append(_reply(sent[13], **{"num-examples": 5, "partition-id": 1}))
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        accepted = screen.screen(1, "train", replies, _keep)
    assert [a.label for a in accepted] == ["partition 1"]
    report = screen.take(1)
    assert report.quarantined == [{"partition": 0, "nodes": [11, 12]}]
    assert [r["reason"].split(":")[0] for r in report.rejected] == ["partition 0 is quarantined"] * 2
    assert "round 1: partition 0 is claimed by nodes [11, 12]: quarantined" in caplog.text


def test_failures_are_named_by_the_node_each_message_was_sent_to(caplog):
    book = PartitionBook()
    book.claim(12, 1)
    screen = ReplyScreen(book, max_examples=100)
    sent = _sent(screen, [11, 12, 13])
    gone = Message(Error(code=5, reason="Node unavailable"), reply_to=sent[12])
    gone.metadata.__dict__["_src_node_id"] = 1  # written by the SuperLink, not by the node
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        accepted = screen.screen(1, "train", [_reply(sent[11], **{"num-examples": 5}), gone], _keep)
    assert [a.node_id for a in accepted] == [11]
    assert [(f["client"], f["node"], f["code"]) for f in screen.take(1).failures] == [
        ("partition 1", 12, 5), ("node 13", 13, None)]
    assert "round 1 train: partition 1 (node 12) failed (error 5): Node unavailable" in caplog.text
    assert "round 1 train: node 13 failed: no reply before the round timeout" in caplog.text


def test_a_claimant_not_live_lapses_before_the_rounds_claims_count():
    book = PartitionBook()
    book.claim(11, 0)  # a node that has since left
    screen = ReplyScreen(book, max_examples=100)
    sent = _sent(screen, [12])
    accepted = screen.screen(1, "train", [_reply(sent[12], **{"num-examples": 5, "partition-id": 0})], _keep,
                             live=[12])
    assert [a.label for a in accepted] == ["partition 0"] and book.node_of == {0: 12}


def test_rounds_that_train_nobody_fail_the_run_past_the_allowance():
    screen = ReplyScreen(PartitionBook(), max_examples=100, max_empty_rounds=1)
    _sent(screen, [11])
    screen.close_train_round(1, screen.screen(1, "train", [], _keep))  # one allowed: a WARNING
    _sent(screen, [11], server_round=2)
    with pytest.raises(NoTrainingError, match=r"round 2 trained nobody \(1 sampled, 0 rejected, 1 failed\): "
                                              r"node 11: no reply before the round timeout"):
        screen.close_train_round(2, screen.screen(2, "train", [], _keep))
    assert screen.empty_rounds == 2


def test_train_metrics_count_the_round_and_average_the_clients():
    screen = ReplyScreen(PartitionBook(), max_examples=100)
    sent = _sent(screen, [1, 2])
    accepted = screen.screen(1, "train", [_reply(sent[1], **{"num-examples": 10, "train-loss": 1.0}),
                                          _reply(sent[2], **{"num-examples": 30, "train-loss": 3.0})], _keep)
    metrics = screen.train_metrics(1, accepted)
    assert (metrics["accepted"], metrics["rejected"], metrics["failures"]) == (2, 0, 0)
    assert metrics["train-loss"] == pytest.approx(2.5) and metrics["train-loss-client-mean"] == pytest.approx(2.0)
