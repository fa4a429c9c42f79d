"""How far one machine goes: FedAvg on MNIST (Dirichlet label skew) with N simulated clients.

For each N (default 10, 100, 1,000, 10,000) one real ``python -m pollen.launch.launcher`` run with N
SuperNodes, 3 rounds, ``clip(N/10, 2, 100)`` clients sampled per round for training and evaluation.
Measured from outside the run: wall per round and milliseconds per message (round wall / messages
sent that round), time from launch to the start of round 1, the whole launch's wall, and the peak
memory (PSS) of the launch's whole process tree (every process carrying this run's marker in its
environment, summed, sampled twice a second). One JSON file per N under ``bench/results/scale/``: a
finished N is skipped when the study is run again (``--force`` reruns it). ``scale.md`` and
``scale.png`` are rewritten from those files::

    python -m bench.scale --data-root ../shared/data                  # 10 100 1000 10000
    python -m bench.scale --data-root ../shared/data --clients 10 100  # a quick look
    python -m bench.scale --data-root ../shared/data --clients --floor 1000 --floor-work-ms 20
                                        # the Flower floor only, each ClientApp spending 20 CPU-ms per message
    python -m bench.scale --report                                     # tables and plot only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.kit import RESULTS, ROOT, pyplot, read_metrics, run_folders, save_figure, write_atomic, write_json
from bench.tree import MarkedTree
from pollen.launch.processes import proc_cmdline, proc_memory, proc_stat

ROLES = ("ClientApp actors", "ServerApp + simulation engine", "SuperLink", "Ray and the rest")


def _role(pid: int) -> str:
    """Which part of the run a process is, from its command line (Ray renames its workers)."""
    args = proc_cmdline(pid) or [b""]
    title = args[0].decode(errors="replace")
    command = " ".join(a.decode(errors="replace") for a in args[:3])
    if title.startswith("ray::ClientAppActor"):
        return ROLES[0]
    if "flwr-simulation" in command:
        return ROLES[1]
    if "flower-superlink" in command:
        return ROLES[2]
    return ROLES[3]


class TreeMemory(MarkedTree):
    """Peak of the summed PSS of every process whose environment carries ``POLLEN_SCALE_MARK=<token>``,
    and a CPU-time trace of each of them by role: the busiest ClientApp actor's CPU-seconds within a
    round is the client work that round's wall cannot go below; the other roles say where the rest of
    the machine's time went."""

    interval_s = 0.0  # the CPU trace below paces the scans

    def __init__(self) -> None:
        super().__init__("POLLEN_SCALE_MARK", _role, ROLES[3])
        self.peak_bytes = 0
        self.peak_processes = 0
        self.cpu_trace: list[tuple[float, dict[int, float]]] = []  # (monotonic time, pid -> CPU s)

    def sample(self, pids: list[int]) -> None:
        memories = [m for m in map(proc_memory, pids) if m is not None]  # None: gone meanwhile
        if sum(memories) > self.peak_bytes:
            self.peak_bytes, self.peak_processes = sum(memories), len(memories)
        for _ in range(4):  # CPU times four times per scan: rounds last seconds
            cpu: dict[int, float] = {}
            for pid in list(self.roles):
                stat = proc_stat(pid)
                if stat is not None:
                    cpu[pid] = stat.own_cpu_s
            self.cpu_trace.append((time.monotonic(), cpu))
            if self.wait(0.125):
                return

    def _deltas(self, start: float, end: float) -> dict[int, float] | None:
        before = [c for t, c in self.cpu_trace if t <= start]
        after = [c for t, c in self.cpu_trace if t >= end]
        if not before or not after:
            return None
        first, last = before[-1], after[0]
        return {pid: last[pid] - first.get(pid, 0.0) for pid in last}

    def busiest_actor_cpu(self, start: float, end: float) -> float | None:
        """The largest CPU-seconds one ClientApp actor spent between two monotonic times (nearest samples)."""
        deltas = self._deltas(start, end)
        if deltas is None:
            return None
        return max((d for pid, d in deltas.items() if self.roles.get(pid) == ROLES[0]), default=None)

    def cpu_by_role(self, start: float, end: float) -> dict[str, float] | None:
        """CPU-seconds each role spent between two monotonic times."""
        deltas = self._deltas(start, end)
        if deltas is None:
            return None
        out = dict.fromkeys(ROLES, 0.0)
        for pid, d in deltas.items():
            out[self.roles.get(pid, ROLES[3])] += d
        return {k: round(v, 2) for k, v in out.items()}


