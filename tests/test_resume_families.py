"""Exact resume for every family, through the real launcher.

Each case launches a tiny run (``pollen run``, the simulation engine, Ray), stops it once a node has
trained a round drawn from a seeded RNG (the round is in the test id) — Ctrl-C (SIGINT to the
launcher's process group) or the whole process tree SIGKILLed at once (nothing gets to clean up) —
and continues it with ``--resume``, twice in a row where a case has two stops. The resumed run must
end with the uninterrupted run's ``metrics.jsonl`` (timings aside) and the same final global state
and personal models, bit for bit: every random stream is seeded from (seed, partition, round), each
node rolls back to the checkpoint's round and a fresh process repeats the round exactly.

The uninterrupted run is done once per family in this process (``pollen.testing``: the same
ServerApp and ClientApp); a launched run writes the same numbers (measured).

``fedprox`` stands for the weight family: FedAvg is the same strategy and client with mu = 0. The
logit family's baselines (FedMD, FedDF) share FCCL's client and round; the fast test below covers
the one random stream of that round the state does not carry.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pollen.app.checkpoints import list_checkpoints, load_arrays, state_rounds
from pollen.app.config import parse_node_config, parse_run_config
from pollen.app.registry import METHODS
from tests.conftest import PROJECT_ROOT, RAY_CPUS, make_context, require_real_data
from tests.test_launch import HAS_PROC, TreeWatcher
from tests.test_run_regression import without_timings

TINY_FCCL = {"task": "digits-offline", "model": "cnn_mnist", "model-width": 0.125, "fccl-public": "photo_patches",
             "fccl-public-size": 40, "fccl-public-batch-size": 20, "fccl-train-sizes": "24,24,24,24",
             "fccl-solo-epochs": 1, "fccl-local-epochs": "1", "fccl-test-size": 20, "fccl-batch-size": 12}
TINY_SHOT = {"task": "mnist-shot", "shot-shots": 12, "shot-stdev": 1, "shot-test-per-class": 5}

# method -> (run config, SuperNodes, rounds, needs the MNIST files, stops in order)
CASES: dict[str, tuple[dict, int, int, bool, tuple[str, ...]]] = {
    "fedprox": ({"task": "uci-dirichlet", "fedprox-mu": 0.1}, 2, 6, False, ("sigint", "sigkill")),
    "fccl": (TINY_FCCL, 4, 6, True, ("sigkill", "sigint")),
    "fedproto": (TINY_SHOT, 2, 4, True, ("sigkill",)),
    "bd-fedproto": (TINY_SHOT, 2, 5, True, ("sigint",)),
}
# The rounds to stop at, increasing, drawn once and shown in the test id. Never the last round (a run
# whose last round is saved has nothing to resume), and two rounds before it where a SIGINT comes: the
# run goes on while the launcher tears down (measured: one more round of a tiny run).
DRAWS = random.Random(32)
STOPS = {m: tuple(zip(c[4], sorted(DRAWS.sample(range(2, c[2] - ("sigint" in c[4])), len(c[4]))), strict=True))
         for m, c in CASES.items()}
LAUNCH_TIMEOUT = 600


def _run_config(method: str, data_root: str | None) -> dict:
    extra, _, rounds, _, _ = CASES[method]
    rc = {"method": method, "seed": 5, "local-epochs": 1, "num-server-rounds": rounds, **extra}
    return {**rc, "data-root": data_root} if data_root else rc


def _toml(rc: dict) -> str:
    def value(v):
        return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)
    return " ".join(f"{k}={value(v)}" for k, v in rc.items())


def _metrics(run_dir: Path) -> list[dict]:
    return without_timings([json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x])


def _same_arrays(mine: Path, theirs: Path) -> bool:
    a, b = load_arrays(mine), load_arrays(theirs)
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of a family, once per family: (run folder, node state folder per partition)."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import app as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    done: dict[str, tuple[Path, list[Path]]] = {}

    def run(method: str, data_root: str | None) -> tuple[Path, list[Path]]:
        if method not in done:
            out = tmp_path_factory.mktemp(f"uninterrupted-{method}")
            rc, nodes = _run_config(method, data_root), CASES[method][1]
            states = [out / "nodes" / f"partition-{p}" for p in range(nodes)]
            grid = InProcessGrid({100 + p: clientapp_node(client_app, rc, p, nodes, state_dir=str(states[p]))
                                  for p in range(nodes)})
            server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                                      run_config={**rc, "out-dir": str(out / "runs")}))
            done[method] = out / "runs" / "7", states
        return done[method]

    return run


class Launch:
    """One ``pollen run`` in its own session, its output collected, every process it starts marked."""

    def __init__(self, args: list[str], watcher: TreeWatcher, ray_tmp: Path):
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "pollen.launch.cli", "run", "--ray-cpus", str(RAY_CPUS), *args,
                                      "--timeout",
                                      str(LAUNCH_TIMEOUT)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env=watcher.env(RAY_TMPDIR=str(ray_tmp)))
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)  # type: ignore[arg-type]
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait(self) -> int:
        code = self.proc.wait(timeout=LAUNCH_TIMEOUT + 120)
        self.reader.join(timeout=30)
        return code

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not ready():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.text[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {LAUNCH_TIMEOUT}s:\n{self.text[-4000:]}"
            time.sleep(0.1)

    def seconds(self) -> float:
        return time.monotonic() - self.started


def _run_dirs(out: Path) -> list[Path]:
    return [p for p in out.glob("*") if p.is_dir() and not p.is_symlink()]  # not 'latest'


def _node_states(out: Path) -> dict[tuple[int, int], int]:
    """Every saved node state, (partition, round) -> its folder's inode: a state written again is a new one."""
    found = {}
    for folder in [f for run in _run_dirs(out) for f in run.glob("nodes/partition-*/round-*")]:
        try:
            found[(int(folder.parent.name.rsplit("-", 1)[1]), int(folder.name.split("-")[1]))] = folder.stat().st_ino
        except (OSError, ValueError):  # replaced or a temporary folder
            continue
    return found


