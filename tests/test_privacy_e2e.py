"""End to end through the launcher (``flwr run``, simulation): every family under dp-mode = payload and
FedAvg and FedProto under dp-mode = sample complete, every client's ε per round in metrics.jsonl is the
one dp-accounting computes for the releases it made, and summary.json carries the final ε. One sample
run also caps ε so that one client stops releasing and says so while the run goes on without it.
(The mechanisms themselves are checked in process: tests/test_privacy*.py.)"""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from pollen.datasets.spec import TaskOptions
from pollen.launch import simulate
from tests.conftest import PROJECT_ROOT, RAY_CPUS

pytestmark = pytest.mark.e2e

DELTA = 1e-5
UCI = {"task": "uci-dirichlet", "max-train-samples": 40, "batch-size": 8, "num-server-rounds": 2,
       "fraction-evaluate": 0.0}


def _private_run(tmp_path, run_config: dict, supernodes: int) -> tuple[list[dict], dict]:
    out = tmp_path / "runs"
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=PROJECT_ROOT, flwr_home=tmp_path / "flwr", num_supernodes=supernodes,
                       run_config={**run_config, "out-dir": str(out)}, timeout=600, echo=False)
    assert outcome.completed, outcome.log[-4000:]
    run_dir = out / str(outcome.run_id)
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    return rounds, summary


ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def _epsilon(events: list[dp_accounting.DpEvent], relation: dp_accounting.NeighboringRelation = ADD_REMOVE) -> float:
    """dp-accounting's PLD accountant over ``events`` under ``relation``, independently of Pollen's ledger."""
    accountant = pld_privacy_accountant.PLDAccountant(relation)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


# what each run's ε protects: (dp-unit, dp-neighbour), as metrics.jsonl and summary.json name it
CLIENT = ("client", "replace-one")
RECORD = ("record", "add-remove")
ROW = ("row-given-model", "add-remove")


def _check_ledgers(rounds: list[dict], summary: dict, round_events, terms: tuple[str, str]) -> dict[str, int]:
    """Every accepted client's dp-epsilon/dp-delta in every round against dp-accounting, given
    ``round_events(client)`` (what one round releases) and ``terms`` (unit, neighbour): a client's dataset
    under replace-one, with the add/remove ε beside it; summary.json's final ε is the last round's, the
    headline only for a record or client unit. No reply may be rejected (the count of releases would be
    off). Returns releases per client."""
    unit, neighbour = terms
    relation = dp_accounting.NeighboringRelation
    releases: dict[str, int] = {}
    for r in rounds:
        assert not r["rejected"], r["rejected"]
        assert r["fit-clients"], f"round {r['round']} trained nobody"
        assert (r["dp-unit"], r["dp-neighbour"]) == terms
        for name, metrics in r["fit-clients"].items():
            releases[name] = releases.get(name, 0) + 1
            events = round_events(name) * releases[name]
            expected = _epsilon(events, relation.REPLACE_ONE if neighbour == "replace-one" else
                                relation.ADD_OR_REMOVE_ONE)
            assert metrics["dp-epsilon"] == pytest.approx(expected, rel=2e-3), (r["round"], name)
            if neighbour == "replace-one":  # the add/remove figure beside it, named
                assert metrics["dp-epsilon-add-remove"] == pytest.approx(_epsilon(events), rel=2e-3)
            else:
                assert "dp-epsilon-add-remove" not in metrics
            assert metrics["dp-delta"] == DELTA
            assert not [k for k in metrics if "loss" in k or k.startswith("solo-")]  # nothing data-derived
        last = list(r["fit-clients"].values())
        assert r["fit"]["dp-epsilon-client-mean"] == pytest.approx(sum(m["dp-epsilon"] for m in last) / len(last))
    assert summary["final"]["fit"]["dp-epsilon-client-mean"] == rounds[-1]["fit"]["dp-epsilon-client-mean"]
    privacy = summary["privacy"]
    assert (privacy["dp-unit"], privacy["dp-neighbour"]) == terms
    worst = max(m["dp-epsilon"] for r in rounds for m in r["fit-clients"].values())
    if unit == "row-given-model":  # no headline: the figure is named for what it protects
        assert privacy["dp-epsilon-max"] is None and privacy["dp-epsilon-row-given-model-max"] == worst
    else:
        assert privacy["dp-epsilon-max"] == worst
    return releases


def _payload(sigma: float):
    return lambda _name: [dp_accounting.GaussianDpEvent(sigma)]


# -- dp-mode = payload, one run per family ---------------------------------------------------------------
def test_fedproto_payload_run_completes_and_records_epsilon(tmp_path):
    rounds, summary = _private_run(tmp_path, {**UCI, "method": "fedproto", "dp-mode": "payload",
                                              "dp-noise-multiplier": 2.0, "dp-clip": 1.0}, 3)
    assert _check_ledgers(rounds, summary, _payload(2.0), ROW) == {f"partition {p}": 2 for p in range(3)}


def test_fedavg_payload_run_releases_noisy_updates_and_records_epsilon(tmp_path):
    rounds, summary = _private_run(tmp_path, {**UCI, "method": "fedavg", "avg-weighting": "uniform",
                                              "dp-mode": "payload", "dp-noise-multiplier": 1.0, "dp-clip": 0.05}, 2)
    assert _check_ledgers(rounds, summary, _payload(1.0), CLIENT) == {"partition 0": 2, "partition 1": 2}


