"""Leak measures on hand-worked cases, and the measured effect of the prototype mechanism's noise."""

import numpy as np
import pytest

from pollen.privacy.leakage import histogram_leak, presence_f1, presence_leak, softmax_histogram_leak, total_variation
from pollen.privacy.mechanisms import release_prototypes
from pollen.protocol.prototypes import DP_HELD_STDS


def test_hand_worked_values():
    assert total_variation([2, 2, 0, 0], [0, 0, 1, 1]) == 1.0
    assert total_variation([3, 1], [1, 1]) == pytest.approx(0.25)
    assert total_variation([3, 1], [-5, 0]) == pytest.approx(0.25)  # all-negative estimate: uniform
    assert histogram_leak([6, 2, 0, 0], [6, 2, 0, 0]) == (0.0, pytest.approx(0.5))
    assert presence_f1([5, 0, 3, 0], [True, True, False, False]) == pytest.approx(0.5)
    assert presence_leak([5, 0, 3, 0], [9.0, -1.0, 4.0, 0.5], threshold=2.0) == (1.0, pytest.approx(2 * 2 / 6))
    logits = np.log(np.array([[0.5, 0.5, 0.0 + 1e-12], [1.0 - 2e-12, 1e-12, 1e-12]]))
    tv, floor = softmax_histogram_leak(logits, [3, 1, 0])
    assert tv == pytest.approx(0.0, abs=1e-9) and floor == pytest.approx(5 / 12)
    with pytest.raises(ValueError, match="differ in length"):
        total_variation([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="N0×3"):
        softmax_histogram_leak(np.zeros((4, 2)), [1, 1, 1])


@pytest.mark.parametrize(("sigma", "leaks"), [(0.05, True), (500.0, False)])
def test_noise_takes_the_label_histogram_away(sigma, leaks):
    """A client with 3 of 10 classes: with little noise the server reads its histogram and classes off
    the counts; with σ = 500 it does no better than its random guess (averaged over 200 releases)."""
    rng = np.random.default_rng(0)
    labels = np.repeat([1, 4, 7], [60, 30, 10])
    truth = np.bincount(labels, minlength=10)
    z = rng.normal(size=(100, 8))
    tvs, f1s = [], []
    for _ in range(200):
        r = release_prototypes(z, labels, 10, 1.0, sigma, rng)
        tv, tv_floor = histogram_leak(truth, r.counts)
        f1, f1_floor = presence_leak(truth, r.counts, max(1.0, DP_HELD_STDS * r.count_std))
        tvs.append(tv)
        f1s.append(f1)
    if leaks:
        assert np.mean(tvs) < 0.01 and np.mean(f1s) == 1.0
    else:  # no better than guessing: TV at least the uniform guess's minus a margin, F1 no better
        assert np.mean(tvs) > tv_floor - 0.05 and np.mean(f1s) <= f1_floor + 0.05
