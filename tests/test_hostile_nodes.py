"""Hostile nodes against the Message-API strategies (issue 31): absurd values refused by the declared
bounds before anything is aggregated (or reaches GLFC's proxy), absurd metrics dropped, a partition
never taken by a claim, and failures named by the node the message was sent to.

Every round runs through a real Flower ``Message`` exchange in process (``pollen.testing``).
"""

from __future__ import annotations

import logging
import math
import uuid

import numpy as np
import pytest
import torch
from flwr.app import Error, Message, MessageType, MetricRecord, RecordDict

from pollen.protocol import glfc as protocol
from pollen.protocol.identity import format_partition_pins, parse_partition_pins
from pollen.protocol.logits import encode_logit_reply
from pollen.protocol.records import ARRAYS
from pollen.protocol.screening import PayloadBounds, check_gradient_norm, check_metrics, check_update_norm
from pollen.strategies import LogitAveraging, PrototypeStrategy, WeightAveraging
from pollen.testing import InProcessGrid, set_task_identity
from tests.test_glfc_strategy import _configure, _grad_set, _reply, _strategy, identity_grid, node_id
from tests.test_message_strategies import DIGEST, STATE, _logit_node, _proto_node, _record, _weights_node

HUGE = 3e38  # finite in float32: passes every finiteness check


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


def _hostile_weights(pid, value=HUGE):
    """Claims ``pid`` and sends every float entry as ``value`` (metadata and dtype all correct)."""
    honest = _weights_node(pid, 10, 0.0)

    def handle(msg):
        if msg.metadata.message_type != MessageType.TRAIN:
            return honest(msg)
        out = {k: (np.full_like(a.numpy(), value) if a.numpy().dtype.kind == "f" else a.numpy())
               for k, a in msg.content["arrays"].items()}
        from pollen.protocol.weights import encode_weights_reply
        return encode_weights_reply(out, 10, {"partition-id": pid})
    return handle


# -- declared bounds ------------------------------------------------------------------------------------
def test_3e38_weights_are_refused_and_the_global_model_stays_the_honest_mean():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(1, 10, 3.0), 13: _hostile_weights(2)})
    strategy = WeightAveraging(min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 2.0, rtol=1e-6)
    (rejected,) = [r for r in strategy.reports[1].rejected if r["stage"] == "train"]
    assert rejected["client"] == "partition 2" and "above the bound max-update-norm = 10000" in rejected["reason"]


def test_the_update_bound_is_relative_to_the_broadcast_model_and_configurable():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _hostile_weights(1, 1e3)})  # ‖Δ‖ ≈ 2.4e3 ≈ 330 × ‖w‖
    loose = WeightAveraging(min_available_nodes=2)
    loose.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    assert loose.reports[1].accepted == 2
    tight = WeightAveraging(min_available_nodes=2, bounds=PayloadBounds(max_update_norm=100.0))
    tight.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
    assert tight.reports[1].accepted == 1


def test_update_norm_rule_against_a_hand_computed_case():
    broadcast = {"w": np.array([3.0, 4.0], np.float32), "n": np.array(7, np.int64)}  # ‖w‖ = 5
    moved = {"w": np.array([3.0, 4.0 + 50.0], np.float32), "n": np.array(10**9, np.int64)}  # ‖Δ‖ = 50
    assert check_update_norm(moved, broadcast, 10.0) is None  # 50 <= 10 × 5; integer entries not counted
    assert "10 × the broadcast model's norm 5" in check_update_norm(moved, broadcast, 9.9)
    zero = {"w": np.zeros(2, np.float32)}  # a zero model: the floor of 1 applies
    assert check_update_norm({"w": np.array([0.0, 2.0], np.float32)}, zero, 2.0) is None
    assert check_update_norm({"w": np.array([0.0, 2.1], np.float32)}, zero, 2.0) is not None
    f64 = {"w": np.array([1e308, 1e308])}  # float64 whose squares overflow: refused, no exception
    assert check_update_norm(f64, {"w": np.zeros(2)}, 1e12) is not None
    grads = [np.array([3.0, 4.0], np.float32), np.array([[12.0]], np.float32)]  # norm 13
    assert check_gradient_norm("g0", grads, 13.0) is None and "norm 13 above" in check_gradient_norm("g0", grads, 12.9)


