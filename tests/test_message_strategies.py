"""Message-API strategies against the math and against hostile clients.

Each strategy runs through Flower's own ``Strategy.start`` loop on an in-process grid whose nodes are
plain functions answering with real ``Message`` objects (``pollen.testing``); bad replies must be
rejected with a reason naming the key, logged as WARNINGs, and never stop the round.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from pollen.protocol.identity import encode_identity_reply
from pollen.protocol.logits import decode_consensus, encode_logit_reply
from pollen.protocol.prototypes import decode_global_prototypes, encode_prototype_reply
from pollen.protocol.records import reply_content
from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import (
    LocalOnly,
    LogitAveraging,
    NoTrainingError,
    PrototypeStrategy,
    WeightAveraging,
    aggregate_prototypes,
    mean_logits,
    prototype_margin,
)
from pollen.testing import InProcessGrid

STATE = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32),
         "steps": np.array(4, dtype=np.int64)}


def _record(state):
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()})


def _weights_node(pid, n, shift):
    """A well-behaved FedAvg client: adds ``shift`` to every float array."""
    def handle(msg):
        if msg.metadata.message_type == "query":
            return encode_identity_reply(pid)
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 1.0, "accuracy": 0.5,
                                                        "partition-id": pid})})
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        out = {k: (v + shift if v.dtype.kind == "f" else v) for k, v in got.items()}
        return encode_weights_reply(out, n, {"partition-id": pid})
    return handle


def test_fedavg_is_the_sample_weighted_mean_and_fedprox_mu_travels():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(1, 30, 5.0)})
    strategy = WeightAveraging(proximal_mu=0.25, min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    want = STATE["w"] + (10 * 1.0 + 30 * 5.0) / 40
    np.testing.assert_allclose(result.arrays["w"].numpy(), want, rtol=1e-6)
    assert result.arrays["steps"].numpy() == 4 and result.arrays["steps"].numpy().dtype == np.int64
    assert {m.content["config"]["proximal-mu"] for m in grid.sent if m.metadata.message_type == "train"} == {0.25}
    assert result.train_metrics_clientapp[1]["accepted"] == 2
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(0.5)


def test_uniform_weighting_ignores_counts():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(1, 30, 5.0)})
    result = WeightAveraging(weighting="uniform", min_available_nodes=2).start(
        grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 3.0, rtol=1e-6)


def _hostile(kind):
    """A client that answers every train message with one kind of bad reply."""
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            bad_eval = {"nan-loss": {"loss": float("nan")}, "accuracy": {"accuracy": 5.0},
                        "negative": {"num-examples": -3}}.get(kind, {})
            return RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 1.0, **bad_eval})})
        arrays = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        metrics = {"num-examples": 10}
        if kind.startswith("nan-array"):
            arrays["w"] = np.full_like(arrays["w"], np.nan)
            if kind.endswith("partition-0"):
                metrics["partition-id"] = 0
        elif kind == "wrong-shape":
            arrays["w"] = np.zeros((3, 3), np.float32)
        elif kind == "float64":
            arrays["w"] = arrays["w"].astype(np.float64)
        elif kind == "missing-key":
            del arrays["b"]
        elif kind == "extra-key":
            arrays["evil"] = np.zeros(2, np.float32)
        elif kind == "huge-count":
            metrics["num-examples"] = 10**15
        elif kind == "nan-partition":
            metrics["partition-id"] = float("nan")
        elif kind == "fractional-partition":
            metrics["partition-id"] = 1.7
        elif kind == "string-metric":  # a ConfigRecord where the MetricRecord belongs: strings get through
            return RecordDict({"arrays": _record(arrays), "metrics": ConfigRecord({"num-examples": "abc"})})
        elif kind == "no-metrics":
            return RecordDict({"arrays": _record(arrays)})
        elif kind == "oversized":  # metadata claims the right shape, the payload is 50 MB of padding
            rec = _record(arrays)
            good = rec["w"]
            rec["w"] = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data + bytes(50_000_000))
            return RecordDict({"arrays": rec, "metrics": MetricRecord(metrics)})
        elif kind == "garbage-bytes":
            rec = _record(arrays)
            good = rec["w"]
            rec["w"] = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=b"\x00" * len(good.data))
            return RecordDict({"arrays": rec, "metrics": MetricRecord(metrics)})
        elif kind == "raise":
            return RuntimeError("client crashed")
        return RecordDict({"arrays": _record(arrays), "metrics": MetricRecord(metrics)})
    return handle


@pytest.mark.parametrize("kind, reason", [
    ("nan-array", "'w': contains NaN"), ("wrong-shape", "'w': shape 3x3 != expected 2x3"),
    ("float64", "'w': dtype float64 != expected float32"), ("missing-key", "missing key(s) ['b']"),
    ("extra-key", "unexpected key(s) ['evil']"), ("huge-count", "'num-examples' = 1000000000000000 is above"),
    ("nan-partition", "'partition-id' = nan is not a finite number"),
    ("fractional-partition", "'partition-id' = 1.7 is not a whole number"),
    ("string-metric", "no MetricRecord under 'metrics'"), ("no-metrics", "no MetricRecord"),
    ("oversized", "'w': 50000"), ("garbage-bytes", "'w': undecodable"),
])
def test_a_bad_train_reply_is_rejected_with_its_reason_and_the_round_goes_on(kind, reason, caplog):
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _hostile(kind)})
    strategy = WeightAveraging(min_available_nodes=2)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 1.0, rtol=1e-6)  # the good one alone
    assert result.train_metrics_clientapp[1]["accepted"] == 1 and result.train_metrics_clientapp[1]["rejected"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("node 12" in w and reason in w for w in warnings), warnings


def test_a_bad_evaluate_count_refuses_the_reply():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _hostile("negative")})
    strategy = WeightAveraging(min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1,
                            evaluate_fn=lambda r, a: None)
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(0.5)  # only the good client
    rejected = strategy.reports[1].rejected
    assert [r["stage"] for r in rejected] == ["evaluate"] and "'num-examples' = -3 is below" in rejected[0]["reason"]


@pytest.mark.parametrize("kind, key, reason", [("nan-loss", "loss", "'loss' = nan is not a finite number"),
                                               ("accuracy", "accuracy", "'accuracy' = 5.0 is above 1")])
def test_a_bad_reported_evaluate_metric_is_dropped_alone(kind, key, reason):
    """A loss or accuracy out of range drops that metric (the reply still counts; its loss is kept)."""
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _hostile(kind)})
    strategy = WeightAveraging(min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    assert not strategy.reports[1].rejected and len(strategy.reports[1].evaluate_clients) == 2
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(0.5)  # the hostile value left out
    assert result.evaluate_metrics_clientapp[1]["loss"] == pytest.approx(1.0)
    (dropped,) = strategy.reports[1].dropped_metrics
    assert dropped["key"] == key and reason in dropped["reason"]


def test_an_error_reply_is_a_failure_with_its_reason():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _hostile("raise")})
    strategy = WeightAveraging(min_available_nodes=2)
    strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    report = strategy.take_round_report(1)
    assert report.accepted == 1 and report.failures[0]["reason"] == "RuntimeError: client crashed"


def test_a_claim_with_a_bad_payload_still_quarantines_the_partition():
    """Whether a claimant's payload is good says nothing about who holds the partition: a bad reply that
    names partition 0 makes partition 0 untrusted (not the bad node's, and not locked to it either)."""
    grid = InProcessGrid({11: _hostile("nan-array-as-partition-0"), 12: _weights_node(0, 10, 1.0),
                          13: _weights_node(1, 10, 1.0)})
    strategy = WeightAveraging(min_available_nodes=3)
    strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    assert strategy.reports[1].accepted == 1 and strategy.node_of == {1: 13}
    assert strategy.reports[1].quarantined == [{"partition": 0, "nodes": [11, 12]}]


def test_a_second_node_claiming_a_partition_quarantines_it():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(0, 10, 3.0),
                          13: _weights_node(1, 10, 5.0)})
    strategy = WeightAveraging(min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 5.0, rtol=1e-6)  # partition 1 only
    reasons = [r["reason"] for r in strategy.reports[1].rejected if r["stage"] == "train"]
    assert len(reasons) == 2 and all("partition 0 is quarantined: nodes [11, 12]" in r for r in reasons)


