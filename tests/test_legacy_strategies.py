"""The legacy (``flwr.server.strategy``) adapters of ``pollen.strategies.legacy``.

What is theirs alone: positional ``Parameters`` turned into the named records ``pollen.protocol``
screens (from each tensor's npy header, before any decoding), the same reasons as the Message API for
the same bad replies (declared bounds and metric ranges included), and the legacy payloads and round
loop. The aggregation math itself is tested on the Message-API strategies the app runs
(``test_weight_averaging.py``, ``test_logit_aggregation.py``, ``test_prototype_strategy.py``).
"""

import numpy as np
import pytest
from flwr.client import NumPyClient
from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    Parameters,
    Status,
    ndarray_to_bytes,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import Server
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from pollen.protocol.screening import PayloadBounds
from pollen.strategies.legacy import (
    LegacyLocalOnly,
    LegacyLogitAveraging,
    LegacyPrototypeStrategy,
    LegacyWeightAveraging,
    client_label,
    parameters_record,
)
from tests.conftest import stub_node

C, D = 4, 3


def _fit_res(arrays, n, pid, **metrics):
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n,
                  {"partition-id": pid, "train-loss": float(pid), **metrics})


def _eval_res(loss, n, pid, **metrics):
    return EvaluateRes(Status(Code.OK, ""), loss, n, {"partition-id": pid, **metrics})


def _junk(pid, count=1):
    return FitRes(Status(Code.OK, ""), Parameters(tensors=[b"not numpy"] * count, tensor_type="numpy.ndarray"), 5,
                  {"partition-id": pid})


# -- conversion ------------------------------------------------------------------------------------------
def test_positional_tensors_become_named_arrays_read_from_their_headers():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)
    record, reason = parameters_record(ndarrays_to_parameters([a, b]), ["x", "y"])
    assert reason is None and list(record.keys()) == ["x", "y"]
    assert (record["x"].dtype, record["x"].shape, record["y"].dtype, record["y"].shape) == \
        ("float32", (2, 3), "int64", (2,))
    np.testing.assert_array_equal(record["x"].numpy(), a)
    # metadata only: a body that is not there is no obstacle to reading the header
    truncated = Parameters(tensors=[ndarray_to_bytes(a)[:-8]], tensor_type="numpy.ndarray")
    record, reason = parameters_record(truncated, ["x"])
    assert reason is None and record["x"].shape == (2, 3)
    assert parameters_record(ndarrays_to_parameters([a]), ["x", "y"]) == (None, "expected 2 arrays, got 1")
    _, reason = parameters_record(Parameters(tensors=[b"junk"], tensor_type="numpy.ndarray"), ["x"])
    assert reason.startswith("'x': undecodable")


@pytest.mark.parametrize("metrics, label", [
    ({"partition-id": 3}, "partition 3"), ({"partition-id": 3.0}, "partition 3"), ({"partition-id": 1.7}, "node c"),
    ({"partition-id": 2**40}, "node c"), ({"partition-id": "x"}, "node c"), ({}, "node c")])
def test_a_client_is_named_by_a_valid_partition_id_only(metrics, label):
    assert client_label(metrics, "c") == label


