"""Parameter averaging as the app runs it: the Message-API ``WeightAveraging`` on an in-process grid,
against a numpy replay of FedAvg written here, plus the pure functions it calls, hand-worked."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import WeightAveraging
from pollen.strategies.aggregation import average_arrays
from pollen.strategies.metrics import mean_std_metrics
from pollen.testing import InProcessGrid

INIT = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32),
        "steps": np.array(7, dtype=np.int64)}


def _record(state):
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()})


def _delta(pid, server_round, key, shape):
    """What client ``pid`` adds to float array ``key`` in ``server_round``: seeded, different every time."""
    return np.random.default_rng([pid, server_round, len(key)]).normal(size=shape).astype(np.float32)


def _node(pid, n, step, loss):
    """A client that adds its own random update to each float array and ``step`` to the int counter."""
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 10, "partition-id": pid})})
        r = int(msg.content["config"]["server-round"])
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        out = {k: (v + _delta(pid, r, k, v.shape) if v.dtype.kind == "f" else v + step) for k, v in got.items()}
        return encode_weights_reply(out, n, {"partition-id": pid, "train-loss": loss})
    return handle


def test_average_arrays_hand_worked():
    a = [np.array([1.0, 2.0], np.float32), np.array(10, np.int64)]
    b = [np.array([4.0, 8.0], np.float32), np.array(20, np.int64)]
    out = average_arrays([a, b], [1, 2])  # weights 1/3, 2/3
    np.testing.assert_allclose(out[0], [3.0, 6.0])
    assert out[0].dtype == np.float32
    assert out[1].dtype == np.int64 and int(out[1]) == 17  # 10/3 + 40/3 = 16.67 -> 17
    uniform = average_arrays([a, b], [1, 1])
    np.testing.assert_allclose(uniform[0], [2.5, 5.0])
    with pytest.raises(ValueError):
        average_arrays([a, b], [0, 0])


def test_mean_std_metrics_hand_worked():
    reports = [(1, {"accuracy": 0.5, "partition-id": 0}), (3, {"accuracy": 1.0, "partition-id": 1})]
    out = mean_std_metrics(reports)
    assert out["accuracy"] == pytest.approx(0.875)  # (0.5 + 3) / 4
    assert out["accuracy-client-mean"] == pytest.approx(0.75)
    assert out["accuracy-client-std"] == pytest.approx(0.25)
    assert "partition-id" not in out


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_each_round_is_the_weighted_mean_of_what_the_clients_sent(weighting):
    clients = [(0, 10, 1, 0.5), (1, 25, 4, 1.5), (2, 65, 2, 3.0)]  # pid, num-examples, counter step, loss
    grid = InProcessGrid({20 + pid: _node(pid, n, step, loss) for pid, n, step, loss in clients})
    strategy = WeightAveraging(weighting=weighting, min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=_record(INIT), num_rounds=3)

    counts = np.array([n for _, n, _, _ in clients], dtype=np.float64)
    w = counts / counts.sum() if weighting == "samples" else np.full(3, 1 / 3)
    state = {k: v.astype(np.float64) for k, v in INIT.items()}
    for r in (1, 2, 3):  # numpy replay: every client starts from the same global state
        new = {}
        for key in ("w", "b"):
            sent = [state[key].astype(np.float32) + _delta(pid, r, key, state[key].shape) for pid, *_ in clients]
            new[key] = sum(wi * s.astype(np.float64) for wi, s in zip(w, sent))
        new["steps"] = np.rint(sum(wi * (state["steps"] + step) for wi, (_, _, step, _) in zip(w, clients)))
        state = new
    for key in ("w", "b"):
        np.testing.assert_allclose(result.arrays[key].numpy(), state[key], rtol=1e-5, atol=1e-6)
        assert result.arrays[key].numpy().dtype == np.float32
    assert result.arrays["steps"].numpy().dtype == np.int64 and int(result.arrays["steps"].numpy()) == state["steps"]
    losses = np.array([loss for *_, loss in clients])
    fit = result.train_metrics_clientapp[3]
    assert fit["train-loss"] == pytest.approx(float((counts * losses).sum() / counts.sum()))  # by num-examples
    assert fit["train-loss-client-mean"] == pytest.approx(float(losses.mean()))
    assert fit["train-loss-client-std"] == pytest.approx(float(losses.std()))


def test_rejected_replies_carry_no_weight_in_the_mean_of_the_rest():
    """Two accepted clients with different counts: the mean is theirs alone, weighted by their counts."""
    def bad(kind):
        def handle(msg):
            got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
            if kind == "nan":
                got["b"] = np.full(3, np.nan, np.float32)
                return encode_weights_reply(got, 50, {"partition-id": 9})
            if kind == "zero-count":
                return encode_weights_reply(got, 0, {"partition-id": 8})
            got["w"] = got["w"].T.copy()  # wrong shape
            return encode_weights_reply(got, 50, {"partition-id": 7})
        return handle

    grid = InProcessGrid({20: _node(0, 10, 1, 0.5), 21: _node(1, 30, 3, 1.0), 22: bad("nan"),
                          23: bad("zero-count"), 24: bad("transposed")})
    strategy = WeightAveraging(min_available_nodes=5, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_record(INIT), num_rounds=1)
    want = {k: (10 * (INIT[k] + _delta(0, 1, k, INIT[k].shape)).astype(np.float64)
                + 30 * (INIT[k] + _delta(1, 1, k, INIT[k].shape)).astype(np.float64)) / 40 for k in ("w", "b")}
    for key in ("w", "b"):
        np.testing.assert_allclose(result.arrays[key].numpy(), want[key], rtol=1e-5, atol=1e-6)
    assert int(result.arrays["steps"].numpy()) == round((10 * 8 + 30 * 10) / 40)  # 9.5 -> 10 (to even)
    reasons = {r["client"]: r["reason"] for r in strategy.reports[1].rejected}
    assert reasons == {"partition 9": "'b': contains NaN or infinite values",
                       "node 23": "metric 'num-examples' = 0 is below 1",  # bad metrics name no partition
                       "partition 7": "'w': shape 3x2 != expected 2x3"}
    assert result.train_metrics_clientapp[1]["train-loss"] == pytest.approx((10 * 0.5 + 30 * 1.0) / 40)


def test_a_round_that_accepts_nobody_keeps_the_global_model():
    good = _node(0, 10, 1, 0.5)

    def broken_in_round_2(msg):
        if msg.content["config"]["server-round"] == 2:
            got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
            return encode_weights_reply({**got, "w": np.full((2, 3), np.inf, np.float32)}, 10, {"partition-id": 0})
        return good(msg)

    grid = InProcessGrid({20: broken_in_round_2})
    strategy = WeightAveraging(max_empty_rounds=1, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=_record(INIT), num_rounds=3)
    sent = [m.content["arrays"]["w"].numpy() for m in grid.sent if m.metadata.message_type == "train"]
    after_1 = INIT["w"] + _delta(0, 1, "w", (2, 3))
    np.testing.assert_allclose(sent[1], after_1, rtol=1e-6)
    np.testing.assert_allclose(sent[2], after_1, rtol=1e-6)  # round 2 changed nothing
    np.testing.assert_allclose(result.arrays["w"].numpy(), after_1 + _delta(0, 3, "w", (2, 3)), rtol=1e-6)
    assert strategy.replies.empty_rounds == 1 and result.train_metrics_clientapp[2]["accepted"] == 0
