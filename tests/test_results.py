import json

import pytest

from pollen.app.results import RunRecorder


def test_recorder_writes_round_lines_summary_and_plot(tmp_path, capsys):
    rec = RunRecorder(tmp_path / "run", {"method": "fedavg", "task": "uci-dirichlet"}, num_rounds=2)
    for rnd, acc in ((1, 0.5), (2, 0.75)):
        r = rec.round(rnd)
        r["bytes-down"] += 2048
        r["bytes-up"] += 1024
        r["fit"] = {"train-loss": 1.0 / rnd}
        r["evaluate"] = {"accuracy": acc, "accuracy-client-mean": acc, "accuracy-client-std": 0.1}
        r["evaluate-clients"] = {"partition 0": {"accuracy": acc}}
        if rnd == 2:
            r["rejected"].append({"round": 2, "client": "partition 1", "reason": "NaN"})
        rec.end_round(rnd)
    summary = rec.finish()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    assert lines[1]["rejected"][0]["reason"] == "NaN" and lines[0]["bytes-down"] == 2048
    assert all(x["wall-time-s"] >= 0 for x in lines)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["final-accuracy"] == {"metric": "accuracy", "mean": 0.75, "std": 0.1}
    assert saved["bytes-up-total"] == 2048 and saved["rejected-total"] == 1
    assert json.loads((tmp_path / "run" / "config.json").read_text())["method"] == "fedavg"
    png = (tmp_path / "run" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    out = capsys.readouterr().out
    assert "round 2/2" in out and "accuracy 0.7500 ± 0.1000" in out and "rejected 1" in out


def test_round_report_keeps_failure_reasons_and_failed_status(tmp_path):
    from pollen.strategies.base import RoundReport

    rec = RunRecorder(tmp_path / "run", {"method": "local"}, num_rounds=1, echo=False)
    report = RoundReport(1, sampled=2)
    report.failures.append({"stage": "train", "client": "node 7", "code": 2,
                            "reason": "ConfigError: node config is missing 'partition-id'"})
    rec.record_report(report)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert line["failures"] == 1 and line["sampled"] == 2
    assert line["failure-reasons"] == [{"stage": "train", "client": "node 7", "code": 2,
                                        "reason": "ConfigError: node config is missing 'partition-id'"}]
    summary = rec.finish(status="failed", reason="round 1 trained nobody")
    assert summary["status"] == "failed" and summary["failure-reason"] == "round 1 trained nobody"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_round_lines_say_elapsed_time_and_eta(tmp_path, monkeypatch, capsys):
    import pollen.app.results as results

    clock = [100.0]
    monkeypatch.setattr(results.time, "perf_counter", lambda: clock[0])
    rec = RunRecorder(tmp_path / "run", {"method": "fedavg", "task": "uci-dirichlet"}, num_rounds=5,
                      resume_after=1)  # a resumed run: its ETA counts only the rounds this process ran
    for rnd in (2, 3):
        rec.round(rnd)
        clock[0] += 30.0
        rec.end_round(rnd)
    out = capsys.readouterr().out
    assert "round 2/5 |" in out and "| elapsed 30s, ETA 1m30s" in out
    assert "round 3/5 |" in out and "| elapsed 1m00s, ETA 1m00s" in out


def test_a_dropped_metric_is_kept_in_the_round_line_and_absent_when_none(tmp_path, capsys):
    """The strategy drops a bad reported metric alone (its reply counts); the run folder says which."""
    from pollen.strategies.base import RoundReport

    rec = RunRecorder(tmp_path / "run", {"method": "fedavg"}, num_rounds=2)
    clean, bad = RoundReport(1, sampled=2), RoundReport(2, sampled=2)
    bad.dropped_metrics.append({"stage": "train", "client": "partition 1", "key": "train-accuracy",
                                "value": 87.5, "reason": "metric 'train-accuracy' = 87.5 is above 1"})
    bad.dropped_metrics.append({"stage": "evaluate", "client": "partition 0", "key": "loss",
                                "value": float("nan"), "reason": "not finite"})
    for report in (clean, bad):
        rec.record_report(report)
    first, second = (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert "dropped-metrics" not in first  # a clean round's line is what it always was
    assert [(d["key"], d["value"]) for d in second["dropped-metrics"]] == [("train-accuracy", "87.5"),
                                                                          ("loss", "nan")]
    assert "dropped metrics 2" in capsys.readouterr().out


def test_the_summary_quotes_the_worst_clients_epsilon_not_the_mean(tmp_path):
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=2, echo=False)
    spent = {1: {"partition 0": 1.5, "partition 1": 2.5}, 2: {"partition 0": 3.0}}  # partition 1 stopped
    for rnd, by_client in spent.items():
        r = rec.round(rnd)
        r["fit-clients"] = {c: {"dp-epsilon": e, "dp-delta": 1e-5} for c, e in by_client.items()}
        r["fit"] = {"dp-epsilon": sum(by_client.values()) / len(by_client)}
        rec.end_round(rnd)
    summary = rec.finish()
    assert summary["privacy"] == {"dp-epsilon-max": 3.0, "dp-delta": 1e-5,
                                  "dp-epsilon-per-client": {"partition 0": 3.0, "partition 1": 2.5}}
    assert "privacy" not in RunRecorder(tmp_path / "off", {"method": "fedavg"}, num_rounds=1, echo=False).finish()


def test_a_client_that_stopped_releasing_is_counted_at_the_epsilon_its_ledger_holds(tmp_path):
    """A capped client's reply is an error (no metrics); its reason carries its ledger's exact ε, which the
    summary counts even when the server never learnt which partition the node serves (a resumed run
    whose node stopped before its first reply)."""
    from pollen.privacy import Budget, BudgetExhausted, LedgerFile, Release

    file = LedgerFile.in_folder(tmp_path / "node")
    budget = Budget(file, 1e-5, 0.0, who="partition 1")
    budget.spend(Release(1.0), Release(1.0))
    with pytest.raises(BudgetExhausted) as stop:
        Budget(file, 1e-5, budget.ledger.epsilon(), who="partition 1").check(Release(1.0))
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=1, echo=False)
    r = rec.round(1)
    r["fit-clients"] = {"partition 0": {"dp-epsilon": 0.5, "dp-delta": 1e-5}}
    r["failures"] = 1
    r["failure-reasons"] = [{"stage": "train", "client": "node 17", "code": 2,
                             "reason": f"BudgetExhausted: {stop.value}"}]
    rec.end_round(1)
    assert rec.finish()["privacy"]["dp-epsilon-per-client"] == {"partition 0": 0.5,
                                                                "partition 1": budget.ledger.epsilon()}


