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
child subreaper, so orphaned Ray and Flower processes are reaped here).

**Fixed and steady CPU, apart.** One total mixes what a run pays once (Python, torch and Flower
imports, SuperLink, SuperNodes and Ray start, the ClientApp actors' start in round 1, the final
evaluation, teardown) with what it pays every round, and the two scale differently: with more rounds
the fixed part fades, the per-round part does not. So each run's output is streamed (into its log as
well) and at each round's line (``ROUND_MARKER``: A's ``[ref] … round k/K``, printed every round here,
B's ``[pollen] round k/K`` through the launcher's log stream, C's ``[floor] round k/K``) the run's CPU
counter is read: the same cgroup counter as the total (without a cgroup: the run's live processes'
``/proc`` times plus the children reaped here, said in the row). Per run, ``steady-round-cpu-s`` =
the median of the per-round increments after round 1, ``fixed-cpu-s`` = total − rounds × steady
(``split_cpu``; the final evaluation, in B's last round and after A's and C's, stays out of the median
and in fixed). Per pair, against the issue's targets: fixed above the floor = B's fixed − C's
(< 10 CPU-s) and the steady ratio = (B's steady − C's) / A's (≤ 1.15). B's and C's round lines come
through Flower's log stream, polled about every 0.5 s: a single increment jitters by up to a poll's CPU
(C's near-empty rounds can arrive together), the median of many rounds far less, the total not at all.

Prints and writes ``bench/results/overhead.{json,md}`` (``--report`` rewrites the Markdown from the
JSON): per pair the CPU-second and wall ratios B / A, then min and median, per Pollen run the
round-time breakdown (round 1, steady rounds, start-up and teardown), the floor, and the fixed /
steady split with both targets met or not (by the median over pairs).

    python -m bench.overhead --data-root ../shared/data --pairs 3 --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.kit import RESULTS, ROOT, read_json, read_metrics, read_summary, run_folders, write_atomic, write_json
from pollen.launch.processes import tree_cpu

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
        used = self.usage()
        with contextlib.suppress(OSError):
            self.path.rmdir()
        return used, left

    def usage(self) -> float | None:
        """CPU-seconds the group has used so far (its processes may still run); None without a group."""
        return None if self.path is None else int((self.path / "cpuacct.usage").read_text()) / 1e9

    def _pids(self) -> list[int]:
        assert self.path is not None
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]


ROUND_MARKER = re.compile(r"\[(?:pollen|floor|ref)\] (?:ways \d+ seed \d+: )?round (\d+)/(\d+)\b")
"""A finished round in a run's output: Pollen's ServerApp line (through the launcher's log stream), the floor
app's, and the plain loop's ``progress_every=1`` line."""


def split_cpu(total: float, at_rounds: list[float], rounds: int) -> dict:
    """A run's CPU-seconds split into a steady per-round cost and a fixed cost, from the CPU counter read at
    each round's marker (``at_rounds[k - 1]``: when round k's line arrived). *steady* = the median of the
    per-round increments after round 1 (round k − round k − 1, k ≥ 2): round 1 carries start-up work (Pollen's
    ClientApp actors) and the last round may carry the final evaluation, the median takes neither;
    *fixed* = ``total − rounds × steady``: everything a run pays once (start-up before round 1, round 1's
    excess, the final evaluation, teardown). Both None with fewer than 2 rounds or a missing marker."""
    if rounds < 2 or len(at_rounds) != rounds:
        return {"steady-round-cpu-s": None, "fixed-cpu-s": None}
    steady = statistics.median(b - a for a, b in zip(at_rounds, at_rounds[1:]))
    return {"steady-round-cpu-s": round(steady, 3), "fixed-cpu-s": round(total - rounds * steady, 2)}


