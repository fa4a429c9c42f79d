"""The launcher (``python -m pollen.launch.launcher``): a bad run config is refused before anything starts, a
failed run exits non-zero with its reason, the run gets its own local Ray whatever cluster the machine
has recorded, and no process of the launch outlives it (checked by PID)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from pollen import launch
from pollen.launch import compose, launcher, processes, simulation, submit, superlinks
from pollen.launch.errors import EXIT_TIMEOUT, EXIT_USAGE
from tests.conftest import PROJECT_ROOT, RAY_CPUS

HAS_PROC = Path("/proc/self/environ").exists()

# Tiny runs: the embedded UCI digits task (no data files), 2 SuperNodes, 2 rounds, 1 local epoch.
TINY = "num-server-rounds=2 local-epochs=1"


def _fake_app(root: Path, config: str = "lr = 0.1\nseed = 0\n") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(
        '[project]\nname = "fakeapp"\nversion = "1.0.0"\n\n[tool.flwr.app]\npublisher = "t"\n\n'
        '[tool.flwr.app.components]\nserverapp = "x:app"\nclientapp = "y:app"\n\n'
        f"[tool.flwr.app.config]\n{config}")
    return root


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any attempt to start a process or create the private FLWR_HOME fails the test."""
    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"the launcher tried to start something: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    return attempts


# --- refused before anything starts (no processes) ----------------------------------------------------

def test_unknown_key_is_refused_before_anything_starts(tmp_path, capsys, nothing_starts):
    home = tmp_path / "flwr-home"
    began = time.monotonic()
    code = launcher.main(["--flwr-home", str(home), "--run-config", "lrr=0.1 num-server-rounds=2 zzz-qqq=1"])
    elapsed = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert "unknown run config keys 'lrr' (did you mean 'lr'?), 'zzz-qqq'" in err
    assert "'num-server-rounds'" not in err  # a valid key is not named
    assert "[tool.flwr.app.config] of its pyproject.toml" in err
    assert not nothing_starts and not home.exists()
    assert elapsed < 5.0, f"refusing a key took {elapsed:.1f}s"


@pytest.mark.parametrize("argv, message", [
    (["--run-config", "lr 0.1"], r"cannot read 'lr 0\.1'"),
    (["--run-config", "method=fedprox"], r"values must be TOML"),
    (["--run-config", "out-dir='/a'", "--out-dir", "/b"], r"'out-dir' given twice"),
    (["--num-supernodes", "0"], r"--num-supernodes 0"),
    (["--timeout", "0"], r"--timeout 0"),
    (["--ray-cpus", "0"], r"--ray-cpus 0: expected at least --cpus-per-client \(1\)"),
    (["--ray-cpus", "2", "--cpus-per-client", "4"], r"--ray-cpus 2: expected at least --cpus-per-client \(4\)"),
    (["--ray-cpus", "2", "--ray-address", "10.0.0.5:6379"], r"a cluster's CPUs are set where its nodes start"),
])
def test_bad_options_are_refused_before_anything_starts(argv, message, capsys, nothing_starts):
    assert launcher.main(argv) == EXIT_USAGE
    assert re.search(message, capsys.readouterr().err)
    assert not nothing_starts