def test_3e38_logits_are_refused():
    honest = np.full((5, 3), 1.0, np.float32)
    grid = InProcessGrid({11: _logit_node(0, honest), 12: _logit_node(1, honest * 3),
                          13: _logit_node(2, np.full((5, 3), HUGE, np.float32))})
    strategy = LogitAveraging(num_public=5, num_classes=3, min_available_nodes=3)
    strategy.start(grid=grid, initial_arrays=_record({}), num_rounds=1)
    np.testing.assert_array_equal(strategy.consensus, np.full((5, 3), 2.0, np.float32))
    reasons = {r["client"]: r["reason"] for r in strategy.reports[1].rejected}
    assert "'logits': magnitude 3e+38 above the plausible maximum 10000" in reasons["partition 2"]


def test_absurd_metrics_are_dropped_with_the_usual_reason():
    """An absurd loss is left out of the round's metrics (a WARNING with the usual reason); the reply,
    which the strategy acts on only through its count and partition, still counts."""
    for loss in (1e308, 1e13, -1e13):
        content = RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": loss, "partition-id": 1})})
        grid = InProcessGrid({11: _weights_node(0, 10, 1.0),
                              12: lambda m, c=content: c if m.metadata.message_type == "evaluate"
                              else _weights_node(1, 10, 1.0)(m)})
        strategy = WeightAveraging(min_available_nodes=2)
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=1)
        assert result.evaluate_metrics_clientapp[1]["loss"] == 1.0  # the honest client's only
        assert not strategy.reports[1].rejected and len(strategy.reports[1].evaluate_clients) == 2
        (dropped,) = strategy.reports[1].dropped_metrics
        assert dropped["stage"] == "evaluate" and dropped["client"] == "partition 1"
        assert dropped["reason"].startswith("metric 'loss' =") and "beyond the sane range ±1e+12" in dropped["reason"]
    assert check_metrics({"train-loss": 1e12, "foo": 2.0**53}, {}) is None
    assert "'foo'" in check_metrics({"foo": [1.0, 2.0**53 + 2]}, {})
    assert "'proxy-matching-loss'" in check_metrics({"proxy-matching-loss": 1e300}, {})


# -- GLFC: models and proto-grads; the proxy never sees a refused gradient ------------------------------
def test_glfc_refuses_3e38_models_and_proto_grads_before_the_proxy(monkeypatch):
    import pollen.strategies.proxy as proxy

    seen: list[float] = []
    real = proxy.reconstruct_batched

    def spy(lenet, grads, *args, **kwargs):
        seen.extend(float(np.abs(np.asarray(g)).max()) for gset in grads for g in gset)
        return real(lenet, grads, *args, **kwargs)

    monkeypatch.setattr(proxy, "reconstruct_batched", spy)
    strat = _strategy(clients_per_round=10)
    msgs = _configure(strat, 1, identity_grid(5))
    honest = _grad_set(strat)
    huge_grads = {k: np.full_like(v, HUGE) for k, v in honest.items()}
    huge_model = {k: (np.full_like(a.numpy(), HUGE) if a.numpy().dtype.kind == "f" else a.numpy())
                  for k, a in msgs[2].content[ARRAYS].items()}
    assert sorted(msgs) == [0, 1, 2]  # task 0: three clients
    before = {k: v.copy() for k, v in zip(strat.keys, strat._global)}
    _, metrics = strat.aggregate_train(1, [_reply(msgs[0], 0, [honest], transition=1),
                                           _reply(msgs[1], 1, [huge_grads], transition=1),
                                           _reply(msgs[2], 2, state=huge_model)])
    reasons = {r["client"]: r["reason"] for r in strat.take_round_report(1).rejected}
    assert "'proto-grads' set 'g0': gradient norm" in reasons["partition 1"]
    assert "'arrays': update norm" in reasons["partition 2"] and "max-update-norm" in reasons["partition 2"]
    assert metrics["proxy-gradients"] == 1 and seen and max(seen) <= 1e3  # only the honest set was inverted
    for k, v in zip(strat.keys, strat._global):
        if v.dtype.kind == "f":
            assert np.abs(v).max() <= np.abs(before[k]).max() + 10  # nothing of 3e38 was averaged in


