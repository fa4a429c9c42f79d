"""What one process of each kind costs in memory: the figures behind the launcher's check of the machine
(:mod:`pollen.launch.resources`) before a run starts.

Two tiny real launches, each process's proportional set size (PSS: shared pages such as torch's libraries
counted once over all processes) sampled 4 times a second and its peak kept per process:

- a simulation (``python -m pollen.launch.launcher``, FedAvg on the embedded UCI digits, 4 SuperNodes,
  ``--ray-cpus 2``: 2 ClientApp actors, 2 rounds);
- a fleet (``pollen fleet``, the same method, 2 SuperNodes, 2 rounds): SuperNodes and the ``flwr-clientapp``
  process each message starts.

and the bytes per SuperNode that the simulation process (Flower's engine and Pollen's ServerApp) holds: its
peak at two population sizes (FedAvg on MNIST, one round of 2 sampled nodes each)::

    python -m bench.footprint [--parts simulation,fleet,per-node] [--nodes 200,3000]
    # -> bench/results/footprint.{json,md}, each part written as soon as it is measured
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from bench.kit import RESULTS, ROOT, default_data_root, read_json, table, write_atomic, write_json
from bench.tree import MarkedTree
from pollen.launch.processes import proc_cmdline, proc_memory

MARK = "POLLEN_FOOTPRINT_MARK"
ROLES = ("ClientApp actor", "flwr-simulation", "flower-superlink", "flower-supernode", "flwr-clientapp",
         "flwr-serverapp", "flower-superexec", "launcher", "Ray and the rest")


def role(pid: int) -> str:
    """Which kind of process ``pid`` is, from its command line (Ray renames its workers)."""
    args = [a.decode(errors="replace") for a in proc_cmdline(pid) or []]
    words = " ".join(args[:4])
    if args and args[0].startswith("ray::ClientAppActor"):
        return "ClientApp actor"
    for name in ROLES[1:7]:
        if name in words:
            return name
    if "pollen.launch" in words:
        return "launcher"
    return "Ray and the rest"


class Peaks(MarkedTree):
    """The peak PSS of every process whose environment carries this sampler's mark, by PID, with its role."""

    def __init__(self) -> None:
        super().__init__(MARK, role, ROLES[-1])
        self.peak: dict[int, int] = {}

    def sample(self, pids: list[int]) -> None:
        for pid in pids:
            memory = proc_memory(pid)
            if memory is not None:
                self.peak[pid] = max(self.peak.get(pid, 0), memory)

    def by_role(self) -> dict[str, dict[str, float]]:
        """Per role: processes seen, the largest one's peak and the sum of their peaks (MB)."""
        out = {}
        for name in ROLES:
            peaks = [self.peak[pid] for pid, r in self.roles.items() if r == name and pid in self.peak]
            if peaks:
                out[name] = {"processes": len(peaks), "largest-mb": round(max(peaks) / 2**20, 1),
                             "sum-mb": round(sum(peaks) / 2**20, 1)}
        return out


def launch(cmd: list[str], timeout: float) -> dict:
    with Peaks() as peaks:
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=peaks.env(), capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - started
    return {"command": " ".join(cmd[1:]), "rc": proc.returncode, "wall-s": round(wall, 1),
            "roles": peaks.by_role(), **({"log-tail": (proc.stdout + proc.stderr)[-3000:]} if proc.returncode else {})}


