"""The machine is checked before a run starts (:mod:`pollen.launch.resources`): a run it cannot hold is
refused with exit 2 before any process, folder or FLWR_HOME exists, naming the estimate and the limit; an
option that needs an integer refuses anything else."""

from __future__ import annotations

import re
import subprocess
import tempfile
import time

import pytest

from pollen.launch import launcher, resources
from pollen.launch.errors import EXIT_USAGE, LaunchConfigError
from pollen.launch.fleet import cli as fleet_cli


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any attempt to start a process or to create a private FLWR_HOME fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"something was started: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def test_a_billion_supernodes_are_refused_before_anything_starts_naming_the_estimate(tmp_path, capsys,
                                                                                      nothing_starts):
    began = time.monotonic()
    code = launcher.main(["--num-supernodes", "1000000000", "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert time.monotonic() - began < 10
    found = re.search(r"--num-supernodes 1000000000: the run needs about ([\d,.]+) TiB of memory \((.*)\); this "
                      r"machine has ([\d,.]+) GiB available", err)
    assert found, err
    assert "1,000,000,000 SuperNodes x 24.0 KiB" in found.group(2) and "ClientApp actors" in found.group(2)
    assert not (tmp_path / "runs").exists()  # not even the run folder


def test_a_fleet_too_large_for_the_machine_is_refused_before_its_plan_is_made(tmp_path, capsys, nothing_starts):
    code = fleet_cli.main(["--num-supernodes", "100000", "--work-dir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert re.search(r"--num-supernodes 100000: the run needs about [\d,.]+ [GT]iB of memory \(.*100,000 SuperNodes x "
                     r"128\.0 MiB.*100,000 ClientApp processes x 550\.0 MiB.*\); this machine has", err), err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("value", ["2.5", "1e9", "two"])
def test_an_integer_option_refuses_anything_else(value, capsys, nothing_starts):
    with pytest.raises(SystemExit) as run_exit:
        launcher.main(["--num-supernodes", value])
    assert run_exit.value.code == EXIT_USAGE
    assert f"argument --num-supernodes: invalid int value: '{value}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as fleet_exit:
        fleet_cli.main(["--rounds", value])
    assert fleet_exit.value.code == EXIT_USAGE
    assert f"argument --rounds: invalid int value: '{value}'" in capsys.readouterr().err


def test_the_estimate_adds_what_grows_with_the_run():
    """Nodes, actors and rounds each add their share; a cluster's actors are not this machine's memory."""
    small = resources.simulation_estimate(10, actors=2, rounds=3, per_round=2.0)
    assert small.memory == (resources.SIMULATION_BASE + 2 * resources.ACTOR + 10 * resources.NODE
                            + 60 * resources.CLIENT_ROUND)
    assert small.processes == resources.SIMULATION_PROCESSES + 2
    more_rounds = resources.simulation_estimate(10, actors=2, rounds=30, per_round=2.0)
    assert more_rounds.memory - small.memory == 540 * resources.CLIENT_ROUND
    cluster = resources.simulation_estimate(10, actors=2, rounds=3, per_round=2.0, on_cluster=True)
    assert small.memory - cluster.memory == 2 * resources.ACTOR
    assert resources.run_shape({"num-server-rounds": 4, "fraction-fit": 0.5, "fraction-evaluate": 0.25}) == (4, 0.75)
    assert resources.run_shape({}) == (1, 2.0)  # another app: one round of every node, trained and evaluated
    assert resources.actor_slots(cpus_per_client=2, ray_cpus=5) == 2 and resources.actor_slots(4, 2) == 1


def test_a_run_needing_more_processes_than_the_machine_allows_is_refused(monkeypatch):
    monkeypatch.setattr(resources, "process_room", lambda: 40)
    monkeypatch.setattr(resources, "memory_available", lambda: 2**50)
    resources.check_fits(resources.fleet_estimate(10, rounds=1, per_round=2.0), "--num-supernodes 10")  # 30 fit
    with pytest.raises(LaunchConfigError, match=r"--num-supernodes 20: the run needs about 50 processes; this machine "
                                                r"allows 40 more \(ulimit -u"):
        resources.check_fits(resources.fleet_estimate(20, rounds=1, per_round=2.0), "--num-supernodes 20")
