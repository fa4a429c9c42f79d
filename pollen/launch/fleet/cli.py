"""``pollen fleet``: run a Pollen method on a local fleet, one SuperLink and N SuperNodes, insecure or TLS +
node auth, and report whether it completed.

Unlike simulation, every client is a real ``flower-supernode`` process with its own
``--node-config`` (partition id, and optionally data root and model), talking to a real
``flower-superlink`` over the network stack, exactly as on separate machines. The command

1. checks the run config (method, sizes, keys) and that the machine can hold the fleet
   (:mod:`pollen.launch.resources`) before starting anything, and makes the run's folder
   (``<out-dir>/YYYYMMDD-HHMMSS-<method>-<task>``, locked, ``latest``, as ``pollen run`` does),
2. with ``--tls``: writes a CA, a server certificate and one key pair per SuperNode
   (:mod:`pollen.launch.fleet.certs`), starts the SuperLink with ``--enable-supernode-auth`` and registers
   every node key with ``flwr supernode register``; the SuperLink keeps its state in ``--database`` in the
   work folder,
3. starts the SuperNodes and waits until all of them are online,
4. submits the app with ``flwr run``, streams its log, reads the final status with ``flwr ls``,
5. watches the SuperLink throughout: if it dies, says so (``SuperLink (pid N) died with code X``) within
   about a second, restarts it on the same port with the same certificates and database, waits for the
   SuperNodes to reconnect and continues the run from its last checkpoint (:mod:`pollen.launch.fleet.
   supervise`), up to ``--max-restarts`` times, then exits 3,
6. stops every process it started (SuperLink, SuperNodes, ``flower-superexec``, ServerApp and ClientApp
   processes, wherever they went: found by PID through the fleet's environment mark), after the run,
   on failure, on timeout, on Ctrl-C and on SIGTERM, and checks by PID that none is left,
7. on every exit writes ``summary.json`` (the ServerApp's, or ``failed``/``interrupted`` with the reason;
   with ``superlink-restarts``) and ``fleet.json`` (status, wall times, processes, restarts) into the run
   folder, and prints them.

The exit code is 0 only for ``finished:completed``. Example (``make fleet`` wraps it)::

    pollen fleet --method fedprox --num-supernodes 3 --rounds 2 --tls --run-config "local-epochs=1 fedprox-mu=0.1"

deploy/README.md explains the same steps for SuperNodes on different machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollen.app.checkpoints import CheckpointError, atomic_write
from pollen.app.config import ConfigError
from pollen.launch.compose import default_app_dir
from pollen.launch.console import RUN_LOG, RunLog, add_console_options
from pollen.launch.errors import (
    EXIT_NOT_COMPLETED,
    EXIT_SUPERLINK_DIED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LaunchConfigError,
    SuperLinkDied,
)
from pollen.launch.fleet import certs
from pollen.launch.fleet.federation import Fleet
from pollen.launch.fleet.plan import compose_run_config, plan_nodes
from pollen.launch.fleet.supervise import Supervision, run_supervised
from pollen.launch.processes import groups_alive
from pollen.launch.resources import check_fits, fleet_estimate, run_shape
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
from pollen.launch.submit import DEFAULT_TIMEOUT_S
from pollen.protocol.identity import format_partition_pins

# A SuperLink that dies is restarted this many times before the fleet gives up (exit 3).
DEFAULT_MAX_RESTARTS = 3


class FleetInterrupted(Exception):
    """SIGTERM/SIGHUP arrived: unwind so every process gets stopped, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class FleetReport:
    """What one fleet run did, in seconds; written as ``fleet.json`` next to the run's results."""

    method: str
    num_supernodes: int
    tls: bool
    run_name: str | None = None  # the run folder's name
    status: str = "not started"
    failure_reason: str | None = None
    run_id: int | None = None  # the Flower run id of the last submission
    superlink_pid: int | None = None
    results_dir: str | None = None
    startup_s: float | None = None
    run_s: float | None = None
    teardown_s: float | None = None
    total_s: float | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    client_errors: dict[str, list[str]] = field(default_factory=dict)
    processes: list[str] = field(default_factory=list)  # "name(pid)" of every process seen
    leftover: list[int] = field(default_factory=list)  # PIDs alive after teardown (should be empty)
    superlink_restarts: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@contextlib.contextmanager
