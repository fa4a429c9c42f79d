"""The cluster benchmark's pure parts (``bench/cluster.py``), without starting Ray or Flower.

The placement the report shows is parsed from the launcher's own lines (written here by the function
that prints them, so a change of their format breaks this test, not silently the report); the runs
interleave ABBA; the report's ratios and its accuracy verdict come from the per-run files; and the
committed report is what its committed files give.
"""

from __future__ import annotations

import json

import pytest

from bench import cluster as bench
from bench.kit import RESULTS
from pollen.launch.cluster import placement_lines

HEAD, WORKER = "a845408d" + "0" * 48, "5f34077c" + "1" * 48


def _record(arm: str, pair: int, walls: list[float], acc: float, cpu: float, **extra) -> dict:
    return {"arm": arm, "pair": pair, "setting": {"preset": bench.PRESET, "run-config": bench.run_config(3),
                                                  "clients": 100, "two-node": {"nodes": 2, "cpus-per-node": 1},
                                                  "one-node": {"cpus": 2}},
            "rc": 0, "status": "completed", "load-1min-at-start": 2.5, "launch-wall-s": 100.0 + sum(walls),
            "time-to-round-1-s": 20.0, "round-wall-s": walls, "cpu-s": cpu, "launch-cpu-s": cpu - 5,
            "cpu-counted-by": "cgroup", "accuracy": acc, "proto-accuracy": acc - 0.01, **extra}


def test_placement_lines_parse_back_to_what_the_launcher_printed():
    data = {"jobs": ["03000000"], "address": "127.0.0.1:1",
            "nodes": {HEAD: {"ip": "127.0.0.1", "actors": 1, "calls": 512, "alive": True},
                      WORKER: {"ip": "127.0.0.1", "actors": 2, "calls": None, "alive": False}}}
    text = "\n".join(["[pollen] run completed", *placement_lines(data), "[pollen] stopping: none left"])
    assert bench.parse_placement(text) == {
        HEAD[:8]: {"ip": "127.0.0.1", "actors": 1, "calls": 512, "alive": True},
        WORKER[:8]: {"ip": "127.0.0.1", "actors": 2, "calls": None, "alive": False}}
    # no placement printed (a private local Ray), or Ray's records not found: nothing, not a guess
    assert bench.parse_placement("[pollen] run completed\n") == {}
    assert bench.parse_placement("\n".join(placement_lines({"nodes": {}, "address": "x"}))) == {}


def test_loopback_address_and_node_roles_are_read_from_its_output():
    text = ("[pollen] loopback Ray cluster up: address 127.0.0.1:41229 (2 node(s), 1 CPU and 0 GPU each); ...\n"
            f"[pollen]   node 0 (head): id {HEAD}, raylet pid 100\n"
            f"[pollen]   node 1 (worker): id {WORKER}, raylet pid 101\n")
    assert bench.parse_loopback(text) == ("127.0.0.1:41229", {HEAD: "head", WORKER: "worker"})


def test_arms_are_interleaved_abba():
    assert bench.schedule(2) == [("one-node", 1), ("two-node", 1), ("two-node", 2), ("one-node", 2)]
    assert bench.schedule(3)[4:] == [("one-node", 3), ("two-node", 3)]


def test_only_the_rounds_change_from_the_preset():
    from bench.kit import preset

    base, config = preset(bench.PRESET), bench.run_config(7)
    assert config.pop("num-server-rounds") == 7
    base.pop("num-server-rounds")
    assert config == base


