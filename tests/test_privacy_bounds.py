"""Bounds that follow the DP mechanism (issue 29 item 3): honest private replies, produced by the
client-side mechanisms of ``pollen.privacy``, pass the bound the server derives from the DP keys over
many seeds; a reply beyond it is refused with a reason naming the bound and the keys it came from;
with DP off nothing changes."""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from pollen.privacy import PayloadPrivacy, PrivacyConfig, calibrate_noise_multiplier, release_unit
from pollen.privacy.bounds import coordinate_bound, dp_bounds, norm_bound
from pollen.privacy.ledger import LedgerFile
from pollen.privacy.mechanisms import release_glfc, release_logits, release_prototypes, release_update
from pollen.privacy.sample import SamplePrivacy
from pollen.protocol.logits import encode_logit_reply
from pollen.protocol.prototypes import divide_release, encode_dp_prototype_reply, encode_prototype_reply
from pollen.protocol.screening import PayloadBounds
from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import LogitAveraging, PrototypeStrategy, WeightAveraging
from pollen.testing import InProcessGrid, set_task_identity
from tests.test_message_strategies import DIGEST, _record

SEEDS = 200


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


def fresh_ledger() -> LedgerFile:
    """A new node's ledger, in a folder of its own (removed with the test session's temporary files)."""
    return LedgerFile.in_folder(tempfile.mkdtemp(prefix="pollen-ledger-"))


def payload(clip=1.0, sigma=0.0, target=0.0, rounds=100) -> tuple[PrivacyConfig, int]:
    """The keys of a payload run; these tests release from one client far more often than the plan
    (one release per seed), so its cap (by default the target ε) is lifted."""
    return PrivacyConfig("payload", clip, sigma, target, 1e-5, 1e9 if target else 0.0), rounds


def client(config: PrivacyConfig, rounds: int, kind: str = "weights") -> PayloadPrivacy:
    return PayloadPrivacy(config, rounds, fresh_ledger(), "partition 0", kind)


def bounds_for(config: PrivacyConfig, rounds: int, kind: str):
    """The server's bounds for releases of ``kind``: σ calibrated for what they protect, as the clients do."""
    return dp_bounds(config, rounds, unit=release_unit(kind, config.mode))


def pair(config: PrivacyConfig, rounds: int, kind: str):
    return bounds_for(config, rounds, kind), client(config, rounds, kind)


# -- the keys, the tail bounds, DP off ---------------------------------------------------------------------
def test_dp_off_derives_no_bound_and_the_declared_bounds_stand():
    off = PrivacyConfig("off", 1.0, 0.0, 0.0, 1e-5, 0.0)
    assert dp_bounds(off, 100) is None
    declared = PayloadBounds(5.0, 6.0, 7.0)
    assert declared.declared() is declared and declared.dp is None
    # sample mode: the models carry no noise of their own, so their declared bounds stay
    sample = dp_bounds(PrivacyConfig("sample", 1.0, 1.0, 0.0, 1e-5, 0.0), 100)
    assert sample is not None and not sample.bounds_models
    assert PayloadBounds(5.0, 6.0, 7.0, sample).declared().max_update_norm == 5.0


def test_sigma_is_the_one_the_clients_use():
    """A target ε is met under what the releases protect: a client's dataset under replace-one (weights,
    logits, GLFC), one embedding row under add/remove (prototypes), so σ differs by family."""
    config, rounds = payload(target=4.0, rounds=50)
    bounds = bounds_for(config, rounds, "weights")
    assert bounds.noise_multiplier == client(config, rounds, "weights").noise_multiplier
    assert bounds.noise_multiplier == calibrate_noise_multiplier(4.0, 1e-5, 50, neighbour="replace-one")
    assert "dp-target-epsilon 4 over 50 releases" in bounds.source and "dp-clip 1" in bounds.source
    assert "replace-one client" in bounds.source
    rows = bounds_for(config, rounds, "prototypes")
    assert rows.noise_multiplier == client(config, rounds, "prototypes").noise_multiplier
    assert rows.noise_multiplier == calibrate_noise_multiplier(4.0, 1e-5, 50) < bounds.noise_multiplier
    assert "from dp-noise-multiplier" in dp_bounds(*payload(sigma=0.7)).source
    # under payload the declared model/logit/gradient bounds give way to the DP bound
    assert PayloadBounds(dp=bounds).declared().max_update_norm > 1e300


