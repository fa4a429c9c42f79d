"""Exact resume for the GLFC family, through the real launcher (the other families:
``tests/test_resume_families.py``, whose launch and stop helpers this file uses).

A tiny GLFC run (2 tasks × 2 rounds, 3 clients, the proxy inverting gradients, old models sent by
version) is stopped once a node has trained a round drawn from a seeded RNG (in the test id): first
Ctrl-C (SIGINT to the launcher's process group), then, in the resumed run, the whole process tree
SIGKILLed at once; it is resumed to the end with ``--resume``. It must end with the uninterrupted run's
``metrics.jsonl`` (timings aside; bytes sent included, so no old model is sent twice), final global
model and final server state (old-model slots, the proxy's monitor set and RNG, the accuracy rows),
bit for bit. The uninterrupted run is the real ServerApp and ClientApp in this process
(``pollen.testing``), so the launched run must also equal it.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from pollen.app.checkpoints import checkpoint_paths, list_checkpoints, read_json, state_rounds
from tests.test_launch import HAS_PROC, TreeWatcher
from tests.test_resume_families import Launch, _metrics, _run_dirs, _same_arrays, _toml, stop_launch

NODES, ROUNDS = 3, 4
RUN_CONFIG = {"method": "glfc", "task": "uci-digits-cil", "seed": 5, "num-server-rounds": ROUNDS, "glfc-tasks": 2,
              "glfc-rounds-per-task": 2, "glfc-initial-clients": 2, "glfc-new-clients": 1,
              "glfc-clients-per-round": 2, "glfc-old-fraction": 0.0, "model": "cnn_mnist", "glfc-max-per-class": 12,
              "glfc-memory-size": 8,
              "glfc-oracle-boundary": True, "glfc-perturb-steps": 2, "glfc-proxy-iterations": 2,
              "glfc-proxy-keep": 1, "glfc-eval-per-class": 10, "local-epochs": 1, "lr": 0.1, "momentum": 0.0}
DRAWS = random.Random(33)  # the rounds to stop at, increasing: drawn once, shown in the test id
STOPS = tuple(zip(("sigint", "sigkill"), sorted(DRAWS.sample(range(2, ROUNDS + 1), 2)), strict=True))


def _uninterrupted(out: Path) -> Path:
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import app as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    grid = InProcessGrid({100 + p: clientapp_node(client_app, RUN_CONFIG, p, NODES,
                                                  state_dir=str(out / "nodes" / f"partition-{p}"))
                          for p in range(NODES)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**RUN_CONFIG, "out-dir": str(out / "runs")}))
    return out / "runs" / "7"


def _final_state(run_dir: Path) -> tuple[Path, dict]:
    """The last checkpoint's arrays file and the strategy's values in it (old-model slots, proxy, rows)."""
    arrays, values = checkpoint_paths(run_dir, list_checkpoints(run_dir)[-1])
    return arrays, read_json(values)["strategy"]


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc")
@pytest.mark.parametrize("stops", [STOPS], ids=["-".join(f"{k}@round{r}" for k, r in STOPS)])
def test_an_interrupted_glfc_run_resumes_to_the_uninterrupted_result(stops, tmp_path):
    out = tmp_path / "runs"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rg", dir="/tmp"))  # Ray's socket paths must stay short
    args = ["--num-supernodes", str(NODES), "--out-dir", str(out), "--run-config", _toml(RUN_CONFIG)]
    run_dir: Path | None = None
    log = []
    try:
        with TreeWatcher() as watcher:
            for kind, stop_round in stops:
                launch = stop_launch(args, watcher, ray_tmp, out, kind, stop_round)
                run_dir = run_dir or _run_dirs(out)[0]
                if kind == "sigint":
                    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
                nodes = {p: state_rounds(run_dir / "nodes" / f"partition-{p}")[-1:] for p in range(NODES)}
                log.append(f"{kind} once a node had trained round {stop_round} ({launch.seconds():.0f}s): "
                           f"checkpoints {list_checkpoints(run_dir)}, newest node states {nodes}")
                args = ["--resume", str(run_dir)]
            launch = Launch(args, watcher, ray_tmp)
            assert launch.wait() == 0, launch.text[-4000:]
            log.append(f"resumed to the end ({launch.seconds():.0f}s)")
            watcher.kill(watcher.alive())
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print("glfc: " + "; ".join(log))
    assert run_dir is not None
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    reference = _uninterrupted(tmp_path / "uninterrupted")
    mine, theirs = _metrics(run_dir), _metrics(reference)
    assert [r["round"] for r in mine] == list(range(1, ROUNDS + 1))
    assert sum(r["fit"].get("proxy-gradients", 0) for r in theirs) > 0  # the proxy had gradients to invert
    assert any(r["fit"].get("distilled", 0) > 0 for r in theirs)  # clients distilled from old models
    assert mine == theirs
    assert _same_arrays(run_dir / "final" / "global.safetensors", reference / "final" / "global.safetensors")
    (mine_state, mine_values), (their_state, their_values) = _final_state(run_dir), _final_state(reference)
    assert mine_state.name == their_state.name and _same_arrays(mine_state, their_state)
    assert mine_values == their_values