def test_a_partition_moves_to_a_new_node_once_its_node_has_left():
    """A restarted SuperNode comes back with a new node id: it may serve its partition once the grid no
    longer lists the old node, and the old node id loses its claim."""
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0)})
    first = _weights_node(1, 10, 1.0)

    def dies_in_round_2(msg):
        if msg.content["config"]["server-round"] == 2:
            del grid.handlers[12]  # the SuperLink drops the dead node; its replacement connects
            grid.handlers[13] = _weights_node(1, 10, 1.0)
            return None
        return first(msg)

    grid.handlers[12] = dies_in_round_2
    strategy = WeightAveraging(min_available_nodes=2)
    strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=3)
    assert strategy.node_of == {0: 11, 1: 13} and 12 not in strategy.partition_of
    assert not any(r.rejected for r in strategy.reports.values())


def test_same_seed_samples_the_same_partitions_whatever_the_node_ids():
    """Flower draws new node ids every run: sampling a fraction by node id would pick other partitions
    each run. With identify_nodes the strategy asks each node its partition once and draws by partition."""
    def sampled_partitions(node_ids, identify):
        grid = InProcessGrid({nid: _weights_node(p, 10, 1.0) for p, nid in enumerate(node_ids)})
        strategy = WeightAveraging(fraction_train=0.4, fraction_evaluate=0.0, min_train_nodes=1, seed=5,
                                   identify_nodes=identify)
        strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=4)
        return [sorted(r.fit_clients) for _, r in sorted(strategy.reports.items())], grid

    ids_a, ids_b = [101, 102, 103, 104, 105], [950, 940, 930, 920, 910]
    first, grid = sampled_partitions(ids_a, identify=True)
    second, _ = sampled_partitions(ids_b, identify=True)
    assert first == second and all(len(r) == 2 for r in first)
    assert sum(m.metadata.message_type == "query" for m in grid.sent) == 5  # once per node, not per round
    plain_a, _ = sampled_partitions(ids_a, identify=False)
    plain_b, _ = sampled_partitions(ids_b, identify=False)
    assert plain_a != plain_b  # by node id: reversed id order, other partitions