# -- weights ---------------------------------------------------------------------------------------------
def test_weight_averaging_drops_bad_replies_with_protocol_reasons_and_averages_the_rest():
    init = [np.zeros((2,), np.float32), np.zeros((1, 2), np.float32)]
    strat = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="samples")
    good1 = [np.array([1.0, 1.0], np.float32), np.array([[2.0, 2.0]], np.float32)]
    good2 = [np.array([4.0, 4.0], np.float32), np.array([[8.0, 8.0]], np.float32)]
    wrong_shape = [np.array([1.0, 1.0, 1.0], np.float32), good1[1]]
    has_nan = [np.array([np.nan, 1.0], np.float32), good1[1]]
    huge = [np.full(2, 3e38, np.float32), good1[1]]  # finite, and beyond max-update-norm
    padded = ndarrays_to_parameters(good1)
    padded.tensors[0] += bytes(50_000_000)  # a right header over a 50 MB body: refused unread
    results = [(stub_node("a"), _fit_res(good1, 10, 0)), (stub_node("b"), _fit_res(good2, 30, 1)),
               (stub_node("c"), _fit_res(wrong_shape, 10, 2)), (stub_node("d"), _fit_res(has_nan, 10, 3)),
               (stub_node("e"), _junk(4, count=2)), (stub_node("f"), _fit_res(huge, 10, 5)),
               (stub_node("g"), _fit_res(good1, 0, 6)), (stub_node("h"), _fit_res(good1, 10, 7, accuracy=1.5)),
               (stub_node("i"), FitRes(Status(Code.OK, ""), padded, 10, {"partition-id": 8}))]
    params, metrics = strat.aggregate_fit(1, results, [])
    out = parameters_to_ndarrays(params)
    np.testing.assert_allclose(out[0], np.average([good1[0], good2[0]], axis=0, weights=[10, 30]))
    np.testing.assert_allclose(out[1], np.average([good1[1], good2[1]], axis=0, weights=[10, 30]))
    assert metrics["accepted"] == 2 and metrics["rejected"] == 7
    rejected = {r.client: r.reason for r in strat.take_rejections()}
    assert sorted(rejected) == [f"partition {i}" for i in range(2, 9)]
    assert rejected["partition 2"] == "'param[0]': shape 3 != expected 2"
    assert rejected["partition 3"] == "'param[0]': contains NaN or infinite values"
    assert rejected["partition 4"].startswith("'param[0]': undecodable")
    assert "above the bound max-update-norm = 10000" in rejected["partition 5"]
    assert rejected["partition 6"] == "metric 'num-examples' = 0 is below 1"
    assert rejected["partition 7"] == "metric 'accuracy' = 1.5 is outside [0, 1]"
    assert rejected["partition 8"] == "'param[0]': 50000136 bytes for a 2 float32 array"
    assert strat.take_rejections() == []


def test_weight_averaging_takes_its_bounds_and_weighting():
    init = [np.ones(2, np.float32)]
    strat = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="uniform",
                            bounds=PayloadBounds(max_update_norm=2.0))
    res = [(stub_node("a"), _fit_res([np.array([1.0, 1.0], np.float32)], 10, 0)),
           (stub_node("b"), _fit_res([np.array([2.5, 3.0], np.float32)], 30, 1)),  # moved by 2.5 <= 2·√2
           (stub_node("c"), _fit_res([np.array([6.0, 1.0], np.float32)], 30, 2))]  # moved by 5 > 2·√2
    params, metrics = strat.aggregate_fit(1, res, [])
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [1.75, 2.0])  # uniform: counts ignored
    assert metrics["rejected"] == 1 and "max-update-norm = 2" in strat.take_rejections()[0].reason
    params, metrics = strat.aggregate_fit(2, [(stub_node("c"), _fit_res([np.ones(3, np.float32)], 3, 2))], [])
    assert params is None and metrics["rejected"] == 1


def test_weight_averaging_sends_round_and_mu_and_screens_evaluate_replies():
    manager = SimpleClientManager()
    for cid in "ab":
        manager.register(stub_node(cid))
    strat = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters([np.zeros(2, np.float32)]), proximal_mu=0.5)
    fit = strat.configure_fit(3, strat.initial_parameters, manager)
    assert len(fit) == 2 and all(ins.config == {"server-round": 3, "proximal-mu": 0.5} for _, ins in fit)
    loss, metrics = strat.aggregate_evaluate(1, [(stub_node("a"), _eval_res(0.5, 10, 0, accuracy=0.75)),
                                                 (stub_node("b"), _eval_res(float("nan"), 10, 1, accuracy=0.5)),
                                                 (stub_node("c"), _eval_res(0.1, 10, 2, accuracy=5.0))], [])
    assert loss == pytest.approx(0.5) and metrics["accuracy"] == pytest.approx(0.75)
    reasons = {r.client: (r.stage, r.reason) for r in strat.take_rejections()}
    assert reasons == {"partition 1": ("evaluate", "metric 'loss' = nan is not a finite number"),
                       "partition 2": ("evaluate", "metric 'accuracy' = 5.0 is outside [0, 1]")}


def test_string_metrics_a_legacy_client_may_send_are_left_out_not_refused():
    strat = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters([np.zeros(2, np.float32)]))
    params, metrics = strat.aggregate_fit(1, [(stub_node("a"), _fit_res([np.ones(2, np.float32)], 4, 0,
                                                                        model="cnn", fast=True))], [])
    assert metrics["accepted"] == 1 and "model" not in metrics