def _signals_raise(timeout: float) -> Iterator[None]:
    """SIGTERM/SIGHUP raise :class:`FleetInterrupted` (SIGINT already raises KeyboardInterrupt), and
    a real-time alarm raises :class:`TimeoutError` after ``timeout`` seconds.

    The alarm is what makes ``--timeout`` hold even when the run hangs silently (e.g. waiting for
    clients that never come): a blocked log stream alone would never notice.
    """
    def on_signal(signum, _frame):
        raise FleetInterrupted(signum)

    def on_alarm(_signum, _frame):
        raise TimeoutError(f"the fleet run did not finish within {timeout:.0f}s")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in previous.items():
            signal.signal(s, h)


def build_parser() -> argparse.ArgumentParser:
    from pollen.app.registry import METHODS

    parser = argparse.ArgumentParser(
        prog="pollen fleet",
        description="Run a Pollen method on a local SuperLink + N SuperNodes fleet (insecure or TLS + node auth).",
        epilog="Registered methods (family: method): "
               + ", ".join(sorted({f"{s.family}: {s.name}" for s in METHODS.values()})))
    parser.add_argument("--method", default=None,
                        help="method to run (default: the run config's, else fedavg); "
                             f"one of {', '.join(sorted(METHODS))}")
    parser.add_argument("--num-supernodes", type=int, default=2, help="SuperNodes to start (partition i of N each)")
    parser.add_argument("--rounds", type=int, default=None, help="num-server-rounds (default: the run config's)")
    parser.add_argument("--run-config", default="", help="extra run config pairs, e.g. \"local-epochs=1 lr=0.1\"")
    parser.add_argument("--tls", action="store_true",
                        help="HTTPS with a fresh CA and SuperNode authentication (keys written and registered)")
    parser.add_argument("--host", action="append", default=[],
                        help="with --tls: extra DNS name/IP for the server certificate (repeatable)")
    parser.add_argument("--data-root", default=None, help="dataset root given to every SuperNode (node config)")
    parser.add_argument("--data-dirs", default="",
                        help="comma-separated data folders, one per SuperNode: node config data-dir, each node's own "
                             "data (the user-data tasks; see docs/data.md)")
    parser.add_argument("--public-dirs", default="",
                        help="comma-separated public image folders, one for all SuperNodes or one per SuperNode: "
                             "node config public-dir (logit methods, fccl-public='folder'; same files everywhere)")
    parser.add_argument("--models", default="",
                        help="comma-separated model names: one for all SuperNodes or one per SuperNode")
    parser.add_argument("--gpus", default="",
                        help="comma-separated GPU indices assigned round-robin as CUDA_VISIBLE_DEVICES "
                             "(one SuperNode per GPU); run config device='auto' (default) or 'cuda' then trains on it")
    parser.add_argument("--pin-partitions", action="store_true",
                        help="with --tls: pin each partition to the node id its registered key was given "
                             "(run config partition-pins), so no other node can claim it")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before the run is abandoned")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                        help="times a SuperLink that dies is restarted (same port, certificates and database) and the "
                             f"run continued from its last checkpoint (default {DEFAULT_MAX_RESTARTS}; 0: exit 3)")
    parser.add_argument("--out-dir", default=None,
                        help="results root; the run lands in OUT_DIR/YYYYMMDD-HHMMSS-<method>-<task>/, OUT_DIR/latest "
                             "points at it (default: $POLLEN_OUT_DIR, else ./runs)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="folder for FLWR_HOME, certificates, logs and the SuperLink's database (default: a fresh "
                             "temporary folder)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the work folder after a completed run (it is always kept after a failure)")
    add_console_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        values, cfg, nodes, app_dir = _checked(args)
        run_dir, lock = _run_folder(values, cfg, args)
    except (ConfigError, LaunchConfigError, RunFolderError) as err:
        print(f"[fleet] error: {err}", file=sys.stderr)
        return EXIT_USAGE
    values = {**values, "run-name": run_dir.name}
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pollen-fleet-"))
    report = FleetReport(method=cfg.method, num_supernodes=len(nodes), tls=args.tls, run_name=run_dir.name,
                         results_dir=str(run_dir))
    supervision = Supervision(args.max_restarts)
    code, stopped = EXIT_NOT_COMPLETED, False
    fleet = Fleet(work_dir, tls=args.tls, hosts=args.host)
    started, since = time.monotonic(), time.time()
    run_log = RunLog(run_dir / RUN_LOG).__enter__()  # left in the finally below
    print(f"[fleet] run folder {run_dir}", flush=True)
    try:
        with _signals_raise(args.timeout):
            try:
                try:
                    with fleet:
                        for spec in nodes:
                            fleet.add_supernode(spec)
                        fleet.wait_for_nodes(timeout=min(300.0, args.timeout))
                        report.startup_s = round(time.monotonic() - started, 2)
                        if args.pin_partitions:
                            values = {**values, "partition-pins": format_partition_pins(fleet.partition_pins())}
                        outcome = run_supervised(fleet, values, run_dir, supervision, echo=not args.quiet,
                                                 app_dir=app_dir, timeout=args.timeout, verbose=args.verbose,
                                                 run_log=run_log)
                        report.run_id, report.status = outcome.run_id, outcome.status
                        report.failure_reason = outcome.failure_reason
                        report.run_s = round(outcome.wall_time_s, 2)
                        code = 0 if outcome.completed else EXIT_NOT_COMPLETED
                except TimeoutError as err:  # the alarm, or a wait inside the fleet
                    report.status, code, stopped = f"timeout: {err}", EXIT_TIMEOUT, True
                except SuperLinkDied as err:
                    report.status, code = f"error: {err}", EXIT_SUPERLINK_DIED
                    if not fleet.superlink_death_reported:
                        print(f"[fleet] {err}", file=sys.stderr, flush=True)
                except FleetInterrupted as err:
                    report.status, code, stopped = str(err), 128 + err.signum, True
                except KeyboardInterrupt:
                    report.status, code, stopped = "interrupted by SIGINT", 128 + signal.SIGINT, True
                except (RuntimeError, OSError, certs.CertError) as err:
                    report.status, code = f"error: {err}", EXIT_NOT_COMPLETED
            except (FleetInterrupted, KeyboardInterrupt, TimeoutError) as err:  # a second signal, while unwinding
                signum = err.signum if isinstance(err, FleetInterrupted) else signal.SIGINT
                report.status = f"{report.status}; then interrupted again ({type(err).__name__})"
                code = EXIT_TIMEOUT if isinstance(err, TimeoutError) and code == 0 else code or 128 + signum
                stopped = True
        report.run_id = report.run_id if report.run_id is not None else fleet.run_id  # the run it was in
        report.teardown_s = fleet.teardown_s
        report.total_s = round(time.monotonic() - started, 2)
        report.superlink_pid = fleet.superlink_proc.pid if fleet.superlink_proc is not None else None
        report.nodes = [{"name": n.spec.name, "pid": n.pid, "node-config": n.spec.node_config, "gpu": n.spec.gpu,
                         "exit-code": n.proc.returncode} for n in fleet.supernodes]
        report.client_errors = fleet.client_errors()
        report.processes, report.leftover = fleet.processes(), fleet.leftover
        report.superlink_restarts = supervision.restarts
        if report.leftover and code == 0:
            code = EXIT_NOT_COMPLETED
        _keep_results(run_dir, report, code, stopped, since)
        _print_report(report, fleet, code)
        left = groups_alive(fleet.process_groups())
        if left:
            print(f"[fleet] warning: process groups still alive after teardown: {left}", file=sys.stderr)
        elif not fleet.leftover and report.processes:
            print(f"[fleet] stopped the fleet's {len(report.processes)} processes: none left (checked by PID)",
                  flush=True)
        if code == 0 and not args.keep_logs and args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"[fleet] logs, certificates, FLWR_HOME and the SuperLink's database kept in {work_dir}")
    finally:
        run_log.__exit__()
        lock.release()
    return code


