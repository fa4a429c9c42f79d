"""Drop-in fidelity (issue 32 item 9): Pollen's Message-API strategies where a Flower project expects
Flower's FedAvg/FedProx.

Every round runs through ``Strategy.start`` on an in-process grid of real ``Message`` replies
(``pollen.testing``); Flower's own ``FedAvg`` runs on the same grid where the two are compared.
Each test asserts what a user sees: the aggregated model, the round's metrics, the WARNING or INFO
line, the exception message. The differences themselves are listed in docs/strategies.md.
"""

from __future__ import annotations

import inspect
import logging
import re

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedProx
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from pollen.protocol.logits import decode_consensus, encode_consensus
from pollen.protocol.prototypes import decode_global_prototypes, encode_global_prototypes
from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import LogitAveraging, PrototypeStrategy, WeightAveraging
from tests.conftest import PROJECT_ROOT
from pollen.testing import InProcessGrid, clientapp_node
from tests.test_message_strategies import STATE, _record

DOC = PROJECT_ROOT / "docs" / "strategies.md"


def _node(pid: int, n: int, shift: float, train_metrics: dict | None = None, *, fail: bool = False):
    """A FedAvg client: adds ``shift`` to every float array; evaluate loss ``1 + pid``, accuracy 0.5."""
    def handle(msg):
        if fail:
            return RuntimeError("client crashed")
        if msg.metadata.message_type == "evaluate":
            return RecordDict({"metrics": MetricRecord({"num-examples": n, "loss": 1.0 + pid, "accuracy": 0.5})})
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        out = {k: (v + shift if v.dtype.kind == "f" else v) for k, v in got.items()}
        return encode_weights_reply(out, n, {"partition-id": pid, **(train_metrics or {})})
    return handle


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- (1) a bad metric costs that metric, not the update -------------------------------------------------------
def test_an_out_of_range_metric_drops_that_metric_not_the_update(caplog):
    grid = InProcessGrid({11: _node(0, 10, 1.0, {"train-accuracy": 0.75, "train-loss": 0.5}),
                          12: _node(1, 30, 5.0, {"train-accuracy": 87.5, "train-loss": -0.2})})  # percent; < 0
    strategy = WeightAveraging(min_available_nodes=2)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + (10 * 1.0 + 30 * 5.0) / 40, rtol=1e-6)
    train = result.train_metrics_clientapp[1]
    assert train["accepted"] == 2 and train["rejected"] == 0
    assert train["train-accuracy"] == 0.75 and train["train-loss"] == 0.5  # the other client's values only
    assert ("round 1 train: dropped metric 'train-accuracy' = 87.5 from partition 1 (node 12), the rest of its "
            "reply counts: metric 'train-accuracy' = 87.5 is above 1") in _warnings(caplog)
    assert any("dropped metric 'train-loss' = -0.2 from partition 1 (node 12)" in w and "is below 0" in w
               for w in _warnings(caplog))
    assert {(d["key"], d["value"]) for d in strategy.reports[1].dropped_metrics} == {
        ("train-accuracy", 87.5), ("train-loss", -0.2)}


@pytest.mark.parametrize("bad, reason", [(np.nan, "'w': contains NaN"), ("shape", "'w': shape 3x3 != expected 2x3")])
def test_arrays_are_still_screened_strictly(bad, reason):
    def hostile(msg):
        if msg.metadata.message_type == "evaluate":
            return _node(1, 10, 0.0)(msg)
        out = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        out["w"] = np.zeros((3, 3), np.float32) if bad == "shape" else np.full_like(out["w"], bad)
        return encode_weights_reply(out, 10, {"partition-id": 1, "train-loss": 0.1})  # good metrics
    strategy = WeightAveraging(min_available_nodes=2)
    result = strategy.start(grid=InProcessGrid({11: _node(0, 10, 1.0), 12: hostile}),
                            initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 1.0, rtol=1e-6)  # the good client alone
    (rejected,) = strategy.reports[1].rejected
    assert rejected["client"] == "partition 1" and reason in rejected["reason"]