def test_tail_bounds_against_hand_computed_values():
    # one coordinate: count·2·exp(−k²/2) = p
    k = coordinate_bound(1.0, 10, 1e-9)
    assert math.isclose(10 * 2 * math.exp(-k * k / 2), 1e-9)
    assert coordinate_bound(3.0, 10, 1e-9) == 3 * k
    # a vector: std·(√d + t), count·exp(−t²/2) = p
    t = norm_bound(1.0, 0, 4, 1e-9)
    assert math.isclose(4 * math.exp(-t * t / 2), 1e-9)
    assert math.isclose(norm_bound(2.0, 100, 4, 1e-9), 2 * (10 + t))
    # the bound is a bound: 20,000 draws of a 50-dimensional Gaussian never pass the 1e-3 level's norm
    draws = np.linalg.norm(np.random.default_rng(0).normal(0.0, 2.0, size=(20_000, 50)), axis=1)
    assert draws.max() <= norm_bound(2.0, 50, 1, 1e-3)


# -- weights -----------------------------------------------------------------------------------------------
BROADCAST = [np.linspace(-1, 1, 600, dtype=np.float32).reshape(20, 30), np.zeros(40, np.float32),
             np.array(3, np.int64)]


def _trained(rng) -> list[np.ndarray]:
    return [b + rng.normal(0, 0.5, b.shape).astype(np.float32) if b.dtype.kind == "f" else b + 1 for b in BROADCAST]


def _named(state):
    return {str(i): a for i, a in enumerate(state)}


def test_honest_noisy_weight_updates_pass_and_a_scaled_one_is_refused():
    config, rounds = payload(clip=2.0, sigma=0.05)
    bounds, privacy = pair(config, rounds, "weights")
    broadcast = _named(BROADCAST)
    worst = 0.0
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        reply, _ = privacy.update(broadcast, _named(_trained(rng)), rng)
        assert bounds.check_update(reply, broadcast) is None
        worst = max(worst, float(np.linalg.norm(np.concatenate([(reply[k].astype(np.float64) - broadcast[k]).ravel()
                                                                for k in ("0", "1")]))))
    limit = bounds.update_limit(640, float(np.linalg.norm(BROADCAST[0])), 0.05 * 2.0)
    assert worst > 0.8 * limit  # the bound is near what honest replies reach, not vacuous
    # the update of an honest reply scaled by 1.5: beyond the clipped update plus the noise
    rng = np.random.default_rng(0)
    reply, _ = privacy.update(broadcast, _named(_trained(rng)), rng)
    assert bounds.check_update(reply, broadcast) is None
    scaled = {k: (broadcast[k] + 1.5 * (a - broadcast[k]) if a.dtype.kind == "f" else a)
              for k, a in reply.items()}
    reason = bounds.check_update(scaled, broadcast)
    assert reason is not None and "above the DP bound" in reason
    assert "dp-clip 2" in reason and "σ 0.05 from dp-noise-multiplier" in reason


def _dp_weights_node(pid, config, rounds, scale=1.0, sent=None):
    privacy = client(config, rounds)

    def handle(msg):
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        rng = np.random.default_rng(pid)
        trained = dict(zip(got, _trained(rng)))
        released, metrics = privacy.update(got, trained, rng)
        reply = {k: got[k] + scale * (r - got[k]) if got[k].dtype.kind == "f" else r for k, r in released.items()}
        if sent is not None and msg.metadata.message_type == "train":
            sent[pid] = reply
        return encode_weights_reply(reply, 1, {"partition-id": pid, **metrics})
    return handle


def test_the_weight_strategy_refuses_a_reply_beyond_the_dp_bound():
    config, rounds = payload(clip=2.0, sigma=0.05)
    state = {"w": BROADCAST[0], "b": BROADCAST[1], "steps": BROADCAST[2]}
    sent: dict = {}
    grid = InProcessGrid({11: _dp_weights_node(0, config, rounds, sent=sent),
                          12: _dp_weights_node(1, config, rounds, sent=sent),
                          13: _dp_weights_node(2, config, rounds, scale=1.5)})
    strategy = WeightAveraging(min_available_nodes=3, weighting="uniform",
                               bounds=PayloadBounds(dp=bounds_for(config, rounds, "weights")))
    result = strategy.start(grid=grid, initial_arrays=_record(state), num_rounds=1)
    assert strategy.reports[1].accepted == 2
    (rejected,) = [r for r in strategy.reports[1].rejected if r["stage"] == "train"]
    assert rejected["client"] == "partition 2" and "above the DP bound" in rejected["reason"]
    for key in ("w", "b"):  # the new global model is the mean of the two honest releases
        np.testing.assert_allclose(result.arrays[key].numpy(), (sent[0][key] + sent[1][key]) / 2, rtol=1e-6)
    # without DP the declared max-update-norm (relative, 1e4) admits that reply
    loose = WeightAveraging(min_available_nodes=3, weighting="uniform")
    loose.start(grid=grid, initial_arrays=_record(state), num_rounds=1)
    assert loose.reports[1].accepted == 3


