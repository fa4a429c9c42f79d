"""SecAgg+ on the Message API (pollen.secagg), in process: real ClientApps with the mod on the in-process
grid, the real driver. The sum is checked against the plain sum of the clients' own integer parts
(exact, in the ring) and against Pollen's plain aggregation per family (within quantization); privacy is
checked by statistics that fail for a vector that is not masked and for shares that are enough."""

from __future__ import annotations

import numpy as np
import pytest
from Crypto.Protocol.SecretSharing import Shamir
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from scipy import stats

from pollen.protocol.prototypes import encode_prototype_reply
from pollen.protocol.records import reply_content
from pollen.protocol.secagg import (
    COLLECT,
    MASKED,
    SECAGG,
    SETUP,
    SHARE_KEYS,
    UNMASK,
    VECTOR,
    Collect,
    Refused,
    Setup,
    ShareKeys,
    Unmask,
    encode,
)
from pollen.secagg import SecAggConfig, SecAggFailed, SecAggPlus, client, crypto, mean_of_sums, payloads, secagg_mod
from pollen.secagg import field as ring
from pollen.strategies.aggregation import average_arrays
from pollen.strategies.prototypes import aggregate_prototypes
from pollen.testing import InProcessGrid, clientapp_node, set_task_identity

FIRST = 100


def _app(replies: dict[int, RecordDict]) -> ClientApp:
    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg, context):
        return Message(replies[context.node_id], reply_to=msg)

    return app


def _weights(n: int, seed: int = 0, scale: float = 1.0) -> dict[int, RecordDict]:
    rng = np.random.default_rng(seed)
    return {FIRST + i: reply_content({"w": (scale * rng.normal(size=(3, 4))).astype(np.float32),
                                      "b": rng.normal(size=5).astype(np.float32),
                                      "steps": np.array(int(rng.integers(0, 9)), dtype=np.int64)},
                                     int(rng.integers(1, 60)), {"train-loss": 0.25})
            for i in range(n)}


class Recorder:
    """Handlers around real ClientApp nodes: drop a node at a stage, keep every reply."""

    def __init__(self, app: ClientApp, n: int, drop: dict[str, set[int]] | None = None, run_config=None):
        self.nodes = {FIRST + i: clientapp_node(app, run_config or {}, i, n, node_id=FIRST + i) for i in range(n)}
        self.drop = drop or {}
        self.replies: list[tuple[str, int, Message]] = []

    def handler(self, node: int):
        def handle(msg: Message):
            stage = msg.content[SECAGG]["stage"] if SECAGG in msg.content else "plain"
            if node in self.drop.get(str(stage), set()):
                return None  # no reply before the timeout
            reply = self.nodes[node](msg)
            self.replies.append((str(stage), node, reply))
            return reply
        return handle

    def grid(self) -> InProcessGrid:
        return InProcessGrid({n: self.handler(n) for n in self.nodes})


def _instructions(nodes) -> dict[int, RecordDict]:
    return {n: RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"server-round": 1})}) for n in nodes}


def _expected_ints(replies: dict[int, RecordDict], nodes, cfg: SecAggConfig) -> tuple[payloads.Layout, np.ndarray]:
    setup = Setup("s", 2, 3, cfg.modulus_bits, cfg.clipping_range, cfg.levels, cfg.max_weight, cfg.kind, cfg.weighting)
    layouts, vectors = zip(*(client.parts_of(replies[n], setup) for n in sorted(nodes)))
    return layouts[0], np.sum(vectors, axis=0)


def _run(replies, cfg, drop=None, n=None):
    rec = Recorder(_app(replies), n or len(replies), drop)
    result = SecAggPlus(cfg).aggregate(rec.grid(), _instructions(rec.nodes), server_round=1)
    return result, rec


# --- the sum ----------------------------------------------------------------------------------------------

def test_secure_sum_equals_the_plain_sum_exactly_in_the_ring():
    replies = _weights(7)
    cfg = SecAggConfig(neighbours=4, kind="weights")  # a 4-regular graph, not the complete one
    result, _ = _run(replies, cfg)
    layout, ints = _expected_ints(replies, replies, cfg)
    assert result.survivors == sorted(replies) and not result.dropped and not result.refused
    assert result.layout == layout
    expected = payloads.unflatten(layout, ints, cfg.quantization())
    for name, value in expected.items():
        assert np.array_equal(result.sums[name], value), name


