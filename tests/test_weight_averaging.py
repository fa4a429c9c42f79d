"""Parameter averaging and reply validation, checked against hand-worked numbers."""

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays

from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.validation import ArraySpec, check_arrays
from pollen.strategies.legacy import WeightAveraging
from pollen.strategies.weights import average_arrays


class FakeProxy:
    """Only the node id is read from a proxy by aggregate_fit."""

    def __init__(self, cid):
        self.cid = cid


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


def test_check_arrays_reasons():
    specs = [ArraySpec("w", (2, 3)), ArraySpec("n", (None,), "int64", nonnegative=True)]
    good = [np.zeros((2, 3), np.float32), np.array([1, 2], np.int64)]
    assert check_arrays(good, specs) is None
    assert "expected 2 arrays" in check_arrays(good[:1], specs)
    assert "shape (3, 2)" in check_arrays([np.zeros((3, 2), np.float32), good[1]], specs)
    assert "dtype float64" in check_arrays([np.zeros((2, 3)), good[1]], specs)
    nan = np.zeros((2, 3), np.float32)
    nan[1, 2] = np.nan
    assert "NaN" in check_arrays([nan, good[1]], specs)
    assert "negative" in check_arrays([good[0], np.array([-1], np.int64)], specs)


def _fit_res(arrays, n, pid):
    return FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(arrays), num_examples=n,
                  metrics={"partition-id": pid, "train-loss": float(pid)})


def test_strategy_drops_bad_replies_and_averages_the_rest():
    init = [np.zeros((2,), np.float32), np.zeros((1, 2), np.float32)]
    strat = WeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="samples")
    good1 = [np.array([1.0, 1.0], np.float32), np.array([[2.0, 2.0]], np.float32)]
    good2 = [np.array([4.0, 4.0], np.float32), np.array([[8.0, 8.0]], np.float32)]
    wrong_shape = [np.array([1.0, 1.0, 1.0], np.float32), np.array([[2.0, 2.0]], np.float32)]
    has_nan = [np.array([np.nan, 1.0], np.float32), np.array([[2.0, 2.0]], np.float32)]
    junk = FitRes(status=Status(Code.OK, ""), parameters=Parameters(tensors=[b"not numpy"], tensor_type="numpy.ndarray"),
                  num_examples=5, metrics={"partition-id": 4})
    results = [(FakeProxy("a"), _fit_res(good1, 10, 0)), (FakeProxy("b"), _fit_res(good2, 30, 1)),
               (FakeProxy("c"), _fit_res(wrong_shape, 10, 2)), (FakeProxy("d"), _fit_res(has_nan, 10, 3)),
               (FakeProxy("e"), junk)]
    params, metrics = strat.aggregate_fit(1, results, [])
    out = parameters_to_ndarrays(params)
    np.testing.assert_allclose(out[0], [3.25, 3.25])  # (10*1 + 30*4) / 40
    np.testing.assert_allclose(out[1], [[6.5, 6.5]])
    assert metrics["accepted"] == 2 and metrics["rejected"] == 3
    rejected = {r.client: r.reason for r in strat.take_rejections()}
    assert set(rejected) == {"partition 2", "partition 3", "partition 4"}
    assert "shape" in rejected["partition 2"] and "NaN" in rejected["partition 3"]
    assert "undecodable" in rejected["partition 4"]
    assert strat.take_rejections() == []


def test_uniform_weighting_and_all_rejected():
    init = [np.zeros((2,), np.float32)]
    strat = WeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="uniform")
    res = [(FakeProxy("a"), _fit_res([np.array([1.0, 1.0], np.float32)], 10, 0)),
           (FakeProxy("b"), _fit_res([np.array([4.0, 4.0], np.float32)], 30, 1))]
    params, _ = strat.aggregate_fit(1, res, [])
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [2.5, 2.5])
    params, metrics = strat.aggregate_fit(2, [(FakeProxy("c"), _fit_res([np.ones(3, np.float32)], 3, 2))], [])
    assert params is None and metrics["rejected"] == 1


def test_mean_std_metrics_hand_worked():
    reports = [(1, {"accuracy": 0.5, "partition-id": 0}), (3, {"accuracy": 1.0, "partition-id": 1})]
    out = mean_std_metrics(reports)
    assert out["accuracy"] == pytest.approx(0.875)  # (0.5 + 3) / 4
    assert out["accuracy-client-mean"] == pytest.approx(0.75)
    assert out["accuracy-client-std"] == pytest.approx(0.25)
    assert "partition-id" not in out