def _kill_tree(watcher: TreeWatcher) -> None:
    """SIGKILL every process of the launch at once: first stop them all (none can react or fork), then kill."""
    needle = f"POLLEN_TEST_MARK={watcher.token}".encode()
    for _ in range(3):
        watcher.scan(needle)
        for pid in watcher.alive():
            os.kill(pid, signal.SIGSTOP)
    watcher.scan(needle)
    watcher.kill(watcher.alive())
    deadline = time.monotonic() + 30
    while watcher.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not watcher.alive(), watcher.describe(watcher.alive())


def stop_launch(args: list[str], watcher: TreeWatcher, ray_tmp, out: Path, kind: str, stop_round: int) -> Launch:
    """Launch, wait until a node has saved its round-``stop_round`` state in this launch, then stop the run
    as ``kind`` says: SIGINT to the launcher's process group (what Ctrl-C does) or SIGKILL of the whole
    tree (a private ``FLWR_HOME`` is then left behind, and removed here)."""
    before = _node_states(out)
    launch = Launch(args, watcher, ray_tmp)

    def trained() -> bool:
        return any(stop_round == r and before.get((p, r)) != ino for (p, r), ino in _node_states(out).items())

    launch.wait_for(trained, f"a node state of round {stop_round}")
    if kind == "sigint":
        os.killpg(launch.proc.pid, signal.SIGINT)
        assert launch.wait() == 128 + signal.SIGINT, launch.text[-4000:]
    else:
        _kill_tree(watcher)
        assert launch.wait() == -signal.SIGKILL, launch.text[-4000:]
        home = re.search(r"^\[pollen\] FLWR_HOME (\S+) \(private", launch.text, flags=re.M)
        if home:  # nobody was left to remove it
            shutil.rmtree(home.group(1), ignore_errors=True)
    return launch


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
@pytest.mark.parametrize("method", list(CASES), ids=[f"{m}-" + "-".join(f"{k}@round{r}" for k, r in STOPS[m])
                                                     for m in CASES])
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(method, uninterrupted, tmp_path):
    data_root = None
    if CASES[method][3]:
        data_root = require_real_data()
    rc = _run_config(method, data_root)
    out = tmp_path / "runs"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))  # Ray's socket paths must stay short
    args = ["--num-supernodes", str(CASES[method][1]), "--out-dir", str(out), "--run-config", _toml(rc)]
    run_dir: Path | None = None
    log = []
    try:
        with TreeWatcher() as watcher:
            for kind, drawn in STOPS[method]:
                resumes_after = list_checkpoints(run_dir)[-1] if run_dir else 0
                stop_round = max(drawn, resumes_after + 1)  # a SIGINT before may have run past the draw
                launch = stop_launch(args, watcher, ray_tmp, out, kind, stop_round)
                run_dir = run_dir or _run_dirs(out)[0]
                if kind == "sigint":
                    summary = json.loads((run_dir / "summary.json").read_text())
                    assert summary["status"] == "interrupted", summary
                nodes = {p: state_rounds(run_dir / "nodes" / f"partition-{p}")[-1:]
                         for p in range(CASES[method][1])}
                moved = "" if stop_round == drawn else f" (drawn {drawn}, run went on to checkpoint {resumes_after})"
                log.append(f"{kind} once a node had trained round {stop_round}{moved} ({launch.seconds():.0f}s): "
                           f"checkpoints {list_checkpoints(run_dir)}, newest node states {nodes}")
                args = ["--resume", str(run_dir)]
            launch = Launch(args, watcher, ray_tmp)
            assert launch.wait() == 0, launch.text[-4000:]
            log.append(f"resumed to the end ({launch.seconds():.0f}s)")
            watcher.kill(watcher.alive())
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"{method}: " + "; ".join(log))
    assert run_dir is not None
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    reference, reference_nodes = uninterrupted(method, data_root)
    assert _metrics(run_dir) == _metrics(reference)
    assert _same_arrays(run_dir / "final" / "global.safetensors", reference / "final" / "global.safetensors")
    for p, theirs in enumerate(reference_nodes):
        if (theirs / "final-model.safetensors").exists():
            assert _same_arrays(run_dir / "nodes" / f"partition-{p}" / "final-model.safetensors",
                                theirs / "final-model.safetensors"), f"partition {p}'s personal model"


