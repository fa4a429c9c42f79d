"""FedProto / BD-FedProto math against hand-worked cases and naive loops."""

import math

import numpy as np
import pytest
import torch

from pollen.methods.prototype_losses import (
    annealing_temperature,
    dynamic_lambda,
    mutual_information,
    negative_hinge_loss,
    negative_infonce_loss,
    negative_mask,
    prototype_loss,
    prototype_probabilities,
    squared_distances,
)
from pollen.strategies.prototypes import aggregate_prototypes, prototype_margin

torch.set_num_threads(1)


# --- server: aggregation and margin -----------------------------------------------------------------

def _three_clients():
    """C = 4 classes, d = 2. Class 3 is held by nobody; some unheld rows carry junk (must be ignored)."""
    a = np.array([[1, 1], [99, 99], [0, 3], [np.nan, 7]], dtype=np.float32)
    b = np.array([[4, -2], [2, 0], [-50, 50], [0, 0]], dtype=np.float32)
    c = np.array([[1e6, 1e6], [6, 4], [4, -1], [0, 0]], dtype=np.float32)
    counts = [np.array([2, 0, 1, 0]), np.array([1, 3, 0, 0]), np.array([0, 1, 3, 0])]
    return [a, b, c], [x.astype(np.int64) for x in counts]


def test_count_weighted_aggregation_hand_worked():
    protos, counts = _three_clients()
    out, present = aggregate_prototypes(protos, counts, "samples")
    # class 0: (2·[1,1] + 1·[4,-2]) / 3;  class 1: (3·[2,0] + 1·[6,4]) / 4;  class 2: (1·[0,3] + 3·[4,-1]) / 4
    np.testing.assert_allclose(out[:3], [[2, 0], [3, 1], [3, 0]], atol=1e-6)
    assert present.tolist() == [True, True, True, False]
    assert out.dtype == np.float32 and out.shape == (4, 2)


def test_uniform_aggregation_is_the_official_codes_plain_mean():
    protos, counts = _three_clients()
    out, present = aggregate_prototypes(protos, counts, "uniform")
    np.testing.assert_allclose(out[:3], [[2.5, -0.5], [4, 2], [2, 1]], atol=1e-6)
    assert present.tolist() == [True, True, True, False]


def test_absent_class_stays_absent_and_is_not_a_zero_average():
    protos, counts = _three_clients()
    out, present = aggregate_prototypes(protos, counts)
    assert not present[3]
    # adding a client that holds only class 3 makes it present with exactly that client's prototype
    extra = np.full((4, 2), 5.0, dtype=np.float32)
    out2, present2 = aggregate_prototypes(protos + [extra], counts + [np.array([0, 0, 0, 7])])
    assert present2.all()
    np.testing.assert_allclose(out2[3], [5, 5])
    np.testing.assert_allclose(out2[:3], out[:3])


def test_aggregation_rejects_bad_arguments():
    protos, counts = _three_clients()
    with pytest.raises(ValueError, match="weighting"):
        aggregate_prototypes(protos, counts, "median")
    with pytest.raises(ValueError, match=">= 0"):
        aggregate_prototypes(protos, [counts[0], counts[1], -counts[2]])
    with pytest.raises(ValueError, match="do not match"):
        aggregate_prototypes([protos[0], protos[1][:, :1], protos[2]], counts)


def test_margin_is_median_pairwise_mse_over_present_classes():
    protos = np.array([[2, 0], [3, 1], [3, 0], [100, 100]], dtype=np.float32)
    present = np.array([True, True, True, False])
    # d01 = (1+1)/2 = 1, d02 = (1+0)/2 = 0.5, d12 = (0+1)/2 = 0.5 -> median 0.5 (class 3 ignored)
    assert prototype_margin(protos, present) == pytest.approx(0.5)
    assert prototype_margin(protos, np.array([True, False, False, False])) == 0.0


# --- client: L_P, L_N -------------------------------------------------------------------------------

def test_prototype_loss_matches_the_official_per_sample_mse_by_naive_loop():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, 5, generator=gen, requires_grad=True)
    y = torch.tensor([0, 2, 1, 2, 3, 0])
    protos = torch.randn(4, 5, generator=gen)
    present = torch.tensor([True, False, True, True])  # class 1 has no global prototype
    loss = prototype_loss(z, y, protos, present)
    total = 0.0
    for b in range(6):
        for k in range(5):
            target = protos[y[b], k].item() if present[y[b]] else z[b, k].item()
            total += (z[b, k].item() - target) ** 2
    assert loss.item() == pytest.approx(total / (6 * 5), rel=1e-6)
    loss.backward()
    assert torch.all(z.grad[2] == 0)  # the sample of the absent class contributes nothing
    np.testing.assert_allclose(z.grad[0].numpy(), (2 * (z[0] - protos[0]) / 30).detach().numpy(), rtol=1e-5)


