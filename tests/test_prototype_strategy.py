"""PrototypeStrategy: validation of real FitRes replies, and use from another Flower project's clients."""

import numpy as np
import pytest
from flwr.client import NumPyClient
from flwr.common import (Code, FitRes, Status, ndarrays_to_parameters,
                         parameters_to_ndarrays)
from flwr.server import Server
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from pollen.strategies.legacy import PrototypeStrategy

C, D = 4, 3


class InProcessProxy(ClientProxy):
    """A ClientProxy that calls a NumPyClient in this process (what a SuperNode does over the wire)."""

    def __init__(self, cid: str, client: NumPyClient):
        super().__init__(cid)
        self.client = client.to_client()

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        return self.client.fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self.client.evaluate(ins)


def _fit_res(arrays, pid, num_examples=10):
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), num_examples, {"partition-id": pid})


def _reply(rows: dict[int, list[float]], counts: dict[int, int]):
    protos = np.zeros((C, D), dtype=np.float32)
    cnt = np.zeros(C, dtype=np.int64)
    for c, row in rows.items():
        protos[c] = row
    for c, n in counts.items():
        cnt[c] = n
    return [protos, cnt]


def _proxy(cid):
    return InProcessProxy(cid, _PointsClient(0, {}))


def test_aggregate_fit_drops_bad_replies_with_reasons_and_keeps_the_rest():
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D)
    good_a = _reply({0: [1, 1, 1], 1: [2, 2, 2]}, {0: 1, 1: 1})
    good_b = _reply({0: [3, 3, 3]}, {0: 3})
    nan = _reply({0: [1, 1, 1]}, {0: 1, 2: 2})
    nan[0][2, 1] = np.nan  # NaN in a held class
    nan_unheld = _reply({2: [5, 5, 5]}, {2: 1})
    nan_unheld[0][3] = np.nan  # NaN in a class with count 0: ignored, reply accepted
    wrong_d = [np.zeros((C, D + 1), np.float32), np.ones(C, np.int64)]
    wrong_dtype = [np.zeros((C, D), np.float64), np.ones(C, np.int64)]
    negative = [np.zeros((C, D), np.float32), np.array([1, -1, 0, 0], np.int64)]
    missing = [np.zeros((C, D), np.float32)]
    results = [(_proxy(str(i)), _fit_res(r, i)) for i, r in
               enumerate([good_a, good_b, nan, nan_unheld, wrong_d, wrong_dtype, negative, missing])]
    params, metrics = strategy.aggregate_fit(1, results, [])
    reasons = {r.client: r.reason for r in strategy.take_rejections()}
    assert set(reasons) == {"partition 2", "partition 4", "partition 5", "partition 6", "partition 7"}
    assert "NaN" in reasons["partition 2"] and "[2]" in reasons["partition 2"]
    assert "shape" in reasons["partition 4"] and "dtype" in reasons["partition 5"]
    assert "negative" in reasons["partition 6"] and "expected 2 arrays" in reasons["partition 7"]
    assert metrics["accepted"] == 3 and metrics["rejected"] == 5 and metrics["classes-present"] == 3
    protos, mask, margin = parameters_to_ndarrays(params)
    np.testing.assert_allclose(protos[:3], [[2.5, 2.5, 2.5], [2, 2, 2], [5, 5, 5]])  # (1·1 + 3·3) / 4 = 2.5
    assert mask.tolist() == [1, 1, 1, 0] and mask.dtype == np.int64
    assert margin.shape == (1,) and margin.dtype == np.float32
    assert np.isfinite(protos).all()


def test_first_round_sends_nothing_and_unreported_classes_keep_their_prototype():
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D)
    assert strategy.global_payload() == []
    strategy.aggregate_fit(1, [(_proxy("0"), _fit_res(_reply({0: [1, 0, 0], 1: [0, 1, 0]}, {0: 2, 1: 2}), 0))], [])
    strategy.aggregate_fit(2, [(_proxy("0"), _fit_res(_reply({1: [0, 3, 0]}, {1: 2}), 0))], [])
    protos, mask, _ = strategy.global_payload()
    np.testing.assert_allclose(protos[:2], [[1, 0, 0], [0, 3, 0]])
    assert mask.tolist() == [1, 1, 0, 0]


