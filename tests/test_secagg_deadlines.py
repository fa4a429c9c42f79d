"""Secure rounds under a run's deadlines and minimums, through the real ServerApp and ClientApps in-process:
on a fleet ``round-timeout`` bounds every SecAgg+ stage (a node silent at a stage drops out there, late),
``min-train-clients`` holds back a round left with fewer contributions, and a resumed run's simulated
clock goes on where it stopped."""

from __future__ import annotations

import json
import logging

import pytest
from flwr.app import Context, MessageType, RecordDict

from pollen.app import client_app, server_app
from pollen.testing import InProcessGrid, clientapp_node

RC = {"method": "fedavg", "task": "uci-dirichlet", "max-train-samples": 64, "batch-size": 8, "seed": 3,
      "device": "cpu", "checkpoint-every": 0, "fraction-evaluate": 0.0, "secure-aggregation": True}
NODES = 5  # the complete graph: t = ceil(0.6 * 5) = 3 of 5


def _stage(msg) -> str:
    return str(msg.content["secagg"]["stage"]) if "secagg" in msg.content else "plain"


def _grid(rc: dict, silent: dict[tuple[int, str], set[int]], name: str = "InProcessGrid", state_root=None):
    """The in-process grid, under ``name`` (``HttpGrid``: a SuperLink's grid, so the app runs as on a fleet).
    The partitions in ``silent[(round, stage)]`` never answer that SecAgg+ stage of that round (their reply
    would come after the wait); every training wait and every stage sent is recorded."""

    class Grid(InProcessGrid):
        def __init__(self):
            super().__init__({100 + p: clientapp_node(
                client_app.app, rc, p, NODES, state_dir=str(state_root / f"p{p}") if state_root else None)
                for p in range(NODES)})
            self.waits: list[float | None] = []
            self.stages: list[tuple[int, str, int]] = []  # (round, stage, partition) of every stage message

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if any(m.metadata.message_type == MessageType.TRAIN for m in messages):
                self.waits.append(timeout)
            replies = []
            for msg in messages:
                rnd, stage, pid = int(msg.metadata.group_id or 0), _stage(msg), msg.metadata.dst_node_id - 100
                if msg.metadata.message_type == MessageType.TRAIN:
                    self.stages.append((rnd, stage, pid))
                if pid in silent.get((rnd, stage), set()):
                    continue
                replies += super().send_and_receive([msg], timeout=timeout)
            return replies

    Grid.__name__ = name
    return Grid()


