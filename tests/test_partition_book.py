"""The partition book alone: claims, pins, quarantine and the engine's provisional assignment, with no grid
and no message (``pollen.strategies.partitions``)."""

from __future__ import annotations

import logging

import pytest

from pollen.strategies.partitions import PartitionBook, check_pins


def test_a_claim_binds_a_node_to_its_first_partition_and_names_it():
    book = PartitionBook()
    book.claim(11, 0)
    book.claim(11, 3)  # a changed claim claims nothing
    assert book.partition_of == {11: 0} and book.node_of == {0: 11}
    assert book.label(11) == "partition 0" and book.label(12) == "node 12"
    assert book.refusal(11, 0) is None and book.refusal(11, None) is None
    assert book.refusal(11, 3) == "partition-id 3 differs from partition 0 this node claimed before"
    # replies are handled by partition, unidentified nodes last, by node id
    book.claim(5, 2)
    assert sorted([99, 5, 11, 7], key=book.order) == [11, 5, 7, 99]
    assert book.unknown([5, 7, 11, 99]) == [7, 99]


def test_two_claimants_quarantine_a_partition_and_neither_serves_it():
    book = PartitionBook()
    book.claim(11, 0)
    book.claim(12, 0)
    assert book.quarantined() == {0: [11, 12]} and 0 not in book.node_of
    for node in (11, 12):
        assert book.refusal(node, 0) == (f"partition 0 is quarantined: nodes [11, 12] have claimed it, so none is "
                                         f"trusted for the rest of the run (this is node {node}; pin the partition "
                                         "with partition-pins)")
        assert book.refusal(node, None) is not None  # naming no partition does not get round it


def test_a_quarantine_sticks_when_a_claimant_leaves_and_nobody_inherits(caplog):
    book = PartitionBook()
    book.claim(11, 0)
    book.claim(12, 0)
    book.claim(13, 1)
    assert book.suspects() == {11, 12}
    with caplog.at_level(logging.INFO, logger="flwr.pollen"):
        book.prune([12, 13])  # the honest node 11 leaves: the impostor 12 must not inherit partition 0
    assert book.quarantined() == {0: [11, 12]} and 0 not in book.node_of and book.node_of == {1: 13}
    assert book.refusal(12, 0).startswith("partition 0 is quarantined: nodes [11, 12] have claimed it")
    assert book.suspects() == {12}
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warning.getMessage().startswith("partition 0: node(s) [11], claimant(s) of this quarantined partition, "
                                           "left the grid; it stays quarantined for the rest of the run and no "
                                           "other claimant inherits it")
    book.claim(14, 0)  # a newcomer joins the dispute; it serves nothing either
    assert book.quarantined() == {0: [11, 12, 14]} and book.suspects() == {12, 14}


def test_an_engine_assignment_a_reply_refutes_disputes_nothing():
    book = PartitionBook()
    book.assume({11: 0, 12: 1})
    book.claim(13, 0)  # node 13 says it serves 0, which the engine assigned to 11: a dispute, for now
    assert book.quarantined() == {0: [11, 13]}
    book.confirm(2, 11, 1)  # 11's own reply: it serves 1; the engine's word was wrong, so no dispute on 0
    assert book.quarantined() == {} and book.node_of == {0: 13}


def test_a_pin_wins_over_any_claim_and_is_never_quarantined():
    book = PartitionBook({0: 50})
    assert book.node_of == {0: 50} and book.partition_of == {50: 0}  # known without a claim
    book.claim(7, 0)
    assert book.quarantined() == {} and book.node_of == {0: 50} and 7 not in book.partition_of
    assert book.refusal(7, 0) == "partition 0 is pinned to node 50, not to this node (7)"
    book.prune([7])  # the pinned node is not connected: its pin still holds
    assert book.node_of == {0: 50}


def test_a_claimant_that_left_lapses(caplog):
    book = PartitionBook()
    book.claim(11, 0)
    with caplog.at_level(logging.INFO, logger="flwr.pollen"):
        book.prune([12])
    assert book.partition_of == {} and book.node_of == {}
    assert "partition 0: node(s) [11] left the grid; their claim lapses" in caplog.text
    book.claim(13, 0)  # a SuperNode restarted on the partition's state folder, under a new id
    assert book.node_of == {0: 13}


def test_a_plan_refuses_partitions_outside_it():
    book = PartitionBook(plan=lambda pid: "outside the plan" if pid >= 3 else None)
    book.claim(11, 4)
    assert book.partition_of == {} and book.refusal(11, 4) == "outside the plan"


def test_the_engines_assignment_is_provisional_until_a_reply_confirms_it(caplog):
    book = PartitionBook()
    book.assume({11: 0, 12: 1, 13: 2})
    assert book.node_of == {0: 11, 1: 12, 2: 13} and book.asked == {11, 12, 13}
    book.confirm(1, 11, 0)  # matches: confirmed
    assert 11 not in book.provisional and not book.engine_refuted
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        book.confirm(1, 12, 2)  # node 12 says 2: the engine's order does not hold
    assert book.engine_refuted and book.provisional == {}
    assert book.partition_of == {11: 0} and book.asked == {11}  # the confirmed node keeps its claim
    assert ("round 1: node 12 answered partition 2, but the simulation engine assigned it partition 1"
            in caplog.text)


def test_pins_are_checked():
    assert check_pins({0: 4, 1: 5}) == {0: 4, 1: 5}
    for bad, match in (({-1: 4}, "partition ids >= 0"), ({0: True}, "partition ids >= 0"),
                       ({0: 4, 1: 4}, "several partitions")):
        with pytest.raises(ValueError, match=match):
            check_pins(bad)