# -- logits ------------------------------------------------------------------------------------------------
def test_honest_noisy_logits_pass_and_a_scaled_matrix_is_refused():
    config, rounds = payload(clip=5.0, target=8.0)
    bounds, privacy = pair(config, rounds, "logits")
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        released, _ = privacy.logits(rng.normal(0, 4.0, size=(64, 10)), rng)
        assert released.dtype == np.float32 and bounds.check_logits(released) is None
    rng = np.random.default_rng(0)
    released, _ = privacy.logits(rng.normal(0, 4.0, size=(64, 10)), rng)
    reason = bounds.check_logits(1.5 * released)
    assert reason is not None and "logit matrix norm" in reason and "above the DP bound" in reason
    assert "calibrated for dp-target-epsilon 8 over 100 releases" in reason and "N0 = 64" in reason
    hot = released.copy()
    hot[3] = 8000.0 / np.sqrt(10)  # one row of norm 8000 (honest ones ≈ 1,500): the matrix norm stays inside
    assert bounds.check_logits(hot).startswith("logit row norm")


def test_the_logit_strategy_refuses_logits_beyond_the_dp_bound():
    config, rounds = payload(clip=1.0, sigma=0.5)
    privacy = client(config, rounds, "logits")
    rng = np.random.default_rng(1)
    honest, _ = privacy.logits(rng.normal(size=(5, 3)), rng)

    def node(pid, logits):
        def handle(msg):
            if msg.metadata.message_type == "evaluate":
                return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.4, "partition-id": pid})})
            return encode_logit_reply(logits, 1, {"partition-id": pid, "public-digest": DIGEST})
        return handle

    grid = InProcessGrid({11: node(0, honest), 12: node(1, 10.0 * honest)})
    strategy = LogitAveraging(num_public=5, num_classes=3, min_available_nodes=2,
                              bounds=PayloadBounds(dp=bounds_for(config, rounds, "logits")))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    assert strategy.reports[1].accepted == 1
    (rejected,) = [r for r in strategy.reports[1].rejected if r["stage"] == "train"]
    assert rejected["client"] == "partition 1" and "logit matrix norm" in rejected["reason"]
    np.testing.assert_allclose(strategy.consensus, honest, rtol=1e-6)  # the consensus is the honest release


