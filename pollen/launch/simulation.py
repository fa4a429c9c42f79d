"""A simulation run on a fresh SuperLink this process owns, its whole process tree stopped afterwards.

The run config is checked against the app's keys first (nothing starts on a bad one); the SuperLink,
``flower-superexec``, ``flwr-simulation`` and the run's private Ray instance (or the ClientApps on an
attached Ray cluster) are found by PID through the launch's mark and stopped on every exit path — also
when the launcher itself is killed (:class:`~pollen.launch.watchdog.Watchdog`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pollen.launch.compose import app_run_config, compose_run_config, default_app_dir, format_run_config
from pollen.launch.console import RunLog
from pollen.launch.errors import LaunchConfigError, LaunchInterrupted, SuperLinkDied
from pollen.launch.processes import ProcessTree
from pollen.launch.resources import actor_slots, check_simulation
from pollen.launch.submit import DEFAULT_TIMEOUT_S, RunOutcome, failure_reason, submit_and_wait
from pollen.launch.superlinks import superlink, superlink_watch
from pollen.launch.watchdog import Watchdog


def _tree_watch(tree: ProcessTree, proc: subprocess.Popen, log_path: Path | None,
                every: float = 5.0) -> Callable[[], None]:
    """:func:`superlink_watch` that also records the tree's members every ``every`` seconds (for the
    report of what was stopped; the teardown finds every member again by itself)."""
    check = superlink_watch(proc, log_path)
    last = [0.0]

    def watch() -> None:
        check()
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            tree.members()
    return watch


def check_ray_cpus(ray_cpus: int, cpus_per_client: int, ray_address: str | None) -> None:
    """``--ray-cpus`` sizes a private Ray instance: at least one ClientApp must fit, and a cluster is
    not resized by a run that attaches to it."""
    if ray_address not in (None, "local"):
        raise LaunchConfigError(f"--ray-cpus {ray_cpus} with --ray-address {ray_address}: a cluster's CPUs are "
                                "set where its nodes start (ray start --num-cpus); leave --ray-cpus out")
    if ray_cpus < cpus_per_client:
        raise LaunchConfigError(f"--ray-cpus {ray_cpus}: expected at least --cpus-per-client ({cpus_per_client}), "
                                "or no ClientApp could run")


def ray_line(ray_address: str | None) -> str:
    if ray_address and ray_address != "local":
        return f"[pollen] Ray: attaching to the cluster at {ray_address} (--ray-address)"
    inherited = os.environ.get("RAY_ADDRESS", "")
    note = f"; RAY_ADDRESS={inherited} from the environment ignored" if inherited and inherited != "local" else ""
    return ("[pollen] Ray: a private local instance for this run (RAY_ADDRESS=local, never a cluster recorded "
            f"on this machine); pass --ray-address ADDR to attach to a cluster{note}")


def simulate(*, app_dir: Path | None = None, flwr_home: Path | None = None, num_supernodes: int = 5,
             cpus_per_client: int = 1, gpus_per_client: float = 0.0,
             run_config: str | Mapping[str, Any] = "", timeout: float = DEFAULT_TIMEOUT_S, echo: bool = True,
             out_dir: str | Path | None = None, data_root: str | Path | None = None,
             ray_address: str | None = None, ray_cpus: int | None = None, run_dir: Path | None = None,
             lock_fd: int | None = None, verbose: bool = False, run_log: RunLog | None = None) -> RunOutcome:
    """One simulation run on a fresh, owned SuperLink, its whole process tree stopped afterwards.

    The run config is checked against the app's keys first (:class:`LaunchConfigError`, nothing
    started). ``flwr_home`` defaults to a private temporary folder, removed at the end; a given one is
    kept. ``ray_address`` ``None``/``"local"`` starts a private Ray instance, anything else attaches to
    that cluster. ``ray_cpus`` caps the private instance's CPUs (Flower's ``init-args-num-cpus``): one
    ClientApp actor per ``cpus_per_client`` of them. Raises :class:`TimeoutError`, :class:`SuperLinkDied`
    or :class:`LaunchInterrupted` (under :func:`signals_raise`) after stopping everything.

    ``run_dir`` is the run's folder when the caller chose it (the CLI: a named run, or ``--resume``),
    else ``out-dir/<run-id>``. A :class:`~pollen.launch.processes.Watchdog` (holding ``lock_fd``, the run
    folder's lock, when given) stops the tree if this process dies; on every path where the ServerApp
    wrote no ``summary.json`` for this launch, one is written here (``interrupted`` or ``failed``).
    """
    app_dir = (Path(app_dir) if app_dir is not None else default_app_dir()).resolve()
    values, results_root = compose_run_config(app_dir, run_config, out_dir=out_dir, data_root=data_root)
    ray_address = ray_address or "local"
    check_simulation({**app_run_config(app_dir), **values}, num_supernodes, cpus_per_client, ray_cpus, ray_address)
    fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
           f"client-resources-num-gpus={gpus_per_client}")
    if ray_cpus is not None:
        check_ray_cpus(ray_cpus, cpus_per_client, ray_address)
        fed += f" init-args-num-cpus={ray_cpus}"
    private_home = flwr_home is None
    home = (Path(tempfile.mkdtemp(prefix="pollen-flwr-")) if flwr_home is None else Path(flwr_home)).resolve()
    tree = ProcessTree()
    outcome: RunOutcome | None = None
    cluster_info = None
    if echo:
        print(ray_line(ray_address), flush=True)
        print(f"[pollen] FLWR_HOME {home}" + (" (private, removed at the end)" if private_home else ""), flush=True)
    teardown_from: float | None = None
    started_at = time.time()
    where: dict[str, Any] = {"run_dir": Path(run_dir) if run_dir is not None else None, "run_id": None}
    watchdog = Watchdog(tree, home=home if private_home else None, run_dir=run_dir, lock_fd=lock_fd,
                        started=started_at)

    def submitted(run_id: int) -> None:
        where["run_id"] = run_id
        watchdog.run_id(run_id)
        if where["run_dir"] is None and results_root is not None:
            found = results_root / str(run_id)
            where["run_dir"] = found
            watchdog.run_dir(found)
        if echo:
            actors = (cluster_info.slots(cpus_per_client, gpus_per_client) if cluster_info is not None
                      else actor_slots(cpus_per_client, ray_cpus))
            ray = "the cluster's" if cluster_info is not None else "a private Ray with"
            print(f"[pollen] run {run_id} submitted; waiting for round 1 (the simulation starts {ray} {actors} "
                  f"ClientApp actor(s) for {num_supernodes} SuperNode(s) first)", flush=True)

    try:
        try:
            try:
                if ray_address != "local":  # look before attaching: unreachable or too small is exit 2
                    from pollen.launch import cluster
                    try:
                        cluster_info = cluster.attach(ray_address, source="--ray-address", echo=echo,
                                                      cpus_per_client=cpus_per_client, gpus_per_client=gpus_per_client)
                    except cluster.ClusterUnfit as err:
                        raise LaunchConfigError(str(err)) from None
                phase = time.monotonic()
                with superlink(home, simulation=True, tree=tree, ray_address=ray_address) as (conn, port, proc):
                    if echo:
                        print(f"[pollen] SuperLink up on port {port} ({time.monotonic() - phase:.1f}s); submitting "
                              f"the app for {num_supernodes} SuperNode(s)", flush=True)
                    log_path = home / f"superlink-{port}.log"
                    kept_log = None if private_home else log_path  # a private home is removed: no pointer to it
                    outcome = submit_and_wait(app_dir, conn, home, run_config=format_run_config(values),
                                              federation_config=fed, timeout=timeout, echo=echo,
                                              out_dir=results_root, watch=_tree_watch(tree, proc, kept_log), tree=tree,
                                              run_dir=run_dir, on_run_id=submitted, verbose=verbose,
                                              run_log=run_log)
                    if not outcome.completed and outcome.failure_reason is None:
                        outcome.failure_reason = failure_reason(None, "", log_path.read_text(errors="replace"))
                    teardown_from = time.monotonic()
            except SuperLinkDied:
                if private_home:  # its log goes with the private home: show its end now
                    for log_file in home.glob("superlink-*.log"):
                        tail = log_file.read_text(errors="replace").splitlines()[-15:]
                        print("[pollen] last lines of the SuperLink's log:\n" + "\n".join(tail), file=sys.stderr,
                              flush=True)
                raise
            finally:
                # A run whose ServerApp wrote its summary has everything on disk: nothing to stop gracefully.
                left = tree.kill() if outcome is not None and outcome.status_from == "app" else tree.terminate()
                if outcome is not None:
                    outcome.teardown_s = round(time.monotonic() - teardown_from, 2) if teardown_from else None
                    outcome.processes = [f"{name or '?'}({pid})" for pid, (_s, name) in sorted(tree.seen.items())]
                    outcome.leftover = left
                if left:
                    print(f"[pollen] warning: still running after teardown: {tree.describe(left)}",
                          file=sys.stderr, flush=True)
        finally:
            if private_home:
                shutil.rmtree(home, ignore_errors=True)
    except BaseException as err:
        from pollen.app.results import write_stopped_summary

        if where["run_dir"] is not None:
            stopped = isinstance(err, (LaunchInterrupted, TimeoutError, KeyboardInterrupt))
            status = "interrupted" if stopped else "failed"
            reason = str(err) if not isinstance(err, TimeoutError) else f"timeout: {err}"
            write_stopped_summary(where["run_dir"], status, reason or type(err).__name__, where["run_id"],
                                  since=started_at)
        raise
    finally:
        watchdog.done()
    if not outcome.completed and outcome.results_dir is not None and outcome.results_dir.is_dir():
        from pollen.app.results import write_stopped_summary

        write_stopped_summary(outcome.results_dir, "failed", outcome.failure_reason or outcome.status,
                              outcome.run_id, since=started_at)
    if cluster_info is not None:  # where the ClientApps ran, from Ray's records of this run's job
        cluster.placement(cluster_info, list(tree.seen), echo=echo, run_dir=outcome.results_dir)
    return outcome