def test_local_only_screens_metrics():
    local = LegacyLocalOnly()
    _, metrics = local.aggregate_fit(1, [(stub_node("a"), _fit_res([], 4, 0)),
                                         (stub_node("b"), _fit_res([], 4, 1, **{"train-loss": float("inf")}))], [])
    assert (metrics["accepted"], metrics["rejected"]) == (1, 1)
    assert local.take_rejections()[0].reason == "metric 'train-loss' = inf is not a finite number"


# -- prototypes ------------------------------------------------------------------------------------------
def _reply(rows: dict[int, list[float]], counts: dict[int, int]):
    protos = np.zeros((C, D), dtype=np.float32)
    cnt = np.zeros(C, dtype=np.int64)
    for c, row in rows.items():
        protos[c] = row
    for c, n in counts.items():
        cnt[c] = n
    return [protos, cnt]


def test_prototype_replies_are_screened_as_on_the_message_api():
    strategy = LegacyPrototypeStrategy(num_classes=C, embed_dim=D, max_examples=1000)
    good_a = _reply({0: [1, 1, 1], 1: [2, 2, 2]}, {0: 1, 1: 1})
    good_b = _reply({0: [3, 3, 3]}, {0: 3})
    nan = _reply({0: [1, 1, 1]}, {0: 1, 2: 2})
    nan[0][2, 1] = np.nan  # NaN in a held class
    nan_unheld = _reply({2: [5, 5, 5]}, {2: 1})
    nan_unheld[0][3] = np.nan  # NaN in a class with count 0: ignored, reply accepted
    cases = [good_a, good_b, nan, nan_unheld, [np.zeros((C, D + 1), np.float32), np.ones(C, np.int64)],
             [np.zeros((C, D), np.float64), np.ones(C, np.int64)],
             [np.zeros((C, D), np.float32), np.array([1, -1, 0, 0], np.int64)], [np.zeros((C, D), np.float32)],
             _reply({0: [2e6, 0, 0]}, {0: 1}), _reply({0: [1, 1, 1]}, {0: 1001})]
    results = [(stub_node(str(i)), _fit_res(r, 10, i)) for i, r in enumerate(cases)]
    params, metrics = strategy.aggregate_fit(1, results, [])
    reasons = {r.client: r.reason for r in strategy.take_rejections()}
    assert reasons == {
        "partition 2": "'prototypes': NaN or infinite values for held class(es) [2]",
        "partition 4": "'prototypes': shape 4x4 != expected 4x3",
        "partition 5": "'prototypes': dtype float64 != expected float32",
        "partition 6": "'class-counts': contains negative values",
        "partition 7": "expected 2 arrays, got 1",
        "partition 8": "'prototypes': magnitude 2e+06 above the plausible maximum 1e+06",
        "partition 9": "'class-counts': value 1001 above the plausible maximum 1000"}
    assert metrics["accepted"] == 3 and metrics["rejected"] == 7 and metrics["classes-present"] == 3
    protos, mask, margin = parameters_to_ndarrays(params)
    np.testing.assert_allclose(protos[:3], [[2.5, 2.5, 2.5], [2, 2, 2], [5, 5, 5]])  # (1·1 + 3·3) / 4 = 2.5
    assert mask.tolist() == [1, 1, 1, 0] and mask.dtype == np.int64
    assert margin.shape == (1,) and margin.dtype == np.float32
    assert np.isfinite(protos).all()


def test_first_round_sends_nothing_and_unreported_classes_keep_their_prototype():
    strategy = LegacyPrototypeStrategy(num_classes=C, embed_dim=D)
    assert strategy.global_payload() == []
    first = _reply({0: [1, 0, 0], 1: [0, 1, 0]}, {0: 2, 1: 2})
    strategy.aggregate_fit(1, [(stub_node("0"), _fit_res(first, 4, 0))], [])
    strategy.aggregate_fit(2, [(stub_node("0"), _fit_res(_reply({1: [0, 3, 0]}, {1: 2}), 2, 0))], [])
    protos, mask, _ = strategy.global_payload()
    np.testing.assert_allclose(protos[:2], [[1, 0, 0], [0, 3, 0]])
    assert mask.tolist() == [1, 1, 0, 0]