def test_glfc_refuses_a_huge_proto_gradient_set_naming_the_set(monkeypatch):
    import pollen.strategies.proxy as proxy

    called = []
    monkeypatch.setattr(proxy, "reconstruct_batched", lambda *a, **k: called.append(a) or pytest.fail("proxy ran"))
    strat = _strategy(clients_per_round=10)
    msgs = _configure(strat, 1, identity_grid(5))
    honest = _grad_set(strat)
    huge = {k: np.full_like(v, HUGE) for k, v in honest.items()}
    _, metrics = strat.aggregate_train(1, [_reply(msgs[0], 0, [honest, huge], transition=1), _reply(msgs[1], 1)])
    (rejected,) = strat.take_round_report(1).rejected
    assert "'proto-grads' set 'g1': gradient norm" in rejected["reason"]
    assert "max-grad-norm = 10000" in rejected["reason"]
    assert metrics["accepted"] == 1 and metrics["proxy-gradients"] == 0 and not called


def test_a_non_finite_proxy_matching_loss_is_a_warning_naming_the_round(monkeypatch, caplog):
    import pollen.strategies.proxy as proxy

    real = proxy.reconstruct_batched

    def nan_loss(*args, **kwargs):
        rec = real(*args, **kwargs)
        rec.losses = torch.full_like(rec.losses, float("nan"))
        return rec

    monkeypatch.setattr(proxy, "reconstruct_batched", nan_loss)
    strat = _strategy(clients_per_round=10)
    msgs = _configure(strat, 1, identity_grid(5))
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        strat.aggregate_train(1, [_reply(msgs[0], 0, [_grad_set(strat)], transition=1)])
    warned = [r.getMessage() for r in caplog.records if "gradient-matching loss is nan" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("round 1:")


# -- partitions: a claim never takes one ----------------------------------------------------------------
@pytest.mark.parametrize("impostor_id", [5, 99], ids=["impostor-answers-first", "impostor-answers-second"])
def test_an_impostor_never_takes_a_partition(impostor_id, caplog):
    """Two nodes claim partition 0: neither is trusted (quarantine) nor sampled again, whatever the order."""
    honest = _weights_node(0, 10, 1.0)
    grid = InProcessGrid({50: honest, 60: _weights_node(1, 10, 3.0), impostor_id: _hostile_weights(0, 2.0)})
    strategy = WeightAveraging(min_available_nodes=3)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=2)
    assert 0 not in strategy.node_of and strategy.node_of[1] == 60
    nodes = sorted([50, impostor_id])
    for rnd in (1, 2):
        report = strategy.reports[rnd]
        assert report.quarantined == [{"partition": 0, "nodes": nodes}]
        assert list(report.fit_clients) == ["partition 1"]  # nobody's values recorded under partition 0
        train = [r for r in report.rejected if r["stage"] == "train"]
        assert len(train) == (2 if rnd == 1 else 0)  # round 2 sends them nothing
        assert all(f"partition 0 is quarantined: nodes {nodes}" in r["reason"] for r in train)
        warns = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith(f"round {rnd}: partition 0 is claimed by nodes {nodes}")]
        assert len(warns) == 1
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 6.0, rtol=1e-6)  # partition 1 alone, twice
    assert {m.metadata.dst_node_id for m in grid.sent if m.content["config"]["server-round"] == 2} == {60}


def test_an_impostor_whose_victim_leaves_never_trains_as_its_partition(caplog):
    """The impostor joins after round 1 (partition 0 is then disputed), the honest node leaves after round 2:
    the impostor inherits nothing, and neither it nor (while there) the honest node is sampled again."""
    grid = InProcessGrid({50: _weights_node(0, 10, 1.0), 60: _weights_node(1, 10, 3.0)})
    strategy = WeightAveraging(min_available_nodes=1)

    def round_hook(server_round, arrays):
        if server_round == 1:
            grid.handlers[7] = _hostile_weights(0, 1.0)  # joins after round 1
        if server_round == 2:
            del grid.handlers[50]  # the victim leaves after round 2
        return None

    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=4, evaluate_fn=round_hook)
    assert strategy.reports[1].accepted == 2 and not strategy.reports[1].quarantined
    for rnd in (2, 3, 4):
        report = strategy.reports[rnd]
        assert report.quarantined == [{"partition": 0, "nodes": [7, 50]}], rnd
        assert report.accepted == 1 and list(report.fit_clients) == ["partition 1"], rnd
    assert 0 not in strategy.node_of and strategy.node_of[1] == 60
    sent_after = {(int(m.content["config"]["server-round"]), m.metadata.dst_node_id) for m in grid.sent
                  if m.content["config"]["server-round"] >= 3}
    assert sent_after == {(3, 60), (4, 60)}  # train and evaluate: the impostor (7) is never sampled
    np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 2.0 + 3.0 * 3, rtol=1e-6)
    assert any(r.getMessage().startswith("partition 0: node(s) [50], claimant(s) of this quarantined partition, "
                                         "left the grid") for r in caplog.records)


