"""Cluster benchmark: a 100-client FedProto MNIST simulation on one Ray node vs a two-node loopback cluster.

Both arms have the same 2 CPUs and 1 CPU per client, so Ray holds two ClientApp actors in both:

* ``one-node``: ``pollen run`` with its default private local Ray (one raylet, the machine's 2 CPUs);
* ``two-node``: ``python -m pollen.launch.cluster loopback --nodes 2 --num-cpus 1`` (two raylets on
  127.0.0.1, 1 CPU each) started here, then ``pollen run --ray-address <its address>``; the cluster is
  stopped by its process group afterwards, on every exit path.

On one machine the second "node" adds no CPU, so this measures what spreading a run over raylets
costs (cross-raylet dispatch, a second raylet's own CPU), not a speed-up, which needs real machines.
The run is ``conf/fedproto-mnist-n3.toml`` with 100 SuperNodes and fewer rounds (``--rounds``) so that a
run takes minutes; every other preset key is kept. Arms are interleaved (one-node, two-node, two-node,
one-node, ...) so that the load of a shared machine hits both alike, and the 1-minute load at each
start is recorded. CPU-seconds cover every process a run started, the cluster's raylets included:
each run gets a cpuacct cgroup of its own (``bench.overhead.CpuGroup``; without cgroup access the
reaped children's rusage, this script being a child subreaper). One file per finished run,
``bench/results/cluster/<arm>-<k>.json`` (a stopped study resumes by skipping them); the report
``bench/results/cluster.{md,json}`` is written from those files::

    python -m bench.cluster --pairs 2           # runs what is missing, then writes the report
    python -m bench.cluster --report            # only rewrites the report from the files
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.kit import (
    RESULTS,
    ROOT,
    RunFiles,
    default_data_root,
    fmt_paired,
    preset,
    read_metrics,
    read_summary,
    run_folders,
    run_study,
    table,
    verdict,
    write_atomic,
    write_json,
)

ARMS = ("one-node", "two-node")
PRESET = "fedproto-mnist-n3"
CLIENTS = 100
ROUNDS = 10
NODES, CPUS_PER_NODE = 2, 1  # the two-node arm; the one-node arm has the machine's CPUs (2 here)
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # pollen.launch.cluster.LOOPBACK_VAR (no Ray import here)
POLLEN = Path(sys.executable).parent / "pollen"
# the launcher's placement lines (pollen.launch.cluster.placement_lines)
PLACEMENT_LINE = re.compile(r"^\[pollen\]   node (\w+) (\S+): (\d+) actor\(s\), (\d+|\?) call\(s\)"
                            r"( \(node dead now\))?$")
LOOPBACK_NODE = re.compile(r"node \d+ \((head|worker)\): id (\w+), raylet pid (\d+)")


class RepeatFiles(RunFiles):
    """The kit's one-file-per-run store, named ``<arm>-<k>.json``: ``k`` is the pair, not a seed (every run
    has the same seed)."""

    def path(self, arm: str, seed: int) -> Path:
        return self.folder / f"{arm}-{seed}.json"

    def load(self, setting: Mapping[str, Any] | None = None) -> list[dict]:
        paths = [p for arm in ARMS for p in self.folder.glob(f"{arm}-*.json")]
        records = [json.loads(p.read_text()) for p in sorted(paths, key=lambda p: _order_key(p.stem))]
        return records if setting is None else [r for r in records if r["setting"] == setting]


def _order_key(stem: str) -> tuple[int, int]:
    """Files in the order they were run: pair k, then one-node first in odd pairs, two-node first in even."""
    arm, _, k = stem.rpartition("-")
    pair = int(k) if k.isdigit() else 0
    first = ARMS[0] if pair % 2 else ARMS[1]
    return pair, 0 if arm == first else 1


def schedule(pairs: int) -> list[tuple[str, int]]:
    """(arm, pair) in running order: one-node, two-node | two-node, one-node | ... (ABBA)."""
    cells = []
    for k in range(1, pairs + 1):
        order = ARMS if k % 2 else tuple(reversed(ARMS))
        cells += [(arm, k) for arm in order]
    return cells


def run_config(rounds: int) -> dict[str, Any]:
    """The preset's keys, only the rounds changed."""
    config = preset(PRESET)
    config["num-server-rounds"] = rounds
    return config


