"""Public-logit aggregation as the app runs it: the Message-API ``LogitAveraging`` on an in-process grid
(consensus, contributors, rejected replies, homogeneous-mode weights) against numpy written here, plus
the pure consensus and leave-one-out functions, hand-worked."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from pollen.methods.logit_losses import leave_one_out_target
from pollen.protocol.logits import decode_consensus, encode_logit_reply
from pollen.strategies import LogitAveraging, mean_logits
from pollen.testing import InProcessGrid

A = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]], np.float32)
B = np.array([[3.0, 0.0], [1.0, 4.0], [6.0, -3.0]], np.float32)
C = np.array([[2.0, 4.0], [2.0, 1.0], [0.0, 3.0]], np.float32)
DIGEST = 0xC0FFEE  # the public set's fingerprint every node reports


def _record(state):
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()})


def _node(pid, replies, n=7, loss=0.0, model=None):
    """Answers train round r with ``replies[min(r, len) - 1]`` (logits, or a ready RecordDict); keeps what it got."""
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 5, "partition-id": pid})})
        r = int(msg.content["config"]["server-round"])
        handle.got.append((decode_consensus(msg.content["arrays"], 3, 2), msg.content["config"]["contributed"],
                           msg.content.get("model")))
        reply = replies[min(r, len(replies)) - 1]
        if isinstance(reply, RecordDict):
            return reply
        state = model(msg) if model is not None else None
        return encode_logit_reply(reply, n, {"partition-id": pid, "train-loss": loss, "public-digest": DIGEST},
                                  model=state)
    handle.got = []
    return handle


def test_mean_and_leave_one_out_hand_worked():
    mean = mean_logits([A, B, C])
    assert mean.dtype == np.float32
    np.testing.assert_array_equal(mean, np.array([[2.0, 2.0], [2.0, 3.0], [2.0, 0.0]], np.float32))
    # leave A out: (B + C) / 2 worked by hand
    np.testing.assert_allclose(leave_one_out_target(mean, 3, A),
                               np.array([[2.5, 2.0], [1.5, 2.5], [3.0, 0.0]], np.float32))
    assert leave_one_out_target(mean_logits([A]), 1, A) is None  # nobody else contributed
    assert leave_one_out_target(mean, 3, None) is mean  # own reply not in the mean: nothing to remove
    with pytest.raises(ValueError, match="shape"):
        leave_one_out_target(mean, 3, A[:2])
    with pytest.raises(ValueError, match="shape"):
        mean_logits([A, B[:2]])


def test_consensus_is_the_unweighted_mean_and_survives_a_round_without_good_replies():
    nan = A.copy()
    nan[0, 0] = np.nan
    extra = encode_logit_reply(C, 7, {"partition-id": 2, "public-digest": DIGEST})
    extra["arrays"]["more"] = Array(C)
    wide = encode_logit_reply(B, 20, {"partition-id": 1, "public-digest": DIGEST})
    wide["arrays"]["logits"] = Array(B.astype(np.float64))
    a = _node(0, [A, nan, A], n=10, loss=0.5)
    b = _node(1, [B, wide, B], n=20, loss=1.0)
    c = _node(2, [C, extra, C], n=5, loss=4.0)
    bad = _node(3, [A[:, :1].copy(), A * 1e5, A[:, :1].copy()])
    strategy = LogitAveraging(num_public=3, num_classes=2, min_available_nodes=4, max_empty_rounds=1)
    result = strategy.start(grid=InProcessGrid({11: a, 12: b, 13: c, 14: bad}), initial_arrays=ArrayRecord(),
                            num_rounds=3)
    want = (A.astype(np.float64) + B + C) / 3  # clients count equally, whatever their num-examples
    assert a.got[0][:2] == (None, False)
    for server_round in (1, 2):  # round 2 accepted nobody: round 3 still gets round 1's consensus
        (consensus, contributors), _, _ = a.got[server_round]
        np.testing.assert_allclose(consensus, want, rtol=1e-6)
        assert contributors == 3
        assert [n.got[server_round][1] for n in (a, b, c, bad)] == [True, True, True, False]
    assert strategy.reports[1].rejected[0]["reason"] == "'logits': shape 3x1 != expected 3x2"
    assert [r["reason"] for r in strategy.reports[2].rejected] == [
        "'logits': contains NaN or infinite values", "'logits': dtype float64 != expected float32",
        "unexpected key(s) ['more']", "'logits': magnitude 400000 above the plausible maximum 10000"]
    assert result.train_metrics_clientapp[2]["accepted"] == 0
    fit = result.train_metrics_clientapp[1]
    counts, losses = np.array([10, 20, 5], np.float64), np.array([0.5, 1.0, 4.0])
    assert fit["train-loss"] == pytest.approx(float((counts * losses).sum() / counts.sum()))
    assert fit["train-loss-client-mean"] == pytest.approx(float(losses.mean()))


def test_homogeneous_mode_averages_the_states_by_num_examples():
    init = {"w": np.zeros(2, np.float32), "steps": np.array(0, np.int64)}
    states = {0: {"w": np.array([1.0, 1.0], np.float32), "steps": np.array(2, np.int64)},
              1: {"w": np.array([4.0, 7.0], np.float32), "steps": np.array(4, np.int64)},
              2: {"w": np.zeros(3, np.float32), "steps": np.array(4, np.int64)}}  # wrong shape

    def model_of(pid):
        return lambda msg: _record(states[pid])

    a = _node(0, [A], n=10, model=model_of(0))
    b = _node(1, [B], n=30, model=model_of(1))
    c = _node(2, [C], n=30, model=model_of(2))
    strategy = LogitAveraging(num_public=3, num_classes=2, average_weights=True, min_available_nodes=3)
    strategy.start(grid=InProcessGrid({11: a, 12: b, 13: c}), initial_arrays=_record(init), num_rounds=2)
    assert strategy.reports[1].accepted == 2
    assert strategy.reports[1].rejected[0]["reason"] == "model: 'w': shape 3 != expected 2"
    sent = a.got[1][2]  # round 2's model record: the count-weighted mean of round 1's accepted states
    np.testing.assert_allclose(sent["w"].numpy(), np.average([states[0]["w"], states[1]["w"]], axis=0,
                                                             weights=[10, 30]))
    assert sent["steps"].numpy().dtype == np.int64 and int(sent["steps"].numpy()) == round((10 * 2 + 30 * 4) / 40)
    (consensus, _), _, _ = a.got[1]
    np.testing.assert_array_equal(consensus, (A + B) / 2)  # exact in float32 for these values


def test_constructor_checks_arguments():
    with pytest.raises(ValueError, match="num_public"):
        LogitAveraging(num_public=0, num_classes=10)
    with pytest.raises(ValueError, match="fraction_train"):
        LogitAveraging(num_public=5, num_classes=10, fraction_train=0.0)