# -- GLFC --------------------------------------------------------------------------------------------------
def test_honest_noisy_glfc_replies_pass_and_a_scaled_gradient_set_is_refused():
    config, rounds = payload(clip=1.0, sigma=0.02)
    bounds, privacy = pair(config, rounds, "glfc")
    lenet = [(6, 3, 5, 5), (6,), (12, 6, 5, 5), (12,)]
    for seed in range(SEEDS // 4):
        rng = np.random.default_rng(seed)
        grads = [{str(j): rng.normal(0, 1.0, s).astype(np.float32) for j, s in enumerate(lenet)} for _ in range(3)]
        state, named, _ = privacy.glfc(_named(BROADCAST), _named(_trained(rng)), grads, 4, rng)
        assert bounds.check_glfc(state, _named(BROADCAST), named, 4) is None
    named[1] = {k: 1.5 * g for k, g in named[1].items()}
    reason = bounds.check_glfc(state, _named(BROADCAST), named, 4)
    assert reason is not None and reason.startswith("gradient set g1 norm") and "K = 4" in reason
    assert "dp-noise-multiplier" in reason
    moved = {k: (a + 0.5 if a.dtype.kind == "f" else a) for k, a in state.items()}  # ‖Δ‖ ≈ 0.5·√640
    assert "update norm" in bounds.check_glfc(moved, _named(BROADCAST), named[:1], 4)


# -- prototypes --------------------------------------------------------------------------------------------
def _release(privacy, rng, n=100, classes=10, dim=16):
    labels = rng.integers(0, 3, size=n)
    released, _ = privacy.prototypes(rng.normal(0, 2.0, size=(n, dim)), labels, classes, rng)
    return released


def test_honest_noisy_prototype_releases_pass_and_beyond_the_bound_is_refused():
    config, rounds = payload(clip=1.0, target=2.0)
    bounds, privacy = pair(config, rounds, "prototypes")
    for seed in range(SEEDS):
        r = _release(privacy, np.random.default_rng(seed))
        sums, counts = r.sums.astype(np.float32), r.counts.astype(np.float32)  # as they travel
        assert bounds.check_prototypes(sums, counts, float(np.float32(r.count_std)), 100) is None
    std = bounds.count_std
    reason = bounds.check_prototypes(sums * 0 + 100 + 8 * std, counts, r.count_std, 100)
    assert "prototype sum magnitude" in reason and "max count 100" in reason and "dp-target-epsilon 2" in reason
    reason = bounds.check_prototypes(sums, counts - counts + 101 + 9 * std, r.count_std, 100)
    assert reason.startswith("noisy count") and "outside the DP bound" in reason
    reason = bounds.check_prototypes(sums, counts, 10 * r.count_std, 100)  # a client that claims more noise
    assert "'count-noise-std'" in reason


def test_sample_mode_bounds_the_prototype_release_it_makes_after_dp_training():
    config = PrivacyConfig("sample", 1.0, 1.2, 0.0, 1e-5, 0.0)
    bounds = dp_bounds(config, 20)
    privacy = SamplePrivacy(config, 20, fresh_ledger(), "partition 0", num_records=100, batch_size=10, epochs=1,
                            prototypes=True)
    for seed in range(SEEDS // 4):
        rng = np.random.default_rng(seed)
        r = privacy.prototypes(rng.normal(size=(100, 8)), rng.integers(0, 4, size=100), 4, rng)
        assert bounds.check_prototypes(r.sums, r.counts, r.count_std, 100) is None


def test_sample_mode_with_a_target_epsilon_sizes_the_bound_by_the_declared_std_above_a_floor():
    """σ then depends on each client's record count: the clients' own σ is at or above the floor, and
    their honest releases pass; a declared std below the floor is refused."""
    config = PrivacyConfig("sample", 1.0, 0.0, 4.0, 1e-5, 0.0)
    bounds = dp_bounds(config, 20)
    assert bounds.sigma_is_floor and bounds.noise_multiplier == calibrate_noise_multiplier(4.0, 1e-5, 20)
    assert "σ >= " in bounds.source
    for n, batch in ((100, 10), (40, 40), (1000, 16)):
        privacy = SamplePrivacy(config, 20, fresh_ledger(), "partition 0", num_records=n, batch_size=batch, epochs=2,
                                prototypes=True)
        assert privacy.noise_multiplier >= bounds.noise_multiplier
        for seed in range(10):
            rng = np.random.default_rng(seed)
            r = privacy.prototypes(rng.normal(size=(n, 8)), rng.integers(0, 4, size=n), 4, rng)
            assert bounds.check_prototypes(r.sums, r.counts, r.count_std, n) is None
    assert "below the DP floor" in bounds.check_prototypes(r.sums, r.counts, 0.5 * bounds.count_std, n)
    beyond = np.full_like(r.sums, n + 20 * r.count_std)  # clip·n plus 20 stds of the declared noise
    assert "prototype sum magnitude" in bounds.check_prototypes(beyond, r.counts, r.count_std, n)


def test_the_prototype_strategy_refuses_releases_beyond_the_dp_bound():
    config, rounds = payload(clip=1.0, sigma=1.0)
    privacy = client(config, rounds, "prototypes")

    def node(pid, scale=1.0, std_scale=1.0):
        def handle(msg):
            if msg.metadata.message_type == "evaluate":
                return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.9, "partition-id": pid})})
            r = _release(privacy, np.random.default_rng(pid), n=50, classes=4, dim=3)
            return encode_dp_prototype_reply(scale * r.sums, r.counts, std_scale * r.count_std, {"partition-id": pid},
                                             num_examples=50)
        return handle

    def plain(pid):  # exact prototypes and counts: no release at all
        def handle(msg):
            if msg.metadata.message_type == "evaluate":
                return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.9, "partition-id": pid})})
            return encode_prototype_reply(np.ones((4, 3), np.float32), np.array([5, 0, 0, 1]), {"partition-id": pid})
        return handle

    grid = InProcessGrid({11: node(0), 12: node(1, scale=100.0), 13: node(2, std_scale=2.0), 14: plain(3)})
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, min_available_nodes=4, max_examples=50,
                                 bounds=PayloadBounds(dp=bounds_for(config, rounds, "prototypes")))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    assert strategy.reports[1].accepted == 1
    reasons = {r["client"]: r["reason"] for r in strategy.reports[1].rejected if r["stage"] == "train"}
    assert "prototype sum magnitude" in reasons["partition 1"] and "count-noise-std" in reasons["partition 2"]
    assert "must carry the noisy release 'proto-sums'" in reasons["partition 3"]
    # the global prototypes are partition 0's release, divided: the classes it holds, nothing else
    r = _release(client(config, rounds, "prototypes"), np.random.default_rng(0), n=50, classes=4, dim=3)
    protos, weights = divide_release(r.sums.astype(np.float32), r.counts.astype(np.float32),
                                     float(np.float32(r.count_std)))
    assert strategy.present.tolist() == (weights > 0).tolist() and weights.any()
    np.testing.assert_allclose(strategy.protos[weights > 0], protos[weights > 0], rtol=1e-5)



