"""Run Pollen under a SuperLink this process owns, and report whether the run really completed (``pollen run``).

The command line around :func:`pollen.launch.simulation.simulate`: options and run config checked before
anything starts (:mod:`pollen.launch.compose`), a named, locked run folder (``YYYYMMDD-HHMMSS-<method>-
<task>``, ``latest``; :mod:`pollen.launch.runs`) or the one ``--resume`` continues (:mod:`pollen.launch.
resume`), the run's processes stopped by PID on every exit path and ``summary.json`` written on each.
Used by ``make run``, the tests and the benchmarks::

    pollen run --num-supernodes 5 --run-config "method='fedprox' num-server-rounds=3"

Exit codes (:mod:`pollen.launch.errors`): 0 only for ``finished:completed``; 1 the run failed, was stopped
or its status is unknown; 2 bad options or run config, an out-dir that cannot be written, a run folder
another launcher holds, a resume that does not match its folder or a run the machine cannot hold (nothing
was started); 3 the SuperLink died; 124 timeout; 128 + signal when interrupted (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pollen.launch.compose import (
    app_run_config,
    compose_run_config,
    default_app_dir,
    fitting_node_count,
    format_run_config,
    is_flower_app,
    preset_node_count,
)
from pollen.launch.console import RUN_LOG, RunLog, add_console_options
from pollen.launch.errors import (
    EXIT_COMPLETED,
    EXIT_NOT_COMPLETED,
    EXIT_SUPERLINK_DIED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LaunchConfigError,
    LaunchInterrupted,
    SuperLinkDied,
    signals_raise,
)
from pollen.launch.resources import check_simulation
from pollen.launch.resume import check_resume
from pollen.launch.runs import (
    RunFolderError,
    RunLock,
    check_free_space,
    create_run_dir,
    link_latest,
    run_name,
    space_needed,
    write_launch_info,
)
from pollen.launch.simulation import check_ray_cpus, simulate
from pollen.launch.submit import DEFAULT_TIMEOUT_S


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown for every option that has one (``None``/``False`` defaults are described in words)."""

    def _get_help_string(self, action):
        if action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


def _catalog() -> str:
    """Registered methods (by family) and tasks, and the main run keys' defaults, for ``--help``; never
    fails (it imports the whole registry, so only for help)."""
    lines = []
    try:
        from pollen.app.registry import METHODS

        families: dict[str, list[str]] = {}
        kinds: dict[str, tuple[str, ...]] = {}
        for spec in METHODS.values():
            families.setdefault(spec.family, []).append(spec.name)
            kinds[spec.family] = spec.task_kinds
        lines.append("methods: (run key 'method', by family, with the kinds of task they run on; README.md has "
                     "the papers)")
        lines += [f"  {family:<11} {', '.join(names)}  [{' / '.join(kinds[family])} tasks]"
                  for family, names in families.items()]
    except Exception as err:  # noqa: BLE001 - help must print whatever is broken
        lines.append(f"methods: (not listed: {type(err).__name__}: {err})")
    try:
        from pollen.datasets.tasks import TASK_KINDS, TASKS

        lines.append("tasks: (run key 'task', by kind)")
        width = max(len(name) for name in TASKS)
        for kind, (name, meaning) in TASK_KINDS.items():
            lines.append(f" {kind}: {name} ({meaning})")
            for name, task in TASKS.items():
                if task.kind == kind:
                    text = " ".join(str(getattr(task, "description", "")).split())
                    lines.append(f"  {name:<{width}}  {text}")
    except Exception as err:  # noqa: BLE001
        lines.append(f"tasks: (not listed: {type(err).__name__}: {err})")
    try:
        from pollen.app.config import DEFAULTS

        main = ("method", "task", "num-server-rounds", "seed", "local-epochs", "batch-size", "lr", "device",
                "max-train-samples", "data-root", "out-dir")
        pairs = format_run_config({k: DEFAULTS[k] for k in main if k in DEFAULTS})
        lines.append("run keys (defaults of the most used; every key with its range: docs/usage.md):")
        lines.append("  " + pairs)
    except Exception as err:  # noqa: BLE001
        lines.append(f"run keys: (not listed: {type(err).__name__}: {err})")
    return "\n".join(lines)


