"""End to end: `flwr run` simulations of FCCL and FedMD with 4 heterogeneous tiny clients, 2 rounds.

The FCCL run gets one malformed reply per round (the test-only ClientApp of ``tests/faults.py`` makes
partition 1 send N0×(C−1) logits): the strategy must drop it with a logged reason and the run must complete.
"""

import json

import pytest

from pollen.launch import simulate
from tests.conftest import PROJECT_ROOT, RAY_CPUS
from tests.faults import faulty_app_dir

pytestmark = pytest.mark.e2e

N0 = 40
TINY = (f"task='digits-offline' num-server-rounds=2 model-width=0.125 fccl-public='photo_patches' "
        f"fccl-public-size={N0} fccl-public-batch-size=20 fccl-train-sizes='24,24,24,24' fccl-solo-epochs=1 "
        "fccl-local-epochs='1' fccl-test-size=20 fccl-batch-size=12")


def _run(tmp_path, data_root, extra, *, faulty: int | None = None):
    out = tmp_path / "runs"
    app_dir = PROJECT_ROOT if faulty is None else faulty_app_dir(tmp_path, PROJECT_ROOT, partition=faulty,
                                                                 kind="logits-shape")
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=app_dir, flwr_home=tmp_path / "flwr", num_supernodes=4,
                       run_config=f"{TINY} data-root='{data_root}' out-dir='{out}' {extra}", timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    run_dir = out / str(outcome.run_id)
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rounds, json.loads((run_dir / "summary.json").read_text())


def _check_evaluation(rounds):
    for rec in rounds:
        clients = rec["evaluate-clients"]
        # one client per domain (partition i serves domain i: mnist, uci, mnistm, syn)
        assert sorted(clients) == [f"partition {i}" for i in range(4)]
        for c in clients.values():
            assert 0.0 <= c["inter-accuracy"] <= 1.0 and 0.0 <= c["intra-accuracy"] <= 1.0
        assert "inter-accuracy" in rec["evaluate"] and "intra-accuracy" in rec["evaluate"]


def test_fccl_heterogeneous_run_drops_a_malformed_reply(tmp_path, data_root):
    rounds, summary = _run(tmp_path, data_root, "method='fccl'", faulty=1)
    assert [r["round"] for r in rounds] == [1, 2]
    for rec in rounds:
        assert len(rec["fit-clients"]) == 3 and rec["fit"]["accepted"] == 3 and rec["fit"]["rejected"] == 1
        assert "partition 1" not in rec["fit-clients"]  # fit-clients lists accepted replies only
        assert [r["client"] for r in rec["rejected"]] == ["partition 1"]
        assert f"'logits': shape {N0}x9 != expected {N0}x10" in rec["rejected"][0]["reason"]
    assert rounds[0]["bytes-down"] == 0  # round 1: no consensus yet
    assert rounds[1]["bytes-down"] >= 4 * N0 * 10 * 4  # the N0×C consensus to each of 4 clients
    assert all("solo-inter-accuracy" in c for c in rounds[0]["fit-clients"].values())
    assert all("collab-loss" in c and "train-kl-intra" in c for c in rounds[1]["fit-clients"].values())
    _check_evaluation(rounds)
    assert summary["rejected-total"] == 2 and summary["rounds"] == 2


def test_fedmd_heterogeneous_run(tmp_path, data_root):
    rounds, summary = _run(tmp_path, data_root, "method='fedmd' fccl-target='leave-one-out'")
    assert summary["rejected-total"] == 0 and summary["rounds"] == 2
    assert all(r["fit"]["accepted"] == 4 for r in rounds)
    assert all("collab-loss" in c and "train-kl-intra" not in c for c in rounds[1]["fit-clients"].values())
    _check_evaluation(rounds)