# -- what a norm alone misses: coordinates, the noise floor, rows tied to counts ----------------------------
def test_a_noise_free_update_concentrated_on_a_few_coordinates_is_refused():
    """d = 1e5 entries, σ = dp-clip = 1: an update of 320 × the clip on 10 coordinates, without noise,
    has a norm inside the norm bound (the noise of 1e5 entries is ≈ 316 long), yet no honest reply has a
    coordinate near 101: refused per coordinate (with honest noise added, by its norm too). A clipped update without
    its noise is refused by the noise floor."""
    config, rounds = payload(clip=1.0, sigma=1.0)
    bounds = bounds_for(config, rounds, "weights")
    d = 100_000
    broadcast = {"w": np.zeros(d, np.float32)}
    crafted = np.zeros(d)
    crafted[:10] = 320.0 / np.sqrt(10)
    assert np.linalg.norm(crafted) < bounds.update_limit(d, 0.0, 1.0)  # the norm alone lets it through
    reason = bounds.check_update({"w": crafted.astype(np.float32)}, broadcast)
    assert reason.startswith("update coordinate 101.") and "above the DP bound" in reason, reason
    noisy = crafted + np.random.default_rng(0).normal(0.0, 1.0, d)
    assert "above the DP bound" in bounds.check_update({"w": noisy.astype(np.float32)}, broadcast)
    honest, _ = client(config, rounds).update(broadcast, {"w": np.full(d, 0.01, np.float32)},
                                              np.random.default_rng(1))
    assert bounds.check_update(honest, broadcast) is None
    clipped_only = {"w": np.full(d, 1.0 / np.sqrt(d), np.float32)}  # ‖·‖ = the clip, no noise
    reason = bounds.check_update(clipped_only, broadcast)
    assert "below the DP noise floor" in reason and "not a release" in reason, reason


def test_prototype_rows_are_bounded_by_their_counts_and_must_carry_their_noise():
    config, rounds = payload(clip=1.0, sigma=1.0)
    bounds, privacy = pair(config, rounds, "prototypes")
    r = _release(privacy, np.random.default_rng(0), n=100, classes=10, dim=16)  # classes 0–2 held
    assert bounds.check_prototypes(r.sums, r.counts, r.count_std, 100) is None
    # an unheld class (noisy count ≈ 0) with a sum row of norm 30: within every per-coordinate bound of
    # max count 100, beyond what its count allows
    row = r.sums.copy()
    row[7] = 30.0 / 4.0
    reason = bounds.check_prototypes(row, r.counts, r.count_std, 100)
    assert reason.startswith("prototype sum") and "of class 7" in reason and "count bound" in reason, reason
    exact = np.zeros_like(r.sums)  # the counts' noise kept, the sums' noise left out
    reason = bounds.check_prototypes(exact, r.counts, r.count_std, 100)
    assert "below the DP noise floor" in reason


def test_a_declared_count_noise_is_capped_by_what_the_server_computes():
    """``sample`` with a target ε: the server knows the DP-SGD plan but not the record count n; the released
    counts bound n, and the σ a client would calibrate for a plan with the rate of the smallest plausible n
    and the steps of the largest is at least any honest client's. Honest clients of very different sizes
    pass; one declaring 100 × its noise is refused, and at n = 1,000 one declaring 1.5 × as well. Measured
    cap / honest std: 2.3–3.5 at n = 10 (the counts' noise is as large as n: they cannot pin it down),
    1.016–1.020 at n = 1,000 (q = 0.016; the cap was 11.5 × when it ignored the subsampling)."""
    config = PrivacyConfig("sample", 1.0, 0.0, 4.0, 1e-5, 0.0)
    bounds = dp_bounds(config, 20, sgd_epochs=2, sgd_batch=16)
    for n, loosest in ((10, 5.0), (17, 5.0), (100, 5.0), (1000, 1.05)):
        privacy = SamplePrivacy(config, 20, fresh_ledger(), "partition 0", num_records=n, batch_size=16, epochs=2,
                                prototypes=True)
        rng = np.random.default_rng(n)
        r = privacy.prototypes(rng.normal(size=(n, 8)), rng.integers(0, 4, size=n), 4, rng)
        assert bounds.check_prototypes(r.sums, r.counts, r.count_std, 10_000) is None
        cap = bounds.count_std_cap(r.counts, r.count_std, 10_000, 1e-9 / 6)
        assert r.count_std <= cap < loosest * r.count_std, (n, r.count_std, cap)
        reason = bounds.check_prototypes(r.sums, r.counts, 100 * r.count_std, 10_000)  # the cap grows with it
        assert "'count-noise-std'" in reason and "is above" in reason, reason
    reason = bounds.check_prototypes(r.sums, r.counts, 1.5 * r.count_std, 10_000)
    assert "'count-noise-std'" in reason and "is above" in reason, reason


