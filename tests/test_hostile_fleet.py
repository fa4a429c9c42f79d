"""An impostor SuperNode on a real TLS fleet (issue 31): two registered nodes claim partition 0.

One fleet, two one-round runs: without a pin the partition is quarantined (both nodes refused, named
in ``metrics.jsonl``); with ``partition-pins`` naming the honest node's registered id, only that node
serves partition 0 and the impostor is refused. Either way the impostor's values are never aggregated
under partition 0. (The in-process variants, both answer orders included: ``tests/test_hostile_nodes.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollen.launch.fleet import Fleet, NodeSpec, compose_run_config, format_config, plan_nodes
from pollen.launch.processes import groups_alive
from pollen.protocol.identity import format_partition_pins


def _round_1(out_dir: Path) -> dict:
    (path,) = out_dir.glob("*/metrics.jsonl")  # one run per folder
    lines = path.read_text().splitlines()
    return json.loads(lines[0])


@pytest.mark.e2e
def test_an_impostor_supernode_never_takes_a_partition_and_a_pin_holds(tmp_path):
    out = tmp_path / "runs"
    user = format_config({"local-epochs": 1, "fraction-evaluate": 0.0})
    with Fleet(tmp_path / "work", tls=True, echo=False) as fleet:
        honest, other = (fleet.add_supernode(spec) for spec in plan_nodes(2))
        impostor = fleet.add_supernode(NodeSpec("impostor", {"partition-id": 0, "num-partitions": 2}))
        fleet.wait_for_nodes(3, timeout=180)
        ids = {"honest": honest.registered_id, "impostor": impostor.registered_id, "other": other.registered_id}
        outcomes = {}
        for name, pins in (("open", ""), ("pinned", format_partition_pins({0: ids["honest"], 1: ids["other"]}))):
            values, _ = compose_run_config(method="fedavg", rounds=1, out_dir=out / name, data_root=None,
                                           user=user, num_supernodes=3)
            outcomes[name] = fleet.run({**values, "partition-pins": pins}, timeout=600, echo=False)
        groups = fleet.process_groups()
    assert not groups_alive(groups), "a SuperLink/SuperNode outlived its fleet"
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