def test_weights_mean_within_quantization_of_pollens_weighted_mean():
    replies = _weights(6, seed=1)
    cfg = SecAggConfig(neighbours=16, clipping_range=4.0, levels=1 << 20)
    result, _ = _run(replies, cfg)
    mean = mean_of_sums("weights", result.sums)
    nodes = sorted(replies)
    arrays = [[replies[n]["arrays"][k].numpy() for k in ("b", "steps", "w")] for n in nodes]
    counts = [int(replies[n]["metrics"]["num-examples"]) for n in nodes]
    plain = average_arrays(arrays, counts)
    half_step = ring.step(cfg.clipping_range, cfg.levels) / 2
    np.testing.assert_allclose(mean["b"], plain[0], atol=half_step, rtol=0)
    np.testing.assert_allclose(mean["w"], plain[2], atol=half_step, rtol=0)
    assert abs(float(mean["steps"]) - float(plain[1])) < 0.5  # integers: the mean before Pollen's rounding
    assert int(result.sums["weight"]) == sum(counts)


def test_prototype_mean_within_quantization_of_pollens_prototype_aggregation():
    rng = np.random.default_rng(3)
    replies, protos, counts = {}, [], []
    for i in range(5):
        p = rng.normal(size=(4, 6)).astype(np.float32)
        c = rng.integers(0, 20, size=4).astype(np.int64)
        c[i % 4] = 0
        p[i % 4] = np.nan  # a class the client does not hold: its row is ignored, whatever it holds
        replies[FIRST + i] = encode_prototype_reply(p, c)
        protos.append(p), counts.append(c)
    for weighting in ("samples", "uniform"):
        cfg = SecAggConfig(neighbours=2, kind="prototypes", weighting=weighting, max_weight=1000)
        result, _ = _run(replies, cfg)
        secure = mean_of_sums("prototypes", result.sums)
        plain, present = aggregate_prototypes(protos, counts, weighting)
        assert np.array_equal(secure["class-weights"] > 0, present)
        np.testing.assert_allclose(secure["prototypes"], plain, atol=ring.step(8.0, cfg.levels) / 2, rtol=0)


def test_logit_mean_within_quantization_of_the_plain_mean():
    rng = np.random.default_rng(4)
    logits = {FIRST + i: rng.normal(scale=3, size=(10, 3)).astype(np.float32) for i in range(4)}
    replies = {n: reply_content({"logits": v}, 10) for n, v in logits.items()}
    cfg = SecAggConfig(kind="logits", weighting="uniform")
    result, _ = _run(replies, cfg)
    secure = mean_of_sums("logits", result.sums)
    np.testing.assert_allclose(secure["logits"], np.mean([v.astype(np.float64) for v in logits.values()], axis=0),
                               atol=ring.step(8.0, cfg.levels) / 2, rtol=0)
    assert int(result.sums["contributors"]) == 4


def test_a_sum_that_could_overflow_the_ring_is_refused_before_any_message():
    replies = _weights(3)
    rec = Recorder(_app(replies), 3)
    grid = rec.grid()
    with pytest.raises(SecAggFailed, match="does not fit a ring of 2\\^32"):
        SecAggPlus(SecAggConfig(modulus_bits=32, levels=1 << 22, max_weight=1000)).aggregate(
            grid, _instructions(rec.nodes))
    assert grid.sent == []


def test_the_train_handler_never_sees_the_stage_record_or_the_sessions_secrets():
    seen = []
    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg, context):
        seen.append((sorted(msg.content.keys()), sorted(context.state.keys())))
        return Message(reply_content({"w": np.ones(3, np.float32)}, 1), reply_to=msg)

    rec = Recorder(app, 3)
    SecAggPlus(SecAggConfig()).aggregate(rec.grid(), _instructions(rec.nodes))
    assert seen == [(["arrays", "config"], [])] * 3
    for stage, _, reply in rec.replies:
        if stage == COLLECT:  # the plain payload never leaves: metrics (no num-examples) + the masked vector
            assert sorted(reply.content.keys()) == sorted(["metrics", MASKED, SECAGG])
            assert "num-examples" not in reply.content["metrics"]
    assert all(client.STATE not in ctx_keys for _, ctx_keys in seen)


