"""The simulated network's pure parts (pollen/strategies/network.py) against counting and hand computation."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pollen.strategies.network import NO_DEADLINE_WAIT_S, NetworkModel, close_round, slow_partitions


def test_dropout_frequency_is_the_probability_and_each_draw_is_fixed_by_seed_round_and_partition():
    net = NetworkModel(dropout=0.3, seed=5)
    draws = [net.drops(r, p) for r in range(1, 101) for p in range(50)]
    n = len(draws)
    assert abs(sum(draws) / n - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)  # binomial: within 4 s.e.
    assert draws == [net.drops(r, p) for r in range(1, 101) for p in range(50)]  # no hidden RNG state
    assert [net.drops(7, p) for p in reversed(range(50))] == [net.drops(7, p) for p in range(50)][::-1]
    other = NetworkModel(dropout=0.3, seed=6)
    assert draws != [other.drops(r, p) for r in range(1, 101) for p in range(50)]
    assert not any(NetworkModel(dropout=0.0).drops(r, 0) for r in range(100))


def test_slow_partitions_are_an_exact_share_chosen_by_the_seed_whatever_the_order():
    parts = list(range(10))
    slow = slow_partitions(parts, 0.2, seed=3)
    assert len(slow) == 2 and slow <= set(parts)
    assert slow_partitions(reversed(parts), 0.2, seed=3) == slow
    assert len(slow_partitions(parts, 0.25, seed=3)) == 3  # 2.5 rounds half up
    assert slow_partitions(parts, 0.0, 3) == frozenset() and slow_partitions(parts, 1.0, 3) == frozenset(parts)
    assert len({slow_partitions(parts, 0.2, seed=s) for s in range(20)}) > 5  # the seed chooses


def test_jitter_is_lognormal_with_mean_one_and_the_given_spread():
    net = NetworkModel(spread=0.5, seed=1)
    factors = [net.factor(r, p) for r in range(1, 201) for p in range(20)]
    logs = [math.log(f) for f in factors]
    assert statistics.fmean(factors) == pytest.approx(1.0, abs=0.03)
    assert statistics.stdev(logs) == pytest.approx(0.5, abs=0.02)
    assert statistics.fmean(logs) == pytest.approx(-0.125, abs=0.02)  # −σ²/2
    assert NetworkModel(spread=0.0).factor(3, 4) == 1.0


def test_duration_is_examples_times_epochs_times_sample_time_times_slowdown_and_factor():
    net = NetworkModel(slowdown=5.0, sample_time=0.002, local_epochs=3, spread=0.2, seed=9)
    assert net.duration(4, 1, 100, slow=False) == pytest.approx(100 * 3 * 0.002 * net.factor(4, 1))
    assert net.duration(4, 1, 100, slow=True) == pytest.approx(5 * net.duration(4, 1, 100, slow=False))
    assert NetworkModel().duration(1, 0, 0, slow=True) == 0.0


def test_the_deadline_rule_by_hand():
    arrivals = {"partition 0": 2.0, "partition 1": None, "partition 2": 7.5, "partition 3": 4.0}
    t = close_round(arrivals, wait_s=5.0, min_arrived=2)
    assert t.arrived == ["partition 0", "partition 3"] and t.dropped == ["partition 1"]
    assert t.late == {"partition 2": 2.5} and t.round_s == 5.0 and not t.below_minimum
    assert close_round(arrivals, wait_s=5.0, min_arrived=3).below_minimum  # 2 in time, 3 needed
    everyone = close_round({"a": 1.0, "b": 3.0}, wait_s=5.0)
    assert everyone.round_s == 3.0 and everyone.arrived == ["a", "b"]  # nobody missing: no waiting for the deadline
    no_deadline = NetworkModel(dropout=0.1).wait_s()
    assert no_deadline == NO_DEADLINE_WAIT_S and close_round({"a": 1.0, "b": None}, no_deadline).round_s == 3600.0
    assert close_round({}, 5.0).below_minimum


@pytest.mark.parametrize("kwargs", [{"dropout": 1.0}, {"dropout": -0.1}, {"slow_fraction": 1.5}, {"slowdown": 0.5},
                                    {"spread": -1.0}, {"sample_time": 0.0}, {"deadline": -1.0}])
def test_out_of_range_network_settings_are_refused_by_name(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        NetworkModel(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# whole runs: Pollen's ServerApp and real ClientApps in this process (no Ray), the network applied by the strategy

RC = {"task": "uci-dirichlet", "max-train-samples": 64, "batch-size": 8, "seed": 3, "num-server-rounds": 3,
      "device": "cpu", "min-available-clients": 6, "checkpoint-every": 0}


def _run(tmp_path, name: str, nodes: int = 6, **keys):
    from flwr.app import Context, RecordDict

    from pollen.app import client_app, server_app
    from pollen.testing import InProcessGrid, clientapp_node

    rc = {**RC, "out-dir": str(tmp_path / name), **keys}
    grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, nodes) for p in range(nodes)})
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    run_dir = tmp_path / name / "1"
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), rounds


def _without_wall_times(rounds):
    return [{k: v for k, v in r.items() if k not in ("wall-time-s", "elapsed-s")} for r in rounds]


def test_a_run_with_dropouts_and_a_deadline_completes_records_who_dropped_and_repeats_exactly(tmp_path):
    keys = {"client-dropout": 0.3, "round-timeout": 0.2, "client-time-spread": 0.3, "client-sample-time": 0.002}
    summary, rounds = _run(tmp_path, "a", **keys)
    assert summary["status"] == "completed" and summary["last-round"] == 3
    net = NetworkModel(dropout=0.3, spread=0.3, sample_time=0.002, deadline=0.2, seed=3)
    dropped = {r: [p for p in range(6) if net.drops(r, p)] for r in (1, 2, 3)}
    assert any(dropped.values())  # this seed drops someone: the test can fail
    for rec in rounds:
        missing = rec["network"]["missing"]
        expected = [f"partition {p}" for p in dropped[rec["round"]]]
        assert [m["client"] for m in missing if m["why"] == "dropped"] == expected
        assert rec["failures"] == 0  # a missing client is not a failure
        late = {m["client"]: m for m in missing if m["why"] == "late"}
        for client, metrics in rec["fit-clients"].items():  # everyone aggregated answered by the deadline
            p = int(client.split()[1])
            assert net.duration(rec["round"], p, metrics["num-examples"], slow=False) <= 0.2
        for m in late.values():
            assert m["late-by-s"] > 0 and m["sim-time-s"] == pytest.approx(0.2 + m["late-by-s"])
        assert rec["accepted"] == 6 - len(missing)
        assert rec["network"]["sim-round-s"] <= 0.2 + 1e-9
    assert rounds[-1]["network"]["sim-clock-s"] == pytest.approx(sum(r["network"]["sim-round-s"] for r in rounds))
    _, again = _run(tmp_path, "b", **keys)
    assert _without_wall_times(again) == _without_wall_times(rounds)  # one seed: the same metrics, to the bit


def test_slow_clients_past_the_deadline_are_late_and_without_one_the_round_waits_for_them(tmp_path):
    keys = {"client-slow-fraction": 0.34, "client-slowdown": 10.0, "client-sample-time": 0.001}
    slow = sorted(slow_partitions(range(6), 0.34, seed=3))
    assert len(slow) == 2
    _, waited = _run(tmp_path, "wait", **keys)
    _, cut = _run(tmp_path, "cut", **keys, **{"round-timeout": 0.2})
    for w, c in zip(waited, cut):
        assert w["network"]["missing"] == [] and w["accepted"] == 6
        examples = {int(k.split()[1]): v["num-examples"] for k, v in w["fit-clients"].items()}
        assert w["network"]["sim-round-s"] == pytest.approx(max(examples[p] * 0.001 * (10 if p in slow else 1)
                                                                for p in range(6)))
        assert [(m["client"], m["why"]) for m in c["network"]["missing"]] == [(f"partition {p}", "late") for p in slow]
        assert c["accepted"] == 4 and c["network"]["sim-round-s"] == 0.2


def test_fewer_replies_than_min_train_clients_by_the_deadline_aggregate_none(tmp_path, caplog):
    import logging

    keys = {"client-slow-fraction": 0.5, "client-slowdown": 10.0, "round-timeout": 0.2, "min-train-clients": 4,
            "num-server-rounds": 1, "max-empty-rounds": 1}
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        summary, rounds = _run(tmp_path, "few", **keys)
    assert summary["status"] == "completed"
    net = rounds[0]["network"]
    assert rounds[0]["accepted"] == 0 and net["arrived"] == 0
    assert sorted(m["why"] for m in net["missing"]) == ["late"] * 3 + ["unused"] * 3
    assert any("fewer than min-train-clients = 4: none is aggregated" in r.getMessage() for r in caplog.records)


def _fleet_grid(nodes: int, rc: dict, silent: set[int]):
    """An in-process grid that calls itself ``HttpGrid``, as a SuperLink's grid does: the nodes in ``silent``
    never answer a training message (as if their reply came after the wait), and each wait is recorded."""
    from flwr.app import MessageType

    from pollen.app import client_app
    from pollen.testing import InProcessGrid, clientapp_node

    class HttpGrid(InProcessGrid):
        def __init__(self):
            super().__init__({100 + p: clientapp_node(client_app.app, rc, p, nodes) for p in range(nodes)})
            self.waits: list[tuple[str, float | None]] = []

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            kinds = {m.metadata.message_type for m in messages}
            self.waits.extend((k, timeout) for k in kinds)
            replies = super().send_and_receive(messages, timeout=timeout)
            return [r for r in replies if not (MessageType.TRAIN in kinds and r.metadata.src_node_id - 100 in silent)]

    return HttpGrid()


def test_on_a_fleet_the_deadline_is_the_wall_clock_wait_and_a_reply_not_there_is_late(tmp_path):
    from flwr.app import Context, MessageType, RecordDict

    from pollen.app import server_app

    rc = {**RC, "num-server-rounds": 1, "round-timeout": 30.0, "min-available-clients": 4, "out-dir": str(tmp_path)}
    grid = _fleet_grid(4, rc, silent={2})
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    rec = json.loads((tmp_path / "1" / "metrics.jsonl").read_text())
    assert (MessageType.TRAIN, 30.0) in grid.waits and (MessageType.EVALUATE, 3600) in grid.waits
    assert rec["network"]["missing"] == [{"client": "partition 2", "node": 102, "why": "late", "late-by-s": None,
                                          "sim-time-s": None}]
    assert rec["accepted"] == 3 and rec["failures"] == 0 and rec["network"]["sim-clock-s"] is None


def test_on_a_fleet_simulated_dropouts_are_refused_naming_the_keys(tmp_path):
    from flwr.app import Context, RecordDict

    from pollen.app import server_app

    rc = {**RC, "num-server-rounds": 1, "client-dropout": 0.2, "min-available-clients": 2, "out-dir": str(tmp_path)}
    with pytest.raises(ValueError, match="client-dropout, client-slow-fraction and client-time-spread simulate"):
        server_app.app(_fleet_grid(2, rc, set()), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                           run_config=dict(rc)))
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    assert summary["status"] == "failed" and "client-dropout" in summary["failure-reason"]


