"""Pollen's strategies on a SecureGrid (pollen.secagg.grid): the same strategy, the same clients, once in clear
and once through SecAgg+; per family the secure aggregate equals the plain one within quantization. Then
the run keys: refused combinations before anything starts, and whole in-process runs of the app."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from pollen.app.config import parse_run_config
from pollen.protocol.logits import encode_logit_reply
from pollen.protocol.prototypes import encode_prototype_reply
from pollen.protocol.weights import encode_weights_reply
from pollen.secagg import SecAggConfig, secagg_mod
from pollen.secagg import field as ring
from pollen.secagg.grid import DROPPED_CODE, SecureGrid
from pollen.settings import ConfigError
from pollen.strategies import LogitAveraging, PrototypeStrategy, WeightAveraging
from pollen.testing import InProcessGrid, clientapp_node, run_inprocess

FIRST, N = 100, 5
HALF_STEP = ring.step(8.0, 1 << 22) / 2


def _grid(reply_of, offline: set[int] = frozenset(), stage_of_drop: str = "collect") -> InProcessGrid:
    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg, context):
        return Message(reply_of(context.node_id - FIRST, msg), reply_to=msg)

    nodes = {FIRST + i: clientapp_node(app, {}, i, N, node_id=FIRST + i) for i in range(N)}

    def handler(node):
        def handle(msg):
            stage = msg.content["secagg"]["stage"] if "secagg" in msg.content else "plain"
            if node in offline and stage in (stage_of_drop, "plain"):
                return None
            return nodes[node](msg)
        return handle

    return InProcessGrid({n: handler(n) for n in nodes})


def _one_round(strategy_factory, reply_of, secure: SecAggConfig | None, initial: ArrayRecord,
               offline: set[int] = frozenset()):
    strategy = strategy_factory()
    grid = _grid(reply_of, offline)
    used = SecureGrid(grid, secure) if secure is not None else grid
    messages = strategy.configure_train(1, initial, ConfigRecord({}), used)
    arrays, metrics = strategy.aggregate_train(1, used.send_and_receive(messages, timeout=None))
    return strategy, arrays, metrics


def _weights_reply(pid: int, msg: Message):
    rng = np.random.default_rng(pid)
    return encode_weights_reply({"w": rng.normal(size=(4, 3)).astype(np.float32),
                                 "steps": np.array(3 + pid, dtype=np.int64)}, 20 + 7 * pid,
                                {"partition-id": pid, "train-loss": 0.1 * pid})


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_weight_averaging_securely_equals_its_plain_mean_within_quantization(weighting):
    initial = ArrayRecord({"w": Array(np.zeros((4, 3), np.float32)), "steps": Array(np.array(0, dtype=np.int64))})

    def make():
        return WeightAveraging(weighting=weighting, fraction_evaluate=0.0, min_available_nodes=N)

    _, plain, plain_metrics = _one_round(make, _weights_reply, None, initial)
    strategy, secure, metrics = _one_round(make, _weights_reply, SecAggConfig(kind="weights", weighting=weighting),
                                           initial)
    np.testing.assert_allclose(secure["w"].numpy(), plain["w"].numpy(), atol=HALF_STEP, rtol=0)
    assert secure["steps"].numpy() == plain["steps"].numpy() and secure["w"].numpy().dtype == np.float32
    assert metrics["accepted"] == N and metrics["failures"] == 0
    # the clients' loss is averaged unweighted: num-examples never left the sum
    assert metrics["train-loss"] == pytest.approx(np.mean([0.1 * p for p in range(N)]))
    assert sorted(strategy.reports[1].fit_clients) == [f"partition {p}" for p in range(N)]


def _proto_reply(pid: int, msg: Message):
    rng = np.random.default_rng(10 + pid)
    counts = rng.integers(1, 30, size=4).astype(np.int64)
    counts[pid % 4] = 0
    return encode_prototype_reply(rng.normal(size=(4, 6)).astype(np.float32), counts, {"partition-id": pid})


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_prototype_strategy_securely_aggregates_as_fedproto_does_within_quantization(weighting):
    def make():
        return PrototypeStrategy(num_classes=4, embed_dim=6, weighting=weighting, fraction_evaluate=0.0,
                                 min_available_nodes=N)

    plain_strategy, _, _ = _one_round(make, _proto_reply, None, ArrayRecord())
    secure_strategy, _, metrics = _one_round(make, _proto_reply, SecAggConfig(kind="prototypes", weighting=weighting,
                                                                              max_weight=1000), ArrayRecord())
    plain_state, secure_state = plain_strategy.state()[0], secure_strategy.state()[0]
    assert set(plain_state) == set(secure_state)
    for key in plain_state:
        np.testing.assert_allclose(secure_state[key], plain_state[key], atol=HALF_STEP, rtol=0, err_msg=key)
    assert metrics["accepted"] == N


def test_logit_averaging_securely_equals_the_plain_consensus_within_quantization():
    def reply(pid, msg):
        logits = np.random.default_rng(20 + pid).normal(scale=2, size=(6, 3)).astype(np.float32)
        return encode_logit_reply(logits, 6, {"partition-id": pid}, public_digest=1234)

    def make():
        return LogitAveraging(num_public=6, num_classes=3, fraction_evaluate=0.0, min_available_nodes=N)

    _, plain, _ = _one_round(make, reply, None, ArrayRecord())
    _, secure, metrics = _one_round(make, reply, SecAggConfig(kind="logits", weighting="uniform"), ArrayRecord())
    assert set(plain) == set(secure)
    for key in plain:
        np.testing.assert_allclose(secure[key].numpy(), plain[key].numpy(), atol=HALF_STEP, rtol=0, err_msg=key)
    assert metrics["accepted"] == N


def test_a_node_that_drops_out_mid_round_is_a_failure_naming_the_stage_and_the_rest_is_averaged():
    initial = ArrayRecord({"w": Array(np.zeros((4, 3), np.float32)), "steps": Array(np.array(0, dtype=np.int64))})

    def make():
        return WeightAveraging(fraction_evaluate=0.0, min_available_nodes=N)

    gone = {FIRST + 2}
    _, plain, _ = _one_round(make, _weights_reply, None, initial, offline=gone)
    strategy, secure, metrics = _one_round(make, _weights_reply, SecAggConfig(kind="weights"), initial, offline=gone)
    np.testing.assert_allclose(secure["w"].numpy(), plain["w"].numpy(), atol=HALF_STEP, rtol=0)
    assert metrics["accepted"] == N - 1 and metrics["failures"] == 1
    (failure,) = strategy.reports[1].failures
    assert failure["code"] == DROPPED_CODE and "no reply at stage 'collect'" in failure["reason"]


def test_an_impostor_claiming_anothers_partition_is_taken_out_before_unmasking():
    initial = ArrayRecord({"w": Array(np.zeros((4, 3), np.float32)), "steps": Array(np.array(0, dtype=np.int64))})

    def impostor(pid, msg):
        return _weights_reply(1 if pid == 3 else pid, msg)  # node 3 says it serves partition 1

    def honest_only(pid, msg):
        return _weights_reply(pid, msg)

    def make():
        return WeightAveraging(fraction_evaluate=0.0, min_available_nodes=N)

    strategy, secure, metrics = _one_round(make, impostor, SecAggConfig(kind="weights"), initial)
    _, without, _ = _one_round(make, honest_only, None, initial, offline={FIRST + 1, FIRST + 3})
    np.testing.assert_allclose(secure["w"].numpy(), without["w"].numpy(), atol=HALF_STEP, rtol=0)
    reasons = [f["reason"] for f in strategy.reports[1].failures]
    assert len(reasons) == 2 and all("partition 1 is also claimed" in r for r in reasons)


@pytest.mark.parametrize("raw, match", [
    ({"secure-aggregation": True, "aggregation": "median"}, "needs aggregation = 'mean'"),
    ({"secure-aggregation": True, "method": "local"}, "not available for method 'local'"),
    ({"secure-aggregation": True, "method": "glfc", "task": "uci-digits-cil"}, "proto-gradient|prototype-gradient"),
    ({"secure-aggregation": True, "dp-mode": "payload", "dp-noise-multiplier": 1.0}, "dp-mode = 'payload'"),
    ({"secagg-neighbours": 4}, "no effect with secure-aggregation = false"),
    ({"secure-aggregation": True, "method": "fccl", "task": "digits-offline", "fccl-average-weights": True},
     "the models would travel in clear"),
    ({"secure-aggregation": True, "secagg-threshold": 0.5}, "secagg-threshold"),
])
def test_refused_before_anything_starts(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(raw)


@pytest.mark.parametrize("method", ["fedavg", "fedproto"])
def test_a_whole_run_of_the_app_under_secure_aggregation_learns_as_the_plain_run(method):
    """Real ClientApps (Pollen's, with the mod), real training: under secure aggregation the evaluated
    accuracies of a 2-round run equal the plain run's (quantization error 1e-6 changes no prediction here)."""
    base = {"method": method, "num-server-rounds": 2, "seed": 0}
    plain = run_inprocess(base, 4, echo=False)
    secure = run_inprocess({**base, "secure-aggregation": True}, 4, echo=False)
    for a, b in zip(plain, secure):
        assert b["fit"]["accepted"] == 4 and b["failures"] == 0
        assert {k: v for k, v in a["evaluate"].items() if "accuracy" in k} == \
               {k: v for k, v in b["evaluate"].items() if "accuracy" in k}


# --- distributed DP (dp-mode = distributed) --------------------------------------------------------------

def _dp_privacy(tmp_path, node: int, z: float = 1.5, h: int = 3, clip: float = 1.0):
    from pollen.privacy.config import PrivacyConfig
    from pollen.privacy.distributed import DistributedPrivacy
    from pollen.privacy.ledger import LedgerFile

    config = PrivacyConfig("distributed", clip, z, 0.0, 1e-5, 0.0)
    return DistributedPrivacy(config, 10, h, LedgerFile.in_folder(tmp_path / f"node-{node}"), f"node {node}")


def test_the_noise_of_a_distributed_dp_sum_is_what_the_ledger_accounts(tmp_path):
    """Six clients each add their share (σ_c = z Δ / √h) to zero logits under SecAgg+: the server's sum carries
    noise of std √6 σ_c steps, the mean nothing else; each client's ledger holds one client-level,
    replace-one release whose ε is dp-accounting's for that mechanism."""
    from pollen.privacy.distributed import epsilon
    from pollen.privacy.ledger import LedgerFile
    from pollen.secagg import SecAggPlus
    from pollen.secagg.client import SecAggMod
    from pollen.secagg.payloads import dp_layout
    from tests.test_privacy_distributed import _independent_epsilon

    n, shape, z, h = 6, (40, 50), 1.5, 3
    privacies = {FIRST + i: _dp_privacy(tmp_path, FIRST + i, z, h) for i in range(n)}

    def factory(context, setup, size):
        return privacies[context.node_id].take_part(2 * setup.clipping_range / setup.levels, size)

    app = ClientApp(mods=[SecAggMod(privatizer=factory)])

    @app.train()
    def train(msg, context):
        return Message(encode_logit_reply(np.zeros(shape, np.float32), 1, public_digest=1), reply_to=msg)

    grid = InProcessGrid({FIRST + i: clientapp_node(app, {}, i, n, node_id=FIRST + i) for i in range(n)})
    cfg = SecAggConfig(kind="logits", weighting="uniform", clip_dp=1.0, noise_multiplier_dp=z, min_honest_dp=h,
                       dp_shape=shape)
    content = {node: RecordDict({"config": ConfigRecord({"server-round": 1})}) for node in grid.handlers}
    result = SecAggPlus(cfg).aggregate(grid, content, layout=dp_layout("logits", None, shape))
    step = ring.step(cfg.clipping_range, cfg.levels)
    sigma_c = privacies[FIRST].plan_sigma(step, int(np.prod(shape)))
    noise = result.sums["logits"].ravel() / step
    assert noise.std() == pytest.approx(np.sqrt(n) * sigma_c, rel=0.05)
    assert abs(noise.mean()) < 5 * np.sqrt(n) * sigma_c / np.sqrt(noise.size)
    for node in grid.handlers:
        (release,) = LedgerFile.in_folder(tmp_path / f"node-{node}").releases()
        assert (release.unit, release.neighbour, release.noise_multiplier) == ("client", "replace-one", z)
    assert epsilon(z, 1.0, 1, 1e-5) == pytest.approx(_independent_epsilon(z, 1.0, 1, 1e-5), rel=1e-8)


def test_a_client_refuses_a_server_that_asks_for_less_noise_than_its_own_run_config(tmp_path):
    privacy = _dp_privacy(tmp_path, 1, z=1.5, h=3, clip=1.0)
    assert privacy.refusal(1.0, 1.5, 3) is None
    for asked in [(2.0, 1.5, 3), (1.0, 1.0, 3), (1.0, 1.5, 5)]:
        assert "refuses" in privacy.refusal(*asked)


def test_a_round_with_fewer_survivors_than_dp_min_honest_is_not_unmasked():
    from pollen.secagg import SecAggFailed, SecAggPlus

    grid = _grid(_weights_reply, offline={FIRST + 1, FIRST + 2})
    cfg = SecAggConfig(kind="weights", threshold=0.55, min_honest_dp=4)
    instructions = {n: RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"server-round": 1})})
                    for n in grid.handlers}
    with pytest.raises(SecAggFailed, match="fewer than dp-min-honest = 4"):
        SecAggPlus(cfg).aggregate(grid, instructions)