def test_negative_hinge_inside_and_outside_the_margin():
    protos = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0]])
    present = torch.tensor([True, True, True])
    negatives = negative_mask(present, [0])
    assert negatives.tolist() == [False, True, True]
    z = torch.tensor([[0.0, 0.0], [2.0, 2.0]])
    # distances to class 1: 2 and 2 (inside margin 3 -> hinge 1 each); to class 2: 8 and 4 (outside -> 0)
    assert negative_hinge_loss(z, protos, negatives, margin=3.0).item() == pytest.approx(0.5)
    assert negative_hinge_loss(z, protos, negatives, margin=1.0).item() == 0.0
    assert negative_hinge_loss(z, protos, negative_mask(present, [0, 1, 2]), margin=3.0).item() == 0.0
    with pytest.raises(ValueError, match="margin"):
        negative_hinge_loss(z, protos, negatives, margin=-1.0)


def test_negative_infonce_by_naive_formula():
    protos = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.5], [9.0, 9.0]])
    present = torch.tensor([True, True, True, False])
    negatives = negative_mask(present, [0, 1])  # only class 2 (class 3 absent)
    z = torch.tensor([[0.5, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 1])
    tau = 0.5

    def d(a, b):
        return sum((x - w) ** 2 for x, w in zip(a, b)) / len(a)

    expected = 0.0
    for zb, yb in zip(z.tolist(), y.tolist()):
        pos = math.exp(-d(zb, protos[yb].tolist()) / tau)
        neg = math.exp(-d(zb, protos[2].tolist()) / tau)
        expected += -math.log(pos / (pos + neg))
    got = negative_infonce_loss(z, y, protos, present, negatives, tau)
    assert got.item() == pytest.approx(expected / 2, rel=1e-5)


def test_squared_distances_and_prototype_probabilities():
    z = torch.tensor([[1.0, 0.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]])
    np.testing.assert_allclose(squared_distances(z, protos).numpy(), [[0.0, 0.5, 20.5]])
    p = prototype_probabilities(z, protos, torch.tensor([True, True, False]), tau=0.5)
    e0, e1 = math.exp(0.0), math.exp(-1.0)
    np.testing.assert_allclose(p.numpy(), [[e0 / (e0 + e1), e1 / (e0 + e1), 0.0]], rtol=1e-6)


# --- client: DA and MI ------------------------------------------------------------------------------

def test_annealing_temperature():
    assert annealing_temperature(0) == 2.0
    assert annealing_temperature(10) == pytest.approx(2 * 0.95 ** 10)
    assert annealing_temperature(1000) == 0.05


def test_dynamic_lambda_on_a_recorded_history_by_hand():
    history = [(1.0, 0.5), (0.8, 0.45)]  # r_S = 0.8, r_P = 0.9
    temp = 2 * 0.95 ** 10
    tilde = 2 * math.exp(0.9 / temp) / (math.exp(0.8 / temp) + math.exp(0.9 / temp))
    got = dynamic_lambda(history, lambda_prev=1.2, lambda0=1.0, round_number=10)
    assert got == pytest.approx(0.5 * 1.2 + 0.5 * tilde, rel=1e-12)
    assert got > 1.1  # L_P falls more slowly than L_S: weight rises above the neutral 1


def test_dynamic_lambda_warmup_clamp_and_neutral_case():
    assert dynamic_lambda([(1.0, 0.5)], 1.7, 1.0, 5) == 1.0  # < 2 rounds of history: λ_0
    # both losses fall alike -> λ̃ = 1: a fixed point at λ_0
    assert dynamic_lambda([(1.0, 0.5), (0.5, 0.25)], 1.0, 1.0, 3) == pytest.approx(1.0)
    # L_S collapses while L_P rises sharply at low temperature -> λ̃ ≈ 2, clamp at 2·λ_0
    assert dynamic_lambda([(1.0, 0.1), (0.1, 1.0)], 2.0, 0.5, 500) == pytest.approx(1.0)
    # the opposite -> λ̃ ≈ 0, clamp at 0.1·λ_0
    assert dynamic_lambda([(0.1, 1.0), (1.0, 0.1)], 0.05, 1.0, 500) == pytest.approx(0.1)


def test_mutual_information_on_known_entropies():
    eye = torch.eye(4)
    assert mutual_information(eye) == pytest.approx(1.0)  # confident and diverse: log C / log C
    assert mutual_information(torch.full((5, 4), 0.25)) == pytest.approx(0.0, abs=1e-12)
    assert mutual_information(torch.tensor([[1.0, 0.0], [1.0, 0.0]])) == pytest.approx(0.0, abs=1e-12)
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    h_mean = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert mutual_information(probs) == pytest.approx((h_mean - math.log(2) / 2) / math.log(2), rel=1e-9)
