"""The one rule that turns paired differences into a verdict on a paper's claim (``bench.kit.verdict``): every
study report and the README's tables come from it, so its boundaries (Δ = 0, s.e. = 0, exactly 2 s.e., too
few seeds) are pinned here. Also: the studies import it instead of carrying a copy, and every bench script
is a module of the ``bench`` package, not a path on ``sys.path``."""

from __future__ import annotations

import ast
import math

import pytest

from bench import kit
from bench.kit import (
    CONTRADICTED,
    NOT_SHOWN_FEW,
    NOT_SHOWN_SMALL,
    NOT_SHOWN_ZERO,
    SUPPORTED,
    fmt_mean_sd,
    fmt_mean_se,
    fmt_paired,
    mean_se,
    table,
    verdict,
)
from tests.conftest import PROJECT_ROOT

BENCH = PROJECT_ROOT / "bench"


def se(diffs):
    m = sum(diffs) / len(diffs)
    return math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))


def test_clear_gain_is_supported_and_clear_loss_contradicted():
    gains = [0.30, 0.35, 0.25, 0.32, 0.28]  # mean 0.30, s.e. 0.017
    assert verdict(gains) == SUPPORTED
    assert verdict([-d for d in gains]) == CONTRADICTED


def test_lower_is_better_flips_the_side():
    drops = [-0.30, -0.35, -0.25]
    assert verdict(drops, lower_is_better=True) == SUPPORTED
    assert verdict(drops) == CONTRADICTED
    assert verdict([-d for d in drops], lower_is_better=True) == CONTRADICTED


def test_the_boundary_is_two_standard_errors():
    base = [-1.0, 0.0, 1.0]  # mean 0, s.e. 1/sqrt(3)
    two_se = 2 * se(base)
    assert verdict([d + two_se * 1.01 for d in base]) == SUPPORTED
    assert verdict([d + two_se * 0.99 for d in base]) == NOT_SHOWN_SMALL
    assert verdict([d - two_se * 1.01 for d in base]) == CONTRADICTED
    assert verdict([d - two_se * 0.99 for d in base]) == NOT_SHOWN_SMALL


def test_exactly_two_standard_errors_counts_as_shown():
    """[3, 1]: mean 2, s.d. √2, s.e. √2/√2 = 1 — exactly 2 s.e. in floating point too."""
    m, s = mean_se([3.0, 1.0])
    assert (m, s) == (2.0, 1.0)
    assert verdict([3.0, 1.0]) == SUPPORTED
    assert verdict([-3.0, -1.0]) == CONTRADICTED
    assert verdict([-3.0, -1.0], lower_is_better=True) == SUPPORTED


@pytest.mark.parametrize("diffs", [[], [0.5], [-7.0]])
def test_fewer_than_two_seeds_never_decide(diffs):
    assert verdict(diffs) == NOT_SHOWN_FEW
    assert verdict(diffs, lower_is_better=True) == NOT_SHOWN_FEW


def test_zero_standard_error_decides_by_sign():
    """Every seed agreeing exactly: |Δ| ≥ 2 · 0 holds, so the sign decides."""
    assert verdict([0.1, 0.1, 0.1]) == SUPPORTED
    assert verdict([-0.1, -0.1]) == CONTRADICTED
    assert verdict([0.1, 0.1], lower_is_better=True) == CONTRADICTED


@pytest.mark.parametrize("diffs", [[0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 1.0], [-0.5, 0.0, 0.5]])
@pytest.mark.parametrize("lower", [False, True])
def test_a_zero_mean_is_never_shown(diffs, lower):
    """Δ = 0 is on neither side of zero, with s.e. = 0 (the copies this rule replaced disagreed there: two
    said "contradicted"/"worse", and GLFC's said "better" for forgetting) and with s.e. > 0."""
    assert verdict(diffs, lower_is_better=lower) == NOT_SHOWN_ZERO


def test_verdicts_fit_in_a_markdown_table_cell():
    for v in (SUPPORTED, CONTRADICTED, NOT_SHOWN_FEW, NOT_SHOWN_ZERO, NOT_SHOWN_SMALL):
        assert "|" not in v
    assert all(v.startswith("not shown") for v in (NOT_SHOWN_FEW, NOT_SHOWN_ZERO, NOT_SHOWN_SMALL))


def test_formats_of_mean_and_spread():
    assert fmt_paired([3.0, 1.0]) == "+2.00 ± 1.00"
    assert fmt_paired([-1.0, -3.0], digits=3) == "-2.000 ± 1.000"
    assert fmt_paired([0.5]) == "+0.50 (1 seed)"
    assert fmt_paired([]) == fmt_mean_se([]) == fmt_mean_sd([]) == "–"
    assert fmt_mean_se([3.0, 1.0]) == "2.00 ± 1.00"
    assert fmt_mean_sd([3.0, 1.0]) == "2.00 ± 1.41"
    assert fmt_mean_se([98.5]) == "98.50"
    assert kit.pop_sd([1.0, 3.0]) == 1.0 and kit.pop_sd([2.0]) == 0.0 and kit.pop_sd([]) is None
    assert table(("a", "b"), [(1, "x"), (2.5, "–")]) == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | – |"]