def test_quarantined_nodes_are_not_sampled():
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(0, 10, 3.0), 13: _weights_node(1, 10, 5.0)})
    strategy = WeightAveraging(min_available_nodes=3)
    strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=3)
    by_round = {}
    for m in grid.sent:
        by_round.setdefault((int(m.content["config"]["server-round"]), m.metadata.message_type), set()).add(
            m.metadata.dst_node_id)
    assert by_round[(1, MessageType.TRAIN)] == {11, 12, 13}  # round 1: nobody knew
    for rnd in (2, 3):  # once disputed, both claimants of partition 0 are left out of every draw
        assert by_round[(rnd, MessageType.TRAIN)] == by_round[(rnd, MessageType.EVALUATE)] == {13}
    assert by_round[(1, MessageType.EVALUATE)] == {13}
    assert all(r.accepted == 1 and r.rejected == [] for rnd, r in strategy.reports.items() if rnd > 1)


def test_a_pinned_partition_holds_against_an_impostor_in_either_order():
    for impostor_id in (5, 99):
        grid = InProcessGrid({50: _weights_node(0, 10, 1.0), impostor_id: _hostile_weights(0, 2.0)})
        strategy = WeightAveraging(min_available_nodes=2, partition_pins={0: 50})
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=2)
        np.testing.assert_allclose(result.arrays["w"].numpy(), STATE["w"] + 2.0, rtol=1e-6)  # honest, twice
        for rnd in (1, 2):
            report = strategy.reports[rnd]
            assert report.accepted == 1 and list(report.fit_clients) == ["partition 0"] and not report.quarantined
            assert [r["reason"] for r in report.rejected if r["stage"] == "train"] == [
                f"partition 0 is pinned to node 50, not to this node ({impostor_id})"]


def test_the_identity_query_follows_the_same_rule():
    def impostor(msg):
        return Message(protocol.encode_identity_reply(0), reply_to=msg)

    for pins in (None, {0: node_id(0)}):
        strat = _strategy(clients_per_round=10, partition_pins=pins)
        msgs = _configure(strat, 1, identity_grid(5, {2: impostor}))
        report = strat.take_round_report(1)
        if pins is None:  # partition 0 quarantined: neither node sampled, both named
            assert sorted(msgs) == [1] and report.quarantined == [{"partition": 0, "nodes": [node_id(0), node_id(2)]}]
        else:  # pinned: its node is sampled without being asked, the impostor refused
            assert sorted(msgs) == [0, 1] and not report.quarantined
            assert [r["reason"] for r in report.rejected] == [
                f"partition 0 is pinned to node {node_id(0)}, not to this node ({node_id(2)})"]


def test_partition_pins_parse_and_refuse_bad_text():
    assert parse_partition_pins(" 0:4312, 1:9876 ,") == {0: 4312, 1: 9876}
    assert format_partition_pins({1: 9876, 0: 4312}) == "0:4312,1:9876" and parse_partition_pins("") == {}
    for bad, match in (("0=4", "not <partition>:<node id>"), ("0:4,0:5", "pinned twice"),
                       ("0:4,1:4", "two partitions"), ("-1:4", "not <partition>"), ("0:0", "node id >= 1")):
        with pytest.raises(ValueError, match=match):
            parse_partition_pins(bad)
    with pytest.raises(ValueError, match="several partitions"):
        WeightAveraging(partition_pins={0: 4, 1: 4})


def test_a_partition_pins_run_key_reaches_the_strategy():
    from pollen.app.config import ConfigError, parse_run_config
    from pollen.app.registry import strategy_options

    cfg = parse_run_config({"partition-pins": "0:11,2:13", "aggregation": "median", "max-logit-abs": 50.0})
    options = strategy_options(cfg)
    assert options["partition_pins"] == {0: 11, 2: 13} and options["aggregation"] == "median"
    assert options["bounds"] == PayloadBounds(max_logit_abs=50.0)
    with pytest.raises(ConfigError, match="'partition-pins' = '0:x' is invalid"):
        parse_run_config({"partition-pins": "0:x"})
    with pytest.raises(ConfigError, match="'trim-fraction' = 0.5 is invalid"):
        parse_run_config({"trim-fraction": 0.5})