# -- (2) list-valued metrics -----------------------------------------------------------------------------------
def test_list_metrics_are_averaged_element_wise_as_flowers_aggregation_does():
    per_class = {0: [0.5, 1.0, 0.0], 1: [1.0, 0.5, 0.25]}
    grid = InProcessGrid({11: _node(0, 10, 1.0, {"class-accuracy": per_class[0]}),
                          12: _node(1, 30, 5.0, {"class-accuracy": per_class[1]})})
    result = WeightAveraging(min_available_nodes=2).start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    train = result.train_metrics_clientapp[1]
    a, b = np.array(per_class[0]), np.array(per_class[1])
    np.testing.assert_allclose(train["class-accuracy"], (10 * a + 30 * b) / 40, rtol=1e-12)
    np.testing.assert_allclose(train["class-accuracy-client-mean"], (a + b) / 2, rtol=1e-12)
    np.testing.assert_allclose(train["class-accuracy-client-std"], np.abs(a - b) / 2, rtol=1e-12)
    flower = aggregate_metricrecords([RecordDict({"metrics": MetricRecord({"num-examples": n, "class-accuracy": v})})
                                      for n, v in ((10, per_class[0]), (30, per_class[1]))], "num-examples")
    np.testing.assert_allclose(train["class-accuracy"], flower["class-accuracy"], rtol=1e-12)


@pytest.mark.parametrize("second, reason", [
    ([1.0, 2.0, 3.0], "lists of different lengths [2, 3] (element-wise means need one length)"),
    (2.0, "a number in 1 replies and a list in 1")])
def test_list_metrics_a_round_cannot_average_are_left_out_with_the_reason(second, reason, caplog):
    grid = InProcessGrid({11: _node(0, 10, 1.0, {"per-class": [1.0, 2.0], "train-loss": 0.5}),
                          12: _node(1, 30, 5.0, {"per-class": second, "train-loss": 0.5})})
    strategy = WeightAveraging(min_available_nodes=2)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    train = result.train_metrics_clientapp[1]
    assert train["accepted"] == 2 and "per-class" not in train and train["train-loss"] == 0.5
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 4.0, rtol=1e-6)  # both updates
    assert f"round 1 train: metric 'per-class' left out of the round's metrics: {reason}" in _warnings(caplog)


# -- (3) per-round logs as Flower's strategies write them ---------------------------------------------------------
def _grid() -> InProcessGrid:
    return InProcessGrid({11: _node(0, 10, 1.0), 12: _node(1, 30, 5.0), 13: _node(2, 20, 0.0, fail=True)})


def test_each_round_logs_its_aggregated_metrics_as_flowers_fedavg_does(caplog):
    def run(strategy):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flwr"):
            result = strategy.start(grid=_grid(), initial_arrays=_record(STATE), num_rounds=2,
                                    evaluate_fn=lambda r, a: MetricRecord({"server-accuracy": 0.5}))
        return result, [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]

    def skeleton(lines):
        keep = ("Starting ", "\t├── ", "Initial global evaluation", "[ROUND", "\t└──> Aggregated", "Global evaluation",
                "\t└──> MetricRecord", "Strategy execution finished")  # not the strategies' own summary()
        return [re.sub(r"[\d.]+s$", "Ns", line.split(": ")[0]) for line in lines if line.startswith(keep)]

    _, flower = run(FedAvg())
    result, pollen = run(WeightAveraging(min_available_nodes=2))
    assert skeleton(pollen) == [line.replace("FedAvg", "WeightAveraging") for line in skeleton(flower)]
    aggregated = [line for line in pollen if line.startswith("\t└──> Aggregated MetricRecord: ")]
    assert aggregated == [f"\t└──> Aggregated MetricRecord: {rec}" for r in (1, 2)
                          for rec in (result.train_metrics_clientapp[r], result.evaluate_metrics_clientapp[r])]