def _checked(args: argparse.Namespace) -> tuple[dict[str, Any], Any, list, Path]:
    """Every option and the run config, checked before anything starts (``ConfigError``/``LaunchConfigError``)."""
    if args.num_supernodes < 1:
        raise ConfigError(f"--num-supernodes = {args.num_supernodes} is invalid: expected an integer >= 1")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts = {args.max_restarts} is invalid: expected an integer >= 0")
    values, cfg = compose_run_config(method=args.method, rounds=args.rounds, out_dir=args.out_dir,
                                     data_root=args.data_root, user=args.run_config, num_supernodes=args.num_supernodes)
    check_fits(fleet_estimate(args.num_supernodes, *run_shape(cfg.to_dict())),
               f"--num-supernodes {args.num_supernodes}")  # before the plan: it holds one entry per node
    nodes = plan_nodes(args.num_supernodes, data_root=args.data_root, models=args.models.split(","),
                       gpus=args.gpus.split(","), data_dirs=args.data_dirs.split(","),
                       public_dirs=args.public_dirs.split(","))
    if args.host and not args.tls:
        raise ConfigError("--host only applies to the TLS server certificate: add --tls")
    if args.pin_partitions and not args.tls:
        raise ConfigError("--pin-partitions pins partitions to registered node keys: add --tls")
    if not args.timeout > 0:  # nan too
        raise ConfigError(f"--timeout = {args.timeout} is invalid: expected seconds > 0")
    app_dir = default_app_dir()
    if args.work_dir is not None and (args.work_dir.resolve() == app_dir or app_dir in args.work_dir.resolve().parents):
        raise ConfigError(f"--work-dir {args.work_dir} is inside the app directory {app_dir}: "
                          "`flwr run` would pack its files into the app; choose a folder outside it")
    return values, cfg, nodes, app_dir