def node_bytes(tmp: str, sizes: tuple[int, int], timeout: float) -> dict:
    """Bytes per SuperNode the simulation process (Flower's engine and Pollen's ServerApp) holds: its peak
    PSS at two population sizes, one round of 2 sampled nodes each, the difference over the nodes added
    (MNIST, which splits into thousands of partitions; the embedded digits do not)."""
    peaks = {}
    for n in sizes:
        config = (f"method='fedavg' task='mnist-dirichlet' num-server-rounds=1 local-epochs=1 fraction-fit={2 / n} "
                  f"fraction-evaluate={2 / n} min-available-clients=2 data-root='{default_data_root()}'")
        run = launch([sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", str(n), "--ray-cpus", "1",
                      "--out-dir", f"{tmp}/nodes-{n}", "--quiet", "--run-config", config], timeout)
        if run["rc"] != 0:
            raise SystemExit(f"N = {n}: exit {run['rc']}\n{run.get('log-tail', '')}")
        peaks[n] = run["roles"]["flwr-simulation"]["largest-mb"]
    small, large = sizes
    return {"flwr-simulation-peak-mb": {str(n): v for n, v in peaks.items()},
            "bytes-per-node": round((peaks[large] - peaks[small]) * 2**20 / (large - small))}


PARTS = ("simulation", "fleet", "per-node")


def measure(part: str, tmp: str, args: argparse.Namespace) -> dict:
    if part == "simulation":
        config = "method='fedavg' task='uci-dirichlet' num-server-rounds=2 local-epochs=1"
        return launch([sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", "4", "--ray-cpus", "2",
                       "--out-dir", f"{tmp}/runs", "--quiet", "--run-config", config], args.timeout)
    if part == "fleet":
        return launch([sys.executable, "-m", "pollen.launch.cli", "fleet", "--num-supernodes", "2", "--rounds", "2",
                       "--run-config", "local-epochs=1", "--work-dir", f"{tmp}/fleet", "--out-dir", f"{tmp}/fleet-runs",
                       "--quiet"], args.timeout)
    small, large = (int(n) for n in args.nodes.split(","))
    return node_bytes(tmp, (small, large), args.timeout)


def report(result: dict) -> list[str]:
    lines = ["# Footprint: memory per process of a launch", "",
             "Written by `python -m bench.footprint` (its docstring says what ran). Peak proportional set size "
             "(PSS, shared pages counted once over all processes) of each process, sampled 4 times a second; per "
             "kind of process: how many ran, the largest one's peak and the sum of their peaks. "
             "`pollen.launch.resources` sizes its estimate from these rows.", ""]
    for part, name in (("simulation", "Simulation"), ("fleet", "Fleet")):
        run = result.get(part)
        if run is None:
            continue
        lines += [f"## {name}: `{run['command']}`", "",
                  f"exit {run['rc']}, {run['wall-s']} s, load {run.get('load-1min', '–')}", ""]
        lines += table(("process", "count", "largest peak MB", "sum of peaks MB"),
                       [(r, v["processes"], v["largest-mb"], v["sum-mb"]) for r, v in run["roles"].items()])
        lines.append("")
    nodes = result.get("per-node")
    if nodes is not None:
        peaks = nodes["flwr-simulation-peak-mb"]
        lines += ["## The simulation process per SuperNode", "",
                  "Flower's engine and Pollen's ServerApp in `flwr-simulation`, one round of 2 sampled nodes: peak "
                  + ", ".join(f"{v} MB at N = {int(n):,}" for n, v in peaks.items())
                  + f", so {nodes['bytes-per-node']:,} bytes per SuperNode.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which to measure (of {', '.join(PARTS)})")
    parser.add_argument("--nodes", default="200,3000", help="the two population sizes of the per-node part")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    args = parser.parse_args(argv)
    path = RESULTS / "footprint.json"
    result = read_json(path, {})
    for part in (p.strip() for p in args.parts.split(",") if p.strip()):
        with tempfile.TemporaryDirectory(prefix="pollen-footprint-") as tmp:
            result[part] = {**measure(part, tmp, args), "load-1min": round(os.getloadavg()[0], 2),
                            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        result["machine"] = {"cpus": os.cpu_count()}
        write_json(path, result, indent=2)  # each part as soon as it is measured
        print(f"[footprint] {part}: done", flush=True)
    lines = report(result)
    write_atomic(RESULTS / "footprint.md", "\n".join(lines))
    print("\n".join(lines))
    return 0 if all(result.get(p, {}).get("rc", 0) == 0 for p in ("simulation", "fleet")) else 1


if __name__ == "__main__":
    sys.exit(main())
