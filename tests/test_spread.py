"""The round's own spread (``pollen.strategies.spread``) against hand-computed cases: sizes, medians, who
is far outside and who is not. The whole rule in runs of every family: tests/test_hostile_nodes.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pollen.strategies.spread import (
    GRADIENT_NORM,
    UPDATE_NORM,
    check_factor,
    far_outside,
    largest_norm,
    logit_size,
    prototype_size,
    spread_record,
    update_norm,
)


def test_sizes_by_hand():
    base = {"w": np.zeros((2, 2), np.float32), "step": np.array(7, np.int64)}
    moved = {"w": np.array([[3.0, 0.0], [0.0, 4.0]], np.float32), "step": np.array(99, np.int64)}
    assert update_norm(moved, base) == 5.0  # 3-4-5; the integer entry is no part of an update
    assert largest_norm([[np.array([1.0, 2.0]), np.array([2.0])], [np.array([6.0])]]) == 6.0  # √9 < 6
    protos = np.array([[3.0, 4.0], [60.0, 80.0], [0.0, 1.0]])
    assert prototype_size(protos, np.array([5, 0, 2])) == 5.0  # the row of an unheld class does not count
    logits = np.array([[1.0, 3.0], [10.0, 10.0]])  # centred: [-1, 1], [0, 0] -> RMS √(2/4)
    assert logit_size(logits) == pytest.approx(math.sqrt(0.5))
    assert logit_size(logits + 1e6) == pytest.approx(math.sqrt(0.5))  # a shift a softmax cannot see
    assert update_norm({"w": np.full(2, 1e200)}, {"w": np.zeros(2)}) == math.inf  # overflow is far, not NaN


def test_far_outside_is_above_factor_times_the_median_of_each_measure():
    sizes = [{UPDATE_NORM: s} for s in (1.0, 2.0, 3.0, 15.0, 16.0)]  # median 3: 15 = 5 × median is inside
    (out,) = far_outside(sizes, 5.0)
    assert (out.index, out.measure, out.size, out.median, out.ratio) == (4, UPDATE_NORM, 16.0, 3.0, 16 / 3)
    assert far_outside(sizes, 0.0) == []  # off
    assert [o.index for o in far_outside(sizes, 4.9)] == [3, 4]


def test_the_median_breaks_at_half_and_needs_three_replies():
    assert [o.index for o in far_outside([{UPDATE_NORM: s} for s in (1.0, 1.2, 100.0)], 5.0)] == [2]  # 1 of 3
    assert far_outside([{UPDATE_NORM: s} for s in (1.0, 1.2, 100.0, 110.0)], 5.0) == []  # 2 of 4: median 50.6
    assert far_outside([{UPDATE_NORM: s} for s in (1.0, 1000.0)], 5.0) == []  # no spread to hold them to
    assert far_outside([{UPDATE_NORM: 0.0}] * 3 + [{UPDATE_NORM: 1.0}], 5.0) == []  # a median of 0 judges nobody


def test_a_reply_far_outside_in_one_measure_is_named_once_by_its_largest_ratio():
    sizes = [{UPDATE_NORM: 1.0, GRADIENT_NORM: 2.0}, {UPDATE_NORM: 1.0, GRADIENT_NORM: 2.0},
             {UPDATE_NORM: 1.0},  # no gradient sets: no vote on that measure
             {UPDATE_NORM: 1.2, GRADIENT_NORM: 2.5},
             {UPDATE_NORM: 1.1, GRADIENT_NORM: 40.0},  # an honest model, gradient sets ×20: refused
             {UPDATE_NORM: 9.0, GRADIENT_NORM: 300.0},  # both far outside: named by the larger ratio
             {UPDATE_NORM: math.nan}]  # NaN is far outside too
    out = far_outside(sizes, 5.0)
    assert [(o.index, o.measure) for o in out] == [(4, GRADIENT_NORM), (5, GRADIENT_NORM), (6, UPDATE_NORM)]
    assert (out[0].median, out[0].ratio, out[1].ratio) == (2.5, 16.0, 120.0)  # median of 2, 2, 2.5, 40, 300
    record = spread_record(sizes[:6])
    assert record[GRADIENT_NORM] == {"replies": 5, "median": 2.5, "max-ratio": 120.0}
    assert record[UPDATE_NORM] == {"replies": 6, "median": 1.05, "max-ratio": pytest.approx(9.0 / 1.05)}


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, True, "5"])
def test_the_factor_is_zero_or_a_finite_positive_number(bad):
    assert check_factor(0) == 0.0 and check_factor(5) == 5.0
    with pytest.raises(ValueError, match="outlier_factor must be 0 \\(off\\) or a finite number > 0"):
        check_factor(bad)