def _run_folder(values: Mapping[str, Any], cfg: Any, args: argparse.Namespace) -> tuple[Path, RunLock]:
    """The run's folder, named and kept as ``pollen run`` keeps one (``YYYYMMDD-HHMMSS-<method>-<task>``,
    locked, ``latest``, ``launch.json``, room for its summary), before anything starts."""
    from pollen.app.results import reserve_summary_space

    root = Path(values["out-dir"])
    check_free_space(root, space_needed(None))
    run_dir = create_run_dir(root, str(values.get("run-name") or run_name(cfg.method, cfg.task)))
    lock = RunLock(run_dir).acquire(argv=sys.argv[1:])
    write_launch_info(run_dir, {"num-supernodes": args.num_supernodes, "fleet": True, "tls": args.tls,
                                "max-restarts": args.max_restarts})
    reserve_summary_space(run_dir)
    with contextlib.suppress(RunFolderError):  # a file system without symlinks still runs
        link_latest(run_dir)
    return run_dir, lock


def _keep_results(run_dir: Path, report: FleetReport, code: int, stopped: bool, since: float) -> None:
    """``summary.json`` and ``fleet.json`` on every exit path: the ServerApp's summary when it wrote one for
    this fleet (a ``failed`` or ``interrupted`` one otherwise), with the SuperLink restarts added."""
    from pollen.app.results import write_stopped_summary, write_summary

    if code != 0:
        reason = report.failure_reason or report.status
        write_stopped_summary(run_dir, "interrupted" if stopped else "failed", reason, report.run_id, since=since)
    summary_path = run_dir / "summary.json"
    if report.superlink_restarts and summary_path.exists():
        with contextlib.suppress(OSError, ValueError, CheckpointError):
            summary = json.loads(summary_path.read_text())
            write_summary(summary_path, {**summary, "superlink-restarts": report.superlink_restarts})
    with contextlib.suppress(OSError, CheckpointError):
        atomic_write(run_dir / "fleet.json", (json.dumps(report.as_dict(), indent=2) + "\n").encode())


def _print_report(report: FleetReport, fleet: Fleet, code: int) -> None:
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}s"

    flower = f" (Flower run {report.run_id})" if report.run_id is not None else ""
    restarts = f", {len(report.superlink_restarts)} SuperLink restart(s)" if report.superlink_restarts else ""
    print(f"[fleet] {report.method} on {report.num_supernodes} SuperNodes "
          f"({'TLS + node auth' if report.tls else 'insecure'}): run {report.run_name}{flower}: {report.status}"
          f"{restarts}", flush=True)
    if report.run_id is not None and code != 0 and report.status.startswith("finished:"):
        verdict = report.status.split(":", 1)[1]
        verdict = "failed" if verdict == "completed" else verdict  # summary.json says failed
        print(f"[fleet] run {report.run_name} {verdict}: {report.failure_reason or 'no reason recorded'}",
              file=sys.stderr, flush=True)
    print(f"[fleet] wall time: fleet up {secs(report.startup_s)} | run {secs(report.run_s)} | "
          f"teardown {secs(report.teardown_s)} | total {secs(report.total_s)}", flush=True)
    if report.results_dir:
        summary_path = Path(report.results_dir) / "summary.json"
        extra = ""
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            acc = summary.get("final-accuracy") or {}
            if acc.get("mean") is not None:
                extra += f" | final {acc.get('metric')} {acc['mean']:.4f}"
            extra += f" | failures {summary.get('failures-total', 0)} rejected {summary.get('rejected-total', 0)}"
        print(f"[fleet] results: {report.results_dir}{extra}", flush=True)
    for name, errors in report.client_errors.items():
        for error in errors[:3]:
            print(f"[fleet] ClientApp error on {name}: {error}", flush=True)
    if code != 0:
        print(fleet.log_tails(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