def test_keys_are_fresh_every_round():
    replies = _weights(3)
    rec = Recorder(_app(replies), 3)
    grid = rec.grid()
    driver = SecAggPlus(SecAggConfig())
    driver.aggregate(grid, _instructions(rec.nodes), server_round=1)
    driver.aggregate(grid, _instructions(rec.nodes), server_round=2)
    keys = [(r.content[SECAGG]["pk1"], r.content[SECAGG]["pk2"]) for s, _, r in rec.replies if s == SETUP]
    assert len(keys) == 6 and len({k for pair in keys for k in pair}) == 12


# --- privacy ----------------------------------------------------------------------------------------------

def _uniformity_p(values: np.ndarray, bits: int, bins: int = 256) -> float:
    counts = np.bincount((values.astype(np.uint64) >> np.uint64(bits - 8)).astype(np.int64), minlength=bins)
    return float(stats.chisquare(counts).pvalue)


def test_the_servers_view_of_one_masked_vector_is_indistinguishable_from_uniform():
    """One client's masked vector, for a maximally structured input (every value the same), passes a
    chi-square test of uniformity over the ring's top byte and shows no correlation with the input; the
    same test rejects the unmasked vector and a vector whose self mask alone was left off."""
    size = 1 << 16
    replies = {FIRST + i: reply_content({"x": np.full(size, 0.5 + i, dtype=np.float32)}, 1) for i in range(4)}
    cfg = SecAggConfig(kind="sum", weighting="uniform", modulus_bits=24, levels=1 << 8, clipping_range=8.0)
    result, rec = _run(replies, cfg)
    (masked,) = [r.content[MASKED][VECTOR].numpy() for s, n, r in rec.replies if s == COLLECT and n == FIRST]
    assert _uniformity_p(masked, 24) > 1e-4
    ramp = np.arange(size) % 256  # and no linear trace of a structured input either
    assert abs(stats.pearsonr(masked.astype(np.float64), ramp).statistic) < 5 / np.sqrt(size)
    plain = ring.to_ring(ring.quantize(np.full(size, 0.5), 8.0, 1 << 8), 24)
    assert _uniformity_p(plain, 24) < 1e-12
    assert np.array_equal(mean_of_sums("sum", result.sums)["x"], np.full(size, 0.5 * 4 + 6))


def test_flowers_mask_generator_is_not_used_because_its_seed_is_32_bits():
    """Why pollen.secagg.crypto.mask exists: Flower's pseudo_rand_gen folds the seed to 32 bits (two
    different seeds give the same mask) and never draws the ring's largest element."""
    a = bytes(range(32))
    b = bytes(a[4:8]) + bytes(a[:4]) + a[8:]  # the same XOR of its 4-byte words
    assert np.array_equal(pseudo_rand_gen(a, 4, [(10_000,)])[0], pseudo_rand_gen(b, 4, [(10_000,)])[0])
    assert pseudo_rand_gen(a, 4, [(10_000,)])[0].max() == 2
    assert not np.array_equal(crypto.mask(a, 10_000, 2), crypto.mask(b, 10_000, 2))
    assert crypto.mask(a, 10_000, 2).max() == 3


@pytest.mark.parametrize("bits", [20, 32, 64])
def test_masks_added_in_place_are_the_ring_sums_of_the_masks(bits):
    """crypto.Masker (one reused keystream buffer, additions in Z_2^64, the ring cut once) gives what
    mask() and the ring's own additions give, and taking each mask off again leaves the vector."""
    rng = np.random.default_rng(bits)
    seeds = [rng.bytes(32) for _ in range(4)]
    signs = [1, -1, 1, -1]
    start = ring.to_ring(rng.integers(-(1 << 19), 1 << 19, 1001), bits)
    expected = start.copy()
    for seed, sign in zip(seeds, signs):
        expected = (ring.add if sign > 0 else ring.sub)(expected, crypto.mask(seed, start.size, bits), bits)
    vector, masker = start.copy(), crypto.Masker(start.size)
    for seed, sign in zip(seeds, signs):
        masker.add(vector, seed, sign)
    assert np.array_equal(ring.reduce(vector.copy(), bits), expected)
    for seed, sign in zip(seeds, signs):
        masker.add(vector, seed, -sign)
    assert np.array_equal(ring.reduce(vector, bits), start)