def sampled(n: int) -> int:
    return max(2, min(100, n // 10))


def floor_file(out: Path, n: int, work_ms: float) -> Path:
    """``scale/floor/{n}.json`` for clients answering at once, ``scale/floor/{n}-work{MS}.json`` with work."""
    return out / "scale" / "floor" / (f"{n}.json" if not work_ms else f"{n}-work{work_ms:g}.json")


def run_floor(n: int, args) -> dict:
    """The Flower floor in this shape: ``bench/overhead.py``'s app with no Pollen and no torch, N nodes,
    the same k sampled for train and evaluate each round, every node answering at once, or after
    ``args.floor_work_ms`` CPU milliseconds per message. The busiest ClientApp actor's CPU per round is
    traced as in :func:`run_one`, each round ending at the wall-clock time its ``[floor] round k/K`` line
    says (``(ended <unix time>)``; the line itself comes through Flower's log stream 0.1-0.4 s later), else
    when the line arrives."""
    from bench.overhead import floor_command

    k, work_ms = sampled(n), args.floor_work_ms
    work_ms = int(work_ms) if work_ms == int(work_ms) else work_ms  # 20, not 20.0, in the row
    with tempfile.TemporaryDirectory(prefix=f"pollen-floor-{n}-") as tmp, TreeMemory() as memory:
        cmd = floor_command(Path(tmp) / "floor-app", n, args.rounds, sampled=k, evaluate_every_round=True,
                            extra=("--timeout", str(args.timeout)), work_ms=work_ms)
        load = os.getloadavg()[0]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=memory.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        lines: list[tuple[float, str]] = []  # (monotonic time, line): the round lines as they come
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
        proc.wait()
        wall = time.monotonic() - started
    rounds = [(at, line) for at, line in lines if line.startswith("[floor] round ")]
    walls = [sum(float(t) for t in re.findall(r"replies ([0-9.]+)s", line)) for _, line in rounds]
    wall_clock = time.time() - time.monotonic()  # the ServerApp's time.time() on this machine, as monotonic
    round_ends = [float(m.group(1)) - wall_clock if (m := re.search(r"\(ended ([0-9.]+)\)", line)) else at
                  for at, line in rounds]
    row = {"clients": n, "sampled-per-round": k, "rounds": args.rounds, "client-work-ms": work_ms,
           "rc": proc.returncode, "launch-wall-s": round(wall, 1), "load-1min": round(load, 2),
           "round-wall-s": [round(w, 2) for w in walls],
           "ms-per-message": [round(1000 * w / (2 * k), 1) for w in walls]}
    if rounds:  # as Pollen's: when round 1 ended, less round 1's own wall
        row["time-to-round-1-s"] = round(round_ends[0] - started - walls[0], 1)
    busiest = [memory.busiest_actor_cpu(end - w, end) for end, w in zip(round_ends, walls)]
    row["busiest-actor-cpu-s"] = [None if b is None else round(b, 2) for b in busiest]
    row["round-wall-per-busiest-actor"] = [None if not b else round(w / b, 2) for w, b in zip(walls, busiest)]
    row["cpu-by-role-s"] = [memory.cpu_by_role(end - w, end) for end, w in zip(round_ends, walls)]
    if proc.returncode != 0:
        row["log-tail"] = "".join(line for _, line in lines)[-3000:]
    return row


def run_config(n: int, rounds: int) -> dict:
    """FedAvg on MNIST with N clients, the same k sampled for training and evaluation each round."""
    k = sampled(n)
    return {"method": "fedavg", "task": "mnist-dirichlet", "num-server-rounds": rounds, "seed": 0,
            "fraction-fit": k / n, "fraction-evaluate": k / n, "min-available-clients": k,
            "local-epochs": 1, "batch-size": 32, "torch-threads": 1}


def run_one(n: int, args) -> dict:
    from pollen.launch import format_run_config

    k = sampled(n)
    config = format_run_config(run_config(n, args.rounds))
    with tempfile.TemporaryDirectory(prefix=f"pollen-scale-{n}-") as tmp:
        out_dir = Path(tmp) / "runs"
        cmd = [sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", str(n), "--out-dir", str(out_dir),
               "--data-root", str(args.data_root), "--run-config", config, "--quiet",
               "--timeout", str(args.timeout)]
        log = Path(tmp) / "launch.log"
        first_line_s = None
        round_ends: list[float] = []  # monotonic time each round's metrics line appeared (within 0.1 s)
        with TreeMemory() as memory, log.open("w") as out:
            load = os.getloadavg()[0]  # other work on the machine: every figure here is a wall time
            started = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=memory.env(), stdout=out, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                runs = run_folders(out_dir)
                if runs:
                    # count lines, not parse them: the last one may be half written
                    done = sum(1 for x in (runs[0] / "metrics.jsonl").read_text().splitlines() if x.strip())
                    round_ends += [time.monotonic()] * (done - len(round_ends))
                    if first_line_s is None and done:
                        first_line_s = time.monotonic() - started
                time.sleep(0.1)
            wall = time.monotonic() - started
        row: dict = {"clients": n, "sampled-per-round": k, "fraction": round(k / n, 4), "rounds": args.rounds,
                     "rc": proc.returncode, "launch-wall-s": round(wall, 1), "load-1min": round(load, 2),
                     "peak-pss-mb": round(memory.peak_bytes / 2**20, 1),
                     "processes-at-peak": memory.peak_processes}
        runs = run_folders(out_dir)
        if runs:
            lines = read_metrics(runs[0])
            walls = [r["wall-time-s"] for r in lines]
            messages = [int(r.get("sampled", 0)) + len(r.get("evaluate-clients", {})) for r in lines]
            row["round-wall-s"] = [round(w, 2) for w in walls]
            row["ms-per-message"] = [round(1000 * w / m, 1) if m else None for w, m in zip(walls, messages)]
            row["accepted"] = [r.get("accepted") for r in lines]
            row["accuracy"] = [r.get("evaluate", {}).get("accuracy") for r in lines]
            if first_line_s is not None and walls:
                row["time-to-round-1-s"] = round(first_line_s - walls[0], 1)
            busiest = [memory.busiest_actor_cpu(end - w, end) for end, w in zip(round_ends, walls)]
            row["busiest-actor-cpu-s"] = [None if b is None else round(b, 2) for b in busiest]
            row["round-wall-per-busiest-actor"] = [None if not b else round(w / b, 2)
                                                   for w, b in zip(walls, busiest)]
            row["cpu-by-role-s"] = [memory.cpu_by_role(end - w, end) for end, w in zip(round_ends, walls)]
        if proc.returncode != 0:
            row["log-tail"] = log.read_text(errors="replace")[-3000:]
    return row


def report(out: Path) -> None:
    rows = sorted((json.loads(p.read_text()) for p in (out / "scale").glob("*.json")), key=lambda r: r["clients"])
    if not rows:
        print("[scale] no results yet")
        return
    lines = ["# Scale: FedAvg on MNIST (Dirichlet), N simulated clients on one machine", "",
             "One `python -m pollen.launch.launcher` run per N, 3 rounds, `clip(N/10, 2, 100)` clients sampled per "
             "round "
             "for training and evaluation, 1 CPU per client, this machine's cores. *ms/message*: round wall / messages "
             "that round (train + evaluate). *Peak PSS*: proportional set size of the launch's whole "
             "process tree (SuperLink, ServerApp, Ray and its workers), summed, shared pages counted once. "
             "Written by `bench/scale.py` from `bench/results/scale/*.json`.", "",
             "Before round 1 the strategy learns which partition each node serves, so that one seed samples the "
             "same partitions in every run. The rows above were run while, under the simulation engine, it read "
             "the engine's assignment and confirmed it with two `query` messages before round 1 (rows without a "
             "load figure: before that, one query per node). Those two queries waited for the engine to start, "
             "so the engine's start-up fell before round 1; in the floor, and in "
             "`bench/results/scale-before-identify/` (sampled by node id, no queries, a more loaded machine), it "
             "falls inside round 1's wall. Since fc9503b no query is sent: each node's first reply confirms its "
             "partition (the identity section below), and the start-up falls inside round 1 as in the floor. "
             "*Round 1 ends* (time to round 1 + round 1's wall) compares all of them.", "",
             "*Busiest actor*: the CPU-seconds of the Ray actor (one per core, each running ClientApps one "
             "after another) that worked most during the round, train and evaluate messages together, read from "
             "`/proc` 8 times a second; round wall / busiest actor near 1 means the round waited for client "
             "work, not for dispatch (runs before this column existed show –). *Load*: the machine's 1-minute load "
             "average when the launch started (2 cores; – where not recorded).", "",
             "| N | sampled | exit | time to round 1 s | round 1 ends s | round wall s (1 / 2 / 3) | "
             "ms/message (1 / 2 / 3) | busiest actor CPU s | round wall / busiest actor | peak PSS MB | processes | "
             "launch wall s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def per_round(values) -> str:
        return " / ".join("–" if v is None else str(v) for v in values or []) or "–"

    def round_one_ends(r: dict) -> str:
        if r.get("time-to-round-1-s") is None or not r.get("round-wall-s"):
            return "–"
        return str(round(round_one_end(r), 1))

    for r in rows:
        lines.append(f"| {r['clients']:,} | {r['sampled-per-round']} | {r['rc']} | {r.get('time-to-round-1-s', '–')} | "
                     f"{round_one_ends(r)} | {per_round(r.get('round-wall-s'))} | "
                     f"{per_round(r.get('ms-per-message'))} | "
                     f"{per_round(r.get('busiest-actor-cpu-s'))} | "
                     f"{per_round(r.get('round-wall-per-busiest-actor'))} | "
                     f"{r['peak-pss-mb']} | {r['processes-at-peak']} | {r['launch-wall-s']} | "
                     f"{r.get('load-1min', '–')} |")
    floors = sorted((json.loads(p.read_text()) for p in (out / "scale" / "floor").glob("*.json")),
                    key=lambda r: (r["clients"], r.get("client-work-ms", 0)))
    if floors:
        lines += ["", "## The Flower floor", "",
                  "The same launch of a Flower app with no Pollen and no torch (`FLOOR_APP` in "
                  "`bench/overhead.py`): N SuperNodes, the same k sampled for train and then evaluate each round, "
                  "every node answering at once. Its round wall is what Flower's dispatch alone costs in this shape.",
                  "",
                  "*Client work ms/message* > 0 (`--floor-work-ms`): the same engine with ClientApps that spend CPU "
                  "per message as Pollen's do (each train and evaluate spins until its process's CPU time has advanced "
                  "that much, then answers), to see what Flower's dispatch costs when messages stay pending; 0: "
                  "answering at once. *Busiest actor* as above, each round ending at the time its "
                  "`[floor] round k/K` line says it ended (– in rows run before the column existed, whose time to "
                  "round 1 counts from the line's arrival through Flower's log stream, 0.1–0.4 s later).",
                  "", "| N | sampled | client work ms/message | exit | time to round 1 s | round 1 ends s | "
                  "round wall s (1 / 2 / 3) | ms/message (1 / 2 / 3) | busiest actor CPU s (1 / 2 / 3) | "
                  "round wall / busiest actor (1 / 2 / 3) | launch wall s | load |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in floors:
            lines.append(f"| {r['clients']:,} | {r['sampled-per-round']} | {r.get('client-work-ms', 0):g} | "
                         f"{r['rc']} | {r.get('time-to-round-1-s', '–')} | {round_one_ends(r)} | "
                         f"{per_round(r.get('round-wall-s'))} | {per_round(r.get('ms-per-message'))} | "
                         f"{per_round(r.get('busiest-actor-cpu-s'))} | "
                         f"{per_round(r.get('round-wall-per-busiest-actor'))} | "
                         f"{r['launch-wall-s']} | {r.get('load-1min', '–')} |")
    pairs = sorted((json.loads(p.read_text()) for p in (out / "scale-identity").glob("*.json")),
                   key=lambda r: (r["clients"], r["order"]))
    if pairs:
        lines += ["", "## Identity: one query per node vs the engine's assignment, interleaved", "",
                  "The same launch at the same N with Pollen before (`queries`: one `query` message per node before "
                  "round 1) and after (`engine`: the engine's assignment, two queries), run in the order shown "
                  "(old, new, new, old) so that the machine's load hits both alike; at N = 10,000 the launch from "
                  "before the change (order 0, an earlier launch) and three pairs of the new code and the Flower "
                  "floor, alternated. Orders 7–10: the engine's assignment with no query at all (each node's first "
                  "train or evaluate reply confirms its partition; a contradiction falls back to one query per node), "
                  "floor, Pollen, Pollen, floor, on a machine loaded by other work. *Load*: the machine's "
                  "1-minute load average when the launch started (2 cores). "
                  "Rows: `bench/results/scale-identity/*.json`.", "",
                  *no_query_summary(pairs), "",
                  "Every Pollen run of one N has the same accuracy after each round, digit for digit: each way, and "
                  "in every launch (new node ids each time), the seed sampled the same partitions. What Pollen's "
                  "launch still spends before round 1 beyond the floor's (the launcher, torch in the ServerApp and "
                  "in each actor, Flower reading Pollen's run-config table once per node, the Dirichlet split of "
                  "N partitions in each actor) is profiled in `bench/results/scale-profile/README.md`.", "",
                  "| N | order | identity | load | time to round 1 s | round 1 ends s | round wall s (1 / 2 / 3) | "
                  "launch wall s | accuracy (1 / 2 / 3) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in pairs:
            accuracy = [None if a is None else round(a, 4) for a in r.get("accuracy") or []]
            lines.append(f"| {r['clients']:,} | {r['order']} | {r['identity']} | {r['load-1min']} | "
                         f"{r.get('time-to-round-1-s', '–')} | {round_one_ends(r)} | "
                         f"{per_round(r.get('round-wall-s'))} | {r['launch-wall-s']} | {per_round(accuracy)} |")
    with_roles = [r for r in rows if any(r.get("cpu-by-role-s") or [])]
    floor_roles = [r for r in floors if any(r.get("cpu-by-role-s") or [])] if floors else []
    if with_roles or floor_roles:
        lines += ["", "## Where the CPU went in the last round", "",
                  "CPU-seconds per part of the run within the last round (same /proc trace); the machine has "
                  f"{os.cpu_count()} cores, so a round of wall *w* has at most {os.cpu_count()}·*w* CPU-seconds. "
                  "Floor rows: the Flower floor with that client work per message; where its clients spend "
                  "CPU as Pollen's do, the simulation engine's CPU (its polling of every stored message for "
                  "every node) is what it is in Pollen's run: that part is Flower's.", "",
                  "| N | run | round wall s | " + " | ".join(f"{role} CPU s" for role in ROLES) + " |",
                  "|---|---|---|" + "---|" * len(ROLES)]
        labelled = [("Pollen", r) for r in with_roles] + [
            (f"floor, {r.get('client-work-ms', 0):g} ms/message", r) for r in floor_roles]
        for label, r in sorted(labelled, key=lambda x: x[1]["clients"]):
            roles = r["cpu-by-role-s"][-1] or {}
            lines.append(f"| {r['clients']:,} | {label} | {r['round-wall-s'][-1]} | "
                         + " | ".join(str(roles.get(role, "–")) for role in ROLES) + " |")
    write_atomic(out / "scale.md", "\n".join(lines) + "\n")
    ok = [r for r in rows if r.get("round-wall-s")]
    if not ok:
        return
    fig, axes = pyplot().subplots(1, 3, figsize=(13, 3.6))
    xs = [r["clients"] for r in ok]
    axes[0].plot(xs, [r["peak-pss-mb"] for r in ok], "o-")
    axes[0].set(xscale="log", xlabel="simulated clients N", ylabel="peak PSS of the tree (MB)")
    axes[1].plot(xs, [r.get("time-to-round-1-s") for r in ok], "o-")
    axes[1].set(xscale="log", xlabel="N", ylabel="time to round 1 (s)")
    axes[2].plot(xs, [r["ms-per-message"][-1] for r in ok], "o-", label="last round")
    axes[2].set(xscale="log", xlabel="N", ylabel="ms per message")
    axes[2].legend()
    save_figure(fig, out / "scale.png", dpi=120)


def no_query_summary(pairs: list[dict]) -> list[str]:
    """The identity target in words: time to round 1 with no query against the floor's, pair by pair."""
    ordered = [r for r in sorted(pairs, key=lambda r: r["order"]) if r["clients"] == 10_000 and r["order"] >= 7]
    pollen = [r for r in ordered if r["identity"].startswith("engine, no query")]
    floor = [r for r in ordered if r["identity"] == "Flower floor"]
    if not pollen or len(pollen) != len(floor):
        return []
    pairs_run = list(zip(pollen, floor, strict=True))  # as run: floor, Pollen | Pollen, floor
    return ["**N = 10,000, no query: time to round 1 / the floor's = "
             + ", ".join(f"{p['time-to-round-1-s']} / {f['time-to-round-1-s']} = "
                         f"{p['time-to-round-1-s'] / f['time-to-round-1-s']:.2f}" for p, f in pairs_run)
             + "; round 1 ends / the floor's = "
             + ", ".join(f"{round_one_end(p):.1f} / {round_one_end(f):.1f} = "
                         f"{round_one_end(p) / round_one_end(f):.2f}" for p, f in pairs_run) + ".**"]


def round_one_end(r: dict) -> float:
    return r["time-to-round-1-s"] + r["round-wall-s"][0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=os.environ.get("POLLEN_DATA_ROOT"))
    parser.add_argument("--clients", type=int, nargs="*", default=[10, 100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", type=int, nargs="*", default=[],
                        help="N for which to run the Flower floor too (same shape, no Pollen, no torch)")
    parser.add_argument("--floor-work-ms", type=float, default=0.0, metavar="MS",
                        help="CPU milliseconds each floor ClientApp spends per train / evaluate message before it "
                             "answers (0: at once); results in scale/floor/{N}-work{MS}.json")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--force", action="store_true", help="rerun an N that already has a result file")
    parser.add_argument("--report", action="store_true", help="only rewrite scale.md and scale.png")
    args = parser.parse_args(argv)
    if not args.report:
        if args.data_root is None or not (Path(args.data_root) / "MNIST" / "raw").is_dir():
            parser.error("--data-root must hold MNIST/raw (or set POLLEN_DATA_ROOT)")
        args.data_root = Path(args.data_root).resolve()
        (args.out / "scale").mkdir(parents=True, exist_ok=True)
        for n in args.clients:
            path = args.out / "scale" / f"{n}.json"
            if path.exists() and not args.force:
                print(f"[scale] N = {n}: done already ({path})", flush=True)
                continue
            print(f"[scale] N = {n}: running", flush=True)
            row = run_one(n, args)
            write_json(path, row, indent=2)
            print(f"[scale] N = {n}: {json.dumps({k: v for k, v in row.items() if k != 'log-tail'})}", flush=True)
        for n in args.floor:
            path = floor_file(args.out, n, args.floor_work_ms)
            if path.exists() and not args.force:
                print(f"[scale] floor {path.stem}: done already ({path})", flush=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"[scale] floor {path.stem}: running", flush=True)
            row = run_floor(n, args)
            write_json(path, row, indent=2)
            shown = {k: v for k, v in row.items() if k != "log-tail"}
            print(f"[scale] floor {path.stem}: {json.dumps(shown)}", flush=True)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
