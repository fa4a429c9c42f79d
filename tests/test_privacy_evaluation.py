"""Evaluation under differential privacy is a decision, not a default: a private run whose clients
evaluate is refused before start, naming the choices (no client evaluation, noised and accounted
accuracies, or an explicit ``unprotected`` that the summary records); a noised evaluate reply carries
only noisy accuracies and is one more release in the ledger; GLFC's detect-only replies carry nothing
of the data under DP."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import Context, RecordDict

from pollen.app.client_app import app as client_app
from pollen.app.config import ConfigError, parse_run_config
from pollen.app.server_app import main as server_main
from pollen.privacy import Ledger, LedgerFile
from pollen.privacy.evaluation import release_evaluation
from pollen.testing import InProcessGrid, clientapp_node
from tests.conftest import pollen_command

UCI = {"task": "uci-dirichlet", "max-train-samples": 48, "batch-size": 8}
PAYLOAD = {"method": "fedproto", **UCI, "dp-mode": "payload", "dp-noise-multiplier": 2.0, "dp-clip": 1.0}
CHOICES = ("fraction-evaluate = 0", "dp-evaluate = 'noised'", "dp-evaluate = 'unprotected'")


@pytest.mark.parametrize("rc", [PAYLOAD, {**UCI, "method": "fedavg", "avg-weighting": "uniform", "dp-mode": "sample",
                                          "dp-noise-multiplier": 1.0, "model": "cnn_mnist"}])
def test_a_private_run_with_default_evaluation_is_refused_naming_the_choices(rc):
    with pytest.raises(ConfigError) as err:
        parse_run_config(rc)  # fraction-evaluate defaults to 1.0
    assert all(choice in str(err.value) for choice in CHOICES), err.value
    assert "outside the ε ledger" in str(err.value)
    for chosen in ({"fraction-evaluate": 0.0}, {"dp-evaluate": "noised"}, {"dp-evaluate": "unprotected"}):
        assert parse_run_config({**rc, **chosen}).dp_mode == rc["dp-mode"]


def test_dp_evaluate_is_refused_where_nothing_is_evaluated_on_clients():
    with pytest.raises(ConfigError, match="'dp-evaluate' = 'noised' has no effect: no client evaluates"):
        parse_run_config({**PAYLOAD, "fraction-evaluate": 0.0, "dp-evaluate": "noised"})
    glfc = {"method": "glfc", "task": "uci-digits-cil", "glfc-tasks": 2, "glfc-classes-per-task": 5,
            "num-server-rounds": 4, "dp-mode": "payload", "dp-noise-multiplier": 1.0}
    assert parse_run_config(glfc).fraction_evaluate == 1.0  # GLFC evaluates on the server: nothing to decide
    with pytest.raises(ConfigError, match="method 'glfc' evaluates on the server"):
        parse_run_config({**glfc, "dp-evaluate": "unprotected"})
    with pytest.raises(ConfigError, match="no effect with dp-mode = 'off'"):
        parse_run_config({**UCI, "method": "fedproto", "dp-evaluate": "unprotected"})


def test_pollen_run_refuses_a_private_run_with_default_evaluation_before_start(tmp_path):
    """As a user meets it: `pollen run` exits 2 with the choices; no run folder appears."""
    out = tmp_path / "runs"
    done = pollen_command("run", "--out-dir", str(out), "--run-config",
                          "method='fedproto' dp-mode='payload' dp-target-epsilon=8.0")
    assert done.returncode == 2, done.stderr[-2000:]
    assert all(choice in done.stderr for choice in CHOICES), done.stderr[-2000:]
    assert not out.exists()


# -- the mechanism --------------------------------------------------------------------------------------------
def test_a_client_level_evaluation_noises_each_accuracy_by_its_range():
    """Unit client: k accuracies in [0, 1] move by at most √k: noise std σ·√k on each (before the clip
    back to [0, 1]), num-examples 1; nothing but the accuracies leaves."""
    metrics = {"intra-accuracy": 0.5, "inter-accuracy": 0.5, "loss": 3.0, "acc-mnist": 0.9, "partition-id": 1}
    draws = [release_evaluation(metrics, 200, "client", 0.05, np.random.default_rng(s)) for s in range(2000)]
    assert {tuple(sorted(m)) for m, _ in draws} == {("inter-accuracy", "intra-accuracy")}
    assert {n for _, n in draws} == {1}
    values = np.array([m["intra-accuracy"] for m, _ in draws])
    assert values.std() == pytest.approx(0.05 * np.sqrt(2), rel=0.05) and values.mean() == pytest.approx(0.5, abs=0.01)


def test_a_record_level_evaluation_noises_the_correct_counts_and_the_count():
    """Unit record (or row given the model): the k correct counts and n each move by at most 1 when one
    test record is added or removed: noise σ·√(k + 1) on each; the reply reports the noisy share and the
    noisy n (rounded), never n."""
    n, sigma = 400, 3.0
    draws = [release_evaluation({"accuracy": 0.75}, n, "record", sigma, np.random.default_rng(s)) for s in range(4000)]
    counts = np.array([num for _, num in draws], dtype=np.float64)
    shares = np.array([m["accuracy"] for m, _ in draws])
    assert counts.std() == pytest.approx(sigma * np.sqrt(2), rel=0.05) and counts.mean() == pytest.approx(n, abs=0.3)
    # the share of two noisy counts: std ≈ σ·√2·√(1 + 0.75²) / n by the delta method
    assert shares.std() == pytest.approx(sigma * np.sqrt(2) * np.sqrt(1 + 0.75 ** 2) / n, rel=0.1)
    assert 0.0 <= shares.min() and shares.max() <= 1.0


# -- whole runs: ServerApp and real ClientApps in this process ---------------------------------------------------
def _run(rc: dict, tmp_path: Path, nodes: int = 3) -> tuple[list[dict], dict, list[Path]]:
    states = [tmp_path / f"p{p}" for p in range(nodes)]
    grid = InProcessGrid({100 + p: clientapp_node(client_app, rc, p, nodes, state_dir=str(states[p]))
                          for p in range(nodes)})
    server_main(grid, Context(run_id=5, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**rc, "out-dir": str(tmp_path / "runs")}))
    run_dir = tmp_path / "runs" / "5"
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rounds, json.loads((run_dir / "summary.json").read_text()), states


def test_noised_evaluation_is_a_release_in_the_ledger_and_carries_only_noisy_accuracies(tmp_path):
    """fedproto under payload, 2 rounds, every client evaluated: 2 releases a round (prototypes, then the
    evaluation) at the same σ, ε after each = dp-accounting's over the releases so far; an evaluate reply
    carries partition-id, the noisy accuracies and the ε metrics, no loss and no test-set size."""
    rc = {**PAYLOAD, "num-server-rounds": 2, "dp-evaluate": "noised"}
    rounds, summary, states = _run(rc, tmp_path)

    def independent(releases: int) -> float:
        accountant = pld_privacy_accountant.PLDAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(2.0), releases)
        return accountant.get_epsilon(1e-5)

    for r in rounds:
        assert r["dp-evaluate"] == "noised" and len(r["evaluate-clients"]) == 3
        for name, metrics in r["evaluate-clients"].items():
            assert set(metrics) <= {"partition-id", "num-examples", "accuracy", "proto-accuracy", "dp-epsilon",
                                    "dp-delta"}, metrics
            assert 0.0 <= metrics["accuracy"] <= 1.0
            assert metrics["dp-epsilon"] == pytest.approx(independent(2 * r["round"]), rel=1e-3)
            assert r["fit-clients"][name]["dp-epsilon"] == pytest.approx(independent(2 * r["round"] - 1), rel=1e-3)
    for state in states:
        assert Ledger(1e-5, LedgerFile.in_folder(state).releases()).count == 4
    assert summary["privacy"]["dp-evaluate"] == "noised"
    assert summary["privacy"]["dp-epsilon-row-given-model-max"] == pytest.approx(independent(4), rel=1e-3)


def test_a_target_epsilon_with_noised_evaluation_covers_both_releases_and_stays_within_it(tmp_path):
    rc = {**PAYLOAD, "dp-noise-multiplier": 0.0, "dp-target-epsilon": 3.0, "num-server-rounds": 2,
          "dp-evaluate": "noised"}
    _rounds, summary, _ = _run(rc, tmp_path)
    spent = summary["privacy"]["dp-epsilon-row-given-model-max"]
    assert 0.99 * 3.0 <= spent <= 3.0 * (1 + 1e-9)  # 4 releases planned, not 2: the cap never bites


def test_unprotected_evaluation_is_recorded_in_the_summary(tmp_path):
    rc = {**PAYLOAD, "num-server-rounds": 1, "dp-evaluate": "unprotected"}
    rounds, summary, _ = _run(rc, tmp_path)
    assert summary["privacy"]["dp-evaluate"] == "unprotected" and rounds[0]["dp-evaluate"] == "unprotected"
    assert all("loss" in m for m in rounds[0]["evaluate-clients"].values())  # as they are, outside ε
    rounds, summary, _ = _run({**PAYLOAD, "num-server-rounds": 1, "fraction-evaluate": 0.0}, tmp_path / "none")
    assert summary["privacy"]["dp-evaluate"] == "none" and not rounds[0]["evaluate-clients"]