def test_fedmd_payload_run_releases_noisy_logits_and_records_epsilon(tmp_path, data_root):
    from tests.test_privacy_clients import TINY_FCCL

    rc = {**TINY_FCCL, "method": "fedmd", "data-root": data_root, "num-server-rounds": 2, "fraction-evaluate": 0.0,
          "dp-mode": "payload", "dp-noise-multiplier": 1.5, "dp-clip": 0.1}
    rounds, summary = _private_run(tmp_path, rc, 4)
    assert _check_ledgers(rounds, summary, _payload(1.5), CLIENT) == {f"partition {p}": 2 for p in range(4)}


def test_glfc_payload_run_releases_noisy_models_and_gradients_and_records_epsilon(tmp_path):
    rc = {"method": "glfc", "task": "uci-digits-cil", "num-server-rounds": 2, "glfc-tasks": 1,
          "glfc-rounds-per-task": 2, "glfc-initial-clients": 2, "glfc-new-clients": 0, "glfc-clients-per-round": 2,
          "glfc-max-per-class": 12, "glfc-memory-size": 8, "glfc-oracle-boundary": True, "glfc-perturb-steps": 2,
          "glfc-proxy-iterations": 2, "glfc-proxy-keep": 1, "glfc-eval-per-class": 10, "model-width": 0.125,
          "local-epochs": 1, "lr": 0.1, "momentum": 0.0, "fraction-evaluate": 0.0,
          "dp-mode": "payload", "dp-noise-multiplier": 1.0, "dp-clip": 0.05}
    rounds, summary = _private_run(tmp_path, rc, 2)
    assert _check_ledgers(rounds, summary, _payload(1.0), CLIENT) == {"partition 0": 2, "partition 1": 2}
    # the noisy gradient sets reached the proxy and passed the DP bound
    assert sum(r["fit"].get("proxy-gradients", 0) for r in rounds) > 0


# -- dp-mode = sample: DP-SGD ---------------------------------------------------------------------------
def _partition_sizes(rc: dict, supernodes: int) -> dict[str, int]:
    """Training records per partition, read from the task independently of the clients."""
    from pollen.app.config import parse_run_config
    from pollen.datasets.tasks import build_client_data

    cfg = parse_run_config(rc)
    return {f"partition {p}": len(build_client_data(cfg.task, TaskOptions.of(cfg), p, supernodes).y_train)
            for p in range(supernodes)}


def _dp_sgd(sigma: float, batch: int, epochs: int, sizes: dict[str, int], prototypes: bool):
    """One round of a client: ⌈n / batch⌉·epochs Poisson-sampled Gaussian steps at q = batch / n (and
    the prototype release)."""
    def events(name: str) -> list[dp_accounting.DpEvent]:
        n = sizes[name]
        step = dp_accounting.PoissonSampledDpEvent(min(1.0, batch / n), dp_accounting.GaussianDpEvent(sigma))
        return [dp_accounting.SelfComposedDpEvent(step, epochs * math.ceil(n / batch))] + (
            [dp_accounting.GaussianDpEvent(sigma)] if prototypes else [])
    return events


def test_fedavg_sample_run_trains_with_dp_sgd_and_records_epsilon(tmp_path):
    rc = {**UCI, "method": "fedavg", "avg-weighting": "uniform", "dp-mode": "sample", "dp-noise-multiplier": 1.2,
          "dp-clip": 1.0}
    rounds, summary = _private_run(tmp_path, rc, 2)
    sizes = _partition_sizes(rc, 2)
    assert _check_ledgers(rounds, summary, _dp_sgd(1.2, 8, 1, sizes, False), RECORD) == {n: 2 for n in sizes}


def test_fedproto_sample_run_composes_dp_sgd_and_prototypes_and_a_capped_client_stops(tmp_path):
    """Partitions of different sizes spend different ε (q = batch / n): dp-max-epsilon between the
    smallest partition's second-round ε and the others' stops that one client before its second round,
    with a reason; the round and the run go on without it."""
    rc = {"task": "uci-dirichlet", "dirichlet-alpha": 0.1, "batch-size": 64, "num-server-rounds": 2,
          "fraction-evaluate": 0.0, "method": "fedproto", "dp-mode": "sample", "dp-noise-multiplier": 1.5,
          "dp-clip": 1.0}
    sizes = _partition_sizes(rc, 3)
    events = _dp_sgd(1.5, 64, 1, sizes, True)
    second = {name: _epsilon(events(name) * 2) for name in sizes}
    smallest = min(sizes, key=sizes.get)
    others = max(e for name, e in second.items() if name != smallest)
    assert second[smallest] > 1.05 * others, (sizes, second)  # the premise: the smallest spends the most
    rc["dp-max-epsilon"] = (second[smallest] + others) / 2
    rounds, summary = _private_run(tmp_path, rc, 3)
    assert _check_ledgers(rounds, summary, events, RECORD) == {n: (1 if n == smallest else 2) for n in sizes}
    assert rounds[0]["failures"] == 0 and rounds[1]["failures"] == 1
    (stopped,) = rounds[1]["failure-reasons"]
    assert stopped["client"] == smallest and f"{smallest} stops releasing" in stopped["reason"]
    assert "dp-max-epsilon" in stopped["reason"]
    assert all(r["fit"]["classes-present"] >= 1 for r in rounds)  # the server still built prototypes