def test_the_count_noise_cap_refuses_no_honest_client_over_1000_seeds():
    """1,000 noise draws each at n = 10 and n = 1,000 (the cap's loosest and tightest sizes above): every
    honest count noise std is at or below the cap (0 refused; the cap's own failure probability is
    1e-9 / 6), and at n = 1,000 the cap stays within 2.5 % of the honest std."""
    config = PrivacyConfig("sample", 1.0, 0.0, 4.0, 1e-5, 0.0)
    bounds = dp_bounds(config, 20, sgd_epochs=2, sgd_batch=16)
    for n in (10, 1000):
        privacy = SamplePrivacy(config, 20, fresh_ledger(), "partition 0", num_records=n, batch_size=16, epochs=2,
                                prototypes=True)
        rng = np.random.default_rng(n)
        features, labels = rng.normal(size=(n, 8)), rng.integers(0, 4, size=n)
        ratios = []
        for seed in range(HONEST_SEEDS):
            r = privacy.prototypes(features, labels, 4, np.random.default_rng([n, seed]))
            ratios.append(bounds.count_std_cap(r.counts, r.count_std, 10_000, 1e-9 / 6) / r.count_std)
        assert min(ratios) >= 1.0, (n, min(ratios))
        if n == 1000:
            assert max(ratios) < 1.025, max(ratios)


HONEST_SEEDS = 1000
LENET = [(6, 3, 5, 5), (6,), (12, 6, 5, 5), (12,)]


@functools.cache
def _family(kind: str, clip: float, sigma: float = 0.0, target: float = 0.0):
    """The server's bounds and the client's own σ for one family's payload keys."""
    config, rounds = payload(clip=clip, sigma=sigma, target=target)
    return bounds_for(config, rounds, kind), client(config, rounds, kind).noise_multiplier


def _honest_weights(rng):
    bounds, sigma = _family("weights", 2.0, sigma=0.05)
    broadcast = _named(BROADCAST)
    released, _ = release_update(_named(_trained(rng)[:2]), _named(BROADCAST[:2]), 2.0, sigma, rng)
    reply = {**broadcast, **{k: a.astype(np.float32) for k, a in released.items()}}
    return bounds.check_update(reply, broadcast)


def _honest_logits(rng):
    bounds, sigma = _family("logits", 5.0, target=8.0)
    released, _ = release_logits(rng.normal(0, 4.0, size=(64, 10)), 5.0, sigma, rng)
    return bounds.check_logits(released.astype(np.float32))


def _honest_glfc(rng):
    bounds, sigma = _family("glfc", 1.0, sigma=0.02)
    grads = [{str(j): rng.normal(0, 1.0, sh).astype(np.float32) for j, sh in enumerate(LENET)}
             for _ in range(rng.integers(0, 5))]
    floats = _named(BROADCAST[:2])
    model, sets = release_glfc(_named(_trained(rng)[:2]), floats, grads, 4, 1.0, sigma, rng)
    reply = {**_named(BROADCAST), **{k: a.astype(np.float32) for k, a in model.items()}}
    sets = [{k: g.astype(np.float32) for k, g in one.items()} for one in sets]
    return bounds.check_glfc(reply, _named(BROADCAST), sets, 4)


def _honest_prototypes(rng):
    bounds, sigma = _family("prototypes", 1.0, target=2.0)
    r = release_prototypes(rng.normal(0, 2.0, size=(100, 16)), rng.integers(0, 3, size=100), 10, 1.0, sigma, rng)
    return bounds.check_prototypes(
        r.sums.astype(np.float32), r.counts.astype(np.float32), float(np.float32(r.count_std)), 100)


SAMPLE_TARGET = PrivacyConfig("sample", 1.0, 0.0, 4.0, 1e-5, 0.0)