def test_keys_are_checked_against_the_chosen_app(tmp_path, capsys, nothing_starts):
    app = _fake_app(tmp_path / "app")
    assert launcher.main(["--app", str(app), "--run-config", "seed=1 method='fedavg'"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown run config key 'method'" in err and str(app) in err
    assert launcher.main(["--app", str(app), "--out-dir", str(tmp_path)]) == EXIT_USAGE
    assert "has no 'out-dir' run key" in capsys.readouterr().err
    assert launcher.main(["--app", str(tmp_path / "not-an-app")]) == EXIT_USAGE
    assert "[tool.flwr.app]" in capsys.readouterr().err


def test_default_app_dir_prefers_the_current_app_then_the_checkout(tmp_path):
    app = _fake_app(tmp_path / "app")
    assert launch.default_app_dir(cwd=app) == app.resolve()
    assert launch.default_app_dir(cwd=tmp_path) == PROJECT_ROOT  # not an app: the checkout holding pollen
    installed = tmp_path / "site-packages" / "pollen" / "launch" / "compose.py"
    with pytest.raises(launch.LaunchConfigError, match="pass --app DIR"):
        launch.default_app_dir(cwd=tmp_path, module_file=installed)
    assert launch.PROJECT_ROOT == PROJECT_ROOT


def test_run_config_round_trips_and_out_dir_becomes_absolute(tmp_path, monkeypatch):
    values = {"method": "fedprox", "lr": 1e-06, "seed": 3, "download": False, "data-root": "/d/it's",
              "fccl-local-epochs": "1,2", "model": ""}
    assert launch.parse_run_config(launch.format_run_config(values)) == values
    monkeypatch.setenv("POLLEN_OUT_DIR", str(tmp_path / "env-out"))
    composed, results = launch.compose_run_config(PROJECT_ROOT, "seed=1", data_root="relative/data")
    assert composed["out-dir"] == str(tmp_path / "env-out") and results == tmp_path / "env-out"
    assert composed["data-root"] == str(Path("relative/data").resolve())
    composed, results = launch.compose_run_config(PROJECT_ROOT, {"out-dir": "rel"}, out_dir=None)
    assert composed["out-dir"] == str(Path("rel").resolve())


def test_help_shows_defaults_paths_methods_and_tasks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert exit_info.value.code == 0
    assert "else 5" in out and "(default: 21600.0)" in out and "(default 1; on --resume, the run's)" in out
    for option in ("--out-dir", "--data-root", "--ray-address", "--flwr-home", "--app"):
        assert option in out
    assert re.search(r"methods: .*\bfedavg\b", out) and re.search(r"tasks: .*\buci-dirichlet\b", out)


def test_ray_goes_local_unless_an_address_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")  # inherited from the shell: not followed
    assert launch.flower_env(tmp_path)["RAY_ADDRESS"] == "local"
    assert "RAY_ADDRESS=local" in simulation.ray_line(None) and "10.0.0.9:6379 from the environment ignored" in \
        simulation.ray_line(None)
    assert launch.flower_env(tmp_path, ray_address="10.0.0.5:6379")["RAY_ADDRESS"] == "10.0.0.5:6379"
    assert "attaching to the cluster at 10.0.0.5:6379" in simulation.ray_line("10.0.0.5:6379")


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_the_wait_ends_on_this_runs_summary_and_the_apps_closing_line(tmp_path, monkeypatch):
    """A run folder's summary.json ends the launcher's wait only when it names this Flower run and the
    ServerApp's own end (completed or failed): an earlier launch's summary (a resumed folder) or the
    launcher's own interrupted one does not. The app's closing line then ends it at once, or the grace."""
    from pollen.app.results import write_stopped_summary

    clock = [100.0]
    monkeypatch.setattr(submit.time, "monotonic", lambda: clock[0])
    ended = submit.AppEnd(tmp_path, run_id=7)
    assert not ended.over()  # no summary yet
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "flower-run-id": 6}))
    assert not ended.over() and ended.summary is None  # the previous launch's
    write_stopped_summary(tmp_path, "interrupted", "Ctrl-C", flower_run_id=7)
    assert not ended.over() and ended.summary is None  # written by a launcher, not by the app
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "flower-run-id": 7, "x": 1}))
    assert not ended.over() and ended.summary["status"] == "failed"  # found: the closing line may follow
    clock[0] += submit.AppEnd.grace + 0.1
    assert ended.over()  # no closing line within the grace
    closing = submit.AppEnd(tmp_path, run_id=7)
    closing.saw(f"[pollen] run failed: boom; summary: {tmp_path / 'summary.json'}\n")
    assert closing.over()
    assert not submit.AppEnd(None, run_id=7).over()  # no run folder known: Flower's status decides