def test_all_replies_bad_keeps_the_previous_global_state():
    strategy = LegacyPrototypeStrategy(num_classes=C, embed_dim=D)
    strategy.aggregate_fit(1, [(stub_node("0"), _fit_res(_reply({0: [1, 0, 0]}, {0: 2}), 2, 0))], [])
    before = [a.copy() for a in strategy.global_payload()]
    _, metrics = strategy.aggregate_fit(2, [(stub_node("0"), _fit_res([np.zeros(3, np.float32)], 2, 0))], [])
    assert metrics["accepted"] == 0 and metrics["rejected"] == 1
    for a, b in zip(before, strategy.global_payload()):
        np.testing.assert_array_equal(a, b)


def test_evaluate_every_skips_rounds_but_always_evaluates_the_last():
    strategy = LegacyPrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=3, num_rounds=7,
                                 min_available_clients=1)
    manager = SimpleClientManager()
    manager.register(stub_node("0"))
    rounds = [r for r in range(1, 8) if strategy.configure_evaluate(r, ndarrays_to_parameters([]), manager)]
    assert rounds == [3, 6, 7]


def test_constructors_reject_bad_arguments():
    with pytest.raises(ValueError, match="weighting"):
        LegacyPrototypeStrategy(num_classes=C, embed_dim=D, weighting="max")
    with pytest.raises(ValueError, match="evaluate_every"):
        LegacyPrototypeStrategy(num_classes=C, embed_dim=D, evaluate_every=0)
    with pytest.raises(ValueError, match="max_examples"):
        LegacyPrototypeStrategy(num_classes=C, embed_dim=D, max_examples=0)
    with pytest.raises(ValueError, match="num_public"):
        LegacyLogitAveraging(num_public=0, num_classes=10)
    with pytest.raises(ValueError, match="fraction_fit"):
        LegacyLogitAveraging(num_public=5, num_classes=10, fraction_fit=0.0)
    with pytest.raises(ValueError, match="max_update_norm"):
        LegacyLogitAveraging(num_public=5, num_classes=10, bounds=PayloadBounds(max_update_norm=-1.0))


class InProcessProxy(ClientProxy):
    """A ClientProxy that calls a NumPyClient in this process (what a SuperNode does over the wire)."""

    def __init__(self, cid: str, client: NumPyClient):
        super().__init__(cid)
        self.client = client.to_client()

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        return self.client.fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self.client.evaluate(ins)


class _PointsClient(NumPyClient):
    """A minimal client of *another* project: fixed 3-d embeddings per class, no Pollen code at all.

    It follows only the legacy payload contract: it replies class means and counts, and evaluates by
    the nearest global prototype among its own classes.
    """

    def __init__(self, seed: int, classes: dict[int, int]):
        rng = np.random.default_rng(seed)
        self.points = {c: (rng.normal(size=(n, D)) + 4 * np.eye(C, D)[c]).astype(np.float32)
                       for c, n in classes.items()}

    def fit(self, parameters, config):
        protos = np.zeros((C, D), np.float32)
        counts = np.zeros(C, np.int64)
        for c, pts in self.points.items():
            protos[c], counts[c] = pts.mean(axis=0), len(pts)
        return [protos, counts], int(counts.sum()), {"received": len(parameters)}

    def evaluate(self, parameters, config):
        protos, mask, _ = parameters
        own = [c for c in self.points if mask[c]]
        correct = total = 0
        for c, pts in self.points.items():
            dist = ((pts[:, None, :] - protos[own][None]) ** 2).mean(axis=2)
            correct += int((np.array(own)[dist.argmin(axis=1)] == c).sum())
            total += len(pts)
        return 0.0, total, {"proto-accuracy": correct / total}


