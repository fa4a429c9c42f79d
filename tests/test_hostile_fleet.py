"""An impostor SuperNode on a real TLS fleet (issue 31): two registered nodes claim partition 0.

One fleet, two one-round runs: without a pin the partition is quarantined (both nodes refused, named
in ``metrics.jsonl``); with ``partition-pins`` naming the honest node's registered id, only that node
serves partition 0 and the impostor is refused. Either way the impostor's values are never aggregated
under partition 0. (The in-process variants, both answer orders included: ``tests/test_hostile_nodes.py``.)
After the runs, a fourth node whose key was never registered is refused by the SuperLink and exits.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pollen.launch.fleet import Fleet, NodeSpec, compose_run_config, format_config, plan_nodes, supernodes
from pollen.launch.processes import groups_alive
from pollen.protocol.identity import format_partition_pins


def _round_1(out_dir: Path) -> dict:
    (path,) = out_dir.glob("*/metrics.jsonl")  # one run per folder
    lines = path.read_text().splitlines()
    return json.loads(lines[0])


@pytest.mark.e2e
def test_an_impostor_supernode_never_takes_a_partition_a_pin_holds_and_an_unregistered_key_is_refused(tmp_path):
    out = tmp_path / "runs"
    user = format_config({"local-epochs": 1, "fraction-evaluate": 0.0})
    with Fleet(tmp_path / "work", tls=True, echo=False) as fleet:
        honest, other = (fleet.add_supernode(spec) for spec in plan_nodes(2))
        impostor = fleet.add_supernode(NodeSpec("impostor", {"partition-id": 0, "num-partitions": 2}))
        online = fleet.wait_for_nodes(3, timeout=180)
        ids = {"honest": honest.registered_id, "impostor": impostor.registered_id, "other": other.registered_id}
        outcomes = {}
        for name, pins in (("open", ""), ("pinned", format_partition_pins({0: ids["honest"], 1: ids["other"]}))):
            values, _ = compose_run_config(method="fedavg", rounds=1, out_dir=out / name, data_root=None,
                                           user=user, num_supernodes=3)
            outcomes[name] = fleet.run({**values, "partition-pins": pins}, timeout=600, echo=False)
        intruder = fleet.add_supernode(NodeSpec("intruder", {"partition-id": 0, "num-partitions": 2}),
                                       register=False)
        try:
            code = intruder.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("a SuperNode with an unregistered key kept running for 120 s")
        listed = supernodes.list_supernodes(fleet.connection, fleet.flwr_home)
        intruder_log = intruder.log_path.read_text(errors="replace")
        groups = fleet.process_groups()
    assert not groups_alive(groups), "a SuperLink/SuperNode outlived its fleet"
    # The node whose key was never registered gets no node id: it logs Flower's exit code 305 with the
    # activation error and exits with status 1 (Flower's flwr_exit maps every error code to status 1), and
    # the SuperLink lists only the registered nodes.
    registered = sorted(str(i) for i in ids.values())
    assert sorted(online) == registered
    assert code == 1, intruder_log[-2000:]
    assert "Exit Code: 305" in intruder_log and "Failed to activate SuperNode" in intruder_log, intruder_log[-2000:]
    assert sorted((n["node-id"], n["status"]) for n in listed) == [(i, "online") for i in registered]
    both = sorted([ids["honest"], ids["impostor"]])

    open_run = outcomes["open"]
    assert open_run.completed, open_run.log[-4000:]
    first = _round_1(out / "open")
    assert set(first["fit-clients"]) == {"partition 1"}  # partition 0: nobody's values
    reasons = [r["reason"] for r in first["rejected"]]
    assert len(reasons) == 2 and all(r.startswith(f"partition 0 is quarantined: nodes {both}") for r in reasons)
    assert f"partition 0 is claimed by nodes {both}: quarantined" in open_run.log

    pinned = outcomes["pinned"]
    assert pinned.completed, pinned.log[-4000:]
    first = _round_1(out / "pinned")
    assert set(first["fit-clients"]) == {"partition 0", "partition 1"}
    assert [r["reason"] for r in first["rejected"]] == [
        f"partition 0 is pinned to node {ids['honest']}, not to this node ({ids['impostor']})"]
    assert "quarantined" not in pinned.log
