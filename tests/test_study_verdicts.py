"""The rule that turns a paired difference into a verdict on a paper's claim (bench/bd_fedproto_study.py):
it must say *supported* only when the mean lies two standard errors on the claimed side of zero."""

from __future__ import annotations

import math
import sys

import pytest

from tests.conftest import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
from bd_fedproto_study import verdict  # noqa: E402


def se(diffs):
    m = sum(diffs) / len(diffs)
    return math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))


def test_clear_gain_is_supported_and_clear_loss_contradicted():
    gains = [0.30, 0.35, 0.25, 0.32, 0.28]  # mean 0.30, s.e. 0.017
    assert verdict(gains) == "supported"
    assert verdict([-d for d in gains]) == "contradicted"


def test_lower_is_better_flips_the_side():
    drops = [-0.30, -0.35, -0.25]
    assert verdict(drops, lower_is_better=True) == "supported"
    assert verdict(drops) == "contradicted"


def test_the_boundary_is_two_standard_errors():
    base = [-1.0, 0.0, 1.0]  # mean 0, s.e. 1/sqrt(3)
    two_se = 2 * se(base)
    assert verdict([d + two_se * 1.01 for d in base]) == "supported"
    assert verdict([d + two_se * 0.99 for d in base]).startswith("not shown")
    assert verdict([d - two_se * 1.01 for d in base]) == "contradicted"


@pytest.mark.parametrize("diffs", [[], [0.5]])
def test_fewer_than_two_seeds_never_decide(diffs):
    assert verdict(diffs) == "not shown (fewer than 2 paired seeds)"


def test_identical_differences_decide_by_sign():
    assert verdict([0.1, 0.1, 0.1]) == "supported"
    assert verdict([0.0, 0.0]).startswith("not shown")


def test_consensus_correlation_is_the_per_class_pearson_mean():
    """bench/fccl_consensus.py's alignment measure against numpy's correlation coefficient."""
    import numpy as np
    import torch
    from fccl_consensus import pearson_diag

    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 10))
    b = 0.5 * a + rng.normal(size=(200, 10)) * np.linspace(0.1, 3.0, 10)
    expected = np.mean([np.corrcoef(a[:, c], b[:, c])[0, 1] for c in range(10)])
    got = pearson_diag(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    assert got == pytest.approx(expected, abs=1e-6)
    assert pearson_diag(torch.tensor(a), torch.tensor(3 * a + 1)) == pytest.approx(1.0, abs=1e-5)
    assert pearson_diag(torch.tensor(a), torch.tensor(-a)) == pytest.approx(-1.0, abs=1e-5)