@functools.cache
def _sample_sigma(n: int) -> float:
    return SamplePrivacy(SAMPLE_TARGET, 20, fresh_ledger(), "p", num_records=n, batch_size=10, epochs=1,
                         prototypes=True).noise_multiplier


def _honest_sample_prototypes(rng):
    """Clients of 12 or 300 records, σ each calibrated for its own DP-SGD plan (1 epoch, batch 10)."""
    n = int(rng.choice([12, 300]))
    sigma = _sample_sigma(n)
    r = release_prototypes(rng.normal(0, 2.0, size=(n, 8)), rng.integers(0, 4, size=n), 4, 1.0, sigma, rng)
    return dp_bounds(SAMPLE_TARGET, 20, sgd_epochs=1, sgd_batch=10).check_prototypes(r.sums, r.counts, r.count_std, 1000)


@pytest.mark.parametrize("check", [_honest_weights, _honest_logits, _honest_glfc, _honest_prototypes,
                                   _honest_sample_prototypes], ids=lambda f: f.__name__.removeprefix("_honest_"))
def test_honest_noisy_replies_are_never_refused_over_1000_seeds(check):
    """The clients' own mechanisms at the clients' own σ, 1,000 seeds per family: 0 refused (the bound
    allows 1e-9 a reply, every check together)."""
    reasons = [check(np.random.default_rng(10_000 + seed)) for seed in range(HONEST_SEEDS)]
    refused = [r for r in reasons if r is not None]
    assert not refused, f"{len(refused)} of {HONEST_SEEDS} honest replies refused, e.g. {refused[0]}"


# -- the run config to the strategy ------------------------------------------------------------------------
UCI = {"task": "uci-dirichlet", "max-train-samples": 48, "batch-size": 8, "fraction-evaluate": 0.0}


def test_strategy_options_carry_the_dp_bound_of_the_run_keys_and_none_without_dp():
    from pollen.app.config import parse_run_config
    from pollen.app.registry import strategy_options

    assert strategy_options(parse_run_config({"method": "fedavg", **UCI}))["bounds"].dp is None
    rc = {"method": "fedavg", **UCI, "dp-mode": "payload", "avg-weighting": "uniform", "dp-clip": 0.5,
          "dp-target-epsilon": 4.0, "num-server-rounds": 7}
    dp = strategy_options(parse_run_config(rc))["bounds"].dp
    assert dp.clip == 0.5 and dp.noise_multiplier == calibrate_noise_multiplier(4.0, 1e-5, 7, neighbour="replace-one")


