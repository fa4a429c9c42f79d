"""Distributed DP at the client level (pollen.privacy.distributed): the discrete Gaussian sampler against its
exact distribution, the clipped and rounded contribution against its stated bound, the ε of the ledger's
mechanism against dp-accounting used on its own, and the stated approximation's cost."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

from pollen.privacy import distributed as dd


@pytest.mark.parametrize("sigma", [0.8, 1.5, 6.3])
def test_the_discrete_gaussian_sampler_matches_its_exact_distribution(sigma):
    rng = np.random.default_rng(11)
    draws = dd.discrete_gaussian(rng, sigma, 200_000)
    support = np.arange(-int(8 * sigma) - 2, int(8 * sigma) + 3)
    pmf = np.exp(-support.astype(float) ** 2 / (2 * sigma ** 2))
    pmf /= pmf.sum()
    observed = np.array([(draws == y).sum() for y in support])
    expected = pmf * draws.size
    big = expected >= 5  # chi-square over the cells with enough mass, the tails pooled
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert obs.sum() == draws.size
    assert stats.chisquare(obs, exp).pvalue > 1e-4
    # the test has power: a rounded continuous Gaussian of a 10 % larger sigma is rejected
    wrong = np.rint(rng.normal(scale=1.1 * sigma, size=200_000)).astype(np.int64)
    wobs = np.array([(wrong == y).sum() for y in support])
    assert stats.chisquare(np.append(wobs[big], wrong.size - wobs[big].sum()), exp).pvalue < 1e-6


def test_a_contribution_is_clipped_rounded_within_its_bound_and_noised_by_its_share():
    plan = dd.DistributedPlan(clip=1.0, noise_multiplier=1.2, min_honest=8, step=1 / 1024)
    rng = np.random.default_rng(2)
    dim = 4096
    big = rng.normal(size=dim) * 50  # far outside the clip
    noiseless = np.rint(dd.clip_l2(big, plan.clip) / plan.step)
    assert np.linalg.norm(noiseless) <= plan.sensitivity(dim)
    noisy = plan.privatize(big, rng)
    noise = noisy - noiseless
    assert noise.std() == pytest.approx(plan.client_sigma(dim), rel=0.05)
    # h honest clients' shares make the sum's noise z·Δ
    assert math.sqrt(plan.min_honest) * plan.client_sigma(dim) == pytest.approx(plan.noise_multiplier
                                                                               * plan.sensitivity(dim))


def _independent_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """dp-accounting on its own: with every client sampled, ``rounds`` Gaussian rounds at z are one Gaussian at
    z / √rounds, and replacing a client moves it by twice the add/remove sensitivity (exact analytic
    Gaussian); Poisson-sampled, its PLD accountant under the replace-one relation."""
    if q >= 1:
        return dp_accounting.gaussian_mechanism.get_epsilon_gaussian(z / 2 / math.sqrt(rounds), delta)
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-3)
    sampled = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(sampled, rounds))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("z, q, rounds", [(1.1, 0.1, 50), (3.0, 1.0, 20), (0.9, 0.02, 500)])
def test_the_ledger_mechanism_equals_an_independent_accountant(z, q, rounds):
    """The ledger's ε of a distributed-DP run (Pollen's Release, client, replace-one) equals dp-accounting's
    own accountants on the same mechanism."""
    assert dd.epsilon(z, q, rounds, 1e-5) == pytest.approx(_independent_epsilon(z, q, rounds, 1e-5), rel=1e-9)


def test_replace_one_costs_what_twice_the_sensitivity_costs_under_add_remove():
    """The neighbour is real: with every client sampled, replacing one is the Gaussian mechanism at twice
    the sensitivity; 20 rounds at z compose to one Gaussian at z / (2 sqrt 20), whose ε dp-accounting's
    analytic Gaussian gives exactly; the RDP accountant's bound sits above."""
    exact = dp_accounting.gaussian_mechanism.get_epsilon_gaussian(3.0 / 2 / math.sqrt(20), 1e-5)
    assert dd.epsilon(3.0, 1.0, 20, 1e-5) == pytest.approx(exact, rel=2e-3)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0 / 2), 20))
    assert dd.epsilon(3.0, 1.0, 20, 1e-5) < rdp.get_epsilon(1e-5)


def test_calibration_reaches_the_target_from_below():
    z = dd.calibrate(4.0, 1e-5, 0.1, 100)
    assert dd.epsilon(z, 0.1, 100, 1e-5) <= 4.0 < dd.epsilon(z / 1.002, 0.1, 100, 1e-5)