# -- the logit round draws every random number from (seed, partition, round) ------------------------------
@pytest.mark.parametrize("method", ["fccl", "fedmd", "feddf"])
def test_the_collaborative_step_is_the_same_whatever_the_process_ran_before(method):
    """Dropout in the collaborative step (cnn_mnist here, EfficientNet-B0 in the Digits preset) must not
    draw from whatever the global RNG holds: under Ray that is another node's last round, and in a resumed
    run a fresh process. Two nodes with the same state, one after other random draws, reply the same."""
    torch.set_num_threads(1)
    rc = {**TINY_FCCL, "method": method, "data-root": require_real_data(), "seed": 5}
    cfg = parse_run_config(rc)
    replies = []
    for noise in (0, 1):
        ctx = make_context(rc, partition_id=2, num_partitions=4)
        client = METHODS[method].make_client(cfg, parse_node_config(ctx.node_config), ctx)
        logits, _, _ = client.fit([], {"server-round": 1})
        consensus = [np.asarray(logits[0]) + 1.0, np.array([4], dtype=np.int64)]
        torch.manual_seed(1000 + noise)
        torch.rand(17 * (noise + 1))  # what another node's round would leave behind
        client = METHODS[method].make_client(cfg, parse_node_config(ctx.node_config), ctx)
        replies.append(client.fit(consensus, {"server-round": 2, "contributed": True}))
    (first, _, m1), (second, _, m2) = replies
    assert m1["collab-loss"] == m2["collab-loss"] and np.array_equal(first[0], second[0])