def test_a_payload_fedavg_run_accepts_every_honest_client(tmp_path):
    """The ServerApp and three real ClientApps in this process: the weights the clients release under
    dp-mode = payload all pass the bound the server derives; the declared max-update-norm, set here far
    below the noise's norm, would refuse every one of them, and under DP gives way."""
    import json

    from flwr.app import Context

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import clientapp_node

    rc = {"method": "fedavg", **UCI, "dp-mode": "payload", "avg-weighting": "uniform", "dp-clip": 1.0,
          "dp-noise-multiplier": 3.0, "num-server-rounds": 1, "max-update-norm": 0.01,
          "out-dir": str(tmp_path / "runs"), "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / f"p{p}")) for p in range(3)}
    server_main(InProcessGrid(nodes), Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    records = [json.loads(line) for line in (tmp_path / "runs" / "9" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accepted"] for r in records] == [3]


def test_the_glfc_strategy_refuses_a_gradient_set_beyond_the_dp_bound():
    from tests.test_glfc_strategy import _configure, _grad_set, _reply, _strategy, identity_grid

    config, rounds = payload(clip=1.0, sigma=0.01)
    privacy = client(config, rounds, "glfc")
    strat = _strategy(clients_per_round=10, bounds=PayloadBounds(dp=bounds_for(config, rounds, "glfc")))
    msgs = _configure(strat, 1, identity_grid(5))
    names = list(strat.lenet_shapes)

    def released(msg, pid, scale=1.0):
        broadcast = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        rng = np.random.default_rng(pid)
        trained = {k: b + rng.normal(0, 0.01, b.shape).astype(b.dtype) if b.dtype.kind == "f" else b
                   for k, b in broadcast.items()}
        grads = [{n: _grad_set(strat)[n] for n in names}]
        state, sets, _ = privacy.glfc(broadcast, trained, grads, strat.schedule.classes_per_task, rng)
        grad_sets = [{n: scale * g for n, g in gs.items()} for gs in sets]
        return _reply(msg, pid, grad_sets, state=state, transition=1)

    honest = released(msgs[0], 0)
    model, metrics = strat.aggregate_train(1, [honest, released(msgs[1], 1, scale=2.0)])
    (rejected,) = strat.take_round_report(1).rejected
    assert rejected["client"] == "partition 1" and rejected["reason"].startswith("gradient set g0 norm")
    assert "K = 5" in rejected["reason"] and "dp-noise-multiplier" in rejected["reason"]
    assert metrics["accepted"] == 1
    for key, array in honest.content["arrays"].items():  # the new global model is the honest release
        if array.numpy().dtype.kind == "f":
            np.testing.assert_allclose(model[key].numpy(), array.numpy(), rtol=1e-6)


def test_a_payload_fedmd_run_accepts_every_honest_client(data_root, tmp_path):
    """Four real ClientApps release noisy logits (std σ·clip·√N0 ≈ 0.95 per entry); the DP bound the
    server derives admits them all, where the declared max-logit-abs set here (0.5) would refuse each."""
    import json

    from flwr.app import Context

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import clientapp_node
    from tests.test_privacy_clients import TINY_FCCL

    rc = {**TINY_FCCL, "method": "fedmd", "data-root": data_root, "dp-mode": "payload", "dp-noise-multiplier": 1.5,
          "dp-clip": 0.1, "max-logit-abs": 0.5, "num-server-rounds": 1, "out-dir": str(tmp_path / "runs"),
          "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 4, state_dir=str(tmp_path / f"p{p}")) for p in range(4)}
    server_main(InProcessGrid(nodes), Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    records = [json.loads(line) for line in (tmp_path / "runs" / "9" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accepted"] for r in records] == [4]


# -- a private model run that will drown in its own noise is told so -----------------------------------------
def test_the_noise_warning_compares_the_averaged_noise_with_the_model_by_hand():
    bounds = dp_bounds(*payload(clip=1.0, sigma=2.0))
    model = {"w": np.full(100, 0.5, np.float32), "steps": np.array(7, np.int64)}  # norm 5, 100 float entries
    # noise of the average of k releases: σ·clip·√(d/k) = 2·√(100/4) = 10 > 5
    warning = bounds.model_noise_warning(model, clients=4)
    assert warning is not None and "≈ 10 " in warning and "norm 5" in warning and "d = 100 float entries" in warning
    assert "k = 4 clients" in warning and "lower dp-noise-multiplier" in warning
    assert bounds.model_noise_warning(model, clients=16) is None  # 2·√(100/16) = 5: not above the model
    sample = dp_bounds(PrivacyConfig("sample", 1.0, 2.0, 0.0, 1e-5, 0.0), 100)
    assert sample.model_noise_warning(model, clients=1) is None  # DP-SGD models carry no release noise


def test_a_fedavg_run_drowned_in_noise_is_warned_before_round_1_and_its_clients_name_the_noise(caplog):
    """The warning depends only on the keys, the initial model and k, so it is certain; when a round does
    diverge (the noise comes from the OS, so when is not: forced here by a learning rate that overflows
    in round 1) the client's error names the noise as well as the learning rate."""
    from pollen.strategies import NoTrainingError
    from pollen.testing import run_inprocess

    rc = {"method": "fedavg", "num-server-rounds": 3, "local-epochs": 1, "fraction-evaluate": 0.0, "dp-mode": "payload",
          "dp-clip": 0.5, "dp-noise-multiplier": 1.5, "avg-weighting": "uniform", "torch-threads": 1}
    assert len(run_inprocess(rc, stop_after=1, echo=False)) == 1  # round 1 trains the clean initial model
    warnings = [r.getMessage() for r in caplog.records if "averaged model gets noise" in r.getMessage()]
    assert len(warnings) == 1 and "k = 3 clients a round" in warnings[0] and "σ 1.5, dp-clip 0.5" in warnings[0]
    caplog.clear()
    quiet = {**rc, "dp-noise-multiplier": 0.05}  # averaged noise well below the model's norm
    assert len(run_inprocess(quiet, stop_after=1, echo=False)) == 1
    assert not [r for r in caplog.records if "averaged model gets noise" in r.getMessage()]
    caplog.clear()
    with contextlib.suppress(NoTrainingError):  # however many clients diverge, each one says why
        run_inprocess({**quiet, "dp-noise-multiplier": 1e-6, "lr": 10.0, "momentum": 0.99}, echo=False)
    errors = [r.getMessage() for r in caplog.records if "training loss became nan" in r.getMessage()]
    assert errors and all("under dp-mode = payload" in e and "lower dp-noise-multiplier" in e for e in errors)
