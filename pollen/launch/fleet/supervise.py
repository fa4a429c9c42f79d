"""A fleet's run that outlives its SuperLink: when the SuperLink dies, bring it back and continue the run.

The SuperLink keeps its state in ``--database`` (registered node keys and their ids among it), so a new one
started on the same port with the same certificates (:meth:`Fleet.restart_superlink`) is the same server
to the SuperNodes, which retry their connection and come back with their keys. The run the dead
SuperLink held is gone with its ServerApp; it continues as a new Flower run with ``resume-from`` = the run
folder, from its last valid checkpoint, with every node rolling its state back to that round — the same
mechanism as ``pollen run --resume``, so the metrics end as an uninterrupted run's. Without a checkpoint
yet, the run starts over. At most ``max_restarts`` times; each restart is said on the console and
returned, for ``summary.json`` and ``fleet.json``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollen.launch.console import RunLog
from pollen.launch.errors import SuperLinkDied
from pollen.launch.fleet.federation import Fleet
from pollen.launch.submit import RunOutcome


@dataclass
class Supervision:
    """The SuperLink restarts of one fleet run, as ``summary.json`` records them (``superlink-restarts``)."""

    max_restarts: int
    restarts: list[dict[str, Any]] = field(default_factory=list)


def resumable_round(run_dir: Path) -> int:
    """The round the run's newest valid checkpoint closed (0: none yet, the run starts over)."""
    from pollen.app.checkpoints import CheckpointError, latest_checkpoint

    try:
        return latest_checkpoint(run_dir).round
    except CheckpointError:
        return 0


def run_supervised(fleet: Fleet, values: Mapping[str, Any], run_dir: Path, supervision: Supervision, *,
                   timeout: float, echo: bool, app_dir: Path, node_timeout: float = 300.0, verbose: bool = False,
                   run_log: RunLog | None = None) -> RunOutcome:
    """``fleet.run`` the app into ``run_dir`` and wait for it, restarting a SuperLink that dies up to
    ``supervision.max_restarts`` times (:class:`SuperLinkDied` after that); ``timeout`` bounds the whole."""
    deadline = time.monotonic() + timeout
    submitted = dict(values)
    while True:
        try:
            return fleet.run(submitted, timeout=max(1.0, deadline - time.monotonic()), echo=echo, app_dir=app_dir,
                             run_dir=run_dir, verbose=verbose, run_log=run_log)
        except SuperLinkDied as err:
            if len(supervision.restarts) >= supervision.max_restarts:
                raise
            began = time.monotonic()
            said = "" if fleet.superlink_death_reported else f"{err}; "  # the death is said once
            print(f"[fleet] {said}restarting the SuperLink ({len(supervision.restarts) + 1} of at most "
                  f"{supervision.max_restarts}, --max-restarts)", flush=True)
            lost = fleet.run_id
            fleet.restart_superlink()
            if lost is not None:  # its ServerApp is gone: no SuperNode should train for it any more
                fleet.stop_run(lost)
            fleet.wait_for_nodes(timeout=min(node_timeout, max(1.0, deadline - time.monotonic())))
            after = resumable_round(run_dir)
            submitted = {**values, "resume-from": str(run_dir)} if after else dict(values)
            supervision.restarts.append({
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "superlink-died": str(err).split("; its log:")[0],
                "restart-s": round(time.monotonic() - began, 2), "resumed-after-round": after, "lost-flower-run": lost,
                "superlink-pid": fleet.superlink_proc.pid if fleet.superlink_proc is not None else None})
            print(f"[fleet] SuperLink back in {time.monotonic() - began:.1f}s with every SuperNode; the run "
                  + (f"continues after round {after} (its last checkpoint)" if after else
                     "starts over (no checkpoint yet)"), flush=True)