def test_report_from_two_run_files(tmp_path):
    folder = tmp_path / "cluster"
    files = bench.RepeatFiles(folder)
    folder.mkdir()
    roles = {HEAD: "head", WORKER: "worker"}
    placement = {HEAD[:8]: {"ip": "127.0.0.1", "actors": 1, "calls": 300, "alive": True},
                 WORKER[:8]: {"ip": "127.0.0.1", "actors": 1, "calls": 306, "alive": True}}
    files.save("two-node", 1, _record("two-node", 1, [30.0, 12.0, 14.0], 0.9812, 80.0, placement=placement,
                                      **{"node-roles": roles, "cluster-up-s": 9.0}))
    files.save("one-node", 1, _record("one-node", 1, [20.0, 10.0, 8.0], 0.9812, 60.0, placement={},
                                      **{"load-1min-mean": 3.1}))
    assert (folder / "one-node-1.json").exists() and (folder / "two-node-1.json").exists()
    data = bench.write_report(folder, tmp_path / "cluster")
    assert [r["arm"] for r in data["runs"]] == ["one-node", "two-node"]  # pair 1: one-node ran first
    s = data["summary"]
    assert s["arms"]["one-node"]["steady-round-s-median"] == 9.0  # rounds 2.. only: 10, 8
    assert s["arms"]["two-node"]["steady-round-s-median"] == 13.0
    assert s["arms"]["two-node"]["steady-round-s-min"] == 12.0
    assert s["two-over-one"]["steady-round-s-median"] == pytest.approx(13.0 / 9.0, abs=1e-3)
    assert s["two-over-one"]["cpu-s-median"] == pytest.approx(80 / 60, abs=1e-3)
    assert s["accuracy"]["identical"] is True
    assert s["paired"]["pairs"] == [{"pair": 1, "one-node-s": 9.0, "two-node-s": 13.0, "diff-s": 4.0,
                                     "ratio": 1.444, "cpu-ratio": 1.333}]
    assert s["paired"]["verdict-two-node-slower"] == "not shown (fewer than 2 paired seeds)"
    md = (tmp_path / "cluster.md").read_text()
    assert json.loads((tmp_path / "cluster.json").read_text())["summary"] == s
    assert "two-node / one-node 1.444" in md
    assert "identical digit for digit in all 2 runs (0.9812 / 0.9712)" in md
    assert "head: 1 actor(s), 300 calls; worker: 1 actor(s), 306 calls" in md
    assert "one node (private Ray; not read)" in md
    assert "`bench/gpu.py`) did not run" in md
    assert "| one-node-1 | 2.5 / 3.1 | completed |" in md and "| two-node-1 | 2.5 / – | completed |" in md
    assert "In every pair the two-node arm's rounds were slower" in md


def test_two_pairs_decide_by_the_kits_rule(tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir()
    files = bench.RepeatFiles(folder)
    for k, (one, two) in enumerate([(10.0, 8.0), (12.0, 9.0)], 1):
        files.save("one-node", k, _record("one-node", k, [20.0, one, one], 0.9, 60.0))
        files.save("two-node", k, _record("two-node", k, [20.0, two, two], 0.9, 60.0))
    data = bench.write_report(folder, tmp_path / "cluster")
    assert [(r["arm"], r["pair"]) for r in data["runs"]] == bench.schedule(2)  # files read in running order
    paired = data["summary"]["paired"]
    assert [p["diff-s"] for p in paired["pairs"]] == [-2.0, -3.0]
    assert paired["diff-s"] == "-2.50 ± 0.50" and paired["verdict-two-node-slower"] == "contradicted"
    assert "In every pair the two-node arm's rounds were faster" in (tmp_path / "cluster.md").read_text()


def test_a_differing_accuracy_is_reported_not_hidden(tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir()
    files = bench.RepeatFiles(folder)
    files.save("one-node", 1, _record("one-node", 1, [20.0, 10.0], 0.9812, 60.0))
    files.save("two-node", 1, _record("two-node", 1, [20.0, 11.0], 0.98125, 70.0))
    data = bench.write_report(folder, tmp_path / "cluster")
    assert data["summary"]["accuracy"]["identical"] is False
    assert "The final accuracies differ between runs" in (tmp_path / "cluster.md").read_text()


def test_the_committed_report_is_what_its_files_give(tmp_path):
    folder = RESULTS / "cluster"
    assert any(folder.glob("*-node-*.json")), "bench/results/cluster/ has no committed runs"
    data = {"runs": bench.RepeatFiles(folder).load()}
    data["summary"] = bench.summarise(data["runs"])
    assert (RESULTS / "cluster.md").read_text() == bench.markdown(data), \
        "bench/results/cluster.md differs from its files: python -m bench.cluster --report"
    assert json.loads((RESULTS / "cluster.json").read_text()) == json.loads(json.dumps(data))
