"""Prototype pooling as the app runs it: the Message-API ``PrototypeStrategy`` on an in-process grid,
against numpy written here — class-wise means weighted by class counts over the replies it accepts,
the state it keeps when nobody is accepted, and the rounds it evaluates."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from pollen.protocol.prototypes import decode_global_prototypes, encode_prototype_reply
from pollen.strategies import PrototypeStrategy
from pollen.testing import InProcessGrid

C, D = 4, 3


class PointsNode:
    """A client of another project: fixed 3-d embeddings per class; replies class means and counts, and
    evaluates by the nearest global prototype among its own classes."""

    def __init__(self, pid: int, classes: dict[int, int]):
        rng = np.random.default_rng(pid)
        self.pid = pid
        self.points = {c: (rng.normal(size=(n, D)) + 4 * np.eye(C, D)[c]).astype(np.float32)
                       for c, n in classes.items()}
        self.received: list = []

    def __call__(self, msg):
        glob = decode_global_prototypes(msg.content["arrays"], C, D)
        if msg.metadata.message_type == "evaluate":
            protos, present, _ = glob
            own = [c for c in self.points if present[c]]
            hits = sum(int((np.array(own)[((p[:, None] - protos[own][None]) ** 2).mean(axis=2).argmin(axis=1)]
                            == c).sum()) for c, p in self.points.items())
            total = sum(len(p) for p in self.points.values())
            return RecordDict({"metrics": MetricRecord({"num-examples": total, "partition-id": self.pid,
                                                        "accuracy": hits / total})})
        self.received.append(glob)
        protos, counts = np.zeros((C, D), np.float32), np.zeros(C, np.int64)
        for c, pts in self.points.items():
            protos[c], counts[c] = pts.mean(axis=0), len(pts)
        return encode_prototype_reply(protos, counts, {"partition-id": self.pid})


def _reply_node(pid, protos, counts):
    def handle(msg):
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": 5, "partition-id": pid})})
        return encode_prototype_reply(protos, counts, {"partition-id": pid})
    return handle


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_global_prototypes_pool_the_clients_points_class_by_class(weighting):
    nodes = [PointsNode(0, {0: 5, 1: 3}), PointsNode(1, {1: 9, 2: 2}), PointsNode(2, {0: 4, 2: 6})]
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, weighting=weighting, min_available_nodes=3)
    result = strategy.start(grid=InProcessGrid({30 + n.pid: n for n in nodes}), initial_arrays=ArrayRecord(),
                            num_rounds=2)
    for c in range(3):
        holders = [n.points[c] for n in nodes if c in n.points]
        # samples: the mean of every point of the class; uniform: the mean of the holders' means
        want = np.concatenate(holders).mean(axis=0) if weighting == "samples" else \
            np.mean([h.mean(axis=0) for h in holders], axis=0)
        np.testing.assert_allclose(result.arrays["prototypes"].numpy()[c], want, rtol=1e-5, atol=1e-6)
    assert result.arrays["present"].numpy().tolist() == [1, 1, 1, 0]
    protos = result.arrays["prototypes"].numpy()[:3].astype(np.float64)
    pair_mse = [((protos[i] - protos[j]) ** 2).mean() for i in range(3) for j in range(i + 1, 3)]
    assert result.arrays["margin"].numpy()[0] == pytest.approx(np.median(pair_mse), rel=1e-5)
    assert nodes[0].received[0] is None and nodes[0].received[1] is not None
    assert result.evaluate_metrics_clientapp[2]["accuracy"] > 0.9


def test_bad_replies_are_dropped_and_the_rest_pooled_by_class_counts():
    def reply(rows, counts):
        protos, cnt = np.zeros((C, D), np.float32), np.zeros(C, np.int64)
        for c, row in rows.items():
            protos[c] = row
        for c, n in counts.items():
            cnt[c] = n
        return protos, cnt

    good_a = reply({0: [1, 1, 1], 1: [2, 2, 2]}, {0: 1, 1: 1})
    good_b = reply({0: [3, 3, 3]}, {0: 3})
    nan_held = reply({0: [1, 1, 1]}, {0: 1, 2: 2})
    nan_held[0][2, 1] = np.nan
    nan_unheld = reply({2: [5, 5, 5]}, {2: 1})
    nan_unheld[0][3] = np.nan  # a class it does not hold: ignored, the reply counts
    handlers = {10 + i: _reply_node(i, *r) for i, r in enumerate([good_a, good_b, nan_held, nan_unheld])}

    def raw(pid, arrays):
        return lambda msg: RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                                       "metrics": MetricRecord({"num-examples": 4, "partition-id": pid})})

    handlers[14] = raw(4, {"prototypes": np.zeros((C, D + 1), np.float32), "class-counts": np.ones(C, np.int64)})
    handlers[15] = raw(5, {"prototypes": np.zeros((C, D), np.float64), "class-counts": np.ones(C, np.int64)})
    handlers[16] = raw(6, {"prototypes": np.zeros((C, D), np.float32), "class-counts": np.array([1, -1, 0, 0])})
    handlers[17] = raw(7, {"prototypes": np.zeros((C, D), np.float32)})
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, min_available_nodes=8, fraction_evaluate=0.0)
    result = strategy.start(grid=InProcessGrid(handlers), initial_arrays=ArrayRecord(), num_rounds=1)
    reasons = {r["client"]: r["reason"] for r in strategy.reports[1].rejected}
    assert reasons == {"partition 2": "'prototypes': NaN or infinite values for held class(es) [2]",
                       "partition 4": "'prototypes': shape 4x4 != expected 4x3",
                       "partition 5": "'prototypes': dtype float64 != expected float32",
                       "partition 6": "'class-counts': contains negative values",
                       "partition 7": "missing key(s) ['class-counts']"}
    accepted = [good_a, good_b, nan_unheld]
    counts = np.array([c for _, c in accepted], dtype=np.float64)
    held_protos = np.where(counts[:, :, None] > 0, np.array([p for p, _ in accepted], dtype=np.float64), 0.0)
    with np.errstate(invalid="ignore"):
        want = (counts[:, :, None] * held_protos).sum(axis=0) / counts.sum(axis=0)[:, None]
    np.testing.assert_allclose(result.arrays["prototypes"].numpy()[:3], want[:3], rtol=1e-6)  # class 0: 2.5
    assert result.arrays["present"].numpy().tolist() == [1, 1, 1, 0]
    assert result.train_metrics_clientapp[1]["classes-present"] == 3


def test_a_round_without_accepted_replies_keeps_the_global_prototypes():
    first = np.arange(C * D, dtype=np.float32).reshape(C, D)
    good = _reply_node(0, first, np.array([2, 0, 1, 0]))
    observer = PointsNode(1, {})

    def broken_in_round_2(msg):
        if msg.content["config"]["server-round"] == 2:
            return encode_prototype_reply(first, np.array([2, 0, 1, -1]), {"partition-id": 0})
        return good(msg)

    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, max_empty_rounds=1, fraction_evaluate=0.0)
    strategy.start(grid=InProcessGrid({10: broken_in_round_2, 11: observer}), initial_arrays=ArrayRecord(),
                   num_rounds=3)
    assert strategy.reports[2].accepted == 0  # the observer holds nothing (num-examples 0): refused too
    for server_round in (2, 3):
        protos, present, _ = observer.received[server_round - 1]
        np.testing.assert_array_equal(protos[[0, 2]], first[[0, 2]])
        assert present.tolist() == [True, False, True, False]


def test_evaluate_every_skips_rounds_but_always_evaluates_the_last():
    grid = InProcessGrid({10: PointsNode(0, {0: 2}), 11: PointsNode(1, {1: 2})})
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=3, num_rounds=7)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=7)
    evaluated = sorted({int(m.content["config"]["server-round"]) for m in grid.sent
                        if m.metadata.message_type == "evaluate"})
    assert evaluated == [3, 6, 7]
    monitored = sorted({int(m.content["config"]["server-round"]) for m in grid.sent
                        if m.metadata.message_type == "train" and m.content["config"]["monitor"]})
    assert monitored == evaluated  # clients run their diagnostics only when evaluated


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="weighting"):
        PrototypeStrategy(num_classes=C, embed_dim=D, weighting="max")
    with pytest.raises(ValueError, match="evaluate_every"):
        PrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=0)
    with pytest.raises(ValueError, match="num_classes"):
        PrototypeStrategy(num_classes=0, embed_dim=D)