def test_the_sum_of_discrete_gaussians_approximation_costs_nothing_measurable_at_pollens_scales():
    """The stated approximation (module docstring) costs τ·d of max-divergence per round: at the study's
    scales (σ_c of thousands of steps, a million coordinates, 100 honest clients) it underflows to 0; it is
    refused when a plan's noise is a fraction of a step, where it would matter; and a sum of h discrete
    Gaussians has the variance the accounting assumes."""
    plan = dd.DistributedPlan(clip=1.0, noise_multiplier=0.8, min_honest=100, step=2 * 8.0 / (1 << 22))
    assert plan.client_sigma(1_000_000) > 1000
    assert dd.sum_gap(plan.client_sigma(1_000_000), 100, 1_000_000) < 1e-300
    dd.check_plan(plan, 1_000_000)
    assert dd.sum_gap(0.3, 10, 1000) > dd.MAX_SUM_GAP
    with pytest.raises(ValueError, match="too small"):
        dd.check_plan(dd.DistributedPlan(clip=1.0, noise_multiplier=0.01, min_honest=10, step=1.0), 1000)
    rng = np.random.default_rng(5)
    total = sum(dd.discrete_gaussian(rng, 2.5, 100_000) for _ in range(8))
    assert total.var() == pytest.approx(8 * 2.5 ** 2, rel=0.02)


# --- the prototype contribution under distributed DP (pollen.secagg.payloads) -------------------------------

def test_a_prototype_contribution_is_within_its_clip_whatever_the_client_holds():
    """Σ a_c² = 1 (counts normalized in L2) and each prototype clipped to B, B² + β² = clip²: the contribution's
    norm is at most clip, for any counts and prototype lengths."""
    from pollen.secagg.payloads import prototype_contribution, prototype_split

    rng = np.random.default_rng(0)
    for d in (2, 50, 512):
        bound, beta = prototype_split(4.0, d)
        assert bound ** 2 + beta ** 2 == pytest.approx(16.0)
        for _ in range(20):
            counts = rng.integers(0, 500, size=10) * (rng.random(10) < 0.4)
            protos = rng.normal(size=(10, d)) * rng.choice([0.01, 1, 100], size=(10, 1))
            u, w = prototype_contribution(protos, counts, 4.0)
            assert np.sqrt((u ** 2).sum() + (w ** 2).sum()) <= 4.0 * (1 + 1e-12)
            assert not u[counts == 0].any() and not w[counts == 0].any()


def test_the_prototype_split_minimizes_the_estimates_error_bound():
    """The split is the minimum of σ² (d/B² + 1/β²) on B² + β² = clip² (prototype_split's docstring): a grid
    of other splits never does better."""
    from pollen.secagg.payloads import prototype_split

    for d in (1, 50, 512):
        bound, beta = prototype_split(1.0, d)
        best = d / bound ** 2 + 1 / beta ** 2
        for b in np.linspace(0.01, 0.99, 199):
            assert d / b ** 2 + 1 / (1 - b ** 2) >= best * (1 - 1e-12)


def test_without_noise_the_server_recovers_each_class_as_the_weighted_mean_and_drops_a_drowned_class():
    """Noise-free sums give each class Σ a_c p_c / Σ a_c exactly (a_c = n_c / |n|₂, prototypes inside B); with
    noise whose expected error exceeds PRESENCE_ERROR · B the class is absent instead of a random point."""
    from pollen.secagg.payloads import PRESENCE_ERROR, prototype_contribution, prototype_estimate, prototype_split

    rng = np.random.default_rng(1)
    d, clip = 8, 4.0
    bound, _ = prototype_split(clip, d)
    clients = [(rng.normal(size=(3, d)) * 0.1, np.array([5, 0, 9])), (rng.normal(size=(3, d)) * 0.1,
                                                                       np.array([1, 4, 0]))]
    parts = [prototype_contribution(p, n, clip) for p, n in clients]
    u, w = sum(p[0] for p in parts), sum(p[1] for p in parts)
    protos, present = prototype_estimate(u, w, 0.0, clip)
    assert present.tolist() == [True, True, True]
    for c in range(3):
        a = [n[c] / np.linalg.norm(n) for _, n in clients]
        want = sum(ai * p[c] for ai, (p, _) in zip(a, clients)) / sum(a)
        assert protos[c] == pytest.approx(want, rel=1e-12)
    weight = w / prototype_split(clip, d)[1]
    lightest = int(np.argmin(weight))
    # the noise at which the lightest class is just drowned, the others still present
    sigma = PRESENCE_ERROR * bound * weight[lightest] / np.sqrt(d + (bound / prototype_split(clip, d)[1]) ** 2)
    _, present = prototype_estimate(u, w, sigma * 1.01, clip)
    assert present.tolist() == [c != lightest for c in range(3)]
    _, present = prototype_estimate(u, w, sigma * 0.99, clip)
    assert present.all()
