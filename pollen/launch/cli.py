"""The ``pollen`` command: one entry point for every tool Pollen ships.

``pollen run`` launches a run (SuperLink + ``flwr run``), ``pollen fleet`` a local SuperLink/SuperNode
fleet, ``pollen predict`` scores a saved model, ``pollen data`` checks or
writes data folders, ``pollen runs`` lists the run folders under an out-dir. Each subcommand hands the
rest of the command line to its tool, so ``pollen run --help`` is the launcher's own help. Tools are
imported only when named: ``pollen runs`` and ``pollen --help`` load neither torch nor Flower.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROG = "pollen"
EXIT_USAGE = 2

# subcommand -> (module, one-line help); every module has ``main(argv) -> int``
TOOLS: dict[str, tuple[str, str]] = {
    "run": ("pollen.launch.launcher", "launch a run: a private SuperLink, the app through `flwr run`, a run folder"),
    "fleet": ("pollen.launch.fleet.cli", "a local fleet: a SuperLink and N SuperNodes, TLS and node auth optional"),
    "predict": ("pollen.launch.predict", "score or label images with a saved global or personal model"),
    "data": ("pollen.datasets.user_data", "check a data folder as a node reads it, or write sample folders"),
    "runs": ("pollen.launch.cli", "list the run folders under an out-dir: status, rounds, final metric"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = [f"usage: {PROG} <command> [options]   ({PROG} <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in TOOLS.items()]
    return "\n".join(lines)


def tool(name: str) -> Callable[[Sequence[str]], int]:
    """The ``main`` of a subcommand's tool, imported now."""
    if name == "runs":
        return runs_main
    main: Callable[[Sequence[str]], int] = importlib.import_module(TOOLS[name][0]).main
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else EXIT_USAGE
    name, rest = args[0], args[1:]
    if name not in TOOLS:
        print(f"{PROG}: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_USAGE
    return int(tool(name)(rest) or 0)


# ---- pollen runs -----------------------------------------------------------------------------------------
def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _rounds_done(run_dir: Path) -> int:
    """Rounds with a line in ``metrics.jsonl`` (0 when there is none yet)."""
    try:
        with (run_dir / "metrics.jsonl").open() as lines:
            return sum(1 for line in lines if line.strip())
    except OSError:
        return 0


def _unfinished_status(run_dir: Path) -> str:
    """A folder without ``summary.json``: ``running`` while a launcher holds its lock, else ``no summary``
    (a run whose every process was killed before anything could write one)."""
    import fcntl

    from pollen.launch.runs import LOCK_FILE

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return "no summary"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return "running"
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return "no summary"


def describe_run(run_dir: Path) -> dict[str, Any] | None:
    """One run folder as ``pollen runs`` shows it, or None when the folder is no run folder.

    A folder with ``config.json`` but no ``summary.json`` is ``running`` or, when no launcher holds it,
    ``no summary``.
    """
    config = _json(run_dir / "config.json")
    summary = _json(run_dir / "summary.json")
    if config is None and summary is None:
        return None
    config = config or {}
    summary = summary or {}
    status = summary.get("status") or _unfinished_status(run_dir)
    final = summary.get("final-accuracy")
    metric = f"{final['metric']} {100 * final['mean']:.2f} ± {100 * final['std']:.2f} %" \
        if isinstance(final, dict) and {"metric", "mean", "std"} <= set(final) else ""
    reason = summary.get("failure-reason") or ""
    rounds = summary.get("last-round") or _rounds_done(run_dir)
    return {"run": run_dir.name, "path": str(run_dir), "status": status,
            "method": summary.get("method") or config.get("method", "?"),
            "task": summary.get("task") or config.get("task", "?"),
            "rounds": rounds, "planned": config.get("num-server-rounds") or summary.get("num-server-rounds"),
            "final": metric, "reason": reason,
            "modified": (run_dir / "summary.json" if summary else run_dir).stat().st_mtime}


def list_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Every run folder directly under ``out_dir``, oldest first."""
    if not out_dir.is_dir():
        return []
    found = (describe_run(child) for child in out_dir.iterdir() if child.is_dir() and not child.is_symlink())
    return sorted((run for run in found if run is not None), key=lambda run: run["modified"])


def format_runs(runs: list[dict[str, Any]]) -> str:
    rows = [("run", "status", "method", "task", "rounds", "final")]
    for run in runs:
        planned = f"/{run['planned']}" if run["planned"] else ""
        final = run["final"] or run["reason"][:60]
        rows.append((run["run"], run["status"], run["method"], run["task"], f"{run['rounds']}{planned}", final))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(f"{str(cell):<{w}}" for cell, w in zip(row, widths)) + "  " + str(row[-1])
                     for row in rows)


def runs_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=f"{PROG} runs", description=TOOLS["runs"][1])
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="the results root (default: $POLLEN_OUT_DIR, else ./runs)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")
    args = parser.parse_args(list(argv))
    if args.out_dir is not None:
        out_dir = args.out_dir.expanduser()
    else:
        from pollen.launch.compose import default_out_dir

        out_dir = default_out_dir()
    if not out_dir.is_dir():
        print(f"{PROG} runs: {out_dir} is not a folder (pass --out-dir, or set POLLEN_OUT_DIR)", file=sys.stderr)
        return EXIT_USAGE
    runs = list_runs(out_dir)
    if args.json:
        for run in runs:
            print(json.dumps({k: v for k, v in run.items() if k != "modified"}, sort_keys=True))
    elif runs:
        print(format_runs(runs))
    else:
        print(f"no run folders in {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