@pytest.mark.parametrize("unit", ["client", "row-given-model"])
def test_every_epsilon_names_its_unit_and_neighbour_and_only_a_record_or_client_one_is_the_headline(tmp_path, unit):
    neighbour = "replace-one" if unit == "client" else "add-remove"
    terms = {"dp-unit": unit, "dp-neighbour": neighbour}
    rec = RunRecorder(tmp_path / "run", {"method": "fedproto"}, num_rounds=1, echo=False, dp_terms=terms)
    r = rec.round(1)
    beside = {"dp-epsilon-add-remove": 1.0} if unit == "client" else {}
    r["fit-clients"] = {"partition 0": {"dp-epsilon": 2.5, "dp-delta": 1e-5, **beside}}
    rec.end_round(1)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert (line["dp-unit"], line["dp-neighbour"]) == (unit, neighbour)
    privacy = rec.finish()["privacy"]
    assert (privacy["dp-unit"], privacy["dp-neighbour"]) == (unit, neighbour)
    if unit == "client":
        assert privacy["dp-epsilon-max"] == 2.5 and privacy["dp-epsilon-add-remove-max"] == 1.0
    else:  # one embedding row given a model trained without DP: never the run's ε
        assert privacy["dp-epsilon-max"] is None and "dp-epsilon-per-client" not in privacy
        assert privacy["dp-epsilon-row-given-model-max"] == 2.5 and "no guarantee" in privacy["no-headline"]
