"""Exemplar memory: herding against a naive greedy loop, quota, shrinking, prototype choice."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pollen.methods.memory import (
    herding,
    memory_from_arrays,
    memory_to_arrays,
    nearest_to_mean,
    normalised_features,
    per_class_quota,
    shrink,
    update_memory,
)
from pollen.models import build_model

torch.set_num_threads(1)


def _naive_herding(feats: np.ndarray, m: int, distinct: bool) -> list[int]:
    """iCaRL's herding written out with Python loops over candidates."""
    mu = feats.mean(0)
    chosen: list[int] = []
    running = np.zeros_like(mu)
    for k in range(1, m + 1):
        best, best_d = None, None
        for i in range(len(feats)):
            if distinct and i in chosen:
                continue
            d = np.sqrt(((mu - (running + feats[i]) / k) ** 2).sum())
            if best_d is None or d < best_d:
                best, best_d = i, d
        chosen.append(best)
        running = running + feats[best]
    return chosen


@pytest.mark.parametrize("distinct", [True, False])
def test_herding_picks_what_a_naive_greedy_loop_picks(distinct):
    rng = np.random.default_rng(3)
    raw = rng.normal(size=(40, 6)) + np.array([2.0, 0, 0, 0, 0, 0])
    feats = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    got = herding(torch.tensor(feats), 12, distinct=distinct)
    assert got.tolist() == _naive_herding(feats, 12, distinct)
    if distinct:
        assert len(set(got.tolist())) == 12


def test_herding_edge_cases_and_prefix_property():
    feats = F.normalize(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    assert herding(feats, 0).size == 0
    assert sorted(herding(feats, 9).tolist()) == [0, 1, 2, 3, 4]  # capped at the class size
    assert herding(feats, 3).tolist() == herding(feats, 5)[:3].tolist()
    with pytest.raises(ValueError, match="m must be"):
        herding(feats, -1)


def test_quota_shrink_and_update_memory():
    assert per_class_quota(2000, 0) == 0
    assert per_class_quota(2000, 30) == 66
    assert per_class_quota(10, 3) == 3
    mem = {0: np.arange(10), 1: np.arange(100, 110)}
    assert {c: v.tolist() for c, v in shrink(mem, 3).items()} == {0: [0, 1, 2], 1: [100, 101, 102]}
    gen = torch.Generator().manual_seed(1)
    new = {2: (np.arange(200, 220), F.normalize(torch.randn(20, 4, generator=gen), dim=1))}
    out = update_memory(mem, new, memory_size=12)  # 3 learned classes -> 4 each
    assert {c: len(v) for c, v in out.items()} == {0: 4, 1: 4, 2: 4}
    assert out[0].tolist() == [0, 1, 2, 3]
    assert set(out[2].tolist()) <= set(range(200, 220))
    assert out[2].tolist() == (200 + herding(new[2][1], 4)).tolist()
    back = memory_from_arrays(memory_to_arrays(out))
    assert all(np.array_equal(back[c], out[c]) for c in out)


def test_nearest_to_mean_and_normalised_features():
    feats = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [1.0, 0.1]]), dim=1)
    mu = feats.mean(0)
    expected = int(np.argmin([float((f - mu).norm()) for f in feats]))
    assert nearest_to_mean(feats) == expected == 2
    torch.manual_seed(0)
    model = build_model("resnet10", 5, in_channels=1, image_size=28, width=0.125)
    x = torch.randn(6, 1, 28, 28)
    f = normalised_features(model, x, torch.device("cpu"), batch_size=4)
    assert f.shape == (6, model.feature_dim)
    assert torch.allclose(f.norm(dim=1), torch.ones(6), atol=1e-5)
