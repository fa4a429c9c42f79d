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
        elif u.is_secure(arm):
            assert keys["secure-aggregation"] is True
        else:  # local DP: the server reads each noisy release, so the histogram audit stays on
            mode, _, eps = arm.partition("-eps")
            assert "secure-aggregation" not in keys and keys["leak-audit"] is True and family == "fedproto"
            assert keys["dp-mode"] == mode and keys["dp-target-epsilon"] == float(eps)
            assert keys["dp-evaluate"] == "unprotected"
        if arm.startswith("distributed-"):
            assert keys["dp-mode"] == "distributed" and keys["dp-min-honest"] == clients // 2
            assert keys["dp-evaluate"] == "unprotected"
            noise = {k: keys[k] for k in ("dp-target-epsilon", "dp-noise-multiplier") if k in keys}
            assert noise == ({"dp-target-epsilon": float(arm.removeprefix("distributed-eps"))}
                             if arm.startswith("distributed-eps")
                             else {"dp-noise-multiplier": float(arm.removeprefix("distributed-z"))})
    assert u.parse_cell("fedavg-n500-distributed-eps8") == ("fedavg", 500, "distributed-eps8")
    assert u.setting("fedavg-n100-distributed-z0.05")["run-config"]["dp-noise-multiplier"] == 0.05
    for bad in ("fedavg-nX-off", "fedavg-n100", "fedprox-n100-off"):
        with pytest.raises(ValueError, match="unknown cell"):
            u.parse_cell(bad)
    assert [u.epsilon_unit(a) for a in ("payload-eps8", "sample-eps2", "distributed-eps8")] == [
        "row given model", "record", "client"]
    for bad in ("fedavg-n100-distributed-eps", "fedavg-n100-distributed-zx", "fedavg-n100-distributed-q0.1",
                "fedavg-n100-dp-eps8", "fedavg-n100-payload-eps8", "fedproto100-sample-eps", "fedproto100-ldp-eps8"):
        with pytest.raises(ValueError, match="unknown arm"):
            u.setting(bad)


def _run(clients: int, arm: str, accuracy: float, seed: int = 0) -> dict:
    """A run file's record, as far as the FedAvg report reads it."""
    return {"family": "fedavg", "clients": clients, "arm": arm, "seed": seed, "wall-s": 1.0, "cpu-s": 1.0,
            "load-1min-at-start": 0.5,
            "evaluate": {"accuracy-client-mean": accuracy}, "fit": {"dp-epsilon": None if arm == "off" else 8.0}}


def test_each_fedavg_point_pairs_its_dp_run_with_the_no_dp_run_of_its_population_and_seed():
    """The gap, the lift kept and the noise on the mean come from the pair and the arithmetic, never from another
    population's or seed's no-DP run; a z arm's noise is its own z, an ε arm's the calibrated one."""
    dim = 21_840
    runs = [_run(100, "off", 0.80), _run(100, "distributed-eps8", 0.17), _run(100, "distributed-z0.05", 0.73),
            _run(500, "off", 0.50), _run(500, "distributed-eps8", 0.30), _run(500, "off", 0.9, seed=1)]
    points = u.fedavg_points(runs, dim)
    assert [(p["clients"], p["arm"]) for p in points] == [(100, "distributed-eps8"), (500, "distributed-eps8"),
                                                          (100, "distributed-z0.05")]  # most noise first
    eps8, n500, z = points
    z8 = u.noise_multiplier(8.0, u.FEDAVG_Q, u.FEDAVG_ROUNDS)
    assert eps8["z"] == z8 and z["z"] == 0.05 and z["target-epsilon"] is None
    assert eps8["noise-over-clip"] == pytest.approx(math.sqrt(2) * z8 * math.sqrt(dim) / 10)
    assert n500["noise-over-clip"] == pytest.approx(eps8["noise-over-clip"] / 5)  # m 50 against 10
    assert eps8["gap-points"] == pytest.approx(-63.0) and n500["gap-points"] == pytest.approx(-20.0)
    assert eps8["lift-kept"] == pytest.approx(0.1) and n500["lift-kept"] == pytest.approx(0.5)
    assert z["lift-kept"] == pytest.approx(0.9)
    # the computed line meets each measured point's noise at that point's m
    assert u.clients_for(8.0, n500["noise-over-clip"], dim) == pytest.approx(50)
    unpaired = u.fedavg_points([_run(250, "distributed-eps8", 0.2)], dim)[0]
    assert unpaired["gap-points"] is None and unpaired["lift-kept"] is None


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


def test_the_reading_names_the_noisiest_cell_that_kept_two_thirds_and_where_each_epsilon_reaches_it():
    dim = 21_840
    runs = [_run(100, "off", 0.80), _run(100, "distributed-eps8", 0.17), _run(100, "distributed-z0.05", 0.73),
            _run(500, "off", 0.50), _run(500, "distributed-eps8", 0.30)]
    points = u.fedavg_points(runs, dim)
    cells = u.fedavg_cells(points)
    text = u._reading(cells, dim)[1]
    assert cells[1]["lift-kept"] == pytest.approx(0.5)  # N = 500, ε 8: below two thirds; z 0.05 kept 90 %
    assert "the noisiest useful cell is 1.04 × clip (N = 100, z = 0.05, 90 % kept)" in text
    assert "more noise kept 50 % (2.38 ×), 10 % (11.91 ×)" in text
    assert f"{u.clients_for(8.0, cells[2]['noise-over-clip'], dim):,.0f} (N = " in text
    assert "no measured cell is" in u._reading(u.fedavg_cells(u.fedavg_points(runs[:2], dim)), dim)[1]
    assert u._seeds_said(points) == "one seed per cell (seed 0)"
    twice = u.fedavg_points(runs + [_run(100, "off", 0.8, seed=1), _run(100, "distributed-eps8", 0.1, seed=1)], dim)
    assert u._seeds_said(twice) == "seeds 0, 1 for N = 100 distributed-eps8, one seed elsewhere"
    # a cell's seeds together: the mean and the range of its seed-paired gaps and lifts
    eps8 = next(c for c in u.fedavg_cells(twice) if (c["clients"], c["arm"]) == (100, "distributed-eps8"))
    assert eps8["seeds"] == [0, 1] and eps8["gap-points"] == pytest.approx((-63 - 70) / 2)
    assert eps8["lift-range"] == pytest.approx((0.0, 0.1)) and eps8["lift-kept"] == pytest.approx(0.05)
    assert u.measured_rows([eps8], dim)[0][2:5] == ["0, 1", "-66.5 [-70.0, -63.0]", "5 % [0, 10]"]
