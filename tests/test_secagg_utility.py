"""The secure-aggregation study's utility part (``bench/secagg_utility.py``): its cells, the noise arithmetic its
report sets the measured gap against (checked against the mechanism's own noise), and the accountant's cache
that makes 100-client in-process runs affordable (one PLD per round, not one per client)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import secagg_utility as u


def test_every_cell_names_its_family_population_and_arm_and_the_private_arms_their_assumptions():
    for cell in u.CELLS:
        family, clients, arm = u.parse_cell(cell)
        config = u.setting(cell)
        assert config["num-supernodes"] == clients and config["run-config"]["method"] == family
        keys = config["run-config"]
        if arm == "off":
            assert "secure-aggregation" not in keys and "dp-mode" not in keys
        else:
            assert keys["secure-aggregation"] is True
        if arm.startswith("distributed-eps"):
            assert keys["dp-mode"] == "distributed" and keys["dp-min-honest"] == clients // 2
            assert keys["dp-target-epsilon"] == float(arm.removeprefix("distributed-eps"))
            assert keys["dp-evaluate"] == "unprotected"
    assert u.parse_cell("fedavg-n500-distributed-eps8") == ("fedavg", 500, "distributed-eps8")
    for bad in ("fedavg-nX-off", "fedavg-n100", "fedprox-n100-off"):
        with pytest.raises(ValueError, match="unknown cell"):
            u.parse_cell(bad)


def test_the_reports_noise_on_the_mean_is_what_the_clients_shares_add_up_to():
    """N clients each add the discrete Gaussian share the mechanism gives them (dp-min-honest = N/2); the sum
    divided by m = q·N has, in units of dp-clip, the L2 norm the report's arithmetic states: exactly in σ (up to
    the rounding term √d/2 of Δ, 1e-3 here) and within sampling error when drawn."""
    from pollen.privacy.distributed import DistributedPlan, discrete_gaussian
    from pollen.secagg.field import step

    clients, q, dim, z, clip = 40, 0.1, 2000, 0.7, 1.0
    grid = step(8.0, 1 << 22)  # the run's default secure-sum grid
    plan = DistributedPlan(clip, z, clients // 2, grid)
    sigma_sum = plan.client_sigma(dim) * math.sqrt(clients) * grid  # value units, per coordinate
    stated = u.mean_noise_ratio(z, q * clients, dim)
    assert sigma_sum * math.sqrt(dim) / (q * clients) / clip == pytest.approx(stated, rel=1e-3)
    rng = np.random.default_rng(0)
    total = sum(discrete_gaussian(rng, plan.client_sigma(dim), dim) for _ in range(clients))
    drawn = float(np.linalg.norm(total * grid)) / (q * clients) / clip
    assert drawn == pytest.approx(stated, rel=0.05)


def test_the_accountant_composes_the_same_releases_once_per_process():
    """Every client of a simulation composes the same releases each round: the PLD is built once, and the cached
    figure is the one a fresh computation gives."""
    from pollen.privacy import accounting
    from pollen.privacy.accounting import Release, composed_epsilon

    releases = [Release(0.9, 0.1, 1, "client", "replace-one")] * 3
    accounting._composed_epsilon.cache_clear()
    first = composed_epsilon(releases, 1e-5)
    again = composed_epsilon(list(releases), 1e-5)  # another list of equal releases: a cache hit
    info = accounting._composed_epsilon.cache_info()
    assert (info.hits, info.misses) == (1, 1) and again == first
    accounting._composed_epsilon.cache_clear()
    assert composed_epsilon(iter(releases), 1e-5) == first  # recomputed from an iterator: the same figure


def test_the_kept_noise_multipliers_are_what_calibration_gives():
    """The reports read z from ``bench/results/secagg/noise-multipliers.json``: each unsampled figure, and the
    FedAvg study's sampled one at ε = 8, recomputed by the calibration a run uses."""
    from bench.kit import read_json
    from pollen.privacy.distributed import calibrate

    kept = read_json(u.NOISE_FILE, {})
    assert kept, "no kept noise multiplier: run python -m bench.secagg report"
    checked = 0
    for key, z in kept.items():
        fields = dict(part.split("=") for part in key.split())
        eps, delta, q, rounds = float(fields["eps"]), float(fields["delta"]), float(fields["q"]), int(fields["rounds"])
        if q == 1.0 or (eps, q, rounds) == (8.0, u.FEDAVG_Q, u.FEDAVG_ROUNDS):
            assert calibrate(eps, delta, q, rounds) == pytest.approx(z, rel=1e-12), key
            checked += 1
    assert checked >= 2
