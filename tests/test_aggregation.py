"""Robust aggregation (``pollen.strategies.aggregation``) against independent references, and what it
is for: one hostile client of five moves the mean arbitrarily, the median and the trimmed mean by
less than the honest clients' own spread — for weights, prototypes and logits alike."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pollen.strategies.aggregation import (
    AGGREGATIONS,
    average_arrays,
    check_aggregation,
    robust_arrays,
    robust_stack,
    trim_count,
)
from pollen.strategies.logits import mean_logits
from pollen.strategies.prototypes import aggregate_prototypes


def _sorted_trimmed_mean(values: np.ndarray, fraction: float) -> np.ndarray:
    """A hand-written reference: sort each coordinate, drop floor(fraction·n) at each end, average."""
    n = values.shape[0]
    k = int(np.floor(fraction * n))
    out = np.empty(values.shape[1:])
    for idx in np.ndindex(*values.shape[1:]):
        column = sorted(float(v) for v in values[(slice(None), *idx)])
        kept = column[k:n - k]
        out[idx] = sum(kept) / len(kept)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11])
def test_median_and_trimmed_mean_equal_numpy_and_scipy_on_random_inputs(n):
    rng = np.random.default_rng(n)
    for _ in range(5):
        values = rng.normal(size=(n, 4, 3)) * rng.choice([1e-3, 1.0, 1e6])
        np.testing.assert_array_equal(robust_stack(list(values), "median"), np.median(values, axis=0))
        for fraction in (0.0, 0.1, 0.2, 0.34, 0.49):
            got = robust_stack(list(values), "trimmed-mean", fraction)
            np.testing.assert_allclose(got, stats.trim_mean(values, fraction, axis=0), rtol=1e-12, atol=0)
            np.testing.assert_allclose(got, _sorted_trimmed_mean(values, fraction), rtol=1e-12, atol=0)


def test_trim_count_always_leaves_a_value():
    for n in range(1, 40):
        for fraction in (0.0, 0.1, 0.25, 0.3333, 0.4999):
            k = trim_count(n, fraction)
            assert k == int(fraction * n) and n - 2 * k >= 1


def test_robust_arrays_keep_dtypes_and_round_integers():
    clients = [[np.array([1.0, 2.0], np.float32), np.array(3, np.int64)],
               [np.array([2.0, 9.0], np.float32), np.array(4, np.int64)],
               [np.array([5.0, 3.0], np.float32), np.array(8, np.int64)],
               [np.array([6.0, 4.0], np.float32), np.array(9, np.int64)]]
    floats, counter = robust_arrays(clients, "median")
    assert floats.dtype == np.float32 and counter.dtype == np.int64 and counter.shape == ()
    np.testing.assert_array_equal(floats, np.array([3.5, 3.5], np.float32))
    assert counter == 6  # median 6.0 of 3, 4, 8, 9


def test_bad_rules_are_refused_by_name():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        check_aggregation("geometric-median", 0.1)
    with pytest.raises(ValueError, match=r"trim_fraction must be a number in \[0, 0.5\), got 0.5"):
        check_aggregation("trimmed-mean", 0.5)
    with pytest.raises(ValueError, match="shape"):
        robust_stack([np.zeros(2), np.zeros(3)], "median")
    assert AGGREGATIONS == ("mean", "median", "trimmed-mean")


def _one_hostile_of_five(rng, shape):
    honest = [rng.normal(size=shape) for _ in range(4)]
    hostile = honest[0] * 1e6  # a plausible update, scaled
    return honest, hostile


def test_one_client_in_five_moves_the_mean_not_the_robust_rules_weights():
    rng = np.random.default_rng(0)
    honest, hostile = _one_hostile_of_five(rng, (6, 4))
    clients = [[h.astype(np.float32)] for h in honest] + [[hostile.astype(np.float32)]]
    stack = np.stack(honest)
    spread = stack.max(axis=0) - stack.min(axis=0)
    honest_mean = stack.mean(axis=0)
    mean = average_arrays(clients, [1.0] * 5)[0]
    assert (np.abs(mean - honest_mean) > 1e4 * spread).any()  # the option exists for this
    for rule in ("median", "trimmed-mean"):
        robust = robust_arrays(clients, rule, 0.2)[0]
        assert (np.abs(robust - honest_mean) <= spread + 1e-6).all(), rule
        assert ((stack.min(axis=0) - 1e-6 <= robust) & (robust <= stack.max(axis=0) + 1e-6)).all(), rule


def test_one_client_in_five_moves_the_mean_not_the_robust_rules_prototypes_and_logits():
    rng = np.random.default_rng(1)
    honest, hostile = _one_hostile_of_five(rng, (3, 4))
    counts = [np.array([5, 2, 1])] * 5
    protos = [h.astype(np.float32) for h in honest] + [hostile.astype(np.float32)]
    stack = np.stack(honest)
    spread, honest_mean = stack.max(axis=0) - stack.min(axis=0), stack.mean(axis=0)
    mean, present = aggregate_prototypes(protos, counts, "uniform")
    assert present.all() and (np.abs(mean - honest_mean) > 1e4 * spread).any()
    for rule in ("median", "trimmed-mean"):
        robust, present = aggregate_prototypes(protos, counts, "samples", rule, 0.2)
        assert present.all() and (np.abs(robust - honest_mean) <= spread + 1e-6).all(), rule
    logit_mean = mean_logits(protos)
    assert (np.abs(logit_mean - honest_mean) > 1e4 * spread).any()
    for rule in ("median", "trimmed-mean"):
        robust = robust_stack(protos, rule, 0.2)
        assert (np.abs(robust - honest_mean) <= spread + 1e-6).all(), rule


def test_robust_prototypes_use_only_the_holders_of_each_class():
    protos = [np.full((2, 2), v, np.float32) for v in (1.0, 2.0, 100.0)]
    counts = [np.array([1, 1]), np.array([1, 0]), np.array([0, 1])]  # class 0: clients 0, 1; class 1: 0, 2
    out, present = aggregate_prototypes(protos, counts, "samples", "median")
    np.testing.assert_array_equal(out, np.array([[1.5, 1.5], [50.5, 50.5]], np.float32))
    assert present.all()
    none_hold = aggregate_prototypes(protos, [np.array([0, 1])] * 3, "samples", "trimmed-mean")
    assert not none_hold[1][0] and (none_hold[0][0] == 0).all()


def test_the_default_mean_is_unchanged_to_every_digit():
    """``aggregation = "mean"`` runs the same code as before the option existed: bit-identical results."""
    rng = np.random.default_rng(2)
    clients = [[rng.normal(size=(5, 3)).astype(np.float32), np.array(rng.integers(0, 100), np.int64)]
               for _ in range(7)]
    weights = rng.uniform(1, 100, size=7)
    expected = []
    w = weights / weights.sum()
    for position in zip(*clients):  # the weighted mean as average_arrays has always computed it
        acc = sum(wi * a.astype(np.float64) for wi, a in zip(w, position))
        ref = position[0]
        expected.append(np.rint(acc).astype(ref.dtype) if ref.dtype.kind in "iu" else acc.astype(ref.dtype))
    got = average_arrays(clients, list(weights))
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    protos = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(5)]
    counts = [rng.integers(0, 4, size=4) for _ in range(5)]
    default = aggregate_prototypes(protos, counts)
    explicit = aggregate_prototypes(protos, counts, "samples", "mean", 0.3)
    assert np.array_equal(default[0], explicit[0]) and np.array_equal(default[1], explicit[1])