def measured(cmd: list[str], env: dict[str, str], log: Path, rounds: int | None = None) -> dict:
    """Run ``cmd`` to the end; wall and CPU-seconds of its whole tree (its own cpuacct group, else the
    children reaped here). Its output is streamed into ``log``; at each :data:`ROUND_MARKER` line the
    tree's CPU so far is read (the group's counter, else :func:`tree_cpu` plus the children reaped here),
    which with ``rounds`` splits the total into fixed and steady (:func:`split_cpu`)."""
    reap_all()
    group = CpuGroup()
    cpu0, t0 = children_cpu(), time.perf_counter()
    marks: list[tuple[int, float, float]] = []  # (round, CPU-s so far, wall-s so far)

    def cpu_now() -> float:
        used = group.usage()
        return used if used is not None else children_cpu() - cpu0 + tree_cpu(os.getpid())

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            encoding="utf-8", errors="replace", preexec_fn=group.enter)

    def pump() -> None:
        assert proc.stdout is not None
        with log.open("w") as out:
            for line in proc.stdout:
                found = ROUND_MARKER.search(line)
                if found:
                    marks.append((int(found.group(1)), cpu_now(), time.perf_counter() - t0))
                out.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    reader.join(timeout=30.0)  # the pipe ends with the command unless a leftover process holds it
    group_cpu, strays = group.cpu_s()
    reader.join(timeout=5.0)  # leftovers killed
    reap_all()  # orphans of the run (Ray, Flower) finish here
    rusage_cpu = children_cpu() - cpu0
    total = group_cpu if group_cpu is not None else rusage_cpu
    row = {"rc": rc, "wall-s": round(wall, 2), "cpu-s": round(total, 2),
           "cpu-counted-by": "cgroup" if group_cpu is not None else "rusage", "rusage-cpu-s": round(rusage_cpu, 2),
           "strays-killed": len(strays),
           "max-rss-mb-one-process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
           "cpu-at-rounds": [round(c, 2) for _, c, _ in marks], "wall-at-rounds-s": [round(w, 2) for _, _, w in marks],
           "cpu-at-rounds-counted-by": "cgroup" if group_cpu is not None else
           "proc-tree (live descendants with their reaped children, plus the children reaped here)"}
    if [k for k, _, _ in marks] != list(range(1, len(marks) + 1)):
        row["round-markers"] = [k for k, _, _ in marks]  # out of order: no split
        marks.clear()
    if rounds is not None:
        row.update(split_cpu(total, [c for _, c, _ in marks], rounds))
        if marks:
            row["to-round-1-cpu-s"] = round(marks[0][1], 2)
            row["after-last-round-cpu-s"] = round(total - marks[-1][1], 2)
    return row


def plain_loop(args, env: dict[str, str], log: Path) -> dict:
    code = ("import json, torch; torch.set_num_threads(1); "
            "from bench.fedproto_reference import run; "
            f"r = run({args.ways}, {args.seed}, {args.rounds}, {str(args.data_root)!r}, num_clients={args.clients}, "
            "progress_every=1); "
            "print('RESULT ' + json.dumps({k: r[k] for k in ('local-mean', 'proto-mean', 'wall-time-s')}))")
    row = measured([sys.executable, "-c", code], env, log, args.rounds)
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
    from pollen.launch import format_run_config

    config = format_run_config(run_config(args))
    cmd = [sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", str(args.clients),
           "--data-root", str(args.data_root), "--out-dir", str(out_dir), "--run-config", config]
    row = measured(cmd, env, log, args.rounds)
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
work-ms = 0
""",
    "flower_floor.py": '''"""Flower with nothing in it: sampled nodes train (and evaluate), answering at once.

Unless ``work-ms`` > 0: then each ClientApp's train and evaluate first spin the CPU (no sleep) until the process's
CPU time has advanced by that many milliseconds, then answer: clients that work per message, as Pollen's do,
with no Pollen and no torch.
"""
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
        print(f"[floor] round {r}/{rounds}: {line} (ended {time.time():.3f})", flush=True)
    if not cfg["evaluate-every-round"]:
        print(f"[floor] final {ask(MessageType.EVALUATE, rounds)}", flush=True)


def work(context: Context) -> None:
    """Busy-spin until this process's CPU time has advanced by ``work-ms`` milliseconds (0: nothing)."""
    seconds = float(context.run_config.get("work-ms", 0)) / 1000
    start = time.process_time()
    while seconds > 0 and time.process_time() - start < seconds:
        pass


@client.train()
def train(msg: Message, context: Context) -> Message:
    work(context)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    work(context)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
