"""What running through Flower costs: FedProto MNIST as a plain loop vs the same work through Pollen.

A = ``bench/fedproto_reference.py``'s plain loop (one process, one thread, 20 clients in turn);
B = Pollen's Flower app through ``python -m pollen.launch.launcher`` (20 SuperNodes, one CPU per client,
evaluation only after the last round, as A does). Same task, split, sizes, optimiser and rounds.
C = the *Flower floor*: a Flower app with no Pollen and no torch (``FLOOR_APP`` below), launched the
same way with the same SuperNodes, rounds and messages (every node gets a train message each round,
then one evaluate round), each ClientApp answering at once. C's cost is what any Flower simulation
of this shape pays on this machine, so (A + C) / A is the lowest CPU ratio B could reach.
The runs are **interleaved** (A B C A B C …) so that a shared machine's load hits all alike; each
run's CPU-seconds cover every process it started: each run has a cpuacct cgroup of its own, so the
kernel counts orphans too (without cgroup access: the reaped children's rusage; this script is a
child subreaper, so orphaned Ray and Flower processes are reaped here). Prints and writes
``bench/results/overhead.{json,md}``: per pair the CPU-second and wall ratios B / A, then min and
median, per Pollen run the round-time breakdown (round 1, steady rounds, start-up and teardown),
and the floor.

    python -m bench.overhead --data-root ../shared/data --pairs 3 --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.kit import RESULTS, ROOT, read_json, read_metrics, read_summary, run_folders, write_atomic, write_json

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants (Ray workers, Flower's processes) are then reparented here, not to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def reap_all(timeout: float = 30.0) -> None:
    """Reap every exited descendant (their CPU then counts in RUSAGE_CHILDREN), waiting at most ``timeout``
    for orphans still exiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)  # descendants still exiting


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuGroup:
    """A cgroup-v1 ``cpuacct`` group of its own for one measured command: the kernel counts the CPU time of
    every process started inside it, descendants and orphans included, whenever they exit; without one
    (no cgroup, no permission) the count falls back to the reaped children's rusage."""

    def __init__(self) -> None:
        self.path: Path | None = CPUACCT / f"pollen-bench-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.path.mkdir()
        except OSError:
            self.path = None

    def enter(self) -> None:
        """Runs in the child between fork and exec: move it (and so all it starts) into the group."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self, wait: float = 60.0) -> tuple[float | None, list[int]]:
        """CPU-seconds of the group once its processes have exited (waits up to ``wait``), and the PIDs
        still running then (stopped here: a measurement must not leak into the next)."""
        if self.path is None:
            return None, []
        deadline = time.monotonic() + wait
        left = self._pids()
        while left and time.monotonic() < deadline:
            reap_all(timeout=0.5)
            left = self._pids()
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        reap_all(timeout=5.0)
        used = int((self.path / "cpuacct.usage").read_text()) / 1e9
        with contextlib.suppress(OSError):
            self.path.rmdir()
        return used, left

    def _pids(self) -> list[int]:
        assert self.path is not None
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]


def measured(cmd: list[str], env: dict[str, str], log: Path) -> dict:
    """Run ``cmd`` to the end; wall and CPU-seconds of its whole tree (its own cpuacct group, else the
    children reaped here)."""
    reap_all()
    group = CpuGroup()
    cpu0, t0 = children_cpu(), time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=group.enter)
    wall = time.perf_counter() - t0
    group_cpu, strays = group.cpu_s()
    reap_all()  # orphans of the run (Ray, Flower) finish here
    rusage_cpu = children_cpu() - cpu0
    return {"rc": proc.returncode, "wall-s": round(wall, 2),
           "cpu-s": round(group_cpu if group_cpu is not None else rusage_cpu, 2),
           "cpu-counted-by": "cgroup" if group_cpu is not None else "rusage", "rusage-cpu-s": round(rusage_cpu, 2),
           "strays-killed": len(strays),
           "max-rss-mb-one-process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}


def plain_loop(args, env: dict[str, str], log: Path) -> dict:
    code = ("import json, torch; torch.set_num_threads(1); "
            "from bench.fedproto_reference import run; "
            f"r = run({args.ways}, {args.seed}, {args.rounds}, {str(args.data_root)!r}, num_clients={args.clients}); "
            "print('RESULT ' + json.dumps({k: r[k] for k in ('local-mean', 'proto-mean', 'wall-time-s')}))")
    row = measured([sys.executable, "-c", code], env, log)
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    return row


def run_config(args) -> dict:
    """Pollen's side of a pair: the plain loop's FedProto setting and procedure."""
    return {"method": "fedproto", "task": "mnist-shot", "num-server-rounds": args.rounds, "seed": args.seed,
            "shot-split": "official", "shot-ways": args.ways, "shot-shots": 100, "shot-stdev": 2,
            "shot-test-per-class": 40, "batch-size": 4, "lr": 0.01, "momentum": 0.5, "local-epochs": 1,
            "proto-evaluate-every": args.rounds, "torch-threads": 1,
            # the plain loop's procedure: prototypes from the training pass (Pollen's default adds a
            # no-grad pass after training, about 9 % of a client's fit), the official unweighted average
            "proto-local-protos": "training", "proto-weighting": "uniform"}


def pollen_run(args, env: dict[str, str], log: Path, out_dir: Path) -> dict:
    from pollen.launch.launcher import format_run_config

    config = format_run_config(run_config(args))
    cmd = [sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", str(args.clients),
           "--data-root", str(args.data_root), "--out-dir", str(out_dir), "--run-config", config]
    row = measured(cmd, env, log)
    runs = run_folders(out_dir)
    if runs:
        lines = read_metrics(runs[-1])
        times = [r["wall-time-s"] for r in lines]
        summary = read_summary(runs[-1])
        final = lines[-1].get("evaluate", {})
        row.update({"round-1-s": round(times[0], 2),
                    "steady-round-median-s": round(statistics.median(times[1:]), 2) if len(times) > 1 else None,
                    "rounds-s": round(sum(times), 2), "server-app-s": summary.get("wall-time-s"),
                    "local-mean": 100 * float(final.get("accuracy", float("nan"))),
                    "proto-mean": 100 * float(final.get("proto-accuracy", float("nan")))})
        row["outside-rounds-s"] = round(row["wall-s"] - row["rounds-s"], 2)
    return row


FLOOR_APP = {
    "pyproject.toml": """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "flower-floor"