# -- failures are named by the node the message was sent to ----------------------------------------------
class SuperLinkGrid(InProcessGrid):
    """Sets message ids as Flower's grids do; a node listed in ``dead`` is answered by the SuperLink (node 1)
    with Flower's NODE_UNAVAILABLE error, as a deployment does for a SuperNode that stopped."""

    def __init__(self, handlers, dead=()):
        super().__init__(handlers)
        self.dead = set(dead)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if msg.metadata.dst_node_id in self.dead:
                reply = Message(Error(code=5, reason="Node unavailable"), reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = 1  # written by the SuperLink, not the node
                replies.append(reply)
                continue
            replies += super().send_and_receive([msg], timeout=timeout)
        return replies


def test_a_dead_nodes_failure_is_recorded_under_its_partition_not_the_superlink(caplog):
    grid = SuperLinkGrid({11: _weights_node(0, 10, 1.0), 12: _weights_node(1, 10, 1.0)})
    strategy = WeightAveraging(min_available_nodes=2)

    def kill_after_round_1(server_round, arrays):
        if server_round == 1:
            grid.dead.add(12)

    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=2, evaluate_fn=kill_after_round_1)
    failures = strategy.reports[2].failures
    assert [(f["stage"], f["client"], f["node"], f["code"]) for f in failures] == [
        ("train", "partition 1", 12, 5), ("evaluate", "partition 1", 12, 5)]
    logged = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert logged == ["round 2 train: partition 1 (node 12) failed (error 5): Node unavailable",
                      "round 2 evaluate: partition 1 (node 12) failed (error 5): Node unavailable"]


def test_a_missing_reply_is_a_failure_of_the_node_it_was_sent_to(caplog):
    silent = _weights_node(1, 10, 1.0)
    grid = InProcessGrid({11: _weights_node(0, 10, 1.0),
                          12: lambda m: None if m.content["config"]["server-round"] == 2 else silent(m)})
    strategy = WeightAveraging(min_available_nodes=2)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=2)
    assert [(f["stage"], f["client"], f["code"]) for f in strategy.reports[2].failures] == [
        ("train", "partition 1", None), ("evaluate", "partition 1", None)]
    assert result.train_metrics_clientapp[2]["failures"] == 1
    assert sum("partition 1 (node 12) failed: no reply before the round timeout" in r.getMessage()
               for r in caplog.records) == 2


def test_glfc_error_replies_are_logged_once_each(caplog):
    strat = _strategy(clients_per_round=10)
    msgs = _configure(strat, 1, identity_grid(5))
    crashed = Message(Error(code=2, reason="Traceback ...\nRuntimeError: CUDA out of memory"), reply_to=msgs[1])
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        strat.aggregate_train(1, [_reply(msgs[0], 0), crashed, _reply(msgs[2], 2)])
    report = strat.take_round_report(1)
    assert [(f["client"], f["code"]) for f in report.failures] == [("partition 1", 2)]
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"round 1 train: partition 1 (node {node_id(1)}) failed (error 2): RuntimeError: CUDA out of memory"]


# -- robust aggregation in the strategies ------------------------------------------------------------------
def test_prototype_and_logit_strategies_aggregate_robustly_when_asked():
    protos = [np.full((4, 3), v, np.float32) for v in (1.0, 2.0, 3.0, 4.0)] + [np.full((4, 3), 1e5, np.float32)]
    counts = np.array([5, 5, 0, 0])
    grid = InProcessGrid({10 + i: _proto_node(i, p, counts) for i, p in enumerate(protos)})
    # outlier_factor=0: the aggregation rule alone (the default spread rule would refuse the 1e5 client first)
    strategy = PrototypeStrategy(num_classes=4, embed_dim=3, aggregation="median", min_available_nodes=5,
                                 outlier_factor=0)
    strategy.start(grid=grid, initial_arrays=_record({}), num_rounds=1)
    np.testing.assert_array_equal(strategy.protos[:2], np.full((2, 3), 3.0, np.float32))
    assert not strategy.present[2:].any()

    logits = [np.full((5, 3), v, np.float32) for v in (1.0, 2.0, 3.0, 4.0, 9e3)]
    grid = InProcessGrid({10 + i: _logit_node(i, x) for i, x in enumerate(logits)})
    strategy = LogitAveraging(num_public=5, num_classes=3, aggregation="trimmed-mean", trim_fraction=0.2,
                              outlier_factor=0,
                              min_available_nodes=5)
    strategy.start(grid=grid, initial_arrays=_record({}), num_rounds=1)
    np.testing.assert_array_equal(strategy.consensus, np.full((5, 3), 3.0, np.float32))  # mean of 2, 3, 4
    assert encode_logit_reply(logits[0], 7, {}, public_digest=DIGEST)  # the helper still encodes


