"""End to end through `flwr run`: a FedProto simulation under dp-mode = payload completes and records
every client's ε per round in metrics.jsonl (the in-process tests check the mechanisms themselves)."""

import json

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from pollen.app.launch import simulate
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.e2e


def test_fedproto_payload_run_completes_and_records_epsilon(tmp_path):
    out = tmp_path / "runs"
    outcome = simulate(app_dir=PROJECT_ROOT, flwr_home=tmp_path / "flwr", num_supernodes=3,
                       run_config=f"method='fedproto' task='uci-dirichlet' max-train-samples=40 num-server-rounds=2 "
                                  f"batch-size=8 dp-mode='payload' dp-noise-multiplier=2.0 dp-clip=1.0 "
                                  f"out-dir='{out}'", timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    run_dir = out / str(outcome.run_id)
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        accountant = pld_privacy_accountant.PLDAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(2.0), r["round"])
        clients = r["fit-clients"]
        assert sorted(clients) == ["partition 0", "partition 1", "partition 2"] and not r["rejected"]
        for metrics in clients.values():
            assert metrics["dp-epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
            assert metrics["dp-delta"] == 1e-5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final"]["fit"]["dp-epsilon-client-mean"] == pytest.approx(rounds[1]["fit"]["dp-epsilon"])
