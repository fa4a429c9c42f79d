"""Whether this machine can hold a run, decided before anything starts: its memory and its processes.

``--num-supernodes 1000000000`` once grew a simulation to 2.2 GB in two minutes without reaching round 1,
stopped only by the timeout. The estimate adds what one process of each kind costs, measured by
``bench/footprint.py`` (``bench/results/footprint.md``), to what grows with the run: bytes per SuperNode in
the simulation process, one ClientApp actor per CPU slot, the per-client records the ServerApp keeps for
every round; a fleet runs a SuperNode process per node and a ClientApp process per message. A run whose
estimate exceeds the memory the kernel reports available, or whose processes exceed what the machine
allows, is refused (exit 2) with the estimate, how it adds up and the limit. The figures are rounded up
from the measurements: the check refuses what cannot fit, it does not promise that the rest will.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollen.launch.errors import LaunchConfigError
from pollen.launch.processes import memory_available, proc_table

MB = 2**20
# Measured (bench/results/footprint.md, PSS) and rounded up. A simulation: the launcher, SuperLink, superexec,
# the simulation process at a few nodes and Ray's daemons (1,258 MB measured); one ClientApp actor (413 MB
# on the embedded digits; a task with more data holds more); per SuperNode in the simulation process,
# Flower's node registry and contexts and Pollen's partition book (20,098 B measured between 200 and 2,000).
SIMULATION_BASE = 1400 * MB
ACTOR = 500 * MB
NODE = 24 * 1024
# per client and round: the metrics the ServerApp keeps (RunRecorder) for metrics.jsonl and the summary
CLIENT_ROUND = 2 * 1024
SIMULATION_PROCESSES = 16  # launcher, watchdog, SuperLink, superexec, simulation, Ray's daemons (16 measured)
# A fleet: the SuperLink side (launcher, SuperLink, superexec, ServerApp; 1,064 MB measured), one SuperNode
# per node (106 MB), and the ClientApp process each running message starts (515 MB).
FLEET_BASE = 1100 * MB
SUPERNODE = 128 * MB
CLIENTAPP = 550 * MB
FLEET_PROCESSES = 10


@dataclass
class Estimate:
    """What a run will take at its peak, and how that adds up (for the message)."""

    memory: int = 0
    processes: int = 0
    parts: list[str] = field(default_factory=list)

    def add(self, what: str, count: int, each: int, processes: int = 0) -> None:
        self.memory += count * each
        self.processes += processes
        self.parts.append(f"{what} {_size(count * each)}" if count == 1 else
                          f"{count:,} {what} x {_size(each)}")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def actor_slots(cpus_per_client: int, ray_cpus: int | None) -> int:
    """ClientApp actors Flower starts on a private Ray instance: one per ``cpus_per_client`` of its CPUs
    (``--ray-cpus``, else all), however many SuperNodes there are (Flower sizes its pool by resources)."""
    cpus = ray_cpus if ray_cpus is not None else (os.cpu_count() or 1)
    return max(1, cpus // max(1, cpus_per_client))


def check_simulation(app_values: Mapping[str, Any], num_supernodes: int, cpus_per_client: int,
                     ray_cpus: int | None, ray_address: str | None) -> None:
    """:func:`check_fits` for a simulation of ``num_supernodes`` with this run config and these resources."""
    rounds, per_round = run_shape(app_values)
    on_cluster = ray_address not in (None, "", "local")
    estimate = simulation_estimate(num_supernodes, actor_slots(cpus_per_client, ray_cpus), rounds, per_round,
                                   on_cluster=on_cluster)
    check_fits(estimate, f"--num-supernodes {num_supernodes}")


def run_shape(app_values: Mapping[str, Any]) -> tuple[int, float]:
    """(rounds, clients trained + evaluated per round as a fraction of the nodes) from a run config; an app
    without Pollen's keys counts one round of every node, twice."""
    rounds = app_values.get("num-server-rounds", 1)
    fit, evaluate = app_values.get("fraction-fit", 1.0), app_values.get("fraction-evaluate", 1.0)
    numbers = [v if isinstance(v, (int, float)) and not isinstance(v, bool) else 1 for v in (rounds, fit, evaluate)]
    return max(1, int(numbers[0])), max(0.0, float(numbers[1])) + max(0.0, float(numbers[2]))


def simulation_estimate(num_supernodes: int, actors: int, rounds: int, per_round: float,
                        on_cluster: bool = False) -> Estimate:
    """A simulation's peak on this machine: with ``on_cluster`` the actors run on the cluster's nodes."""
    estimate = Estimate()
    estimate.add("for SuperLink, simulation and Ray", 1, SIMULATION_BASE, SIMULATION_PROCESSES)
    if not on_cluster:
        estimate.add("ClientApp actors", actors, ACTOR, actors)
    estimate.add("SuperNodes", num_supernodes, NODE)
    records = max(1, round(rounds * per_round * num_supernodes))
    estimate.add("client-round records", records, CLIENT_ROUND)
    return estimate


def fleet_estimate(num_supernodes: int, rounds: int, per_round: float) -> Estimate:
    """A local fleet's peak: every SuperNode with a ClientApp process running at once."""
    estimate = Estimate()
    estimate.add("for SuperLink and ServerApp", 1, FLEET_BASE, FLEET_PROCESSES)
    estimate.add("SuperNodes", num_supernodes, SUPERNODE, num_supernodes)
    estimate.add("ClientApp processes", num_supernodes, CLIENTAPP, num_supernodes)
    estimate.add("client-round records", max(1, round(rounds * per_round * num_supernodes)), CLIENT_ROUND)
    return estimate


def process_room() -> int | None:
    """How many more processes this machine allows (the per-user limit and the kernel's PID space, less
    what runs now); None when it cannot tell."""
    limits = []
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    try:
        limits.append(int(Path("/proc/sys/kernel/pid_max").read_text()))
    except (OSError, ValueError):
        pass
    running = proc_table()
    if not limits or running is None:
        return None
    return min(limits) - len(running)


def check_fits(estimate: Estimate, what: str) -> None:
    """:class:`LaunchConfigError` (exit 2) when ``estimate`` exceeds this machine's available memory or
    process room, with the estimate, how it adds up and the limit."""
    available = memory_available()
    if available is not None and estimate.memory > available:
        raise LaunchConfigError(f"{what}: the run needs about {_size(estimate.memory)} of memory "
                                f"({' + '.join(estimate.parts)}); this machine has {_size(available)} available. "
                                "Start fewer SuperNodes (a simulation: or fewer actors, --ray-cpus), or use a larger "
                                "machine")
    room = process_room()
    if room is not None and estimate.processes > room:
        raise LaunchConfigError(f"{what}: the run needs about {estimate.processes:,} processes; this machine allows "
                                f"{room:,} more (ulimit -u and the kernel's pid_max, less those running)")