def test_glfc_aggregates_robustly_when_asked():
    strat = _strategy(clients_per_round=10, old_model="previous-task", aggregation="median", outlier_factor=0)
    msgs = _configure(strat, 1, identity_grid(5))
    arrays, _ = strat.aggregate_train(1, [_reply(msgs[0], 0, scale=1.0), _reply(msgs[1], 1, scale=2.0),
                                          _reply(msgs[2], 2, scale=40.0)])
    for key, a in msgs[0].content[ARRAYS].items():
        if a.numpy().dtype.kind == "f":
            np.testing.assert_allclose(arrays[key].numpy(), a.numpy() * 2.0, rtol=1e-6)


def test_the_fleet_pins_each_partition_to_its_registered_node(tmp_path, capsys):
    from pollen.launch.errors import EXIT_USAGE
    from pollen.launch.fleet import Fleet, NodeSpec, SuperNode
    from pollen.launch.fleet.cli import main
    from pollen.app.config import ConfigError

    fleet = Fleet(tmp_path, tls=True, echo=False)
    fleet.supernodes = [SuperNode(NodeSpec(f"supernode_{i}", {"partition-id": i, "num-partitions": 2}), None,
                                  tmp_path / "log", None, node) for i, node in enumerate((4312, 9876))]
    assert format_partition_pins(fleet.partition_pins()) == "0:4312,1:9876"
    fleet.supernodes.append(SuperNode(NodeSpec("impostor", {"partition-id": 0}), None, tmp_path / "log", None, 555))
    with pytest.raises(ConfigError, match=r"partition 0 is configured on two registered SuperNodes \(supernode_0 "
                                          r"and impostor\)"):
        fleet.partition_pins()
    assert main(["--pin-partitions", "--num-supernodes", "2"]) == EXIT_USAGE
    assert "--pin-partitions pins partitions to registered node keys: add --tls" in capsys.readouterr().err


# -- the default defence: one node of five sending ×k of its honest update ---------------------------------
# Each family's run in process (Pollen's ServerApp, real ClientApps), tiny; partition ATTACKER's ClientApp
# is tests/faults.py's: its train replies carry k × its honest update (inside every declared bound).
ATTACKER = 2
COMMON_RUN = {"seed": 1, "device": "cpu", "torch-threads": 1, "num-server-rounds": 3}
FAMILY_RUNS: dict[str, tuple[dict, int, bool]] = {  # family -> (run config, nodes, needs the MNIST files)
    "weights": ({"method": "fedavg", "task": "uci-dirichlet", "max-train-samples": 96, "batch-size": 16}, 5, False),
    "prototypes": ({"method": "fedproto", "task": "uci-dirichlet", "max-train-samples": 96, "batch-size": 8,
                    "lr": 0.05}, 5, False),
    # digits-offline has one client per domain: four nodes, one of them hostile
    "logits": ({"method": "fccl", "task": "digits-offline", "model": "cnn_mnist", "fccl-public": "photo_patches",
                "fccl-public-size": 40, "fccl-public-batch-size": 20, "fccl-train-sizes": "24,24,24,24",
                "fccl-solo-epochs": 1, "fccl-local-epochs": "1", "fccl-test-size": 20, "fccl-batch-size": 12},
               4, True),
    # every round is a new task, so every client shares gradient sets every round
    "glfc": ({"method": "glfc", "task": "uci-digits-cil", "glfc-tasks": 3, "glfc-classes-per-task": 3,
              "glfc-rounds-per-task": 1, "glfc-initial-clients": 5, "glfc-new-clients": 0,
              "glfc-clients-per-round": 5, "glfc-max-per-class": 20, "glfc-memory-size": 20,
              "glfc-oracle-boundary": True, "glfc-proxy-iterations": 3, "glfc-proxy-keep": 2,
              "glfc-perturb-steps": 2, "glfc-eval-per-class": 20, "model-width": 0.125, "local-epochs": 1,
              "lr": 0.5, "momentum": 0.0}, 5, False),
}