''',
}


def floor_command(folder: Path, nodes: int, rounds: int, sampled: int = 0, evaluate_every_round: bool = False,
                  extra: tuple[str, ...] = (), work_ms: float = 0) -> list[str]:
    """Write ``FLOOR_APP`` into ``folder`` (once) and return the launcher command that runs it: ``nodes``
    SuperNodes, ``rounds`` rounds of ``sampled`` nodes (0: all), evaluating every round or once at the end,
    each ClientApp spending ``work_ms`` CPU milliseconds per message before it answers (0: answering at once)."""
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for name, text in FLOOR_APP.items():
            (folder / name).write_text(text)
    return [sys.executable, "-m", "pollen.launch.launcher", "--app", str(folder), "--num-supernodes", str(nodes),
            "--run-config", f"num-server-rounds={rounds} num-nodes={nodes} sampled={sampled} "
            f"evaluate-every-round={str(evaluate_every_round).lower()} work-ms={float(work_ms):g}", *extra]


def floor_run(args, env: dict[str, str], log: Path, app_dir: Path) -> dict:
    """The Flower floor (module docstring): same launcher, SuperNodes, rounds and message pattern."""
    return measured(floor_command(app_dir, args.clients, args.rounds), env, log, args.rounds)


FIXED_TARGET_CPU_S = 10.0
"""The issue's target: Pollen's fixed CPU-s above the floor's, below this."""
STEADY_TARGET_RATIO = 1.15
"""The issue's target: (Pollen's − the floor's steady CPU-s per round) / the plain loop's, at most this."""


def pair_split(pair: dict) -> tuple[float, float] | None:
    """A pair's (fixed CPU-s above the floor = Pollen's fixed − the floor's, steady ratio = (Pollen's − the
    floor's steady CPU-s per round) / the plain loop's); None without a floor run or a split of each run."""
    runs = [pair.get(r, {}) for r in ("plain", "pollen", "floor")]
    if any(r.get("steady-round-cpu-s") is None or r.get("fixed-cpu-s") is None for r in runs):
        return None
    plain, pollen, floor = runs
    return (pollen["fixed-cpu-s"] - floor["fixed-cpu-s"],
            (pollen["steady-round-cpu-s"] - floor["steady-round-cpu-s"]) / plain["steady-round-cpu-s"])


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
    splits = [x for x in map(pair_split, pairs) if x is not None]
    if splits:
        fixed, steady = [f for f, _ in splits], [r for _, r in splits]
        out.update({"fixed-above-floor-cpu-s-min": round(min(fixed), 2),
                    "fixed-above-floor-cpu-s-median": round(statistics.median(fixed), 2),
                    "steady-ratio-min": round(min(steady), 3),
                    "steady-ratio-median": round(statistics.median(steady), 3),
                    "split-pairs": len(splits)})
    return out


def _cell(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def split_markdown(data: dict) -> list[str]:
    """The fixed / steady section of the report (runs recorded before the split have none)."""
    cfg, s = data["config"], data["summary"]
    if not any("steady-round-cpu-s" in p["pollen"] for p in data["pairs"]):
        return []
    counted = {x.get("cpu-at-rounds-counted-by") for p in data["pairs"] for x in p.values()}
    lines = ["", "## Fixed and steady CPU", "",
             "Each run's CPU counter (the one its total comes from) is read as each round's line arrives "
             "(`[ref] … round k/K`, `[pollen] round k/K` through the launcher's log stream, `[floor] round k/K`). "
             "*steady* = the median of the per-round increments after round 1 (round k − round k − 1, k ≥ 2); "
             f"*fixed* = total − {cfg['rounds']} × steady: start-up before round 1, round 1's excess over a steady "
             "round (Pollen: the ClientApp actors start), the final evaluation (after the last round's line in the "
             "plain loop and the floor, inside Pollen's last round: the median leaves it out of steady in all "
             "three) and teardown. Start-up and the steady state are measured apart because they scale apart: "
             "fixed is paid once per run, steady once per round. Pollen's and the floor's lines come through "
             "Flower's log stream, polled about every 0.5 s: single increments jitter by that, the median of many "
             "rounds far less. Targets: fixed above the floor = Pollen − floor "
             f"< {FIXED_TARGET_CPU_S:g} CPU-s; steady ratio = (Pollen − floor) / plain per round ≤ "
             f"{STEADY_TARGET_RATIO:g}." +
             ("" if counted <= {"cgroup"} else " Per-round counter: " + "; ".join(sorted(map(str, counted))) + "."),
             "", "| pair | plain fixed CPU s | plain steady CPU s / round | Pollen fixed CPU s | "
             "Pollen steady CPU s / round | floor fixed CPU s | floor steady CPU s / round | fixed above floor CPU s | "
             "steady ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(data["pairs"], 1):
        runs = [p.get(r, {}) for r in ("plain", "pollen", "floor")]
        cells = [c for r in runs for c in (_cell(r.get("fixed-cpu-s")), _cell(r.get("steady-round-cpu-s"), 3))]
        split = pair_split(p)
        cells += ["–", "–"] if split is None else [f"{split[0]:.2f}", f"{split[1]:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    if "steady-ratio-median" not in s:
        return lines + ["", "**Targets not judged: no pair has a floor run and a split of each run.**"]

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    lines += ["", f"**(a) Fixed cost above the floor: min {s['fixed-above-floor-cpu-s-min']}, median "
                  f"{s['fixed-above-floor-cpu-s-median']} CPU-s; target < {FIXED_TARGET_CPU_S:g} CPU-s: "
                  f"{met(s['fixed-above-floor-cpu-s-median'] < FIXED_TARGET_CPU_S)} (median of "
                  f"{s['split-pairs']} pairs).**", "",
              f"**(b) Steady ratio (Pollen − floor) / plain per round: min {s['steady-ratio-min']}, median "
              f"{s['steady-ratio-median']}; target ≤ {STEADY_TARGET_RATIO:g}: "
              f"{met(s['steady-ratio-median'] <= STEADY_TARGET_RATIO)} (median of {s['split-pairs']} pairs).**"]
    return lines


def markdown(data: dict) -> str:
    cfg, s = data["config"], data["summary"]
    lines = ["# Overhead: Pollen's Flower app vs the plain loop", "",
             f"FedProto MNIST, {cfg['clients']} clients, {cfg['ways']}-way 100-shot (official split), {cfg['rounds']} "
             f"rounds, seed {cfg['seed']}; plain loop = `bench/fedproto_reference.py` (1 process, 1 thread); "
             f"Pollen = `python -m pollen.launch.launcher --num-supernodes {cfg['clients']}` (1 CPU per client, "
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
    lines += split_markdown(data)
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