version = "1.0.0"
dependencies = ["flwr>=1.42"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "bench"

[tool.flwr.app.components]
serverapp = "flower_floor:server"
clientapp = "flower_floor:client"

[tool.flwr.app.config]
num-server-rounds = 3
num-nodes = 20
sampled = 0
evaluate-every-round = false
""",
    "flower_floor.py": '''"""Flower with nothing in it: sampled nodes train (and evaluate), answering at once."""
import random
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, expected, sampled = int(cfg["num-server-rounds"]), int(cfg["num-nodes"]), int(cfg["sampled"])
    while len(list(grid.get_node_ids())) < expected:
        time.sleep(0.1)
    nodes = sorted(grid.get_node_ids())
    rng = random.Random(0)

    def ask(kind: str, r: int) -> str:
        chosen = rng.sample(nodes, sampled) if 0 < sampled < len(nodes) else nodes
        t0 = time.perf_counter()
        replies = list(grid.send_and_receive(
            [Message(RecordDict({"config": ConfigRecord({"round": r})}), dst_node_id=n, message_type=kind)
             for n in chosen]))
        bad = [m for m in replies if m.has_error()]
        if len(replies) != len(chosen) or bad:
            raise RuntimeError(f"round {r}: {len(replies)} replies for {len(chosen)} nodes, {len(bad)} errors")
        return f"{kind} {len(replies)} replies {time.perf_counter() - t0:.3f}s"

    for r in range(1, rounds + 1):
        line = ask(MessageType.TRAIN, r)
        if cfg["evaluate-every-round"]:
            line += " " + ask(MessageType.EVALUATE, r)
        print(f"[floor] round {r}/{rounds}: {line}", flush=True)
    if not cfg["evaluate-every-round"]:
        print(f"[floor] final {ask(MessageType.EVALUATE, rounds)}", flush=True)


@client.train()
def train(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
''',
}


def floor_command(folder: Path, nodes: int, rounds: int, sampled: int = 0, evaluate_every_round: bool = False,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """Write ``FLOOR_APP`` into ``folder`` (once) and return the launcher command that runs it: ``nodes``
    SuperNodes, ``rounds`` rounds of ``sampled`` nodes (0: all), evaluating every round or once at the end."""
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for name, text in FLOOR_APP.items():
            (folder / name).write_text(text)
    return [sys.executable, "-m", "pollen.launch.launcher", "--app", str(folder), "--num-supernodes", str(nodes),
            "--run-config", f"num-server-rounds={rounds} num-nodes={nodes} sampled={sampled} "
            f"evaluate-every-round={str(evaluate_every_round).lower()}", *extra]


def floor_run(args, env: dict[str, str], log: Path, app_dir: Path) -> dict:
    """The Flower floor (module docstring): same launcher, SuperNodes, rounds and message pattern."""
    return measured(floor_command(app_dir, args.clients, args.rounds), env, log)


def summarise(pairs: list[dict]) -> dict:
    cpu = [p["pollen"]["cpu-s"] / p["plain"]["cpu-s"] for p in pairs]
    wall = [p["pollen"]["wall-s"] / p["plain"]["wall-s"] for p in pairs]
    out = {"cpu-ratio-min": round(min(cpu), 3), "cpu-ratio-median": round(statistics.median(cpu), 3),
           "wall-ratio-min": round(min(wall), 3), "wall-ratio-median": round(statistics.median(wall), 3),
           "pairs": len(pairs)}
    floors = [p for p in pairs if "floor" in p]
    if floors:
        reach = [(p["plain"]["cpu-s"] + p["floor"]["cpu-s"]) / p["plain"]["cpu-s"] for p in floors]
        out.update({"floor-cpu-s-median": round(statistics.median(p["floor"]["cpu-s"] for p in floors), 2),
                    "floor-wall-s-median": round(statistics.median(p["floor"]["wall-s"] for p in floors), 2),
                    "reachable-cpu-ratio-min": round(min(reach), 3),
                    "reachable-cpu-ratio-median": round(statistics.median(reach), 3)})
    return out


def markdown(data: dict) -> str:
    cfg, s = data["config"], data["summary"]
    lines = ["# Overhead: Pollen's Flower app vs the plain loop", "",
             f"FedProto MNIST, {cfg['clients']} clients, {cfg['ways']}-way 100-shot (official split), {cfg['rounds']} "
             f"rounds, seed {cfg['seed']}; plain loop = `bench/fedproto_reference.py` (1 process, 1 thread); "
             f"Pollen = `python -m pollen.app.launch --num-supernodes {cfg['clients']}` (1 CPU per client, "
             f"{cfg['cores']} cores), evaluation after the last round only in both, prototypes from the training "
             "pass and averaged unweighted in both (`proto-local-protos='training'`, `proto-weighting='uniform'`). "
             "Interleaved pairs, plain "
             f"first. CPU-seconds: every process each run started, orphans included (" +
             ("a cpuacct cgroup per run" if all(x.get("cpu-counted-by") == "cgroup" for p in data["pairs"]
                                                for x in p.values()) else "the reaped children's rusage") +
             f"). {cfg['date']}, load average at start "
             f"{cfg['load-at-start']}.", "",
             f"**CPU-seconds ratio Pollen / plain: min {s['cpu-ratio-min']}, median {s['cpu-ratio-median']}; "
             f"wall ratio: min {s['wall-ratio-min']}, median {s['wall-ratio-median']}** ({s['pairs']} pairs).", "",
             "| pair | plain CPU s | plain wall s | Pollen CPU s | Pollen wall s | CPU ratio | wall ratio | "
             "Pollen round 1 s | steady round s (median) | outside rounds s | plain local / proto % | "
             "Pollen local / proto % |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(data["pairs"], 1):
        a, b = p["plain"], p["pollen"]
        lines.append(f"| {i} | {a['cpu-s']} | {a['wall-s']} | {b['cpu-s']} | {b['wall-s']} | "
                     f"{b['cpu-s'] / a['cpu-s']:.3f} | {b['wall-s'] / a['wall-s']:.3f} | {b.get('round-1-s')} | "
                     f"{b.get('steady-round-median-s')} | {b.get('outside-rounds-s')} | "
                     f"{a.get('local-mean', float('nan')):.2f} / {a.get('proto-mean', float('nan')):.2f} | "
                     f"{b.get('local-mean', float('nan')):.2f} / {b.get('proto-mean', float('nan')):.2f} |")
    lines += ["", "*outside rounds* = Pollen wall minus the rounds' own wall: SuperLink and Ray start-up, "
              "loading, shutdown. The plain loop's accuracy uses its own evaluation (per-client counters); "
              "Pollen's is the example-weighted mean over clients."]
    if "floor-cpu-s-median" in s:
        lines += ["", "## The Flower floor", "",
                  f"The same launch of a Flower app with no Pollen and no torch: {cfg['clients']} SuperNodes, "
                  f"{cfg['rounds']} rounds in which every node gets a train message and answers at once, then one "
                  "evaluate round (`FLOOR_APP` in `bench/overhead.py`). Any Flower simulation of this shape pays "
                  "it, so (plain + floor) / plain is the lowest CPU ratio Pollen could reach here.", "",
                  "| pair | floor CPU s | floor wall s | (plain + floor) / plain |", "|---|---|---|---|"]
        for i, p in enumerate(data["pairs"], 1):
            if "floor" in p:
                f, a = p["floor"], p["plain"]
                lines.append(f"| {i} | {f['cpu-s']} | {f['wall-s']} | {(a['cpu-s'] + f['cpu-s']) / a['cpu-s']:.3f} |")
        lines += ["", f"**Floor: median {s['floor-cpu-s-median']} CPU-s, {s['floor-wall-s-median']} s wall; lowest "
                      f"reachable CPU ratio: min {s['reachable-cpu-ratio-min']}, median "
                      f"{s['reachable-cpu-ratio-median']}.**"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=os.environ.get("POLLEN_DATA_ROOT"), required=False)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--ways", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-floor", action="store_true", help="skip the Flower-floor run of each pair")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for overhead.json and overhead.md")
    parser.add_argument("--report", action="store_true", help="only rewrite overhead.md from overhead.json")
    args = parser.parse_args(argv)
    if args.report:
        write_atomic(args.out / "overhead.md", markdown(read_json(args.out / "overhead.json")))
        return 0
    if args.data_root is None or not (Path(args.data_root) / "MNIST" / "raw").is_dir():
        parser.error("--data-root must hold MNIST/raw (or set POLLEN_DATA_ROOT)")
    args.data_root = Path(args.data_root).resolve()
    if not become_subreaper():
        print("[overhead] warning: not a child subreaper: CPU of orphaned processes is not counted", flush=True)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1"}
    config = {"clients": args.clients, "ways": args.ways, "rounds": args.rounds, "seed": args.seed,
              "cores": os.cpu_count(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load-at-start": round(os.getloadavg()[0], 2)}
    pairs = []
    with tempfile.TemporaryDirectory(prefix="pollen-overhead-") as tmp:
        for i in range(args.pairs):
            print(f"[overhead] pair {i + 1}/{args.pairs}: plain loop", flush=True)
            plain = plain_loop(args, env, Path(tmp) / f"plain-{i}.log")
            print(f"[overhead]   plain: {plain}", flush=True)
            print(f"[overhead] pair {i + 1}/{args.pairs}: Pollen", flush=True)
            pollen = pollen_run(args, env, Path(tmp) / f"pollen-{i}.log", Path(tmp) / f"runs-{i}")
            print(f"[overhead]   Pollen: {pollen}", flush=True)
            if plain["rc"] != 0 or pollen["rc"] != 0:
                bad = "plain" if plain["rc"] != 0 else "pollen"
                print((Path(tmp) / f"{bad}-{i}.log").read_text()[-3000:], file=sys.stderr)
                return 1
            pair = {"plain": plain, "pollen": pollen}
            if not args.no_floor:
                print(f"[overhead] pair {i + 1}/{args.pairs}: Flower floor", flush=True)
                pair["floor"] = floor_run(args, env, Path(tmp) / f"floor-{i}.log", Path(tmp) / "floor-app")
                print(f"[overhead]   floor: {pair['floor']}", flush=True)
                if pair["floor"]["rc"] != 0:
                    print((Path(tmp) / f"floor-{i}.log").read_text()[-3000:], file=sys.stderr)
                    return 1
            pairs.append(pair)
    data = {"config": config, "pairs": pairs, "summary": summarise(pairs)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "overhead.json", data, indent=2)
    write_atomic(args.out / "overhead.md", markdown(data))
    print(markdown(data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