def build_parser(catalog: bool = False) -> argparse.ArgumentParser:
    epilog = ("exit codes: 0 finished:completed; 1 run failed/stopped/unknown; 2 bad options or run config, "
              "out-dir not writable, run folder held by another launcher, resume not matching its folder, a "
              "machine too small for the run (nothing started); 3 SuperLink died; 124 timeout; 130/143 interrupted "
              "(Ctrl-C/SIGTERM)")
    if catalog:
        epilog = _catalog() + "\n\n" + epilog
    parser = argparse.ArgumentParser(prog="pollen run", description=__doc__.split("\n\n")[0],
                                     epilog=epilog, formatter_class=_HelpFormatter)
    parser.add_argument("--app", type=Path, default=None,
                        help="Flower app directory (default: the current directory if its pyproject.toml has "
                             "[tool.flwr.app], else the checkout holding the pollen package)")
    parser.add_argument("--flwr-home", type=Path, default=None,
                        help="FLWR_HOME to use and keep (default: a private temporary folder, removed at the end)")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help="simulated SuperNodes (clients); default: what the task or method needs "
                             "(FCCL's domain tasks: one per domain; GLFC: its final population), else 5")
    parser.add_argument("--cpus-per-client", type=int, default=None,
                        help="CPUs Ray reserves per ClientApp (default 1; on --resume, the run's)")
    parser.add_argument("--gpus-per-client", type=float, default=None,
                        help="GPU fraction per ClientApp, e.g. 0.25 packs 4 clients on one GPU (default 0; on "
                             "--resume, the run's)")
    parser.add_argument("--run-config", default="",
                        help="run keys of [tool.flwr.app.config], e.g. \"method='fedprox' num-server-rounds=3\" "
                             "(or one .toml file); unknown keys are refused before anything starts")
    parser.add_argument("--out-dir", default=None,
                        help="results root, the 'out-dir' run key; results land in "
                             "OUT_DIR/YYYYMMDD-HHMMSS-<method>-<task>/, OUT_DIR/latest points at the newest (default: "
                             "the run config's out-dir, else $POLLEN_OUT_DIR, else ./runs)")
    parser.add_argument("--data-root", default=None,
                        help="dataset root, the 'data-root' run key (default: the run config's, else "
                             "$POLLEN_DATA_ROOT as the app reads it)")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="CPUs the private Ray instance may use (default: all it finds); at most "
                             "RAY_CPUS / cpus-per-client ClientApps run at once, each in an actor of its own "
                             "that imports torch once. Not with --ray-address: a cluster has its own")
    parser.add_argument("--ray-address", default=None,
                        help="attach the simulation to this Ray cluster (default: start a private local Ray, "
                             "RAY_ADDRESS=local, ignoring any cluster recorded on this machine)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (e.g. OUT_DIR/latest) from its last valid checkpoint, "
                             "with its config.json and SuperNodes (--run-config may change only num-server-rounds, "
                             "paths, device, torch-threads; no --out-dir: it stays in RUN_DIR)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before the run is stopped (exit 124; it can be resumed)")
    add_console_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    args = build_parser(catalog=wants_help).parse_args(argv)
    lock: RunLock | None = None
    try:
        if args.num_supernodes is not None and args.num_supernodes < 1:
            raise LaunchConfigError(f"--num-supernodes {args.num_supernodes}: expected at least 1")
        if args.cpus_per_client is not None and args.cpus_per_client < 1:
            raise LaunchConfigError(f"--cpus-per-client {args.cpus_per_client}: expected at least 1")
        if args.ray_cpus is not None:
            check_ray_cpus(args.ray_cpus, args.cpus_per_client or 1, args.ray_address)
        if args.gpus_per_client is not None and not 0.0 <= args.gpus_per_client:
            raise LaunchConfigError(f"--gpus-per-client {args.gpus_per_client}: expected >= 0")
        if not args.timeout > 0:
            raise LaunchConfigError(f"--timeout {args.timeout}: expected seconds > 0")
        app_dir = args.app.resolve() if args.app is not None else default_app_dir()
        if not is_flower_app(app_dir):
            raise LaunchConfigError(f"--app {args.app}: {app_dir} has no pyproject.toml with [tool.flwr.app]")
        run_dir: Path | None = None
        if args.resume:
            run_dir, run_config, lock = check_resume(app_dir, args)
        else:
            run_config = args.run_config
            if args.num_supernodes is None:  # a preset file names the nodes it needs
                args.num_supernodes = preset_node_count(args.run_config)
        values, results_root = compose_run_config(app_dir, run_config, out_dir=args.out_dir, data_root=args.data_root)
        args.num_supernodes = fitting_node_count(app_dir, values, args.num_supernodes)
        args.cpus_per_client = 1 if args.cpus_per_client is None else args.cpus_per_client
        args.gpus_per_client = 0.0 if args.gpus_per_client is None else args.gpus_per_client
        check_simulation({**app_run_config(app_dir), **values}, args.num_supernodes, args.cpus_per_client,
                         args.ray_cpus, args.ray_address)
        if results_root is not None and "run-name" in app_run_config(app_dir):  # a Pollen app: named, locked
            run_dir, lock = prepare_run_dir(app_dir, values, results_root, run_dir, args, lock)
    except (LaunchConfigError, RunFolderError) as err:
        if lock is not None:
            lock.release()
        print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        return _launch(args, app_dir, values, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()

def prepare_run_dir(app_dir: Path, values: dict[str, Any], results_root: Path, run_dir: Path | None,
                    args: argparse.Namespace, lock: RunLock | None = None) -> tuple[Path, RunLock]:
    """A new run's folder ``YYYYMMDD-HHMMSS-<method>-<task>`` (or the resumed one), locked for this
    launcher, ``latest`` pointing at it, its federation in ``launch.json``. ``values`` gets ``run-name``."""
    check_free_space(run_dir if run_dir is not None else results_root, space_needed(run_dir))
    if run_dir is None:
        merged = {**app_run_config(app_dir), **values}
        name = str(values.get("run-name") or run_name(str(merged.get("method")), str(merged.get("task"))))
        run_dir = create_run_dir(results_root, name)
        values["run-name"] = run_dir.name
    lock = lock or RunLock(run_dir).acquire(argv=sys.argv[1:])
    if lock.taken_over and lock.taken_over.get("pid"):
        print(f"[pollen] note: took over the lock of {run_dir} from launcher PID {lock.taken_over['pid']}, which is "
              "no longer running", flush=True)
    if args.resume:  # the last launch's summary no longer says how the run stands; this launch writes one on
        (run_dir / "summary.json").unlink(missing_ok=True)  # every exit path, and meanwhile the lock says running
    if not (run_dir / "launch.json").exists():
        write_launch_info(run_dir, {"num-supernodes": args.num_supernodes, "cpus-per-client": args.cpus_per_client,
                                    "gpus-per-client": args.gpus_per_client, "ray-address": args.ray_address or "local",
                                    "app": str(app_dir)})
    from pollen.app.results import reserve_summary_space

    reserve_summary_space(run_dir)  # whatever fills the disk later, summary.json keeps its room
    with contextlib.suppress(RunFolderError):  # a file system without symlinks still runs
        link_latest(run_dir)
    return run_dir, lock


def _launch(args: argparse.Namespace, app_dir: Path, values: dict[str, Any], run_dir: Path | None,
            lock: RunLock | None) -> int:
    if run_dir is None:  # another app's run: its folder is named by Flower's run id, known once submitted
        return _simulate(args, app_dir, values, run_dir, lock, None)
    with RunLog(run_dir / RUN_LOG) as run_log:  # what the console shows, and Flower's lines besides
        print(f"[pollen] run folder {run_dir}" + (" (resumed)" if args.resume else ""), flush=True)
        return _simulate(args, app_dir, values, run_dir, lock, run_log)


def _simulate(args: argparse.Namespace, app_dir: Path, values: dict[str, Any], run_dir: Path | None,
              lock: RunLock | None, run_log: RunLog | None) -> int:
    started = time.monotonic()
    outcome = None
    with signals_raise():
        try:
            outcome = simulate(app_dir=app_dir, flwr_home=args.flwr_home, num_supernodes=args.num_supernodes,
                               cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                               run_config=values, timeout=args.timeout, echo=not args.quiet,
                               ray_address=args.ray_address, ray_cpus=args.ray_cpus, run_dir=run_dir,
                               lock_fd=lock.fd if lock is not None else None, verbose=args.verbose,
                               run_log=run_log)
        except LaunchInterrupted as err:
            print(f"[pollen] {err}: stopped every process of the run after {time.monotonic() - started:.1f}s",
                  file=sys.stderr, flush=True)
            if run_dir is not None:
                print(f"[pollen] {run_dir / 'summary.json'} says interrupted; continue with: pollen run "
                      f"--resume {run_dir}", file=sys.stderr, flush=True)
            return 128 + err.signum
        except TimeoutError as err:
            print(f"[pollen] timeout: {err}", file=sys.stderr, flush=True)
            return EXIT_TIMEOUT
        except SuperLinkDied as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_SUPERLINK_DIED
        except LaunchConfigError as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except (RuntimeError, OSError) as err:
            print(f"[pollen] error: {err}", file=sys.stderr, flush=True)
            return EXIT_NOT_COMPLETED
    results = f"; results {outcome.results_dir}" if outcome.results_dir and outcome.results_dir.is_dir() else ""
    print(f"[pollen] run {outcome.run_id}: {outcome.status} in {outcome.wall_time_s:.1f}s{results}", flush=True)
    if not outcome.completed:
        reason = outcome.failure_reason or "no reason recorded (see the log above)"
        print(f"[pollen] run {outcome.run_id} {outcome.verdict}: {reason}", file=sys.stderr, flush=True)
    if outcome.processes:
        counts: dict[str, int] = {}
        for entry in outcome.processes:
            name = entry.rsplit("(", 1)[0]
            counts[name] = counts.get(name, 0) + 1
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())
        left = f"still alive: {outcome.leftover}" if outcome.leftover else "none left (checked by PID)"
        took = f" in {outcome.teardown_s:.1f}s" if outcome.teardown_s is not None else ""
        print(f"[pollen] stopped the run's processes ({names}){took}: {left}", flush=True)
    if outcome.leftover:
        return EXIT_NOT_COMPLETED
    return EXIT_COMPLETED if outcome.completed else EXIT_NOT_COMPLETED


if __name__ == "__main__":
    sys.exit(main())
