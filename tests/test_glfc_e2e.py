"""End to end: GLFC through `flwr run` (simulation, Message API): nodes identified by one query each,
2 tasks, clients joining at task 2, the proxy running, and one client sending NaN gradients that the
server rejects (by key) while the run completes."""

import json

import pytest

from pollen.launch import simulate
from tests.conftest import PROJECT_ROOT, RAY_CPUS
from tests.faults import faulty_app_dir

pytestmark = pytest.mark.e2e


def test_glfc_simulation_two_tasks_with_joining_clients_and_a_bad_gradient(tmp_path):
    out = tmp_path / "runs"
    # 3 clients at task 0, +2 at task 1 -> 5 SuperNodes; partition 1 corrupts its LeNet gradients.
    # The embedded UCI digits stream (10 classes) needs no data files, so this runs everywhere.
    run_config = (f"method='glfc' task='uci-digits-cil' out-dir='{out}' "
                  "num-server-rounds=4 glfc-tasks=2 glfc-rounds-per-task=2 glfc-initial-clients=3 "
                  "glfc-new-clients=2 glfc-clients-per-round=3 glfc-max-per-class=20 glfc-memory-size=20 "
                  "glfc-oracle-boundary=true glfc-proxy-iterations=3 glfc-proxy-keep=2 glfc-perturb-steps=2 "
                  "glfc-eval-per-class=20 model-width=0.125 local-epochs=1 lr=0.5 "
                  "momentum=0.0")
    app_dir = faulty_app_dir(tmp_path, PROJECT_ROOT, partition=1, kind="proto-grads-nan")  # tests/faults.py
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=app_dir, flwr_home=tmp_path / "flwr", num_supernodes=5,
                       run_config=run_config, timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    rounds = [json.loads(x) for x in (out / str(outcome.run_id) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    # Only the 3 initial clients exist at task 0; partitions 3 and 4 join at task 1.
    for r in rounds[:2]:
        assert {int(k.split()[-1]) for k in r["fit-clients"]} <= {0, 1, 2}
    assert [r["server-evaluate"]["seen-classes"] for r in rounds] == [5, 5, 10, 10]
    assert "task1-accuracy" in rounds[2]["server-evaluate"]
    # The proxy received and inverted gradients; partition 1's NaN gradients were rejected with a reason.
    assert sum(r["fit"].get("proxy-gradients", 0) for r in rounds) > 0
    rejected = [rej for r in rounds for rej in r["rejected"]]
    assert rejected and all(rej["client"] == "partition 1" and rej["stage"] == "train" for rej in rejected)
    assert any("NaN" in rej["reason"] and "'proto-grads': 'g" in rej["reason"] for rej in rejected)
    # every node answered its query: no failures anywhere, 3 trained per round, task 1 evaluated with AIA
    assert all(r["failures"] == 0 and r["sampled"] == 3 for r in rounds)
    assert "aia" in rounds[3]["server-evaluate"] and "forgetting" in rounds[3]["server-evaluate"]
    summary = json.loads((out / str(outcome.run_id) / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["rejected-total"] == len(rejected)
    assert (out / str(outcome.run_id) / "final" / "global.safetensors").is_file()  # the final global model