def _run(grid, rc: dict):
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    run_dir = grid_dir(rc)
    return (json.loads((run_dir / "summary.json").read_text()),
            [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def grid_dir(rc: dict):
    from pathlib import Path

    return Path(rc["resume-from"]) if rc.get("resume-from") else Path(rc["out-dir"]) / "1"


# -- a fleet: round-timeout is the wall-clock wait of every stage ------------------------------------------

@pytest.mark.parametrize("stage", ["setup", "share-keys", "collect", "unmask"])
def test_on_a_fleet_each_secagg_stage_waits_round_timeout_and_a_node_silent_there_drops_out_late(stage, tmp_path):
    """One node of five never answers one stage: every stage waited round-timeout (30 s, not the strategy's
    3600 s), the node is missing, late at that stage (not a failure), and the four others are summed; silent
    only at unmask it had contributed already and the others' shares rebuild its seed: all five summed."""
    rc = {**RC, "num-server-rounds": 1, "round-timeout": 30.0, "min-available-clients": NODES,
          "out-dir": str(tmp_path)}
    grid = _grid(rc, {(1, stage): {2}}, name="HttpGrid")
    summary, (rec,) = _run(grid, rc)
    assert summary["status"] == "completed"
    assert grid.waits and all(w == 30.0 for w in grid.waits)
    assert {s for _, s, _ in grid.stages} == {"setup", "share-keys", "collect", "unmask"}
    if stage == "unmask":
        assert rec["accepted"] == NODES and rec["network"]["missing"] == []
        assert rec["secure-aggregation"]["summed"] == NODES
        return
    assert rec["accepted"] == NODES - 1 and rec["failures"] == 0
    assert rec["network"]["missing"] == [{"client": "partition 2", "node": 102, "why": "late", "stage": stage,
                                          "late-by-s": None, "sim-time-s": None}]
    assert rec["network"]["sim-clock-s"] is None and rec["network"]["deadline-s"] == 30.0
    assert rec["secure-aggregation"]["dropped"] == {"partition 2": stage}
    assert rec["secure-aggregation"]["summed"] == NODES - 1


def test_on_a_fleet_a_round_silent_below_the_threshold_fails_with_its_reason_and_the_run_goes_on(tmp_path, caplog):
    """Three of five silent at collect in round 1 leave two holders of each secret, below t = 3: the round fails
    naming the threshold (the two who answered get error replies with it, the three are late), max-empty-rounds
    = 1 lets the run go on, and round 2 sums all five."""
    rc = {**RC, "num-server-rounds": 2, "round-timeout": 30.0, "min-available-clients": NODES,
          "max-empty-rounds": 1, "out-dir": str(tmp_path)}
    grid = _grid(rc, {(1, "collect"): {0, 2, 4}}, name="HttpGrid")
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        summary, (first, second) = _run(grid, rc)
    assert summary["status"] == "completed"
    assert first["accepted"] == 0 and first["failures"] == 2
    assert sorted((m["client"], m["why"], m["stage"]) for m in first["network"]["missing"]) == [
        ("partition 0", "late", "collect"), ("partition 2", "late", "collect"), ("partition 4", "late", "collect")]
    assert any("round 1 not aggregated" in r.getMessage() and "the threshold is 3" in r.getMessage()
               for r in caplog.records)
    assert second["accepted"] == NODES and second["secure-aggregation"]["summed"] == NODES
    assert all(w == 30.0 for w in grid.waits)


def test_on_a_fleet_simulated_faults_are_refused_under_secure_aggregation_too(tmp_path):
    rc = {**RC, "num-server-rounds": 1, "client-dropout": 0.2, "min-available-clients": NODES,
          "out-dir": str(tmp_path)}
    with pytest.raises(ValueError, match="client-dropout, client-slow-fraction and client-time-spread simulate"):
        _run(_grid(rc, {}, name="HttpGrid"), rc)


# -- min-train-clients ---------------------------------------------------------------------------------------

def test_min_train_clients_holds_back_a_secure_round_left_with_fewer_contributions(tmp_path, caplog):
    """min-train-clients = 5 of 5. Round 1: one node silent at collect leaves four contributions: nothing is
    unmasked and the round fails naming the key. Round 2: one node silent at setup: the round fails right after
    setup, so nobody is sent the training instruction. Round 3 sums all five (max-empty-rounds = 2)."""
    rc = {**RC, "num-server-rounds": 3, "min-available-clients": NODES, "min-train-clients": NODES,
          "max-empty-rounds": 2, "out-dir": str(tmp_path)}
    grid = _grid(rc, {(1, "collect"): {1}, (2, "setup"): {3}})
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        summary, rounds = _run(grid, rc)
    assert summary["status"] == "completed"
    assert [r["accepted"] for r in rounds] == [0, 0, NODES]
    failed = [r.getMessage() for r in caplog.records if "not aggregated" in r.getMessage()]
    assert len(failed) == 2
    assert "after stage 'collect': 4 of 5 nodes left, fewer than the 5 contributions" in failed[0]
    assert "after stage 'setup': 4 of 5 nodes left" in failed[1] and "min-train-clients" in failed[1]
    assert "unmask" not in {s for rnd, s, _ in grid.stages if rnd == 1}  # nothing of round 1 was unmasked
    assert {s for rnd, s, _ in grid.stages if rnd == 2} == {"setup"}  # nobody trained for round 2
    assert rounds[0]["secure-aggregation"]["dropped"] == {"node 101": "collect"}  # no partition claimed yet


# -- the simulated clock ------------------------------------------------------------------------------------

def test_a_resumed_secure_run_continues_the_simulated_clock(tmp_path):
    """A secure run under a simulated network (jittered client times) stopped after round 2 and resumed: round
    3's simulated clock is the uninterrupted run's, the sum of the three rounds' simulated times."""
    keys = {**RC, "num-server-rounds": 3, "client-time-spread": 0.5, "round-timeout": 100.0,
            "min-available-clients": NODES, "checkpoint-every": 1}
    full = {**keys, "out-dir": str(tmp_path / "full")}
    _, full_rounds = _run(_grid(full, {}, state_root=tmp_path / "full-nodes"), full)
    part = {**keys, "num-server-rounds": 2, "out-dir": str(tmp_path / "part")}
    _run(_grid(part, {}, state_root=tmp_path / "part-nodes"), part)
    resumed = {**keys, "out-dir": str(tmp_path / "unused"), "resume-from": str(tmp_path / "part" / "1")}
    _, rounds = _run(_grid(resumed, {}, state_root=tmp_path / "part-nodes"), resumed)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    clock = [r["network"]["sim-clock-s"] for r in rounds]
    assert clock == [r["network"]["sim-clock-s"] for r in full_rounds]
    assert clock[2] == pytest.approx(sum(r["network"]["sim-round-s"] for r in rounds), abs=1e-5)
    assert rounds[2]["network"]["sim-round-s"] > 0 and clock[2] > rounds[2]["network"]["sim-round-s"]
