"""End to end: `flwr run` simulations of FedProto and BD-FedProto, each with one misbehaving client.

FedProto's N-way K-shot MNIST task when ``POLLEN_DATA_ROOT`` points at MNIST; otherwise the embedded
UCI digits (every client then holds every class, so CPA has no negatives, but the protocol is the same).
One client's train replies are damaged on the wire by the test-only ClientApp of ``tests/faults.py``.
"""

import json

import pytest

from pollen.launch import simulate
from tests.conftest import PROJECT_ROOT, RAY_CPUS, real_data_root
from tests.faults import faulty_app_dir

pytestmark = pytest.mark.e2e


def _task_keys() -> tuple[str, bool]:
    root = real_data_root()  # the one real-data rule (tests/conftest.py); without data: embedded UCI
    if root is not None:
        return (f"task='mnist-shot' data-root='{root}' shot-ways=3 shot-shots=30 shot-stdev=1 "
                "shot-test-per-class=5 local-epochs=2", True)
    return "task='uci-dirichlet' max-train-samples=40", False


def _run(tmp_path, method: str, extra: str, *, faulty: int, fault: str):
    out = tmp_path / "runs"
    task, shot = _task_keys()
    app_dir = faulty_app_dir(tmp_path, PROJECT_ROOT, partition=faulty, kind=fault)
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=app_dir, flwr_home=tmp_path / "flwr", num_supernodes=4,
                       run_config=f"method='{method}' {task} num-server-rounds=2 batch-size=8 lr=0.05 "
                                  f"out-dir='{out}' {extra}", timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    run_dir = out / str(outcome.run_id)
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return rounds, summary, shot


def test_fedproto_run_rejects_a_wrong_shaped_reply_and_completes(tmp_path):
    rounds, summary, shot = _run(tmp_path, "fedproto", "", faulty=1, fault="prototypes-shape")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert [(x["client"], "shape" in x["reason"]) for x in r["rejected"]] == [("partition 1", True)]
        assert r["fit"]["accepted"] == 3 and r["fit"]["rejected"] == 1
        clients = r["evaluate-clients"]
        assert sorted(clients) == [f"partition {i}" for i in range(4)]
        assert all("accuracy" in m and "proto-accuracy" in m for m in clients.values())
    assert rounds[0]["bytes-down"] > 0 and rounds[0]["bytes-up"] > 0
    assert summary["rejected-total"] == 2 and summary["failures-total"] == 0
    final = summary["final"]["evaluate"]
    # chance: 1/3 on each client's ~3 own classes (shot task), 1/10 on UCI; in-process runs of this
    # setting reach 0.84-0.94 (local) and 0.85-0.92 (prototypes) over seeds 0-2
    low = 0.65 if shot else 0.3
    assert low < final["accuracy-client-mean"] <= 1.0 and "proto-accuracy-client-std" in final
    if shot:
        assert final["proto-accuracy-client-mean"] > 0.6


def test_bd_fedproto_run_rejects_a_nan_reply_and_reports_da_and_mi(tmp_path):
    rounds, summary, shot = _run(tmp_path, "bd-fedproto",
                                 "proto-model-heter=true", faulty=2,
                                 fault="prototypes-nan")
    assert summary["rejected-total"] == 2
    assert all("NaN" in r["rejected"][0]["reason"] and r["rejected"][0]["client"] == "partition 2"
               for r in rounds)
    fit2 = rounds[1]["fit-clients"]
    # fit-clients holds the accepted replies only: partition 2's NaN reply is in "rejected"
    assert sorted(fit2) == ["partition 0", "partition 1", "partition 3"]
    assert all("mi" in m and "lambda" in m and "loss-proto" in m for m in fit2.values())
    if shot:  # clients hold few classes: the other classes' prototypes act as negatives
        assert all("loss-neg" in m for m in fit2.values())
    assert rounds[1]["fit"]["classes-present"] >= 2 and rounds[1]["fit"]["margin"] > 0
    assert "proto-accuracy-client-mean" in summary["final"]["evaluate"]