def test_prototype_strategy_runs_a_plain_flower_server_with_foreign_clients():
    clients = [_PointsClient(0, {0: 5, 1: 3}), _PointsClient(1, {1: 9, 2: 2}), _PointsClient(2, {0: 4, 2: 6})]
    manager = SimpleClientManager()
    for i, client in enumerate(clients):
        manager.register(InProcessProxy(str(i), client))
    strategy = LegacyPrototypeStrategy(num_classes=C, embed_dim=D, min_available_clients=3)
    history, _ = Server(client_manager=manager, strategy=strategy).fit(num_rounds=2, timeout=None)
    # independent computation: the count-weighted mean of each class over every point of every client
    for c in range(3):
        pts = np.concatenate([cl.points[c] for cl in clients if c in cl.points])
        np.testing.assert_allclose(strategy.protos[c], pts.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert strategy.present.tolist() == [True, True, True, False]
    assert [r for r, _ in history.metrics_distributed_fit["received"]] == [1, 2]
    assert [v for _, v in history.metrics_distributed_fit["received-client-mean"]] == [0.0, 3.0]
    assert history.metrics_distributed["proto-accuracy"][-1][1] > 0.9


# -- logits ----------------------------------------------------------------------------------------------
A = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]], np.float32)
B = np.array([[3.0, 0.0], [1.0, 4.0], [6.0, -3.0]], np.float32)
LC = np.array([[2.0, 4.0], [2.0, 1.0], [0.0, 3.0]], np.float32)


def test_logits_round_one_sends_nothing_then_the_consensus_and_its_count():
    manager = SimpleClientManager()
    proxies = [stub_node(str(i)) for i in range(4)]
    for p in proxies:
        manager.register(p)
    strat = LegacyLogitAveraging(num_public=3, num_classes=2, min_available_clients=4)
    first = strat.configure_fit(1, strat.initialize_parameters(manager), manager)
    assert len(first) == 4
    assert all(parameters_to_ndarrays(ins.parameters) == [] and ins.config["server-round"] == 1
               and ins.config["contributed"] is False for _, ins in first)

    results = [(proxies[0], _fit_res([A], 10, 0)), (proxies[1], _fit_res([B], 20, 1)),
               (proxies[2], _fit_res([LC], 5, 2)), (proxies[3], _fit_res([A[:, :1].copy()], 7, 3))]
    params, metrics = strat.aggregate_fit(1, results, [])
    assert metrics["accepted"] == 3 and metrics["rejected"] == 1
    assert metrics["train-loss"] == pytest.approx(1.0)  # clients count equally: (0 + 1 + 2) / 3
    rejections = strat.take_rejections()
    assert [(r.client, r.server_round, r.reason) for r in rejections] == \
        [("partition 3", 1, "'logits': shape 3x1 != expected 3x2")]
    sent = parameters_to_ndarrays(params)
    np.testing.assert_array_equal(sent[0], (A + B + LC) / 3)  # exact in float32 for these values
    assert sent[1].dtype == np.int64 and sent[1].tolist() == [3]

    second = dict((p.cid, ins) for p, ins in strat.configure_fit(2, params, manager))
    assert {cid: ins.config["contributed"] for cid, ins in second.items()} == {"0": True, "1": True, "2": True,
                                                                                "3": False}
    # NaN, float64, extra arrays, undecodable bytes and logits beyond max-logit-abs are all dropped;
    # the old consensus survives
    nan = A.copy()
    nan[0, 0] = np.nan
    params, metrics = strat.aggregate_fit(2, [(proxies[0], _fit_res([nan], 1, 0)),
                                              (proxies[1], _fit_res([B.astype(np.float64)], 1, 1)),
                                              (proxies[2], _fit_res([LC, LC], 1, 2)), (proxies[3], _junk(3)),
                                              (stub_node("4"), _fit_res([A * 1e5], 1, 4))], [])
    assert params is None and metrics["accepted"] == 0 and metrics["rejected"] == 5
    reasons = [r.reason for r in strat.take_rejections()]
    assert reasons[:3] == ["'logits': contains NaN or infinite values", "'logits': dtype float64 != expected float32",
                           "expected 1 arrays, got 2"]
    assert reasons[3].startswith("'logits': undecodable")
    assert reasons[4] == "'logits': magnitude 400000 above the plausible maximum 10000"
    np.testing.assert_array_equal(strat.consensus, (A + B + LC) / 3)