def _family_config(family: str, out_dir, **extra) -> tuple[dict, int]:
    config, nodes, needs_data = FAMILY_RUNS[family]
    rc = {**COMMON_RUN, **config, "min-available-clients": nodes, "out-dir": str(out_dir), **extra}
    if needs_data:
        from tests.conftest import require_real_data

        rc["data-root"] = require_real_data()
    return rc, nodes


def _float_arrays(arrays: dict, prefix: str = "") -> dict:
    return {k[len(prefix):]: v.astype(np.float64) for k, v in arrays.items()
            if k.startswith(prefix) and v.dtype.kind == "f"}


def _final(run_dir) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run_dir / "final" / "global.safetensors"))


def run_family(family: str, out_dir, kind: str | None = None, **extra):
    """One whole run in process; ``(metrics.jsonl rows, summary, final global state, last round's honest
    replies {partition: arrays})``. With ``kind``, partition ATTACKER runs tests/faults.py's ClientApp;
    ``kind = "silent"``: it answers no train message (the federation without the attacker)."""
    import json

    from flwr.app import Context

    from pollen.app import client_app, server_app
    from pollen.testing import clientapp_node
    from tests.faults import make_app

    rc, nodes = _family_config(family, out_dir, **extra)
    last: dict[int, dict] = {}

    def node(pid: int):
        hostile = kind is not None and kind != "silent" and pid == ATTACKER
        inner = clientapp_node(make_app(ATTACKER, kind) if hostile else client_app.app, rc, pid, nodes,
                               node_id=100 + pid)

        def handle(msg):
            training = msg.metadata.message_type == MessageType.TRAIN
            if training and kind == "silent" and pid == ATTACKER:
                return None
            out = inner(msg)
            if training and not out.has_error() and pid != ATTACKER \
                    and msg.content["config"]["server-round"] == rc["num-server-rounds"]:
                last[pid] = {k: a.numpy() for k, a in out.content["arrays"].items()}
            return out
        return handle

    grid = InProcessGrid({100 + p: node(p) for p in range(nodes)})
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    run_dir = out_dir / "1"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows, json.loads((run_dir / "summary.json").read_text()), _final(run_dir), last


def honest_spread(family: str, final: dict, replies: dict) -> float:
    """How far the honest clients' last replies lie from the global state they made: the yardstick."""
    if family in ("weights", "glfc"):
        glob = _float_arrays(final, "model.")
        return max(math.sqrt(sum(float(np.square(r[k].astype(np.float64) - g).sum()) for k, g in glob.items()))
                   for r in replies.values())
    if family == "prototypes":
        protos, present = final["prototypes"].astype(np.float64), final["present"].astype(bool)
        return max(float(np.linalg.norm(r["prototypes"][j] - protos[j])) for r in replies.values()
                   for j in np.flatnonzero((r["class-counts"] > 0) & present))
    return max(float(np.linalg.norm(r["logits"].astype(np.float64) - final["consensus"])) for r in replies.values())


def distance(family: str, got: dict, honest: dict) -> float:
    """How far one run's final global state lies from another's."""
    if family in ("weights", "glfc"):
        a, b = _float_arrays(got, "model."), _float_arrays(honest, "model.")
        return math.sqrt(sum(float(np.square(a[k] - b[k]).sum()) for k in b))
    if family == "prototypes":
        both = np.flatnonzero(got["present"].astype(bool) & honest["present"].astype(bool))
        return max(float(np.linalg.norm(got["prototypes"][j].astype(np.float64) - honest["prototypes"][j]))
                   for j in both)
    return float(np.linalg.norm(got["consensus"].astype(np.float64) - honest["consensus"]))


@pytest.fixture(scope="module")
def runs_without_attacker(tmp_path_factory):
    """Each family's run without the attacker (its node silent), computed once, on first use."""
    done: dict[str, tuple] = {}

    def get(family: str):
        if family not in done:
            done[family] = run_family(family, tmp_path_factory.mktemp(f"without-{family}"), kind="silent")
        return done[family]
    return get