def test_shares_below_the_threshold_reveal_nothing():
    """Perfect secrecy of t-of-n Shamir: t − 1 shares fit every secret equally well. (1) Completed by
    each possible value of one more share, they rebuild 2^8 distinct secrets — one per completion, so every
    secret stays possible; (2) the t − 1 shares of two different secrets are identically distributed
    (a chi-square test of the share bytes over 600 dealings of each); (3) the shares this module deals
    cannot be combined below the threshold."""
    t, n = 4, 6
    secret_a, secret_b = bytes(16), bytes([255]) * 16
    below = Shamir.split(t, n, secret_a, ssss=False)[: t - 1]
    completions = {Shamir.combine(below + [(n, bytes([v]) + bytes(15))], ssss=False) for v in range(256)}
    assert len(completions) == 256
    draws = {s: np.array([[b for _, share in Shamir.split(t, n, s, ssss=False)[: t - 1] for b in share]
                          for _ in range(600)]).ravel() for s in (secret_a, secret_b)}
    table = np.array([np.bincount(draws[s] >> 4, minlength=16) for s in (secret_a, secret_b)])
    assert stats.chi2_contingency(table).pvalue > 1e-4
    seed = bytes(range(32))
    shares = crypto.split_secret(seed, t, n)
    assert crypto.combine_secret(shares[:t]) == seed
    try:
        rebuilt = crypto.combine_secret(shares[: t - 1])
    except ValueError:  # Flower's combine refuses when the padding does not check out
        rebuilt = None
    assert rebuilt != seed


# --- dropouts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [SETUP, SHARE_KEYS, COLLECT, UNMASK])
def test_dropouts_up_to_n_minus_t_are_recovered_at_each_stage(stage):
    n = 7
    cfg = SecAggConfig(neighbours=6, threshold=0.6)  # complete graph, t = ceil(0.6 · 7) = 5: 2 may drop
    t = cfg.shares_needed(n)
    assert t == 5
    replies = _weights(n, seed=5)
    gone = {FIRST + 1, FIRST + 4}
    result, _ = _run(replies, cfg, drop={stage: gone})
    in_sum = set(replies) - gone if stage != UNMASK else set(replies)
    assert set(result.survivors) == in_sum
    assert result.dropped == ({} if stage == UNMASK else dict.fromkeys(gone, stage))
    layout, ints = _expected_ints(replies, in_sum, cfg)
    for name, value in payloads.unflatten(layout, ints, cfg.quantization()).items():
        assert np.array_equal(result.sums[name], value), name


@pytest.mark.parametrize("stage", [SETUP, SHARE_KEYS, COLLECT, UNMASK])
def test_more_than_n_minus_t_dropouts_fail_the_round_with_a_reason(stage):
    n = 7
    cfg = SecAggConfig(neighbours=6, threshold=0.6)
    with pytest.raises(SecAggFailed, match="threshold is 5") as err:
        _run(_weights(n), cfg, drop={stage: {FIRST + 1, FIRST + 4, FIRST + 6}})
    assert stage in str(err.value)


def test_dropouts_on_a_sparse_graph_are_recovered():
    n = 12
    cfg = SecAggConfig(neighbours=6, threshold=0.55)  # 6-regular, t = 4 of 7
    replies = _weights(n, seed=7)
    gone = {FIRST + 3}
    result, _ = _run(replies, cfg, drop={COLLECT: gone})
    layout, ints = _expected_ints(replies, set(replies) - gone, cfg)
    for name, value in payloads.unflatten(layout, ints, cfg.quantization()).items():
        assert np.array_equal(result.sums[name], value), name


# --- stage discipline: the client ---------------------------------------------------------------------------

def _node(app=None, run_config=None):
    set_task_identity()
    return clientapp_node(app or _app(_weights(1)), run_config or {}, 0, 1, node_id=FIRST)


def _msg(record, extra: RecordDict | None = None) -> Message:
    content = extra if extra is not None else RecordDict()
    content[SECAGG] = record
    return Message(content=content, dst_node_id=FIRST, message_type="train")


def _error(reply: Message) -> str:
    assert reply.has_error()
    return reply.error.reason


def test_a_stage_out_of_order_is_refused_by_the_client():
    node = _node()
    assert "without an open session" in _error(node(_msg(encode(Unmask("s", (FIRST,), ())))))
    setup = Setup("s", 2, 3, 32, 8.0, 1 << 10, 100, "weights", "samples")
    assert not node(_msg(encode(setup))).has_error()
    early = _msg(encode(Collect("s", (), ())), _weights(1)[FIRST])
    assert "'collect' where 'share-keys' was due" in _error(node(early))
    assert not node(_msg(encode(setup))).has_error()  # a new setup starts afresh
    assert "open session is 's'" in _error(node(_msg(encode(ShareKeys("other", (FIRST,), (b"k",), (b"k",))))))