def test_homogeneous_mode_screens_states_and_averages_them_by_samples():
    strat = LegacyLogitAveraging(num_public=3, num_classes=2, average_weights=True)
    w1 = [np.array([1.0, 1.0], np.float32), np.array(2, np.int64)]
    w2 = [np.array([4.0, 7.0], np.float32), np.array(4, np.int64)]
    params, metrics = strat.aggregate_fit(1, [(stub_node("a"), _fit_res([A, *w1], 10, 0)),
                                              (stub_node("b"), _fit_res([B, *w2], 30, 1)),
                                              (stub_node("c"), _fit_res([LC, np.zeros(3, np.float32)], 30, 2)),
                                              (stub_node("d"), _fit_res([LC, np.full(2, 1e5, np.float32),
                                                                         w1[1]], 30, 3))], [])
    assert metrics["accepted"] == 2  # the third reply has too few arrays, the fourth a state beyond the bound
    reasons = [r.reason for r in strat.take_rejections()]
    assert reasons[0] == "expected 3 arrays, got 2"
    assert reasons[1].startswith("model: update norm 1.414e+05") and "max-update-norm = 10000" in reasons[1]
    sent = parameters_to_ndarrays(params)
    np.testing.assert_array_equal(sent[0], (A + B) / 2)
    np.testing.assert_allclose(sent[2], np.average([w1[0], w2[0]], axis=0, weights=[10, 30]))
    assert sent[3].dtype == np.int64 and int(sent[3]) == round((10 * 2 + 30 * 4) / 40)
    # round 2: the state must keep round 1's layout
    _, metrics = strat.aggregate_fit(2, [(stub_node("a"), _fit_res([A, w1[0], w1[0]], 10, 0))], [])
    assert metrics["rejected"] == 1 and strat.take_rejections()[0].reason == \
        "model: 'param[1]': shape 2 != expected scalar"


# -- differential privacy: the bounds follow the mechanism, as on the Message API -------------------------
def _payload_privacy(clip: float, sigma: float, kind: str = "weights"):
    import tempfile

    from pollen.privacy import LedgerFile, PayloadPrivacy, PrivacyConfig
    from pollen.privacy.bounds import dp_bounds

    config = PrivacyConfig("payload", clip, sigma, 0.0, 1e-5, 0.0)
    return dp_bounds(config, 10), lambda pid: PayloadPrivacy(
        config, 10, LedgerFile.in_folder(tempfile.mkdtemp(prefix="pollen-ledger-")), f"partition {pid}", kind)


def test_weight_averaging_under_dp_keeps_honest_releases_and_refuses_one_beyond_the_dp_bound():
    bounds, privacy = _payload_privacy(clip=2.0, sigma=0.05)
    init = [np.linspace(-1, 1, 600, dtype=np.float32).reshape(20, 30), np.zeros(40, np.float32)]
    strat = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="uniform",
                            bounds=PayloadBounds(dp=bounds))
    rng = np.random.default_rng(0)
    releases = []
    for pid in range(3):
        trained = [a + rng.normal(0, 0.5, a.shape).astype(np.float32) for a in init]
        # a legacy client names its positions (the release is by name) and lists them again for the reply
        release, metrics = privacy(pid).update(dict(enumerate(init)), dict(enumerate(trained)), rng)
        releases.append(list(release.values()))
    scaled = [b + 1.5 * (r - b) for b, r in zip(init, releases[2])]  # an honest release's update × 1.5
    results = [(stub_node(str(pid)), _fit_res(arrays, 1, pid))
               for pid, arrays in ((0, releases[0]), (1, releases[1]), (2, scaled))]
    params, metrics = strat.aggregate_fit(1, results, [])
    assert metrics["accepted"] == 2 and metrics["rejected"] == 1
    (rejection,) = strat.take_rejections()
    assert rejection.client == "partition 2" and "above the DP bound" in rejection.reason
    assert "dp-clip 2" in rejection.reason and "σ 0.05 from dp-noise-multiplier" in rejection.reason
    for got, a, b in zip(parameters_to_ndarrays(params), releases[0], releases[1]):
        np.testing.assert_allclose(got, (a + b) / 2, rtol=1e-6)
    # without DP the relative max-update-norm (1e4 × the broadcast) admits the scaled reply
    loose = LegacyWeightAveraging(initial_parameters=ndarrays_to_parameters(init), weighting="uniform")
    assert loose.aggregate_fit(1, results, [])[1]["accepted"] == 3


