"""FCCL / FedMD / FedDF objectives against independent computations (naive loops, torch.distributions)."""

import numpy as np
import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from pollen.methods.logit_losses import (
    LAMBDA_OFF_DIAGONAL,
    correlation_target_loss,
    cross_correlation_loss,
    cross_correlation_matrix,
    fccl_local_loss,
    feddf_kl_loss,
    fedmd_l1_loss,
    kl_to_teacher,
    standardize_columns,
)

torch.set_num_threads(1)


def naive_loss(z, t, lam=LAMBDA_OFF_DIAGONAL, eps=1e-6):
    """Eq. 1-2 with explicit loops over batch, classes u and v (float64, unbiased std)."""
    z = z.double().tolist()
    t = t.double().tolist()
    n, c = len(z), len(z[0])

    def standardised(rows, col):
        vals = [rows[b][col] for b in range(n)]
        mean = sum(vals) / n
        std = (sum((v - mean) ** 2 for v in vals) / (n - 1)) ** 0.5
        return [(v - mean) / (std + eps) for v in vals]

    zs = [standardised(z, u) for u in range(c)]
    ts = [standardised(t, v) for v in range(c)]
    loss = 0.0
    for u in range(c):
        for v in range(c):
            m_uv = sum(zs[u][b] * ts[v][b] for b in range(n)) / n
            loss += (m_uv - 1.0) ** 2 if u == v else lam * (m_uv + 1.0) ** 2
    return loss


def test_cross_correlation_loss_matches_naive_double_loop():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(12, 5, generator=gen) * 3 + 1
    t = torch.randn(12, 5, generator=gen)
    got = float(cross_correlation_loss(z.double(), t.double()))
    assert got == pytest.approx(naive_loss(z, t), rel=1e-10)
    # float32 path used in training agrees too
    assert float(cross_correlation_loss(z, t)) == pytest.approx(naive_loss(z, t), rel=1e-5)
    # a different off-diagonal weight and eps
    assert float(cross_correlation_loss(z.double(), t.double(), 0.3, 0.5)) == pytest.approx(
        naive_loss(z, t, 0.3, 0.5), rel=1e-10)


def test_constant_column_is_finite_thanks_to_eps():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    t = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    z[:, 2] = 3.0  # a class the model never distinguishes: std 0
    t[:, 0] = -1.5
    z.requires_grad_(True)
    loss = cross_correlation_loss(z, t)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    assert float(loss.detach()) == pytest.approx(naive_loss(z.detach(), t), rel=1e-10)
    # the standardised constant column is exactly zero, so its diagonal entry contributes (0 - 1)^2
    assert torch.equal(standardize_columns(z.detach())[:, 2], torch.zeros(8, dtype=torch.float64))
    # without eps the same input is NaN (why eps exists)
    assert torch.isnan(cross_correlation_loss(z.detach(), t, eps=0.0))


def test_target_is_identity_with_minus_one_off_diagonal():
    c = 4
    target = 2 * torch.eye(c, dtype=torch.float64) - 1
    assert float(correlation_target_loss(target)) == 0.0
    # identity (off-diagonal 0) is NOT the target: each of the c(c-1) entries costs lam * (0 + 1)^2
    assert float(correlation_target_loss(torch.eye(c, dtype=torch.float64))) == pytest.approx(
        LAMBDA_OFF_DIAGONAL * c * (c - 1))
    # all ones: off-diagonal entries cost lam * 4 each, diagonal 0
    assert float(correlation_target_loss(torch.ones(c, c, dtype=torch.float64))) == pytest.approx(
        LAMBDA_OFF_DIAGONAL * 4 * c * (c - 1))
    # any single-entry perturbation of the target gives a positive loss
    for u in range(c):
        for v in range(c):
            m = target.clone()
            m[u, v] += 0.01
            assert float(correlation_target_loss(m)) > 0.0


def test_cross_correlation_matrix_of_identical_logits():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    m = cross_correlation_matrix(z, z, eps=0.0)
    # unbiased std: diagonal is (n-1)/n, off-diagonal the sample correlations times (n-1)/n
    assert torch.allclose(torch.diagonal(m), torch.full((3,), 9 / 10, dtype=torch.float64))
    corr = torch.from_numpy(np.corrcoef(z.numpy().T))
    assert torch.allclose(m, corr * 9 / 10)


def test_gradient_flows_only_into_the_student():
    z = torch.randn(6, 3, requires_grad=True)
    t = torch.randn(6, 3, requires_grad=True)
    cross_correlation_loss(z, t).backward()
    assert z.grad is not None and t.grad is None


def _kl(teacher, student):
    return float(kl_divergence(Categorical(logits=teacher), Categorical(logits=student)).mean())


def test_kl_terms_match_torch_distributions():
    gen = torch.Generator().manual_seed(3)
    s, p, f = (torch.randn(7, 10, generator=gen, dtype=torch.float64) for _ in range(3))
    y = torch.randint(0, 10, (7,), generator=gen)
    assert float(kl_to_teacher(s, p)) == pytest.approx(_kl(p, s), rel=1e-10)
    assert float(feddf_kl_loss(s, p)) == pytest.approx(_kl(p, s), rel=1e-10)
    ce = float(-Categorical(logits=s).log_prob(y).mean())
    loss, parts = fccl_local_loss(s, y, p, f, lambda_loc=0.7)
    assert float(loss) == pytest.approx(ce + 0.7 * (_kl(p, s) + _kl(f, s)), rel=1e-10)
    assert parts["kl-inter"] == pytest.approx(_kl(p, s)) and parts["kl-intra"] == pytest.approx(_kl(f, s))
    ce_only, parts = fccl_local_loss(s, y, None, None)
    assert float(ce_only) == pytest.approx(ce, rel=1e-10) and set(parts) == {"ce"}
    assert float(kl_to_teacher(s, s)) == pytest.approx(0.0, abs=1e-12)


def test_fedmd_l1_is_mean_absolute_difference():
    z = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    c = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert float(fedmd_l1_loss(z, c)) == pytest.approx((1 + 2 + 0.5 + 2) / 4)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="differ in shape"):
        cross_correlation_matrix(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="at least 2 rows"):
        standardize_columns(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="square"):
        correlation_target_loss(torch.zeros(2, 3))