def test_the_client_refuses_a_threshold_of_half_or_less_and_a_node_listed_both_alive_and_dropped():
    node = _node()
    weak = Setup("s", 2, 4, 32, 8.0, 1 << 10, 100, "weights", "samples")
    assert "more than half" in _error(node(_msg(encode(weak))))
    with pytest.raises(Refused, match="both survivors and dropped"):
        from pollen.protocol.secagg import decode_instruction

        decode_instruction(encode(Unmask("s", (1, 2), (2,))))


def test_a_node_whose_run_config_requires_secure_aggregation_refuses_a_plain_train_message():
    node = _node(run_config={"secure-aggregation": True})
    plain = Message(content=RecordDict({"arrays": ArrayRecord()}), dst_node_id=FIRST, message_type="train")
    assert "only through secure aggregation" in _error(node(plain))
    assert not _node()(plain).has_error()  # without the key the mod passes it through


def test_the_client_refuses_to_reveal_shares_it_does_not_hold_or_for_itself_as_dropped():
    session = client.Session(Setup("s", 2, 3, 32, 8.0, 1 << 10, 100, "weights", "samples"), 5, COLLECT,
                             b"", b"", b"", b"", sources=(6, 7), seed_shares={5: b"a", 6: b"b", 7: b"c"},
                             key_shares={5: b"x", 6: b"y", 7: b"z"})
    with pytest.raises(Refused, match="holds no shares of \\[9\\]"):
        client.reveal(session, Unmask("s", (5, 6), (9,)))
    with pytest.raises(Refused, match="listed as dropped"):
        client.reveal(session, Unmask("s", (6, 7), (5,)))
    assert client.reveal(session, Unmask("s", (5, 6), (7,))).shares == (b"a", b"b", b"z")


# --- stage discipline: the server ---------------------------------------------------------------------------

class Meddler(Recorder):
    """A Recorder whose chosen node answers one stage with something else."""

    def __init__(self, app, n, stage: str, node: int, tamper):
        super().__init__(app, n)
        self.stage, self.node, self.tamper = stage, node, tamper

    def handler(self, node: int):
        inner = super().handler(node)

        def handle(msg):
            stage = msg.content[SECAGG]["stage"]  # read first: the mod hands the train handler a plain message
            reply = inner(msg)
            if node == self.node and stage == self.stage:
                return self.tamper(msg, reply, self)
            return reply
        return handle


def _meddled(stage, tamper, n=5, cfg=None, node=FIRST + 2):
    replies = _weights(n, seed=9)
    cfg = cfg or SecAggConfig(neighbours=4, threshold=0.6)
    rec = Meddler(_app(replies), n, stage, node, tamper)
    grid = rec.grid()
    if tamper is _duplicate:
        orig = grid.send_and_receive

        def twice(messages, timeout=None):
            again = messages[0].content[SECAGG]["stage"] == stage
            out = orig(messages, timeout=timeout)
            return out + [r for r in out if again and r.metadata.src_node_id == node]
        grid.send_and_receive = twice
    result = SecAggPlus(cfg).aggregate(grid, _instructions(rec.nodes), server_round=1)
    return result, replies, cfg


def _duplicate(msg, reply, rec):
    return reply


def _stage_swap(msg, reply, rec):
    reply.content[SECAGG]["stage"] = SETUP
    return reply


def _short_vector(msg, reply, rec):
    vec = reply.content[MASKED][VECTOR].numpy()
    from flwr.app import Array

    reply.content[MASKED] = ArrayRecord({VECTOR: Array(vec[:-1])})
    return reply


def _wrong_layout(msg, reply, rec):
    reply.content[SECAGG]["layout-names"] = ["b", "steps", "v", "weight"]
    return reply


def _swapped_share(msg, reply, rec):
    shares = list(reply.content[SECAGG]["shares"])
    shares[0], shares[1] = shares[1], shares[0]
    reply.content[SECAGG]["shares"] = shares
    return reply