def test_logit_averaging_under_dp_refuses_logits_beyond_the_dp_bound_and_homogeneous_mode():
    bounds, privacy = _payload_privacy(clip=1.0, sigma=0.5)
    rng = np.random.default_rng(1)
    honest, _ = privacy(0).logits(rng.normal(size=(5, 3)), rng)
    strat = LegacyLogitAveraging(num_public=5, num_classes=3, bounds=PayloadBounds(dp=bounds))
    params, metrics = strat.aggregate_fit(1, [(stub_node("0"), _fit_res([honest], 1, 0)),
                                              (stub_node("1"), _fit_res([10.0 * honest], 1, 1))], [])
    assert metrics["accepted"] == 1
    (rejection,) = strat.take_rejections()
    assert rejection.client == "partition 1" and "logit matrix norm" in rejection.reason
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], honest, rtol=1e-6)
    with pytest.raises(ValueError, match="homogeneous mode.*differential privacy"):
        LegacyLogitAveraging(num_public=5, num_classes=3, average_weights=True, bounds=PayloadBounds(dp=bounds))


# -- every *accuracy key, on both APIs ---------------------------------------------------------------------
def accuracy_keys() -> list[str]:
    """Every metric key ending in ``accuracy`` that Pollen's code writes (string literals in ``pollen/``;
    an f-string's placeholder stands for 0), plus FCCL's ``solo-`` copies and a key of the user's own."""
    import re

    from tests.conftest import PROJECT_ROOT

    found = set()
    for path in (PROJECT_ROOT / "pollen").rglob("*.py"):
        for key in re.findall(r"""["']([a-z0-9{}_-]*accuracy)["']""", path.read_text()):
            found.add(re.sub(r"\{[^}]*\}", "0", key))
    found -= {"final-accuracy"}  # the summary's field, not a metric a client sends
    found |= {f"solo-{k}" for k in ("inter-accuracy", "intra-accuracy")} | {"my-own-accuracy"}
    return sorted(found)


def test_the_accuracy_keys_are_found():
    assert {"accuracy", "proto-accuracy", "inter-accuracy", "intra-accuracy", "task0-accuracy",
            "proxy-monitor-accuracy"} <= set(accuracy_keys())


@pytest.mark.parametrize("key", accuracy_keys())
def test_every_accuracy_key_is_range_checked_on_both_apis(key):
    """A legacy reply with ``<key> = 1.5`` (or -0.1) is refused, fit and evaluate alike; on the Message API
    the value is dropped alone (the reply counts), a list with one element outside [0, 1] too."""
    from pollen.protocol.screening import metric_bounds, screen_metrics

    strat = LegacyPrototypeStrategy(num_classes=C, embed_dim=D)
    protos, counts = np.ones((C, D), np.float32), np.array([1, 1, 0, 0], np.int64)
    for bad in (1.5, -0.1):
        fit = [(stub_node("a"), _fit_res([protos, counts], 2, 0, **{key: 0.5})),
               (stub_node("b"), _fit_res([protos, counts], 2, 1, **{key: bad}))]
        _, metrics = strat.aggregate_fit(1, fit, [])
        assert metrics["accepted"] == 1, key
        (refused,) = strat.take_rejections()
        assert (refused.client, refused.reason) == ("partition 1", f"metric '{key}' = {bad} is outside [0, 1]")
        strat.aggregate_evaluate(1, [(stub_node("c"), _eval_res(0.3, 5, 2, **{key: bad}))], [])
        (refused,) = strat.take_rejections()
        assert refused.stage == "evaluate" and refused.reason == f"metric '{key}' = {bad} is outside [0, 1]"
        for stage in (False, True):
            screened = screen_metrics({"num-examples": 3, key: bad}, metric_bounds(10, evaluate=stage))
            assert screened.reason is None and key not in screened.kept and screened.dropped[0][0] == key
    listed = screen_metrics({"num-examples": 3, key: [0.5, 1.5]}, metric_bounds(10, evaluate=True))
    assert key not in listed.kept and "is above 1" in listed.dropped[0][2]
    assert screen_metrics({"num-examples": 3, key: 1.0}, metric_bounds(10, evaluate=True)).kept[key] == 1.0
