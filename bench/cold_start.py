"""How long the default ``make run`` takes from the command to the prompt, and where the time goes.

Runs ``make run`` (installed venv, the default run config, a temporary ``OUT_DIR``) several times
and stamps each line of its output as it arrives, which splits the wall into phases:

- *launcher start*: the command until the launcher's first line (Python and the launcher's imports);
- *to round 1*: until Flower's ``[ROUND 1/…]`` line (SuperLink start, ``flwr run`` builds and
  submits the app, the ServerApp and Ray start);
- *rounds*: until the last round's ``[pollen] round K/K`` line (training, evaluation, the first
  round's actor start-up included);
- *run end*: until the launcher starts stopping the run's processes (the ServerApp's last files,
  the log stream's end, the final status from ``flwr ls``);
- *teardown*: until ``make`` exits (every process of the run stopped; the launcher reports how
  long its part took).

Interleaved with each ``make run``, the *Flower floor* (``bench/overhead.py``'s app with no Pollen
and no torch, every node answering at once) goes through the same launcher with the same SuperNodes
and rounds: what any Flower simulation of this shape costs here, the wall ``make run`` cannot go below.

The machine's 1-minute load average at each start is recorded: on a busy machine the split is still
informative, the absolute numbers are not. Writes ``bench/results/cold_start.{json,md}``::

    python -m bench.cold_start --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from bench.kit import RESULTS, ROOT, read_json, write_atomic, write_json
from bench.overhead import floor_command

PHASES = ("launcher start", "to round 1", "rounds", "run end", "teardown")
ROUND_LINE = re.compile(r"\[(?:pollen|floor)\] round (\d+)/(\d+)")


def default_shape() -> tuple[int, int]:
    """(SuperNodes, rounds) of the default ``make run``: the launcher's default and the app's config."""
    import tomllib

    from pollen.launch import DEFAULT_SUPERNODES

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return DEFAULT_SUPERNODES, int(config["num-server-rounds"])


def run_once(floor: bool = False) -> dict:
    """One ``make run`` (or, with ``floor``, the Flower floor in its shape); the monotonic time of each
    marker line, turned into phase durations."""
    with tempfile.TemporaryDirectory(prefix="pollen-cold-") as tmp:
        env = {**os.environ, "FLWR_HOME": str(Path(tmp) / "flwr-home")}
        cmd = ["make", "-s", "run", f"OUT_DIR={tmp}/runs"]
        if floor:
            nodes, rounds = default_shape()
            cmd = floor_command(Path(tmp) / "floor-app", nodes, rounds, evaluate_every_round=True)
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        marks: dict[str, float] = {}
        teardown_s = None
        tail: deque[str] = deque(maxlen=40)
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic() - t0
            tail.append(line)
            if "[pollen]" in line and "launcher" not in marks:
                marks["launcher"] = now
            if ("[ROUND 1/" in line or "[floor] round 1/" in line) and "round-1" not in marks:
                # the floor prints after its first round: its "to round 1" includes that round
                marks["round-1"] = now
            found = ROUND_LINE.search(line)
            if found and found.group(1) == found.group(2):
                marks["last-round"] = now
            if re.search(r"\[pollen\] run \d+: ", line):
                marks["run-end"] = now
            stopped = re.search(r"\[pollen\] stopped the run's processes .* in ([0-9.]+)s", line)
            if stopped:
                teardown_s = float(stopped.group(1))
        rc = proc.wait()
        wall = time.monotonic() - t0
    row: dict = {"run": "floor" if floor else "make run", "rc": rc, "wall-s": round(wall, 2),
                 "load-at-start": round(load, 2),
                 "marks-s": {k: round(v, 2) for k, v in marks.items()}}
    order = ["launcher", "round-1", "last-round", "run-end"]
    if rc == 0 and all(k in marks for k in order) and teardown_s is not None:
        # the launcher prints its run line after stopping every process, and says how long that took
        points = [0.0] + [marks[k] for k in order[:3]] + [marks["run-end"] - teardown_s, wall]
        row["phases-s"] = {name: round(b - a, 2) for name, a, b in zip(PHASES, points[:-1], points[1:], strict=True)}
    else:
        row["output-tail"] = "".join(tail)
    return row


def markdown(data: dict) -> str:
    """The report of ``cold_start.json``; the shape is the one recorded with the runs (files written before it
    was recorded ran the defaults of their day, taken as today's)."""
    rows = data["runs"]
    nodes, rounds = data.get("shape") or default_shape()
    lines = ["# Cold start: the default `make run`, command to prompt", "",
             f"`make run` with an installed venv and the default run config ({nodes} SuperNodes, {rounds} rounds), "
             "each run with a fresh `FLWR_HOME` and output folder, interleaved with the *Flower floor*: a Flower "
             "app with no Pollen and no torch (`FLOOR_APP` in `bench/overhead.py`) through the same launcher, with "
             "the same SuperNodes and rounds, every node answering at once. Phases from the time each marker line "
             "of the output arrived: *launcher start* (to the launcher's first line), *to round 1* (SuperLink "
             "start, app build and submit, ServerApp and Ray start; the floor's marker comes after its first "
             "round), *rounds* (to the last round's line; the first round's actor start-up included), *run end* "
             "(the ServerApp's last files, the log stream's end, the final status from `flwr ls`), *teardown* "
             "(every process stopped, the command exits). Written by `bench/cold_start.py`.", "",
             "| # | run | load at start | wall s | " + " | ".join(f"{p} s" for p in PHASES) + " | exit |",
             "|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for i, r in enumerate(rows, 1):
        phases = r.get("phases-s", {})
        cells = " | ".join(str(phases.get(p, "–")) for p in PHASES)
        lines.append(f"| {i} | {r.get('run', 'make run')} | {r['load-at-start']} | {r['wall-s']} | {cells} | "
                     f"{r['rc']} |")
    lines.append("")
    for kind in ("make run", "floor"):
        ok = [r for r in rows if "phases-s" in r and r.get("run", "make run") == kind]
        if ok:
            walls = [r["wall-s"] for r in ok]
            lines.append(f"**{kind}: wall median {statistics.median(walls):.1f} s, min {min(walls):.1f} s** "
                         f"({len(ok)} completed runs); median share of the wall: " +
                         ", ".join(f"{p} {100 * statistics.median(r['phases-s'][p] / r['wall-s'] for r in ok):.0f} %"
                                   for p in PHASES) + ".")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="make runs (each followed by a floor run)")
    parser.add_argument("--no-floor", action="store_true", help="make runs only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true", help="only rewrite cold_start.md from cold_start.json")
    args = parser.parse_args(argv)
    if args.report:
        write_atomic(args.out / "cold_start.md", markdown(read_json(args.out / "cold_start.json")))
        return 0
    rows = []
    kinds = [False] if args.no_floor else [False, True]
    for i in range(args.runs):
        for floor in kinds:
            row = run_once(floor)
            rows.append(row)
            print(f"[cold-start] {row['run']} {i + 1}/{args.runs}: {json.dumps(row)}", flush=True)
    data = {"shape": list(default_shape()), "runs": rows}
    write_json(args.out / "cold_start.json", data)
    write_atomic(args.out / "cold_start.md", markdown(data))
    print(markdown(data))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