def test_a_round_that_trains_nobody_fails_the_run_with_the_reasons():
    grid = InProcessGrid({11: _hostile("nan-array"), 12: _hostile("raise")})
    with pytest.raises(NoTrainingError, match=r"round 1 trained nobody .*'w': contains NaN.*client crashed"):
        WeightAveraging(min_available_nodes=2).start(grid=grid, initial_arrays=_record(STATE), num_rounds=2)


def test_max_empty_rounds_tolerates_that_many():
    calls = {"n": 0}
    good = _weights_node(0, 10, 1.0)

    def flaky(msg):
        calls["n"] += 1
        return RuntimeError("transient") if calls["n"] == 1 else good(msg)

    strategy = WeightAveraging(min_available_nodes=1, max_empty_rounds=1)
    result = strategy.start(grid=InProcessGrid({11: flaky}), initial_arrays=_record(STATE), num_rounds=2)
    assert result.train_metrics_clientapp[2]["accepted"] == 1 and strategy.replies.empty_rounds == 1


def test_too_few_nodes_fails_within_the_wait_naming_both_numbers():
    strategy = WeightAveraging(min_available_nodes=5, node_wait_s=0.3)
    with pytest.raises(NoTrainingError, match=r"only 2 node\(s\) connected .* needs 5"):
        strategy.start(grid=InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(1, 10, 1.0)}),
                       initial_arrays=_record(STATE), num_rounds=1)


def test_sampling_is_seeded_by_the_strategy_not_the_global_rng():
    def picks(seed):
        grid = InProcessGrid({i: _weights_node(i, 10, 0.0) for i in range(10)})
        WeightAveraging(fraction_train=0.3, fraction_evaluate=0.0, seed=seed).start(
            grid=grid, initial_arrays=_record(STATE), num_rounds=3)
        return [m.metadata.dst_node_id for m in grid.sent]

    assert picks(1) == picks(1) and picks(1) != picks(2) and len(picks(1)) == 9