@pytest.mark.parametrize("raw, match", [
    ({"dp-mode": "distributed", "dp-min-honest": 3, "dp-noise-multiplier": 1.0}, "needs secure-aggregation = true"),
    ({"secure-aggregation": True, "dp-mode": "distributed", "dp-noise-multiplier": 1.0}, "go together"),
    ({"secure-aggregation": True, "dp-min-honest": 3}, "go together"),
])
def test_distributed_dp_is_refused_before_start_without_what_it_needs(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config({"method": "fedproto", **raw})


def test_a_whole_distributed_dp_run_reports_the_epsilon_an_independent_accountant_gives():
    from tests.test_privacy_distributed import _independent_epsilon

    z = 0.8
    rounds = run_inprocess({"method": "fedproto", "num-server-rounds": 2, "seed": 0, "secure-aggregation": True,
                            "dp-mode": "distributed", "dp-min-honest": 3, "dp-noise-multiplier": z,
                            "fraction-evaluate": 0.0}, 4, echo=False)
    for r in rounds:
        assert r["fit"]["accepted"] == 4 and r["failures"] == 0
        assert r["fit"]["dp-epsilon"] == pytest.approx(_independent_epsilon(z, 1.0, r["round"], 1e-5), rel=1e-8)


def test_pollens_client_keeps_its_distributed_dp_ledger_beside_its_state_and_refuses_less_noise(tmp_path):
    """A simulation node has no 'state-dir' key: the ledger goes where the app keeps the node's state (the run
    folder's nodes/partition-i), before the reply leaves; a server asking for less noise is refused."""
    from flwr.app import Context

    from pollen.app.client_app import distributed_privatizer
    from pollen.protocol.secagg import Refused, Setup

    run_config = {"method": "fedproto", "secure-aggregation": True, "dp-mode": "distributed", "dp-min-honest": 3,
                  "dp-noise-multiplier": 1.2, "fraction-evaluate": 0.0, "out-dir": str(tmp_path)}
    context = Context(run_id=7, node_id=1, node_config={"partition-id": 2, "num-partitions": 4}, state=RecordDict(),
                      run_config=run_config)
    setup = Setup("s", 3, 4, 64, 8.0, 1 << 22, 1000, "prototypes", "samples", 1.0, 1.2, 3)
    sampled, privatize, metrics = distributed_privatizer(context, setup, 20)
    (ledger,) = list(tmp_path.rglob("dp-ledger.json"))
    assert sampled and ledger.parent.name == "partition-2" and metrics["dp-epsilon"] > 0
    assert privatize(np.zeros(20)).dtype == np.int64
    with pytest.raises(Refused, match="refuses"):
        distributed_privatizer(context, Setup("s", 3, 4, 64, 8.0, 1 << 22, 1000, "prototypes", "samples", 1.0, 0.5, 3),
                               20)


# --- distributed DP with Poisson sampling: each client's own secret draw ------------------------------------

def test_under_poisson_sampling_an_unsampled_client_never_trains_and_adds_only_its_noise(tmp_path):
    """q = 0.5: each client draws in secret whether it contributes. Those not drawn never call the train
    handler and add zeros plus their noise share, so the sum is the drawn clients' clipped logits plus the
    noise; every client appends one release at q = 0.5 (sampled or not) and reports dp-sampling in clear,
    and no drawn client's training metrics travel in clear (they would tell it apart)."""
    import random

    from pollen.privacy.config import PrivacyConfig
    from pollen.privacy.distributed import DistributedPrivacy
    from pollen.privacy.ledger import LedgerFile
    from pollen.secagg import SecAggPlus
    from pollen.secagg.client import SecAggMod
    from pollen.secagg.payloads import dp_layout

    n, shape, z, h, q = 6, (4, 5), 1.5, 3, 0.5
    config = PrivacyConfig("distributed", 1.0, z, 0.0, 1e-5, 0.0)
    privacies = {FIRST + i: DistributedPrivacy(config, 10, h, LedgerFile.in_folder(tmp_path / f"node-{i}"),
                                               f"node {i}", sampling=q, rng=random.Random(i)) for i in range(n)}
    drawn = {FIRST + i for i in range(n) if random.Random(i).random() < q}  # the same draws, replayed
    assert 0 < len(drawn) < n
    trained: list[int] = []
    inputs: dict[int, np.ndarray] = {}
    outputs: dict[int, np.ndarray] = {}

    def factory(context, setup, size):
        sampled, privatize, metrics = privacies[context.node_id].take_part(2 * setup.clipping_range / setup.levels,
                                                                           size)

        def recorded(vector):
            inputs[context.node_id] = np.array(vector)
            outputs[context.node_id] = privatize(vector)
            return outputs[context.node_id]
        return sampled, recorded, metrics

    app = ClientApp(mods=[SecAggMod(privatizer=factory)])

    @app.train()
    def train(msg, context):
        trained.append(context.node_id)
        value = 0.02 * (context.node_id - FIRST + 1)  # L2 norm 0.09 (i + 1) <= clip 1: not clipped
        return Message(encode_logit_reply(np.full(shape, value, np.float32), 1, {"train-loss": value},
                                          public_digest=1), reply_to=msg)

    grid = InProcessGrid({FIRST + i: clientapp_node(app, {}, i, n, node_id=FIRST + i) for i in range(n)})
    cfg = SecAggConfig(kind="logits", weighting="uniform", clip_dp=1.0, noise_multiplier_dp=z, min_honest_dp=h,
                       sampling_dp=q, dp_shape=shape)
    content = {node: RecordDict({"config": ConfigRecord({"server-round": 1})}) for node in grid.handlers}
    result = SecAggPlus(cfg).aggregate(grid, content, layout=dp_layout("logits", None, shape))
    assert sorted(trained) == sorted(drawn) and sorted(inputs) == sorted(grid.handlers)
    for node, vector in inputs.items():  # what each client privatized: its logits if drawn, else zeros
        value = 0.02 * (node - FIRST + 1) if node in drawn else 0.0
        assert vector == pytest.approx(np.full(vector.size, value, np.float64), abs=1e-7)
    step = ring.step(cfg.clipping_range, cfg.levels)
    assert np.array_equal(np.rint(result.sums["logits"].ravel() / step).astype(np.int64), sum(outputs.values()))
    for node, reply in result.replies.items():
        metrics = reply.content["metrics"]
        assert metrics["dp-sampling"] == q and "train-loss" not in metrics
        (release,) = LedgerFile.in_folder(tmp_path / f"node-{node - FIRST}").releases()
        assert release.sampling_probability == q


def test_a_client_refuses_a_server_that_states_another_sampling_probability(tmp_path):
    import random

    from pollen.privacy.config import PrivacyConfig
    from pollen.privacy.distributed import DistributedPrivacy
    from pollen.privacy.ledger import LedgerFile

    config = PrivacyConfig("distributed", 1.0, 1.5, 0.0, 1e-5, 0.0)
    privacy = DistributedPrivacy(config, 10, 3, LedgerFile.in_folder(tmp_path), "node 1", sampling=0.2,
                                 rng=random.Random(0))
    assert privacy.refusal(1.0, 1.5, 3, 0.2) is None
    assert "sampling 1; this node's run config says" in privacy.refusal(1.0, 1.5, 3, 1.0)
    assert "sampling 0.1" in privacy.refusal(1.0, 1.5, 3, 0.1)


def test_the_server_divides_by_the_expected_number_of_updates_so_the_mean_is_unbiased():
    """Under sampling q the sum holds on average q·m updates: broadcast + Σ / (q m) for weights, Σ / (q m)
    for logits, whoever was drawn."""
    from pollen.secagg.payloads import dp_aggregate

    sums = {"w": np.full((2, 2), 3.0)}
    assert dp_aggregate("weights", sums, 0.5 * 6, 1.0, {"w": np.ones((2, 2))})["w"] == pytest.approx(np.full((2, 2),
                                                                                                           2.0))
    assert dp_aggregate("logits", {"logits": np.full((2, 3), 3.0)}, 0.5 * 6, 1.0)["logits"] == \
        pytest.approx(np.ones((2, 3)))
    with pytest.raises(ValueError, match="no contribution"):
        dp_aggregate("logits", {"logits": np.zeros((2, 3))}, 0.0, 1.0)


def test_a_whole_run_under_poisson_sampling_reports_the_epsilon_an_independent_accountant_gives():
    """fraction-fit = 0.5 under distributed DP: the strategy asks every client (the draw is theirs), every
    client answers, and the reported ε per round is dp-accounting's Poisson-sampled Gaussian under
    replace-one (its own PLD accountant), the sampling probability reported beside it."""
    from tests.test_privacy_distributed import _independent_epsilon

    z, q = 0.8, 0.5
    rounds = run_inprocess({"method": "fedproto", "num-server-rounds": 2, "seed": 0, "secure-aggregation": True,
                            "dp-mode": "distributed", "dp-min-honest": 2, "dp-noise-multiplier": z,
                            "fraction-fit": q, "fraction-evaluate": 0.0}, 4, echo=False)
    for r in rounds:
        assert r["fit"]["accepted"] == 4 and r["failures"] == 0 and r["fit"]["dp-sampling"] == q
        assert r["fit"]["dp-epsilon"] == pytest.approx(_independent_epsilon(z, q, r["round"], 1e-5), rel=1e-9)


def test_the_server_states_the_layout_and_a_client_refuses_a_dp_round_without_one():
    from pollen.protocol.secagg import Collect, Refused, decode_instruction, encode
    from pollen.secagg.payloads import dp_layout

    layout = dp_layout("prototypes", None, (10, 50))
    assert [(p.name, p.shape) for p in layout] == [("prototypes", (10, 50)), ("class-shares", (10,))]
    back = decode_instruction(encode(Collect("s", (1, 2), (b"a", b"b"), layout, True)))
    assert back.layout == layout and back.timed is True
    with pytest.raises(ValueError, match="two sizes"):
        dp_layout("logits", None, ())
    with pytest.raises(ValueError, match="broadcast model"):
        dp_layout("weights", None)
    bad = encode(Collect("s", (1,), (b"a",), layout))
    bad["layout-dims"] = [10]
    with pytest.raises(Refused, match="do not agree"):
        decode_instruction(bad)


# --- a simulated network on the secure round's stages (issue 44: stragglers under secure aggregation) --------

def test_under_a_simulated_network_clients_vanish_at_secagg_stages_and_the_rounds_complete_by_its_rules(tmp_path):
    """8 clients, client-dropout 0.25, one slow client of 4x and round-timeout 0.5 s, seed 1 (the draws, from
    pollen.strategies.network and vanishing_stage): round 1 loses partition 5 at collect (its masks rebuilt)
    and partition 2 at unmask (in the sum), partition 3 is late at collect; round 2 loses partition 1 at
    share-keys, partition 4 at collect, partition 3 late. Both rounds complete with the others summed, the
    missing are not failures, metrics.jsonl's network record names each with its stage, the secure record
    the stage each left the sum at and the bytes of every stage; the results file carries the same."""
    from pollen.app.results import RunRecorder
    from pollen.strategies.replies import RoundReport

    rounds = run_inprocess({"method": "fedavg", "num-server-rounds": 2, "seed": 1, "secure-aggregation": True,
                            "client-dropout": 0.25, "client-slow-fraction": 0.125, "round-timeout": 0.5,
                            "fraction-evaluate": 0.0}, 8, echo=False)
    expected = {1: {"partition 5": ("dropped", "collect"), "partition 3": ("late", "collect")},
                2: {"partition 1": ("dropped", "share-keys"), "partition 4": ("dropped", "collect"),
                    "partition 3": ("late", "collect")}}
    for r in rounds:
        missing = {m["client"]: (m["why"], m["stage"]) for m in r["network"]["missing"]}
        assert missing == expected[r["round"]]
        assert r["failures"] == 0 and r["fit"]["accepted"] == 8 - len(missing)
        late = next(m for m in r["network"]["missing"] if m["why"] == "late")
        assert late["sim-time-s"] > 0.5 and r["network"]["sim-round-s"] == 0.5
        secure = r["secure-aggregation"]
        assert secure["summed"] == 8 - len(missing) and secure["threshold"] == 5
        assert secure["dropped"] == {client: stage for client, (_, stage) in missing.items()}
        assert set(secure["stages"]) == {"setup", "share-keys", "collect", "unmask"}
        assert all(s["bytes-up"] > 0 for s in secure["stages"].values())  # setup's instruction: numbers only
        assert secure["stages"]["collect"]["bytes-down"] > secure["stages"]["share-keys"]["bytes-down"] > 0
    assert rounds[0]["network"]["vanished-in-sum"] == {"partition 2": "unmask"}
    assert rounds[1]["network"]["sim-clock-s"] == 1.0

    recorder = RunRecorder(tmp_path, {}, 2, echo=False)
    report = RoundReport(1, network=rounds[0]["network"], secure=rounds[0]["secure-aggregation"])
    recorder.record_report(report)
    import json
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    written = json.loads(line)
    assert written["secure-aggregation"]["stages"]["collect"]["bytes-up"] == \
        rounds[0]["secure-aggregation"]["stages"]["collect"]["bytes-up"]
    assert written["network"]["missing"][0]["stage"] in ("collect", "share-keys")
