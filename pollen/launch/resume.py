"""Continue a run from its folder: the same run config (changes refused by name), the same federation, every
hashed file intact and a valid checkpoint — all checked before anything starts, under the folder's lock.

``pollen run --resume RUN_DIR`` uses :func:`check_resume`; :func:`resume_config` alone gives the run config
that continues a run (for ``simulate(run_config=...)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pollen.launch.compose import app_run_config, parse_run_config
from pollen.launch.errors import LaunchConfigError
from pollen.launch.runs import RunLock, read_launch_info, recorded_supernodes


def resume_config(app_dir: Path, run_dir: Path, overrides: str) -> dict[str, Any]:
    """The saved ``config.json`` of ``run_dir`` (keys the app knows), ``overrides`` on top, and
    ``resume-from``; the ServerApp refuses a resumption whose config changed in any other key."""
    config = Path(run_dir).expanduser().resolve() / "config.json"
    if not config.is_file():
        raise LaunchConfigError(f"--resume {run_dir}: no config.json there; is it a Pollen run folder?")
    try:
        saved = json.loads(config.read_text())
    except ValueError as err:
        raise LaunchConfigError(f"--resume {run_dir}: {config} is not valid JSON ({err})") from err
    from pollen.settings import RESUMABLE_CHANGES

    known = app_run_config(app_dir)
    values = {k: v for k, v in saved.items() if k in known}
    changes = parse_run_config(overrides)
    changed = sorted(k for k, v in changes.items() if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v)
    if changed:
        detail = ", ".join(f"'{k}' = {changes[k]!r} (the run has {saved[k]!r})" for k in changed)
        raise LaunchConfigError(f"--resume {run_dir}: a resumed run keeps its run config; --run-config changes "
                                f"{detail}; only {', '.join(sorted(RESUMABLE_CHANGES - {'resume-from'}))} may "
                                "change (start a new run to change the rest)")
    values.update(changes)
    values["resume-from"] = str(config.parent)
    return values



def check_resume(app_dir: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any], RunLock]:
    """Everything ``--resume`` needs, checked before anything starts: the folder, locked for this launcher
    first (another launcher writing it is refused at once, and nothing is read while it writes), its config
    (changed keys refused by name), its federation (SuperNodes and resources from ``launch.json``, a
    different ``--num-supernodes`` refused), every hashed file intact and a valid checkpoint."""
    run_dir = Path(args.resume).expanduser().resolve()
    if args.out_dir is not None:
        raise LaunchConfigError(f"--out-dir {args.out_dir} with --resume {args.resume}: a resumed run continues in its "
                                f"own folder {run_dir}; drop --out-dir (copy the folder to resume it elsewhere)")
    if not run_dir.is_dir():
        raise LaunchConfigError(f"--resume {args.resume}: no such folder")
    lock = RunLock(run_dir).acquire(argv=sys.argv[1:])
    try:
        run_config = _resume_checks(app_dir, args, run_dir)
    except BaseException:
        lock.release()
        raise
    return run_dir, run_config, lock


def _resume_checks(app_dir: Path, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from pollen.app.checkpoints import (
        CHECKPOINT_DIR,
        CheckpointError,
        latest_checkpoint,
        list_checkpoints,
        verify_files,
    )

    run_config = resume_config(app_dir, run_dir, args.run_config)
    info = read_launch_info(run_dir)
    recorded = recorded_supernodes(run_dir)
    if recorded is not None and args.num_supernodes not in (None, recorded):
        raise LaunchConfigError(f"--num-supernodes {args.num_supernodes} with --resume {args.resume}: the run ran on "
                                f"{recorded} SuperNodes (its data was split {recorded} ways); drop the option")
    args.num_supernodes = args.num_supernodes or recorded
    for option, key in (("cpus_per_client", "cpus-per-client"), ("gpus_per_client", "gpus-per-client")):
        saved = info.get(key)
        given = getattr(args, option)
        if saved is not None and given is not None and given != saved:
            print(f"[pollen] note: --{key} {given} (the run had {saved}): resources change speed, not results",
                  flush=True)
        if given is None and saved is not None:
            setattr(args, option, saved)
    problems = verify_files(run_dir, skip=(CHECKPOINT_DIR,))  # checkpoints: the newest valid one is used
    if problems:
        raise LaunchConfigError(f"--resume {args.resume}: refusing files that changed since they were written or "
                                "have no sidecar: " + "; ".join(problems))
    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError as err:
        raise LaunchConfigError(f"--resume {args.resume}: {err}") from err
    newest = max(list_checkpoints(run_dir))
    if checkpoint.round != newest:
        print(f"[pollen] note: --resume {args.resume}: the checkpoints after round {checkpoint.round} (newest: round "
              f"{newest}) are damaged (see the warning above); the run continues from round {checkpoint.round}",
              flush=True)
    return run_config