# -- prototypes ---------------------------------------------------------------------------------------
def _proto_node(pid, protos, counts, num_examples=None):
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.9, "partition-id": pid})})
        handle.received.append(decode_global_prototypes(msg.content["arrays"], *protos.shape))
        return encode_prototype_reply(protos, counts, {"partition-id": pid}, num_examples=num_examples)
    handle.received = []
    return handle


def test_prototype_strategy_sends_nothing_first_then_the_class_wise_mean():
    rng = np.random.default_rng(0)
    pa, pb = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    ca, cb = np.array([5, 0, 2, 0]), np.array([1, 3, 0, 0])
    a, b = _proto_node(0, pa, ca), _proto_node(1, pb, cb)
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, min_available_nodes=2)
    result = strategy.start(grid=InProcessGrid({11: a, 12: b}), initial_arrays=ArrayRecord(), num_rounds=2)
    assert a.received[0] is None  # round 1: an empty record
    protos, present, margin = a.received[1]
    want, want_present = aggregate_prototypes([pa, pb], [ca, cb])
    np.testing.assert_allclose(protos[want_present], want[want_present], rtol=1e-6)
    assert present.tolist() == [True, True, True, False]
    assert margin == pytest.approx(prototype_margin(want, want_present), rel=1e-6)
    assert set(result.arrays.keys()) == {"prototypes", "present", "margin"}
    assert result.train_metrics_clientapp[2]["classes-present"] == 3


def test_prototype_reply_with_nan_for_a_held_class_or_huge_counts_is_rejected():
    good = _proto_node(0, np.ones((4, 3), np.float32), np.array([1, 1, 0, 0]))
    nan = np.ones((4, 3), np.float32)
    nan[3] = np.nan  # a class it does not hold may be NaN; a held one may not
    bad_nan = _proto_node(1, nan, np.array([0, 0, 1, 1]))
    bad_count = _proto_node(2, np.ones((4, 3), np.float32), np.array([2**62, 0, 0, 0]), num_examples=2)
    ok_nan = _proto_node(3, nan, np.array([1, 0, 0, 0]))
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, min_available_nodes=4)
    strategy.start(grid=InProcessGrid({11: good, 12: bad_nan, 13: bad_count, 14: ok_nan}),
                   initial_arrays=ArrayRecord(), num_rounds=1)
    reasons = {r["client"]: r["reason"] for r in strategy.reports[1].rejected}
    assert "held class(es) [3]" in reasons["partition 1"]  # named by its claim, though it binds nothing
    assert "'class-counts': value 4611686018427387904 above the plausible maximum" in reasons["partition 2"]
    assert strategy.reports[1].accepted == 2


# -- logits --------------------------------------------------------------------------------------------
DIGEST = 0x5EED  # the public set's fingerprint every well-behaved node reports


def _logit_node(pid, logits, digest=DIGEST):
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.4, "partition-id": pid})})
        handle.got.append((decode_consensus(msg.content["arrays"], 5, 3),
                           msg.content["config"]["contributed"]))
        metrics = {"partition-id": pid} if digest is None else {"partition-id": pid, "public-digest": digest}
        return encode_logit_reply(logits, 7, metrics)
    handle.got = []
    return handle


def test_logit_strategy_averages_into_a_consensus_and_says_who_contributed():
    a_logits, b_logits = np.full((5, 3), 1.0, np.float32), np.full((5, 3), 4.0, np.float32)
    a, b = _logit_node(0, a_logits), _logit_node(1, b_logits)
    bad = _logit_node(2, np.full((5, 2), 1.0, np.float32))
    strategy = LogitAveraging(num_public=5, num_classes=3, min_available_nodes=3)
    strategy.start(grid=InProcessGrid({11: a, 12: b, 13: bad}), initial_arrays=ArrayRecord(), num_rounds=2)
    assert a.got[0] == (None, False)
    consensus, contributors = a.got[1][0]
    np.testing.assert_array_equal(consensus, mean_logits([a_logits, b_logits]))  # mean of 1 and 4: exact
    assert contributors == 2 and a.got[1][1] is True and bad.got[1][1] is False
    assert "'logits': shape 5x2 != expected 5x3" in strategy.reports[1].rejected[0]["reason"]