def setting(args) -> dict[str, Any]:
    return {"preset": PRESET, "run-config": run_config(args.rounds), "clients": args.clients,
            "cpus-per-client": 1, "two-node": {"nodes": NODES, "cpus-per-node": CPUS_PER_NODE},
            "one-node": {"ray": "private local (RAY_ADDRESS=local)", "cpus": os.cpu_count()}}


def parse_placement(text: str) -> dict[str, dict[str, Any]]:
    """The launcher's ``Ray placement`` lines as {node id prefix: {ip, actors, calls, alive}}; empty when
    it printed none (a run without ``--ray-address``, or Ray's records could not be read)."""
    nodes: dict[str, dict[str, Any]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("[pollen] Ray placement (job "):
            continue
        for row in lines[i + 1:]:
            match = PLACEMENT_LINE.match(row.rstrip())
            if not match:
                break
            node, ip, actors, calls, dead = match.groups()
            nodes[node] = {"ip": ip, "actors": int(actors), "calls": None if calls == "?" else int(calls),
                           "alive": not dead}
    return nodes


def parse_loopback(text: str) -> tuple[str | None, dict[str, str]]:
    """The loopback command's address and {node id: head/worker} from its first lines."""
    address = re.search(r"up: address (\S+) ", text)
    roles = {node_id: role for role, node_id, _pid in LOOPBACK_NODE.findall(text)}
    return (address.group(1) if address else None), roles


# --- running ------------------------------------------------------------------------------------------

def _env(arm: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the launcher ignores it anyway without --ray-address; never inherit one
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    if arm == "two-node":
        env[LOOPBACK_VAR] = "0"  # every process attaching to a loopback cluster needs it (docs/cluster.md)
    return env


def _usage_s(group) -> float | None:
    """The cgroup's CPU-seconds so far (exited processes included), None without a cgroup."""
    if group.path is None:
        return None
    return int((group.path / "cpuacct.usage").read_text()) / 1e9


def start_loopback(env: dict[str, str], log: Path, preexec, timeout: float = 300.0):
    """Start the two-node loopback cluster in its own process group; wait for its address."""
    cmd = [sys.executable, "-m", "pollen.launch.cluster", "loopback", "--nodes", str(NODES),
           "--num-cpus", str(CPUS_PER_NODE)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=preexec)
    deadline = time.monotonic() + timeout
    text = ""
    while "attach with" not in text:
        if proc.poll() is not None:
            raise RuntimeError(f"loopback cluster exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"loopback cluster not up in {timeout:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
        text = log.read_text(errors="replace")
    address, roles = parse_loopback(text)
    return proc, address, roles


def launch(cmd: list[str], env: dict[str, str], log: Path, out_dir: Path, preexec) -> dict[str, Any]:
    """Run the launcher to the end, noting when each round's metrics line appears (time to round 1)."""
    first_line_s = None
    loads: list[float] = []  # the machine's 1-minute load every 5 s: the other work it ran meanwhile
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)
        while proc.poll() is None:
            runs = run_folders(out_dir)
            if first_line_s is None and runs and (runs[0] / "metrics.jsonl").read_text().strip():
                first_line_s = time.monotonic() - started
            if len(loads) * 5.0 <= time.monotonic() - started:
                loads.append(os.getloadavg()[0])
            time.sleep(0.2)
    return {"rc": proc.returncode, "launch-wall-s": round(time.monotonic() - started, 1),
            "load-1min-mean": round(statistics.fmean(loads), 2) if loads else None, "_first_line_s": first_line_s}


def run_arm(arm: str, k: int, args, tmp: Path) -> dict[str, Any]:
    from bench.overhead import CpuGroup, children_cpu, reap_all
    from pollen.launch import format_run_config, stop_process

    reap_all()
    group = CpuGroup()
    env = _env(arm)
    out_dir, log = tmp / f"{arm}-{k}-runs", tmp / f"{arm}-{k}.log"
    cmd = [str(POLLEN), "run", "--num-supernodes", str(args.clients), "--data-root", str(args.data_root),
           "--out-dir", str(out_dir), "--flwr-home", str(tmp / f"{arm}-{k}-flwr-home"),
           "--timeout", str(args.timeout), "--run-config", format_run_config(run_config(args.rounds))]
    record: dict[str, Any] = {"arm": arm, "pair": k, "setting": setting(args),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "load-1min-at-start": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                              "python": platform.python_version()}
    cpu0, began = children_cpu(), time.monotonic()
    cluster = None
    try:
        if arm == "two-node":
            cluster, address, roles = start_loopback(env, tmp / f"{arm}-{k}-cluster.log", group.enter)
            record["cluster-up-s"] = round(time.monotonic() - began, 1)
            record["node-roles"] = roles
            cmd[2:2] = ["--ray-address", address]
        cpu_launch0 = _usage_s(group)
        record.update(launch(cmd, env, log, out_dir, group.enter))
        cpu_launch1 = _usage_s(group)
        if cpu_launch0 is not None and cpu_launch1 is not None:
            record["launch-cpu-s"] = round(cpu_launch1 - cpu_launch0, 1)
    finally:
        if cluster is not None:
            stop_process(cluster, grace=60)  # its process group only: the nodes this script started
    group_cpu, strays = group.cpu_s()
    reap_all()
    record["arm-wall-s"] = round(time.monotonic() - began, 1)
    rusage_cpu = children_cpu() - cpu0
    record.update({"cpu-s": round(group_cpu if group_cpu is not None else rusage_cpu, 1),
                   "cpu-counted-by": "cgroup" if group_cpu is not None else "rusage",
                   "rusage-cpu-s": round(rusage_cpu, 1), "strays-killed": len(strays)})
    text = log.read_text(errors="replace")
    record["placement"] = parse_placement(text)
    first_line_s = record.pop("_first_line_s", None)
    runs = run_folders(out_dir)
    if runs:
        walls = [r["wall-time-s"] for r in read_metrics(runs[0])]
        record["round-wall-s"] = [round(w, 2) for w in walls]
        if first_line_s is not None and walls:
            record["time-to-round-1-s"] = round(first_line_s - walls[0], 1)
        summary = read_summary(runs[0])
        final = (summary.get("final") or {}).get("evaluate", {})
        record.update({"status": summary.get("status"), "rounds": summary.get("rounds"),
                       "failures-total": summary.get("failures-total"),
                       "accuracy": final.get("accuracy"), "proto-accuracy": final.get("proto-accuracy")})
        placed = runs[0] / "cluster.json"
        if placed.exists():
            record["cluster-json"] = json.loads(placed.read_text())
    if record["rc"] != 0 or record.get("status") != "completed":
        record["log-tail"] = text[-3000:]
    return record


# --- the report ---------------------------------------------------------------------------------------

def _med(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per arm: round walls (round 1 apart, rounds 2.. pooled over runs), launch wall, CPU, time to round 1;
    two-node / one-node ratios of the medians; whether the final accuracies agree digit for digit."""
    arms: dict[str, Any] = {}
    for arm in ARMS:
        rows = [r for r in records if r["arm"] == arm and r.get("round-wall-s")]
        steady = [w for r in rows for w in r["round-wall-s"][1:]]
        arms[arm] = {"runs": len(rows),
                     "round-1-s-median": _med([r["round-wall-s"][0] for r in rows]),
                     "steady-round-s-median": _med(steady),
                     "steady-round-s-min": round(min(steady), 2) if steady else None,
                     "launch-wall-s-median": _med([r["launch-wall-s"] for r in rows]),
                     "time-to-round-1-s-median": _med([r["time-to-round-1-s"] for r in rows
                                                       if r.get("time-to-round-1-s") is not None]),
                     "cpu-s-median": _med([r["cpu-s"] for r in rows]),
                     "launch-cpu-s-median": _med([r["launch-cpu-s"] for r in rows
                                                  if r.get("launch-cpu-s") is not None]),
                     "load-1min-at-start": [r["load-1min-at-start"] for r in rows]}
    one, two = arms[ARMS[0]], arms[ARMS[1]]
    ratios = {key: round(two[key] / one[key], 3) if one[key] and two[key] is not None else None
              for key in ("steady-round-s-median", "steady-round-s-min", "round-1-s-median", "launch-wall-s-median",
                          "cpu-s-median", "launch-cpu-s-median")}
    by_run = {(r["arm"], r["pair"]): r for r in records if r.get("round-wall-s")}
    pairs = []
    for k in sorted({k for _, k in by_run}):
        a, b = by_run.get((ARMS[0], k)), by_run.get((ARMS[1], k))
        if a is None or b is None or len(a["round-wall-s"]) < 2 or len(b["round-wall-s"]) < 2:
            continue
        ma, mb = _med(a["round-wall-s"][1:]), _med(b["round-wall-s"][1:])
        pairs.append({"pair": k, "one-node-s": ma, "two-node-s": mb, "diff-s": round(mb - ma, 2),
                      "ratio": round(mb / ma, 3), "cpu-ratio": round(b["cpu-s"] / a["cpu-s"], 3)})
    diffs = [p["diff-s"] for p in pairs]
    paired = {"pairs": pairs, "diff-s": fmt_paired(diffs),
              # the claim a loopback cluster is expected to show: its extra raylet makes rounds slower
              "verdict-two-node-slower": verdict(diffs)}
    finals = [(r["arm"], r["pair"], r.get("accuracy"), r.get("proto-accuracy")) for r in records]
    distinct = {(a, p) for _, _, a, p in finals}
    return {"arms": arms, "two-over-one": ratios, "paired": paired,
            "accuracy": {"runs": [{"arm": arm, "pair": k, "accuracy": a, "proto-accuracy": p}
                                  for arm, k, a, p in finals],
                         "identical": len(distinct) == 1 and None not in next(iter(distinct), (None,))}}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def _placement_cell(r: Mapping[str, Any]) -> str:
    placed = r.get("placement") or {}
    if not placed:
        return "one node (private Ray; not read)" if r["arm"] == "one-node" else "not read"
    roles = {node_id[:8]: role for node_id, role in (r.get("node-roles") or {}).items()}
    return "; ".join(f"{roles.get(node, node)}: {row['actors']} actor(s), "
                     f"{'?' if row['calls'] is None else row['calls']} calls" for node, row in sorted(
                         placed.items(), key=lambda kv: roles.get(kv[0], kv[0])))


def markdown(data: Mapping[str, Any]) -> str:
    records, s = data["runs"], data["summary"]
    if not records:
        return "# Cluster benchmark\n\nNo finished runs yet.\n"
    st = records[0]["setting"]
    cfg = st["run-config"]
    one, two, ratio = s["arms"]["one-node"], s["arms"]["two-node"], s["two-over-one"]
    counted = {r.get("cpu-counted-by") for r in records}
    lines = [
        "# Cluster benchmark: one Ray node vs a two-node loopback cluster, same CPUs", "",
        f"FedProto MNIST (`conf/{st['preset']}.toml`: {cfg['shot-ways']}-way {cfg['shot-shots']}-shot, "
        f"batch {cfg['batch-size']}, lr {cfg['lr']}) with **{st['clients']} SuperNodes** (the preset has 20) and "
        f"**{cfg['num-server-rounds']} rounds** (the preset has 100; fewer so that a run takes minutes on a shared "
        "machine), every other preset key kept; every client trains and evaluates every round. 1 CPU per client. "
        f"*one-node*: `pollen run` with its private local Ray ({st['one-node']['cpus']} CPUs, one raylet). "
        f"*two-node*: `python -m pollen.launch.cluster loopback --nodes {st['two-node']['nodes']} --num-cpus "
        f"{st['two-node']['cpus-per-node']}` (two raylets on 127.0.0.1), then `pollen run --ray-address ADDR`. "
        "Both arms hold two ClientApp actors at once. Runs interleaved in the order shown; the machine was shared "
        "with another study the whole time, so its 1-minute load at each start is given (and its mean over the "
        "launch, sampled every 5 s, where recorded). Written by `bench/cluster.py` from "
        "`bench/results/cluster/*.json`.", "",
        "*Round wall*: `wall-time-s` of each round in the run's `metrics.jsonl`; *time to round 1*: from the "
        "launcher's start until round 1 began; *launch wall*: the whole `pollen run` (the two-node arm's cluster "
        "start-up, *cluster up*, comes before it). *CPU s*: every process the run started, the two-node arm's "
        "cluster from start to stop included (" +
        ("a cpuacct cgroup per run" if counted == {"cgroup"} else "cgroup where available, else reaped children's "
         "rusage") + "); *CPU s in launch*: the same group while `pollen run` ran. *Placement*: the launcher's "
        "`Ray placement` lines (ClientApp actors and calls per node, from Ray's records of the run's job).", "",
        "## Runs", ""]
    rows = []
    for r in records:
        walls = r.get("round-wall-s") or []
        load = f"{r['load-1min-at-start']} / {r.get('load-1min-mean') or '–'}"
        rows.append([f"{r['arm']}-{r['pair']}", load, r.get("status", f"exit {r['rc']}"),
                     r.get("cluster-up-s", "–"), r["launch-wall-s"], r.get("time-to-round-1-s", "–"),
                     " / ".join(f"{w:.1f}" for w in walls) or "–", _med(walls[1:]) or "–", r["cpu-s"],
                     r.get("launch-cpu-s", "–"),
                     _placement_cell(r), f"{_pct(r.get('accuracy'))} / {_pct(r.get('proto-accuracy'))}"])
    lines += table(["run", "load start / mean", "status", "cluster up s", "launch wall s", "time to round 1 s",
                    "round wall s (1 / 2 / …)", "rounds 2… s (median)", "CPU s", "CPU s in launch", "placement",
                    "local / proto acc %"], rows)

    def fmt(x) -> str:
        return "–" if x is None else str(x)

    lines += ["", "## Summary", "",
              *table(["arm", "runs", "round 1 s (median)", "rounds 2… s (median)", "rounds 2… s (min)",
                      "launch wall s (median)", "time to round 1 s (median)", "CPU s (median)",
                      "CPU s in launch (median)", "load at starts"],
                     [[arm, a["runs"], fmt(a["round-1-s-median"]), fmt(a["steady-round-s-median"]),
                       fmt(a["steady-round-s-min"]), fmt(a["launch-wall-s-median"]),
                       fmt(a["time-to-round-1-s-median"]), fmt(a["cpu-s-median"]), fmt(a["launch-cpu-s-median"]),
                       ", ".join(str(x) for x in a["load-1min-at-start"])]
                      for arm, a in s["arms"].items()]), "",
              f"**Round wall (rounds 2…, median over runs): one-node {fmt(one['steady-round-s-median'])} s, two-node "
              f"{fmt(two['steady-round-s-median'])} s, two-node / one-node {fmt(ratio['steady-round-s-median'])} "
              f"(min: {fmt(one['steady-round-s-min'])} s vs {fmt(two['steady-round-s-min'])} s, ratio "
              f"{fmt(ratio['steady-round-s-min'])}).**", "",
              f"**Launch wall (median): one-node {fmt(one['launch-wall-s-median'])} s, two-node "
              f"{fmt(two['launch-wall-s-median'])} s, ratio {fmt(ratio['launch-wall-s-median'])}; CPU-seconds (median, "
              f"whole run): one-node {fmt(one['cpu-s-median'])}, two-node {fmt(two['cpu-s-median'])}, ratio "
              f"{fmt(ratio['cpu-s-median'])}.**", ""]
    paired = s["paired"]
    if paired["pairs"]:
        lines += ["Per pair (the two runs of a pair ran one after the other, so they saw more nearly the same load):",
                  "", *table(["pair", "one-node rounds 2… s (median)", "two-node rounds 2… s (median)",
                              "two-node − one-node s", "two-node / one-node", "CPU s two-node / one-node"],
                             [[p["pair"], p["one-node-s"], p["two-node-s"], f"{p['diff-s']:+.2f}", p["ratio"],
                               p["cpu-ratio"]] for p in paired["pairs"]]), "",
                  f"**Paired difference of the per-run median round wall, two-node − one-node: {paired['diff-s']} s "
                  f"(mean ± s.e. over {len(paired['pairs'])} pairs); the claim that the loopback cluster's extra "
                  f"raylet makes rounds slower: {paired['verdict-two-node-slower']}** (`bench/kit.py`'s rule: "
                  "shown at 2 s.e.).", ""]
    acc = s["accuracy"]
    shown = ", ".join(f"{a['arm']}-{a['pair']} {a['accuracy']!r} / {a['proto-accuracy']!r}" for a in acc["runs"])
    if acc["identical"]:
        lines.append(f"**Same seed, same result on both arms**: the final accuracies (local / prototype, as "
                     f"`summary.json` holds them) are identical digit for digit in all {len(acc['runs'])} runs "
                     f"({acc['runs'][0]['accuracy']!r} / {acc['runs'][0]['proto-accuracy']!r}): where an actor "
                     "runs does not change what a client computes.")
    else:
        lines.append(f"**The final accuracies differ between runs** (local / prototype, as `summary.json` holds "
                     f"them): {shown}.")
    lines += ["", "## What it means", "",
              "Both arms have the same two CPUs on the same 2-core machine: the loopback cluster's second node adds "
              "a raylet, not a core. So the ratios above measure what spreading the same two actors over two raylets "
              "costs or saves (cross-raylet scheduling and object transfer, a second raylet's and the cluster's own "
              "processes), never a speed-up from more hardware; a speed-up needs nodes on separate machines, each "
              "bringing its own cores (docs/cluster.md, *Several machines*). " + _reading(paired["pairs"]) +
              " The machine was shared with another study whose load changed within and between runs (given per "
              "run), so the wall times carry it; the CPU-seconds are less sensitive to it.", "",
              "## GPU", "",
              "The GPU benchmark (`bench/gpu.py`) did not run: no accelerator was lent to the session that ran these "
              "runs. It is ready for a CUDA machine (`python -m bench.gpu --data-root DATA`)."]
    return "\n".join(lines) + "\n"


def _reading(pairs: Sequence[Mapping[str, Any]]) -> str:
    """One sentence on the direction the pairs show, from their signs (the verdict above says how sure)."""
    if not pairs:
        return "No complete pair yet."
    if all(p["diff-s"] > 0 for p in pairs):
        return ("In every pair the two-node arm's rounds were slower: that is the cost of dispatching over "
                "two raylets here.")
    if all(p["diff-s"] < 0 for p in pairs):
        return ("In every pair the two-node arm's rounds were faster, so no cost of a second raylet shows at this "
                "precision. This benchmark does not isolate why they were faster: besides the number of raylets "
                "the arms differ in who starts Ray (Flower's simulation process starts the one-node arm's private "
                "Ray inside the launch, on the machine's network address; the loopback command starts the cluster "
                "before it, on 127.0.0.1, with the settings of `pollen/launch/cluster.py`).")
    return "The pairs disagree in sign: no difference between the arms shows beyond the noise."


def write_report(folder: Path, out: Path) -> dict[str, Any]:
    records = RepeatFiles(folder).load()
    data = {"runs": records, "summary": summarise(records)}
    write_json(out.with_suffix(".json"), data, indent=1)
    write_atomic(out.with_suffix(".md"), markdown(data))
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs, one per arm each, interleaved ABBA")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="num-server-rounds (the preset's 100 is hours)")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--data-root", type=Path, default=Path(default_data_root()))
    parser.add_argument("--timeout", type=float, default=3600.0, help="per run, passed to pollen run")
    parser.add_argument("--results", type=Path, default=RESULTS / "cluster",
                        help="folder of the per-run files; the report goes beside it as <folder>.{md,json}")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the files")
    args = parser.parse_args(argv)
    out = args.results.parent / args.results.name  # <folder>.md / <folder>.json
    if not args.report:
        if not (args.data_root / "MNIST" / "raw").is_dir():
            parser.error(f"--data-root {args.data_root} must hold MNIST/raw (or set POLLEN_DATA_ROOT)")
        args.data_root = args.data_root.resolve()
        from bench.overhead import become_subreaper

        if not become_subreaper():
            print("[cluster] warning: not a child subreaper: CPU of orphaned processes may be missed", flush=True)
        args.results.mkdir(parents=True, exist_ok=True)

        def run(arm: str, k: int) -> dict:
            print(f"[cluster] {arm}-{k}: load {os.getloadavg()[0]:.2f}", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"pollen-cluster-{arm}-{k}-") as tmp:
                record = run_arm(arm, k, args, Path(tmp))
            if record["rc"] != 0 or record.get("status") != "completed":
                print(record.get("log-tail", ""), file=sys.stderr, flush=True)
                with contextlib.suppress(OSError):
                    write_json(args.results / f"failed-{arm}-{k}.json", record)
                raise SystemExit(f"[cluster] {arm}-{k}: {json.dumps(shown(record))}")
            return record

        def shown(record: dict) -> dict:
            return {key: record.get(key) for key in ("rc", "status", "launch-wall-s", "round-wall-s", "cpu-s",
                                                     "placement", "accuracy", "proto-accuracy")}

        run_study("cluster", RepeatFiles(args.results), schedule(args.pairs), setting(args), run,
                  said=lambda record: json.dumps(shown(record)))
    data = write_report(args.results, out)
    print(markdown(data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