def test_run_files_resume_and_refuse_another_setting(tmp_path):
    runs = kit.RunFiles(tmp_path / "study")
    setting = {"rounds": 10}
    assert runs.todo([("fccl", 0), ("solo", 0)], setting) == [("fccl", 0), ("solo", 0)]
    runs.save("fccl", 0, {"method": "fccl", "seed": 0, "setting": setting})
    assert runs.todo([("fccl", 0), ("solo", 0)], setting) == [("solo", 0)]
    assert [r["method"] for r in runs.load(setting)] == ["fccl"]
    assert runs.load({"rounds": 5}) == []
    with pytest.raises(SystemExit, match="another setting"):
        runs.todo([("fccl", 0)], {"rounds": 5})


def test_the_study_loop_runs_what_is_missing_and_keeps_each_run(tmp_path, capsys):
    """One loop for every study: cells already on disk are skipped, each run is saved before the next
    starts (a study stopped by a failing run keeps the runs before it), the report follows every run."""
    runs = kit.RunFiles(tmp_path / "study")
    setting = {"rounds": 2}
    runs.save("a", 0, {"arm": "a", "seed": 0, "setting": setting})
    ran, reports = [], []

    def run(arm: str, seed: int) -> dict:
        ran.append((arm, seed))
        if arm == "c":
            raise SystemExit("c failed")
        return {"arm": arm, "seed": seed, "setting": setting}

    cells = [("a", 0), ("b", 0), ("c", 0), ("d", 0)]
    with pytest.raises(SystemExit, match="c failed"):
        kit.run_study("s", runs, cells, setting, run, said=lambda r: f"did {r['arm']}",
                      report=lambda: reports.append(len(runs.load())))
    assert ran == [("b", 0), ("c", 0)] and reports == [2]
    assert "[s] 3 runs to do: b/0, c/0, d/0" in capsys.readouterr().out
    assert kit.run_study("s", runs, cells, lambda arm: setting, lambda a, s: run("d", s), dry_run=True) == 0
    assert ran == [("b", 0), ("c", 0)]  # a dry run only lists
    assert [p.name for p in sorted(runs.folder.iterdir())] == ["a-seed0.json", "b-seed0.json"]


def test_no_study_loops_on_its_own():
    """Every study that keeps one file per run goes through ``kit.run_study``, which decides what to skip."""
    for path in _bench_sources():
        if path.name != "kit.py":
            assert ".todo(" not in path.read_text(), f"{path.name} walks its cells itself: use kit.run_study"


def test_shared_ledger_keeps_the_first_entry_of_a_key(tmp_path):
    path = tmp_path / "results.json"
    key = lambda e: (e["arm"], e["seed"])  # noqa: E731
    assert kit.append_entry(path, {"arm": "a", "seed": 0, "v": 1}, key, {"setting": {"n": 3}})
    assert not kit.append_entry(path, {"arm": "a", "seed": 0, "v": 2}, key, {"setting": {"n": 4}})
    assert kit.append_entry(path, {"arm": "a", "seed": 1, "v": 3}, key, {"setting": {"n": 4}})
    stored = kit.read_json(path)
    assert stored["setting"] == {"n": 3}
    assert [e["v"] for e in stored["runs"]] == [1, 3]
    kit.check_setting(path, {"n": 3})
    with pytest.raises(SystemExit, match="another setting"):
        kit.check_setting(path, {"n": 4})


def _bench_sources():
    return sorted(p for p in BENCH.glob("*.py"))


def test_no_study_carries_its_own_verdict_or_mean_se():
    """One verdict rule and one mean ± s.e.: a study defining its own is the drift this kit removed."""
    own = {"verdict", "mean_se", "mean_sd", "fmt_paired", "fmt_mean_se", "fmt_mean_sd", "write_atomic", "locked"}
    for path in _bench_sources():
        if path.name == "kit.py":
            continue
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert not defined & own, f"{path.name} defines {sorted(defined & own)}: use bench.kit's"


def test_bench_scripts_are_package_modules():
    """``python -m bench.<name>``: no script edits ``sys.path`` or imports a sibling by its bare name."""
    siblings = {p.stem for p in _bench_sources()}
    for path in _bench_sources():
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert node.module.split(".")[0] not in siblings, f"{path.name}: from {node.module} import"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in siblings, f"{path.name}: import {alias.name}"


def test_consensus_correlation_is_the_per_class_pearson_mean():
    """bench.fccl_consensus's alignment measure against numpy's correlation coefficient."""
    import numpy as np
    import torch

    from bench.fccl_consensus import pearson_diag

    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 10))
    b = 0.5 * a + rng.normal(size=(200, 10)) * np.linspace(0.1, 3.0, 10)
    expected = np.mean([np.corrcoef(a[:, c], b[:, c])[0, 1] for c in range(10)])
    got = pearson_diag(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    assert got == pytest.approx(expected, abs=1e-6)
    assert pearson_diag(torch.tensor(a), torch.tensor(3 * a + 1)) == pytest.approx(1.0, abs=1e-5)
    assert pearson_diag(torch.tensor(a), torch.tensor(-a)) == pytest.approx(-1.0, abs=1e-5)


def test_run_folders_count_each_run_once(tmp_path):
    """The launcher's ``latest`` link points at a run folder: a study reading a results root sees that run once."""
    for name in ("20260101-000000-fccl-digits", "20260101-000100-fccl-digits"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"round": 1}\n')
    (tmp_path / "latest").symlink_to("20260101-000100-fccl-digits")
    (tmp_path / "not-a-run").mkdir()
    assert [p.name for p in kit.run_folders(tmp_path)] == ["20260101-000000-fccl-digits",
                                                          "20260101-000100-fccl-digits"]
    assert kit.read_metrics(tmp_path / "latest") == [{"round": 1}]