def test_logit_strategy_refuses_logits_on_another_public_set_and_the_majority_decides_which():
    """The node answering first with another copy of the public folder must not decide the federation's."""
    ones = np.ones((5, 3), np.float32)
    odd, a, b, silent = (_logit_node(0, 9 * ones, digest=0xBAD), _logit_node(1, ones), _logit_node(2, 3 * ones),
                         _logit_node(3, ones, digest=None))
    strategy = LogitAveraging(num_public=5, num_classes=3, min_available_nodes=4)
    strategy.start(grid=InProcessGrid({11: odd, 12: a, 13: b, 14: silent}), initial_arrays=ArrayRecord(),
                   num_rounds=2)
    for server_round in (1, 2):
        report = strategy.reports[server_round]
        reasons = {r["client"]: r["reason"] for r in report.rejected}
        assert report.accepted == 2 and sorted(reasons) == ["partition 0", "partition 3"]
        assert f"digest {0xBAD:013x}, the federation's is {DIGEST:013x}" in reasons["partition 0"]
        assert "'public-digest' (the public set's fingerprint) is missing" in reasons["partition 3"]
    np.testing.assert_array_equal(strategy.consensus, 2 * ones)  # the mean of 1 and 3 only
    assert "public-digest" not in strategy.reports[1].fit  # an identifier, never averaged
    arrays, values = strategy.state()
    again = LogitAveraging(num_public=5, num_classes=3)
    again.restore(arrays, values)
    assert again.public_digest == DIGEST  # a resumed run keeps the federation's public set


def test_local_only_trains_every_node_and_refuses_arrays():
    def node(pid, arrays):
        def handle(msg):
            return reply_content(arrays, 3, {"partition-id": pid, "train-loss": 0.5})
        return handle

    strategy = LocalOnly(fraction_evaluate=0.0)
    strategy.start(grid=InProcessGrid({11: node(0, {}), 12: node(1, {"w": np.zeros(2, np.float32)})}),
                   initial_arrays=ArrayRecord(), num_rounds=1)
    report = strategy.reports[1]
    assert report.accepted == 1 and "local-only replies carry no arrays" in report.rejected[0]["reason"]


def test_importing_the_strategies_does_not_import_torch():
    code = "import sys, pollen.strategies, pollen.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_an_initial_model_the_layout_most_clients_share_wins():
    """One client answering first with an odd model must not decide the homogeneous model's shapes."""
    def node(pid, shape):
        def handle(msg):
            if msg.metadata.message_type == "evaluate":
                return RecordDict({"metrics": MetricRecord({"num-examples": 5, "partition-id": pid})})
            return encode_logit_reply(np.ones((5, 3), np.float32), 4, {"partition-id": pid, "public-digest": DIGEST},
                                      model=_record({"w": np.ones(shape, np.float32)}))
        return handle

    strategy = LogitAveraging(num_public=5, num_classes=3, average_weights=True, min_available_nodes=3)
    strategy.start(grid=InProcessGrid({11: node(0, (1000,)), 12: node(1, (2, 2)), 13: node(2, (2, 2))}),
                   initial_arrays=ArrayRecord(), num_rounds=1)
    assert strategy.weights["w"].shape == (2, 2) and strategy.reports[1].accepted == 2
    assert "model: 'w': shape 1000 != expected 2x2" in strategy.reports[1].rejected[0]["reason"]


def test_metric_record_takes_numpy_numbers_and_lists_of_them():
    from pollen.protocol.records import metric_record

    rec = metric_record(3, {"a": [np.float32(1.5)], "c": [1, 2], "f": np.float32(0.25), "b": True, "s": "x"})
    assert dict(rec) == {"a": [1.5], "c": [1, 2], "f": 0.25, "b": 1, "num-examples": 3}