# -- Flower's FedAvg behaviour, re-expressed against WeightAveraging ------------------------------------------------
def test_with_flowers_metric_aggregation_weight_averaging_returns_what_fedavg_returns():
    """Same grid (one node failing every message), same options: the same model and the same metrics;
    integer arrays keep their dtype in Pollen (Flower's come back as float64)."""
    flower = FedAvg().start(grid=_grid(), initial_arrays=_record(STATE), num_rounds=2)
    strategy = WeightAveraging(min_train_nodes=2, min_evaluate_nodes=2, min_available_nodes=2,
                               weighted_by_key="num-examples", arrayrecord_key="arrays", configrecord_key="config",
                               train_metrics_aggr_fn=aggregate_metricrecords,
                               evaluate_metrics_aggr_fn=aggregate_metricrecords)
    pollen = strategy.start(grid=_grid(), initial_arrays=_record(STATE), num_rounds=2)
    for key in ("w", "b"):
        np.testing.assert_allclose(pollen.arrays[key].numpy(), flower.arrays[key].numpy(), rtol=1e-6)
    np.testing.assert_allclose(pollen.arrays["w"].numpy(), STATE["w"] + 2 * (10 * 1.0 + 30 * 5.0) / 40, rtol=1e-6)
    assert pollen.arrays["steps"].numpy().dtype == np.int64 and flower.arrays["steps"].numpy().dtype == np.float64
    for r in (1, 2):
        assert dict(pollen.evaluate_metrics_clientapp[r]) == pytest.approx(dict(flower.evaluate_metrics_clientapp[r]))
        train = dict(pollen.train_metrics_clientapp[r])
        assert {k: train[k] for k in flower.train_metrics_clientapp[r]} == pytest.approx(
            dict(flower.train_metrics_clientapp[r]))
        assert (train["accepted"], train["failures"]) == (2, 1)
    assert len(strategy.reports[1].failures) == 2  # the failing node, in train and in evaluate


def test_train_and_evaluate_messages_carry_what_flowers_fedprox_sends():
    flower_grid, pollen_grid = _grid(), _grid()
    FedProx(proximal_mu=0.1).start(grid=flower_grid, initial_arrays=_record(STATE), num_rounds=1)
    result = WeightAveraging(proximal_mu=0.1, min_available_nodes=2).start(
        grid=pollen_grid, initial_arrays=_record(STATE), num_rounds=1)
    for flower, pollen in zip(flower_grid.sent, pollen_grid.sent):
        assert flower.metadata.message_type == pollen.metadata.message_type
        assert sorted(flower.content.keys()) == sorted(pollen.content.keys()) == ["arrays", "config"]
        assert dict(pollen.content["config"]) == dict(flower.content["config"])  # server-round, proximal-mu
    evaluate = [m for m in pollen_grid.sent if m.metadata.message_type == "evaluate"]
    for msg in evaluate:  # the global model after this round's averaging, as Flower's
        np.testing.assert_array_equal(msg.content["arrays"]["w"].numpy(), result.arrays["w"].numpy())


# -- (4) options ------------------------------------------------------------------------------------------------
def test_every_fedavg_and_fedprox_option_is_accepted():
    flower = {p for cls in (FedAvg, FedProx) for p in inspect.signature(cls.__init__).parameters if p != "self"}
    assert flower <= set(WeightAveraging.supported_options())
    WeightAveraging(fraction_train=0.5, fraction_evaluate=0.5, min_train_nodes=2, min_evaluate_nodes=2,
                    min_available_nodes=2, weighted_by_key="num-examples", arrayrecord_key="arrays",
                    configrecord_key="config", train_metrics_aggr_fn=aggregate_metricrecords,
                    evaluate_metrics_aggr_fn=aggregate_metricrecords, proximal_mu=0.1)


