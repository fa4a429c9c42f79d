"""Public-logit aggregation: hand-worked means, leave-one-out, reply validation, payloads."""

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

from pollen.methods.logit_losses import leave_one_out_target
from pollen.strategies.legacy import LogitAveraging
from pollen.strategies.logits import mean_logits
from tests.conftest import stub_node


A = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]], np.float32)
B = np.array([[3.0, 0.0], [1.0, 4.0], [6.0, -3.0]], np.float32)
C = np.array([[2.0, 4.0], [2.0, 1.0], [0.0, 3.0]], np.float32)


def _res(arrays, n, pid):
    return FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(arrays), num_examples=n,
                  metrics={"partition-id": pid, "train-loss": float(pid)})


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


def test_round_one_sends_nothing_then_consensus_and_count():
    manager = SimpleClientManager()
    proxies = [stub_node(str(i)) for i in range(4)]
    for p in proxies:
        manager.register(p)
    strat = LogitAveraging(num_public=3, num_classes=2, min_available_clients=4)
    first = strat.configure_fit(1, strat.initialize_parameters(manager), manager)
    assert len(first) == 4
    assert all(parameters_to_ndarrays(ins.parameters) == [] and ins.config["server-round"] == 1
               and ins.config["contributed"] is False for _, ins in first)

    bad_shape = A[:, :1].copy()
    nan = A.copy()
    nan[0, 0] = np.nan
    results = [(proxies[0], _res([A], 10, 0)), (proxies[1], _res([B], 20, 1)), (proxies[2], _res([C], 5, 2)),
               (proxies[3], _res([bad_shape], 7, 3))]
    params, metrics = strat.aggregate_fit(1, results, [])
    assert metrics["accepted"] == 3 and metrics["rejected"] == 1
    assert metrics["train-loss"] == pytest.approx(1.0)  # clients count equally
    rejections = strat.take_rejections()
    assert [(r.client, r.server_round) for r in rejections] == [("partition 3", 1)]
    assert "shape (3, 1) != expected 3x2" in rejections[0].reason
    sent = parameters_to_ndarrays(params)
    np.testing.assert_array_equal(sent[0], mean_logits([A, B, C]))
    assert sent[1].dtype == np.int64 and sent[1].tolist() == [3]

    second = dict((p.cid, ins) for p, ins in strat.configure_fit(2, params, manager))
    assert {cid: ins.config["contributed"] for cid, ins in second.items()} == {"0": True, "1": True, "2": True,
                                                                                "3": False}
    np.testing.assert_array_equal(parameters_to_ndarrays(second["3"].parameters)[0], mean_logits([A, B, C]))

    # NaN, float64, extra arrays and undecodable bytes are all dropped; the old consensus survives
    junk = FitRes(status=Status(Code.OK, ""), parameters=Parameters(tensors=[b"junk"], tensor_type="numpy.ndarray"),
                  num_examples=3, metrics={"partition-id": 3})
    params, metrics = strat.aggregate_fit(2, [(proxies[0], _res([nan], 1, 0)),
                                              (proxies[1], _res([B.astype(np.float64)], 1, 1)),
                                              (proxies[2], _res([C, C], 1, 2)), (proxies[3], junk)], [])
    assert params is None and metrics["accepted"] == 0 and metrics["rejected"] == 4
    reasons = [r.reason for r in strat.take_rejections()]
    assert "NaN" in reasons[0] and "float64" in reasons[1] and "expected 1 arrays" in reasons[2]
    assert "undecodable" in reasons[3]
    np.testing.assert_array_equal(strat.consensus, mean_logits([A, B, C]))


def test_homogeneous_mode_averages_weights_by_samples():
    strat = LogitAveraging(num_public=3, num_classes=2, average_weights=True)
    w1 = [np.array([1.0, 1.0], np.float32), np.array(2, np.int64)]
    w2 = [np.array([4.0, 7.0], np.float32), np.array(4, np.int64)]
    params, metrics = strat.aggregate_fit(1, [(stub_node("a"), _res([A, *w1], 10, 0)),
                                              (stub_node("b"), _res([B, *w2], 30, 1)),
                                              (stub_node("c"), _res([C, np.zeros(3, np.float32)], 30, 2))], [])
    assert metrics["accepted"] == 2  # the third reply's weights have the wrong shape
    sent = parameters_to_ndarrays(params)
    np.testing.assert_array_equal(sent[0], mean_logits([A, B]))
    np.testing.assert_allclose(sent[2], [(10 * 1 + 30 * 4) / 40, (10 * 1 + 30 * 7) / 40])
    assert sent[3].dtype == np.int64 and int(sent[3]) == round((10 * 2 + 30 * 4) / 40)


def test_constructor_checks_arguments():
    with pytest.raises(ValueError, match="num_public"):
        LogitAveraging(num_public=0, num_classes=10)
    with pytest.raises(ValueError, match="fraction_fit"):
        LogitAveraging(num_public=5, num_classes=10, fraction_fit=0.0)