def test_fractional_class_counts_are_refused_on_the_client():
    with pytest.raises(ValueError, match="whole numbers"):
        encode_prototype_reply(np.zeros((2, 3), np.float32), np.array([2.9, 0.5]))
    reply = encode_prototype_reply(np.zeros((2, 3), np.float32), np.array([2.0, 0.0]))
    assert reply["arrays"]["class-counts"].numpy().tolist() == [2, 0]


# -- mutants that used to survive (issue 33) ---------------------------------------------------------------
def test_a_class_nobody_reports_keeps_its_last_prototype_not_a_zero_one():
    """Mutant caught: replacing every row by this round's aggregate (a zero prototype marked present)."""
    both = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0, 0, 0], [0, 0, 0]], np.float32)
    first = _proto_node(0, both, np.array([3, 3, 0, 0]))
    only_class_0 = both.copy()
    only_class_0[0] += 10.0

    def changes_after_round_1(msg):
        if msg.metadata.message_type == "train" and msg.content["config"]["server-round"] > 1:
            return encode_prototype_reply(only_class_0, np.array([3, 0, 0, 0]), {"partition-id": 0})
        return first(msg)

    observer = _proto_node(1, both, np.array([0, 0, 0, 0]))
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, min_available_nodes=2)
    strategy.start(grid=InProcessGrid({11: changes_after_round_1, 12: observer}), initial_arrays=ArrayRecord(),
                   num_rounds=3)
    protos, present, _ = observer.received[2]  # what round 3 sends: after round 2 reported class 0 only
    np.testing.assert_array_equal(protos[0], only_class_0[0])
    np.testing.assert_array_equal(protos[1], both[1])  # class 1: round 1's prototype, kept
    assert present.tolist() == [True, True, False, False]


def test_the_logit_contributors_are_this_rounds_only():
    """Mutant caught: accumulating contributors across rounds (a node rejected in round 2 would be told
    its logits are in the mean, and the count would scale the consensus wrongly)."""
    a_logits, b_logits = np.full((5, 3), 1.0, np.float32), np.full((5, 3), 4.0, np.float32)
    a, b_good = _logit_node(0, a_logits), _logit_node(1, b_logits)
    b_bad = _logit_node(1, np.full((5, 3), np.nan, np.float32))

    def b(msg):
        late = msg.metadata.message_type == "train" and msg.content["config"]["server-round"] == 2
        return (b_bad if late else b_good)(msg)

    strategy = LogitAveraging(num_public=5, num_classes=3, min_available_nodes=2)
    strategy.start(grid=InProcessGrid({11: a, 12: b}), initial_arrays=ArrayRecord(), num_rounds=3)
    assert strategy.reports[2].accepted == 1
    (consensus, contributors), contributed = a.got[2]
    assert contributors == 1 and contributed is True
    np.testing.assert_array_equal(consensus, a_logits)
    assert b_good.got[-1][1] is False  # round 3: b's round-2 logits are not in the mean


@pytest.mark.parametrize("shape", [(2, 3, 1), (2, 3, 1, 1), (2,)], ids=["rank-3", "rank-4", "rank-1"])
def test_an_array_of_the_wrong_rank_is_refused(shape):
    """Mutant caught: dropping the rank comparison. ``zip`` over the axes alone passes any shape whose
    common axes agree — (2, 3, 1) even carries the right bytes, and (2,) is a consistent, smaller array."""
    def reshaped(msg):
        if msg.metadata.message_type != "train":
            return _weights_node(1, 10, 1.0)(msg)
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        got["w"] = got["w"].reshape(shape) if len(shape) > 2 else got["w"][:, 0].copy()
        return encode_weights_reply(got, 10, {"partition-id": 1})

    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: reshaped})
    strategy = WeightAveraging(min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    assert result.arrays["w"].numpy().shape == (2, 3)
    (rejected,) = strategy.reports[1].rejected
    want = "x".join(str(s) for s in shape)
    assert rejected["reason"] == f"'w': shape {want} != expected 2x3"