def test_all_replies_bad_keeps_the_previous_global_state():
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D)
    strategy.aggregate_fit(1, [(_proxy("0"), _fit_res(_reply({0: [1, 0, 0]}, {0: 2}), 0))], [])
    before = [a.copy() for a in strategy.global_payload()]
    _, metrics = strategy.aggregate_fit(2, [(_proxy("0"), _fit_res([np.zeros(3, np.float32)], 0))], [])
    assert metrics["accepted"] == 0 and metrics["rejected"] == 1
    for a, b in zip(before, strategy.global_payload()):
        np.testing.assert_array_equal(a, b)


def test_evaluate_every_skips_rounds_but_always_evaluates_the_last():
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=3, num_rounds=7,
                                 min_available_clients=1)
    manager = SimpleClientManager()
    manager.register(_proxy("0"))
    rounds = [r for r in range(1, 8) if strategy.configure_evaluate(r, ndarrays_to_parameters([]), manager)]
    assert rounds == [3, 6, 7]


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="weighting"):
        PrototypeStrategy(num_classes=C, embed_dim=D, weighting="max")
    with pytest.raises(ValueError, match="evaluate_every"):
        PrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=0)


class _PointsClient(NumPyClient):
    """A minimal client of *another* project: fixed 3-d embeddings per class, no Pollen code at all.

    It follows only the payload contract: it replies class means and counts, and evaluates by the
    nearest global prototype among its own classes.
    """

    def __init__(self, seed: int, classes: dict[int, int]):
        rng = np.random.default_rng(seed)
        self.points = {c: (rng.normal(size=(n, D)) + 4 * np.eye(C, D)[c]).astype(np.float32)
                       for c, n in classes.items()}

    def fit(self, parameters, config):
        protos = np.zeros((C, D), np.float32)
        counts = np.zeros(C, np.int64)
        for c, pts in self.points.items():
            protos[c], counts[c] = pts.mean(axis=0), len(pts)
        return [protos, counts], int(counts.sum()), {"received": len(parameters)}

    def evaluate(self, parameters, config):
        protos, mask, _ = parameters
        own = [c for c in self.points if mask[c]]
        correct = total = 0
        for c, pts in self.points.items():
            dist = ((pts[:, None, :] - protos[own][None]) ** 2).mean(axis=2)
            correct += int((np.array(own)[dist.argmin(axis=1)] == c).sum())
            total += len(pts)
        return 0.0, total, {"proto-accuracy": correct / total}


def test_strategy_runs_a_plain_flower_server_with_foreign_clients():
    clients = [_PointsClient(0, {0: 5, 1: 3}), _PointsClient(1, {1: 9, 2: 2}), _PointsClient(2, {0: 4, 2: 6})]
    manager = SimpleClientManager()
    for i, client in enumerate(clients):
        manager.register(InProcessProxy(str(i), client))
    strategy = PrototypeStrategy(num_classes=C, embed_dim=D, min_available_clients=3)
    history, _ = Server(client_manager=manager, strategy=strategy).fit(num_rounds=2, timeout=None)
    # independent computation: the count-weighted mean of each class over every point of every client
    for c in range(3):
        pts = np.concatenate([cl.points[c] for cl in clients if c in cl.points])
        np.testing.assert_allclose(strategy.protos[c], pts.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert strategy.present.tolist() == [True, True, True, False]
    assert [r for r, _ in history.metrics_distributed_fit["received"]] == [1, 2]
    assert [v for _, v in history.metrics_distributed_fit["received-client-mean"]] == [0.0, 3.0]
    assert history.metrics_distributed["proto-accuracy"][-1][1] > 0.9