def check_defended(family: str, rows: list, summary: dict, final: dict, without, messages: list[str]) -> None:
    """The run completed, its global state lies within the honest spread of the run without the attacker,
    and every round refused the attacker by ratio, with a WARNING naming node, partition and ratio."""
    h_rows, h_summary, h_final, h_replies = without
    assert h_summary["status"] == "completed" and all(r["accepted"] == r["sampled"] - 1 for r in h_rows), h_rows
    assert summary["status"] == "completed", summary.get("failure-reason")
    spread, moved = honest_spread(family, h_final, h_replies), distance(family, final, h_final)
    assert moved <= spread, f"{family}: the global state moved {moved:.4g} from the honest run's, beyond {spread:.4g}"
    for row in rows:  # refused by the spread rule, or (far enough) by a declared bound first: the outer wall
        (refused,) = [r for r in row["rejected"] if r["stage"] == "train"]
        assert refused["client"] == f"partition {ATTACKER}" and f"partition {ATTACKER}" not in row["fit-clients"]
        warned = [m for m in messages if m.startswith(f"round {row['round']} train: rejected reply from partition "
                                                      f"{ATTACKER}: ")]
        assert len(warned) == 1, warned
        if "ratio" in refused:
            assert refused["node"] == 100 + ATTACKER and refused["ratio"] > 5, refused
            assert f"(node {100 + ATTACKER})" in warned[0] and f"is {refused['ratio']:.4g} × the round's median" \
                in warned[0]
        else:
            assert "above the bound max-" in refused["reason"], refused


@pytest.mark.parametrize("factor", [10, 100, 1000])
@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_one_node_sending_k_times_its_update_is_refused_by_default(family, factor, runs_without_attacker, tmp_path,
                                                                  caplog):
    without = runs_without_attacker(family)
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        rows, summary, final, _ = run_family(family, tmp_path, kind=f"scale-{factor}")
    check_defended(family, rows, summary, final, without, [r.getMessage() for r in caplog.records])


def test_without_the_defence_the_attack_moves_the_global_state_far_outside(runs_without_attacker, tmp_path):
    """The yardstick can fail: with the rule off, ×100 from one node of five drags the mean far away."""
    without = runs_without_attacker("weights")
    rows, summary, final, _ = run_family("weights", tmp_path, kind="scale-100", **{"outlier-factor": 0.0})
    assert not any("ratio" in r for row in rows for r in row["rejected"])  # nothing refused by the spread rule
    assert distance("weights", final, without[2]) > 3 * honest_spread("weights", without[2], without[3])


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_flwr_run_with_one_node_sending_10_100_1000_times_its_update(family, runs_without_attacker, tmp_path):
    """Through ``flwr run`` (simulation, default settings): partition ATTACKER's ClientApp sends ×10, ×100 and
    ×1000 of its honest update in rounds 1, 2 and 3 (tests/faults.py ``scale-by-round``). The run completes,
    every round refuses it with a WARNING naming its partition, and the final global state lies within the
    honest spread of the run without it (in process, same settings)."""
    import json

    from pollen.launch.launcher import simulate
    from tests.conftest import PROJECT_ROOT, RAY_CPUS
    from tests.faults import faulty_app_dir

    out = tmp_path / "runs"
    rc, nodes = _family_config(family, out)
    app_dir = faulty_app_dir(tmp_path, PROJECT_ROOT, partition=ATTACKER, kind="scale-by-round")
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=app_dir, flwr_home=tmp_path / "flwr", num_supernodes=nodes,
                       run_config=rc, timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    run_dir = out / str(outcome.run_id)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3]
    without = runs_without_attacker(family)
    spread, moved = honest_spread(family, without[2], without[3]), distance(family, _final(run_dir), without[2])
    assert summary["status"] == "completed" and moved <= spread, (moved, spread)
    log = outcome.log
    for row in rows:
        (refused,) = [r for r in row["rejected"] if r["stage"] == "train"]
        assert refused["client"] == f"partition {ATTACKER}", refused
        assert f"round {row['round']} train: rejected reply from partition {ATTACKER}: {refused['reason']}" in log
        if "ratio" in refused:  # the spread rule; else a declared bound refused it first
            assert f"(node {refused['node']})" in refused["reason"] and refused["ratio"] > 5