def test_process_tree_stops_a_process_that_left_the_session_and_its_parent(tmp_path):
    """What ``flwr-serverapp`` and Ray daemons do: a new session, the parent gone. Found by the mark."""
    tree = processes.ProcessTree("test")
    env = tree.mark(dict(os.environ))
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            "open(sys.argv[1], 'w').write(str(p.pid))")
    parent = subprocess.Popen([sys.executable, "-c", code, str(pid_file)], env=env, start_new_session=True)
    tree.add_root(parent.pid)
    parent.wait(timeout=30)
    orphan = int(pid_file.read_text())
    try:
        assert orphan in tree.members()  # not a descendant any more: found by its environment
        assert tree.terminate(grace=2.0) == []
        assert tree.alive([orphan]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_killing_a_tree_takes_what_ignores_sigterm_at_once(tmp_path):
    """What two Ray agents do once their driver is gone: ignore SIGTERM. ``terminate`` waits its patience
    for them; ``kill`` (a launch whose work is on disk) takes them, and the rest of the tree, at once."""
    tree = processes.ProcessTree("test")
    env = tree.mark(dict(os.environ))
    pid_file = tmp_path / "pid"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[2]], "
            "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code, str(pid_file), stubborn], env=env, start_new_session=True)
    tree.add_root(parent.pid)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        assert child in tree.members() and parent.pid in tree.members()
        assert tree.kill() == []
        assert tree.alive([child, parent.pid]) == []
        assert parent.wait(timeout=5) == -signal.SIGKILL  # terminate() would have sent SIGTERM first
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_process_tree_stops_an_unmarked_orphan_by_its_group(tmp_path):
    """What a Ray agent does under load: started late by a group leader of the launch, its environment
    overwritten when it renames itself, its parent gone before the teardown looked. Found by its group."""
    tree = processes.ProcessTree("test")
    env = tree.mark(dict(os.environ))
    go, pid_file = tmp_path / "go", tmp_path / "pid"
    leader = ("import os, subprocess, sys, time\n"
              "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
              "env = {k: v for k, v in os.environ.items() if k != sys.argv[3]}\n"
              "p = subprocess.Popen(['sleep', '300'], env=env)\n"
              "open(sys.argv[2], 'w').write(str(p.pid))\n")
    root = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]], "
            "start_new_session=True).wait()")
    parent = subprocess.Popen([sys.executable, "-c", root, leader, str(go), str(pid_file), processes.LAUNCH_MARK],
                              env=env)
    tree.add_root(parent.pid)
    deadline = time.monotonic() + 30
    while len(tree.members()) < 2 and time.monotonic() < deadline:  # the root and the group leader
        time.sleep(0.05)
    assert len(tree.members()) == 2
    go.write_text("")
    parent.wait(timeout=30)
    orphan = int(pid_file.read_text())
    try:
        assert processes.LAUNCH_MARK.encode() not in Path(f"/proc/{orphan}/environ").read_bytes()
        assert int(Path(f"/proc/{orphan}/stat").read_text().split(") ")[1].split()[1]) not in tree.seen
        assert orphan in tree.members()  # no mark, no member parent: found by its group
        assert tree.terminate(grace=2.0) == []
        assert tree.alive([orphan]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


# --- real launches (Flower, Ray) -----------------------------------------------------------------------

class TreeWatcher:
    """Every process carrying ``POLLEN_TEST_MARK=<token>`` (the launcher and all it starts inherit it), seen
    by polling /proc while the launch runs: the test's own PID record, independent of the launcher's."""

    def __init__(self):
        self.token = uuid.uuid4().hex
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, comm when first seen)
        self.names_seen: set[str] = set()  # every name any of them had
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, POLLEN_TEST_MARK=self.token, **extra)
        env.pop("RAY_ADDRESS", None)
        return env

    def __enter__(self) -> TreeWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        needle = f"POLLEN_TEST_MARK={self.token}".encode()
        while not self._stop.is_set():
            self.scan(needle)
            self._stop.wait(0.3)

    def scan(self, needle: bytes) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                comm, pgrp, start = stat[stat.index("(") + 1:stat.rindex(")")], int(fields[2]), int(fields[19])
                known = self.seen.get(pid)
                if known is not None and known[0] == start:
                    self.names_seen.add(comm)  # a process renames itself after exec (raylet, ray::...)
                    continue
                # marked, or in the group of a process seen (a renamed Ray agent's environment is overwritten)
                if needle not in (entry / "environ").read_bytes() and pgrp not in self.seen:
                    continue
            except (OSError, ValueError):
                continue
            self.seen[pid] = (start, comm)
            self.names_seen.add(comm)

    def names(self) -> set[str]:
        return set(self.names_seen)

    def alive(self) -> list[int]:
        """Every process seen that still runs (same start time, not a zombie)."""
        left = []
        for pid, (start, _comm) in self.seen.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] not in ("Z", "X") and int(fields[19]) == start:
                left.append(pid)
        return left

    def describe(self, pids: list[int]) -> str:
        """What a failure message needs about the processes left: name, state, parent, command line,
        and whether the launcher could have found them (its own mark in their environment)."""
        lines = []
        for pid in pids:
            name = f"{self.seen[pid][1]}({pid})"
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                marked = processes.LAUNCH_MARK.encode() in Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                lines.append(f"{name}: gone")
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            lines.append(f"{name}: state {fields[0]} ppid {fields[1]} pgrp {fields[2]} launcher-mark {marked} "
                         f"cmd {cmd[:300]}")
        return "\n".join(lines)

    @staticmethod
    def kill(pids: list[int]) -> None:
        """A failed test must not leave its strays running into the next test."""
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def wait_for(self, predicate, timeout: float, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout
        while not predicate() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pollen.launch.launcher", "--num-supernodes", "2", "--ray-cpus", str(RAY_CPUS), *args]


def _after(watcher: TreeWatcher, grace: float = 15.0) -> str:
    """What is still running a moment after the launcher exited (it already verified; this re-checks):
    empty when nothing, else one line per stray, which is then killed."""
    deadline = time.monotonic() + grace
    while watcher.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = watcher.alive()
    detail = watcher.describe(left)
    watcher.kill(left)
    return detail


@pytest.fixture
def ray_tmpdir():
    """A private, short Ray temp dir (Ray's socket paths must stay under 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_superlink_retries_a_port_taken_by_another_superlink(tmp_path, monkeypatch):
    """The free port was taken before the SuperLink bound it, by a server that even answers /health (as
    another launch's SuperLink would): the launcher must not mistake it for its own, and retries."""
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Health)  # bound to port 0: no race of its own
    taken = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ports = iter([taken])
    real_free_port = superlinks.free_port
    monkeypatch.setattr(superlinks, "free_port", lambda: next(ports, None) or real_free_port())
    tree = processes.ProcessTree("test")
    try:
        with launch.superlink(tmp_path / "home", simulation=True, tree=tree) as (_conn, port, proc):
            assert port != taken and proc.poll() is None
            assert processes.listening_on(proc.pid, port) is True
        assert tree.terminate() == []
        logs = sorted(p.name for p in (tmp_path / "home").glob("superlink-*.log"))
        assert logs == sorted([f"superlink-{taken}.log", f"superlink-{port}.log"])
        assert "address already in use" in (tmp_path / "home" / f"superlink-{taken}.log").read_text()
    finally:
        other.shutdown()
        other.server_close()
        tree.terminate()


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_stale_ray_cluster_record_does_not_hang_the_run_and_nothing_is_left(tmp_path, ray_tmpdir):
    """Ray's ``ray_current_cluster`` names a dead GCS (as after a crashed ``ray start``). A bare
    ``ray.init()`` would keep retrying it; the launcher's ``RAY_ADDRESS=local`` starts a private Ray."""
    dead = socket.socket()  # bound, never listening: connections to it are refused for the whole test
    dead.bind(("127.0.0.1", 0))
    record = ray_tmpdir / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text(f"127.0.0.1:{dead.getsockname()[1]}")
    out = tmp_path / "runs"
    try:
        with TreeWatcher() as watcher:
            began = time.monotonic()
            proc = subprocess.run(_launch_cmd("--run-config", TINY, "--out-dir", str(out), "--timeout", "240"),
                                  cwd=PROJECT_ROOT, env=watcher.env(RAY_TMPDIR=str(ray_tmpdir)),
                                  capture_output=True, text=True, timeout=400)
            elapsed = time.monotonic() - began
            left = _after(watcher)
    finally:
        dead.close()
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "RAY_ADDRESS=local" in proc.stdout and "private local instance" in proc.stdout
    assert elapsed < 240
    assert record.read_text().startswith("127.0.0.1:")  # still recorded: Ray was told not to look
    assert list((ray_tmpdir / "ray").glob("session_*")), "Ray did not use the private temp dir"
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    assert "none left (checked by PID)" in proc.stdout
    # the test's own record: the whole tree was seen, and none of it survives
    assert {"raylet", "gcs_server"} <= watcher.names(), watcher.names()
    assert any(n.startswith("flower-superl") for n in watcher.names()), watcher.names()
    assert left == "", left


@pytest.mark.e2e
def test_missing_data_root_fails_with_the_datasets_message(tmp_path):
    """Every client fails to load MNIST, so no round trains anybody: the run must end failed, the launcher
    exit non-zero and print the reason, which carries the dataset's own message."""
    out = tmp_path / "runs"
    proc = subprocess.run(
        _launch_cmd("--run-config", f"task='mnist-dirichlet' {TINY}", "--data-root", str(tmp_path / "no-data"),
                    "--out-dir", str(out), "--timeout", "240"),
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=400)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    reason = re.search(r"^\[pollen\] run \d+ failed: (.+)$", proc.stderr, flags=re.M)
    assert reason, text[-4000:]
    # The dataset's message (DatasetMissingError: "dataset 'mnist' not found under root '<root>': expected
    # <files> (missing: ...). To get it: ..."), as the ServerApp recorded it.
    assert "trained nobody" in reason.group(1) and "dataset 'mnist' not found under root" in reason.group(1)
    assert f"{tmp_path / 'no-data'}/MNIST/raw" in reason.group(1) and "To get it:" in reason.group(1)
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert summary["status"] == "failed" and summary["failure-reason"] in reason.group(1)


@pytest.mark.e2e
def test_resume_continues_a_finished_run_with_more_rounds(tmp_path):
    """``--resume RUN_DIR`` reruns with the saved config and federation (``--num-supernodes`` not repeated),
    continues after the last checkpoint and appends to the same run folder, whose name sorts by start time;
    a changed method is refused before anything starts, naming the key. The first launch writes to the
    default folder, ./runs of the checkout (where `make run` writes) and `pollen runs` lists it there; the
    console shows one line per round, Flower's own lines are in the run's run.log (issue 44.5)."""
    env = {k: v for k, v in os.environ.items() if k != "POLLEN_OUT_DIR"}
    first = subprocess.run(_launch_cmd("--run-config", "num-server-rounds=1 local-epochs=1", "--num-supernodes", "2",
                                       "--timeout", "300"),
                           cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=500)
    found = re.search(r"^\[pollen\] run folder (\S+)", first.stdout, flags=re.M)
    run_dir = Path(found[1]) if found else None
    try:
        assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
        assert run_dir is not None and run_dir.parent == PROJECT_ROOT / "runs", first.stdout[-3000:]
        assert re.fullmatch(r"\d{8}-\d{6}-fedavg-uci-dirichlet", run_dir.name), run_dir
        first_summary = json.loads((run_dir / "summary.json").read_text())
        assert first_summary["status"] == "completed" and first_summary["last-round"] == 1
        assert f"run {first_summary['flower-run-id']}: finished:completed" in first.stdout
        listed = subprocess.run([sys.executable, "-m", "pollen.launch.cli", "runs"], cwd=PROJECT_ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert re.search(rf"^{run_dir.name}\s+completed\s+fedavg\s+uci-dirichlet\s+1/1", listed.stdout,
                         flags=re.M), listed.stdout + listed.stderr
        console = first.stdout + first.stderr
        assert len(re.findall(r"\[pollen\] round 1/1 ", console)) == 1, console[-3000:]
        assert "[ROUND 1/1]" not in console and "Aggregated MetricRecord" not in console  # Flower's: in run.log
        log = (run_dir / "run.log").read_text()
        assert "[ROUND 1/1]" in log and "[pollen] round 1/1 " in log and "[pollen] SuperLink up on port" in log
        assert "\x1b[" not in log
        again = subprocess.run([sys.executable, "-m", "pollen.launch.launcher", "--ray-cpus", str(RAY_CPUS),
                                "--resume", str(run_dir), "--run-config", "num-server-rounds=2", "--timeout", "300"],
                               cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=500)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        rounds = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rounds == [1, 2]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["files"]["checkpoint"].endswith("round-0002.safetensors")
        assert re.search(r"round 2/2 .*\| elapsed \d+s", again.stdout), again.stdout[-3000:]
        assert "launched again ---" in (run_dir / "run.log").read_text()  # the resume appends to run.log
        changed = subprocess.run(_launch_cmd("--resume", str(run_dir), "--run-config",
                                             "num-server-rounds=3 method='fedprox'", "--timeout", "300"),
                                 cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=500)
        assert changed.returncode == EXIT_USAGE, changed.stderr
        assert "--run-config changes 'method' = 'fedprox' (the run has 'fedavg')" in changed.stderr
    finally:
        if run_dir is not None and run_dir.parent == PROJECT_ROOT / "runs":
            shutil.rmtree(run_dir, ignore_errors=True)
            latest = PROJECT_ROOT / "runs" / "latest"
            if latest.is_symlink() and not latest.exists():
                latest.unlink()


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
@pytest.mark.parametrize("stop", ["sigint", "timeout"])
def test_interrupted_or_timed_out_launch_leaves_nothing_behind(stop, tmp_path):
    """Ctrl-C (SIGINT) once Ray is up, or ``--timeout`` mid-run: exit 130 / 124, and every process the launch
    started — SuperLink, superexec, flwr-simulation, Ray — is gone, checked by PID."""
    long_run = "num-server-rounds=200 local-epochs=1"
    timeout = "25" if stop == "timeout" else "600"
    with TreeWatcher() as watcher:
        proc = subprocess.Popen(_launch_cmd("--run-config", long_run, "--out-dir", str(tmp_path / "runs"),
                                            "--timeout", timeout),
                                cwd=PROJECT_ROOT, env=watcher.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            if stop == "sigint":
                watcher.wait_for(lambda: "raylet" in watcher.names(), 240, proc)
                assert proc.poll() is None, "the launcher ended before Ray started"
                time.sleep(2.0)  # the run is under way
                proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        left = _after(watcher)
    text = stdout + stderr
    if stop == "sigint":
        assert proc.returncode == 128 + signal.SIGINT, text[-4000:]
        assert "interrupted by SIGINT" in stderr
    else:
        assert proc.returncode == EXIT_TIMEOUT, text[-4000:]
        # mid-run ("run N did not finish within 25s") or, on a loaded machine, still submitting
        assert re.search(r"^\[pollen\] timeout: .* within 25s", stderr, flags=re.M), stderr[-3000:]
    assert "raylet" in watcher.names() or stop == "timeout", watcher.names()
    assert any(n.startswith("flower-superl") for n in watcher.names()), watcher.names()
    assert "still running after teardown" not in stderr, stderr[-3000:]
    assert left == "", left
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert summary["failure-reason"].startswith("interrupted by SIGINT" if stop == "sigint" else "timeout: ")


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
def test_the_run_dies_with_its_launcher(tmp_path):
    """``kill -9`` of the launcher alone: its watchdog stops SuperLink, SuperExec, the simulation and Ray
    within 10 s, removes the private FLWR_HOME, writes summary.json (interrupted) and only then lets the
    run folder's lock go, so a resume never meets a leftover server."""
    out = tmp_path / "runs"
    lines: list[str] = []
    with TreeWatcher() as watcher:
        proc = subprocess.Popen(_launch_cmd("--run-config", "num-server-rounds=200 local-epochs=1", "--out-dir",
                                            str(out), "--timeout", "600"),
                                cwd=PROJECT_ROOT, env=watcher.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        try:
            watcher.wait_for(lambda: any("[pollen] round 1/200" in x for x in lines), 300, proc)
            assert proc.poll() is None, "".join(lines)[-4000:]
            proc.kill()
            killed = time.monotonic()
            proc.wait()

            def run_left() -> list[int]:
                return [pid for pid in watcher.alive()
                        if b"pollen.launch.watchdog" not in Path(f"/proc/{pid}/cmdline").read_bytes()]

            while run_left() and time.monotonic() - killed < 30:
                time.sleep(0.1)
            stopped_after = time.monotonic() - killed
            left = watcher.describe(run_left())
            everything = _after(watcher, grace=30.0)  # the watchdog itself leaves once done
        finally:
            watcher.kill(watcher.alive())
    text = "".join(lines)
    assert left == "" and stopped_after <= 10.0, f"{stopped_after:.1f}s: {left}\n{text[-3000:]}"
    assert everything == "", everything
    # what happens before round 1 is said as it happens
    assert re.search(r"^\[pollen\] SuperLink up on port \d+ \([\d.]+s\)", text, flags=re.M), text[-3000:]
    # the actors Flower really starts (one per CPU of --ray-cpus 1), not one per SuperNode
    assert "waiting for round 1 (the simulation starts a private Ray with 1 ClientApp actor(s) for 2 SuperNode(s) " \
           "first)" in text
    home = re.search(r"^\[pollen\] FLWR_HOME (\S+) \(private", text, flags=re.M)
    assert home and not Path(home.group(1)).exists(), text[-3000:]
    run_dir = (out / "latest").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and f"the launcher (PID {proc.pid}) died" in summary["failure-reason"]
    assert summary["last-round"] >= 1 and summary["flower-run-id"] is not None
    from pollen.launch.runs import RunLock

    RunLock(run_dir).acquire().release()  # free again: nobody writes the folder any more
    print(f"run processes gone {stopped_after:.1f}s after the launcher's SIGKILL")


def test_node_count_follows_the_task_and_a_wrong_one_is_refused_before_start(capsys, nothing_starts):
    """FCCL's domain tasks need one SuperNode per domain, GLFC its final population: picked when not
    given, refused by number when given wrong — never a run in which every client fails."""
    assert compose.fitting_node_count(PROJECT_ROOT, {"method": "fccl", "task": "digits-offline"}, None) == 4
    glfc = {"method": "glfc", "task": "mnist-fmnist-cil", "num-server-rounds": 8}
    assert compose.fitting_node_count(PROJECT_ROOT, glfc, None) == 10
    assert compose.fitting_node_count(PROJECT_ROOT, {"method": "fedavg"}, None) == launch.DEFAULT_SUPERNODES
    assert compose.fitting_node_count(PROJECT_ROOT, {"method": "fedavg"}, 7) == 7
    code = launcher.main(["--run-config", "method='fccl' task='digits-offline'", "--num-supernodes", "5"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "needs exactly 4 SuperNodes, got --num-supernodes 5" in err
    code = launcher.main(["--run-config", "method='fedavg' lr=1e9"])
    assert code == EXIT_USAGE and "'lr' = 1000000000.0 is invalid" in capsys.readouterr().err