def test_an_unsupported_option_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="weighted_by_key must be 'num-examples', got 'samples': Pollen's wire"):
        WeightAveraging(weighted_by_key="samples")
    with pytest.raises(TypeError) as err:
        WeightAveraging(server_learning_rate=1.0)  # FedAvgM's
    text = str(err.value)
    assert text.startswith("WeightAveraging does not support server_learning_rate; its options: ")
    assert all(name in text for name in ("fraction_train", "proximal_mu", "weighting", "train_metrics_aggr_fn"))
    with pytest.raises(TypeError) as err:
        LogitAveraging(num_public=5, num_classes=3, proximal_mu=0.1)
    supported = str(err.value).split("its options: ")[1]
    assert "num_public" in supported and "proximal_mu" not in supported


# -- the documented LogitAveraging client and decode helpers ---------------------------------------------------
def _doc_block(heading: str) -> str:
    section = DOC.read_text().split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r} in {DOC}"
    return match.group(1)


def test_the_documented_logit_client_runs_against_logit_averaging():
    namespace: dict = {}
    exec(compile(_doc_block("### A `LogitAveraging` client"), str(DOC), "exec"), namespace)
    grid = InProcessGrid({100 + p: clientapp_node(namespace["app"], {}, p, 3) for p in range(3)})
    strategy = LogitAveraging(num_public=100, num_classes=10, min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)

    # independently: round 1 averages each partition's logits; in round 2 each client moves halfway to
    # the mean of the *other* clients' round-1 logits (its own taken out of the consensus)
    own = np.stack([np.random.default_rng(p).normal(size=(100, 10)).astype(np.float32) for p in range(3)])
    others = (own.sum(axis=0, dtype=np.float64) - own) / 2
    round2 = (own + others) / 2
    np.testing.assert_allclose(strategy.consensus, round2.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert [result.train_metrics_clientapp[r]["accepted"] for r in (1, 2)] == [3, 3]
    assert result.evaluate_metrics_clientapp[2]["accuracy"] == pytest.approx(0.7)
    evaluate = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert evaluate and all(len(m.content["arrays"]) == 0 for m in evaluate)  # each evaluates its own model


def test_the_decode_helpers_return_what_the_doc_says():
    page = DOC.read_text()
    assert "`(protos, present, margin)`: C×d float32 `np.ndarray`, C bool `np.ndarray`, `float`" in page
    assert "`(consensus, contributors)`: N0×C float32 `np.ndarray`, `int`" in page
    protos, present, margin = decode_global_prototypes(
        encode_global_prototypes(np.ones((4, 3)), np.array([1, 0, 1, 1]), 0.25), 4, 3)
    assert protos.dtype == np.float32 and protos.shape == (4, 3)
    assert present.dtype == bool and present.tolist() == [True, False, True, True]
    assert type(margin) is float and margin == 0.25
    consensus, contributors = decode_consensus(encode_consensus(np.zeros((5, 2)), 3), 5, 2)
    assert consensus.dtype == np.float32 and consensus.shape == (5, 2) and type(contributors) is int
    assert decode_global_prototypes(ArrayRecord(), 4, 3) is None and decode_consensus(ArrayRecord(), 5, 2) is None
    with pytest.raises(ValueError, match="'prototypes': shape"):
        decode_global_prototypes(encode_global_prototypes(np.ones((2, 3)), np.ones(2), 0.0), 4, 3)


def test_prototype_evaluate_messages_carry_the_global_prototypes():
    def node(pid):
        def handle(msg):
            if msg.metadata.message_type == "evaluate":
                return RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": 0.5})})
            from pollen.protocol.prototypes import encode_prototype_reply
            return encode_prototype_reply(np.full((4, 3), float(pid), np.float32), np.array([2, 2, 0, 1]))
        return handle
    grid = InProcessGrid({11: node(0), 12: node(1)})
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, min_available_nodes=2)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    (msg, _) = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    protos, present, _margin = decode_global_prototypes(msg.content["arrays"], 4, 3)
    assert present.tolist() == [True, True, False, True]
    np.testing.assert_allclose(protos[present], 0.5)  # both clients hold those classes equally