def _copied_key(msg, reply, rec):
    first = next(r for s, n, r in rec.replies if s == SETUP and n == FIRST)
    reply.content[SECAGG]["pk1"] = first.content[SECAGG]["pk1"]
    return reply


@pytest.mark.parametrize("stage, tamper, reason", [
    (SHARE_KEYS, _stage_swap, "a 'setup' record where stage 'share-keys' was asked for"),
    (COLLECT, _duplicate, "a second reply to one stage message"),
    (COLLECT, _short_vector, "as its layout says, got uint64"),
    (COLLECT, _wrong_layout, "contribution laid out as"),
    (SETUP, _copied_key, "repeat node"),
])
def test_a_bad_reply_is_refused_named_and_its_node_dropped_while_the_round_completes(stage, tamper, reason):
    result, replies, cfg = _meddled(stage, tamper)
    bad = FIRST + 2
    assert [r["node"] for r in result.refused] == [bad] and reason in result.refused[0]["reason"]
    assert result.refused[0]["stage"] == stage and result.dropped == {bad: stage}
    layout, ints = _expected_ints(replies, set(replies) - {bad}, cfg)
    for name, value in payloads.unflatten(layout, ints, cfg.quantization()).items():
        assert np.array_equal(result.sums[name], value), name


def _renumbered_share(msg, reply, rec):
    shares = list(reply.content[SECAGG]["shares"])
    shares[0] = (crypto.share_index(shares[0]) + 1).to_bytes(4, "little") + shares[0][4:]
    reply.content[SECAGG]["shares"] = shares
    return reply


@pytest.mark.parametrize("tamper, reason", [(_renumbered_share, "carries number"),
                                            (_swapped_share, "does not fit the others'")])
def test_a_bad_share_is_named_and_left_out_and_the_secrets_still_rebuild(tamper, reason):
    """A share with another holder's number is refused on sight; a well-formed share of the wrong value
    (two shares swapped) is found by rebuilding without it, checked against the owner's commitment."""
    result, replies, cfg = _meddled(UNMASK, tamper, cfg=SecAggConfig(neighbours=4, threshold=0.6))
    assert result.refused and all(r["node"] == FIRST + 2 and r["stage"] == UNMASK for r in result.refused)
    assert all(reason in r["reason"] for r in result.refused)
    layout, ints = _expected_ints(replies, set(replies), cfg)  # its own vector is in the sum
    for name, value in payloads.unflatten(layout, ints, cfg.quantization()).items():
        assert np.array_equal(result.sums[name], value), name


def test_a_reply_the_strategy_refuses_before_unmasking_is_taken_out_of_the_sum():
    """``vet`` sees each masked-input reply's clear part (its metrics) before anything is unmasked; a refused
    node's contribution leaves the sum exactly as a dropout's does."""
    replies = _weights(6, seed=8)
    cfg = SecAggConfig(neighbours=4, threshold=0.6)
    rec = Recorder(_app(replies), 6)
    seen = []

    def vet(replies):
        seen.extend(sorted(reply.content["metrics"].keys()) for reply in replies.values())
        return {FIRST + 3: "partition 3 is claimed by another node"}

    result = SecAggPlus(cfg).aggregate(rec.grid(), _instructions(rec.nodes), vet=vet)
    assert seen == [["train-loss"]] * 6
    assert result.refused == [{"node": FIRST + 3, "stage": COLLECT, "reason": "partition 3 is claimed by another node"}]
    layout, ints = _expected_ints(replies, set(replies) - {FIRST + 3}, cfg)
    for name, value in payloads.unflatten(layout, ints, cfg.quantization()).items():
        assert np.array_equal(result.sums[name], value), name


def test_a_reply_from_a_node_not_asked_is_refused():
    replies = _weights(4)
    rec = Recorder(_app(replies), 4)
    grid = rec.grid()
    orig = grid.send_and_receive

    def with_stranger(messages, timeout=None):
        out = orig(messages, timeout=timeout)
        stray = Message(RecordDict(), reply_to=messages[0])
        stray.metadata.__dict__["_src_node_id"] = 4242
        return out + [stray]
    grid.send_and_receive = with_stranger
    result = SecAggPlus(SecAggConfig()).aggregate(grid, _instructions(rec.nodes))
    assert {r["node"] for r in result.refused} == {4242}
    assert all("not sent to" in r["reason"] for r in result.refused)
    assert result.survivors == sorted(replies)
