"""Every committed report under ``bench/results/`` is what its committed JSON gives through the study kit:
a change to ``bench.kit`` (the verdict rule, mean ± s.e., a format) or to a study's report that would
rewrite a committed number or verdict fails here, before anyone regenerates the reports. Nothing runs:
each report's Markdown is rebuilt in memory from the JSON beside it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "bench" / "results"


def _json(name):
    return json.loads((RESULTS / name).read_text())


def fccl_study():
    from bench import fccl_study as s

    records = s.RUNS.load(s.defaults())
    return s.markdown(records, s.summarise(records), s.defaults())


def glfc_study():
    from bench import glfc_study as s

    return s.markdown(s.RUNS.load(s.DEFAULTS), s.DEFAULTS)


def bd_fedproto_study():
    from bench import bd_fedproto_study as s

    return s.markdown(s.load_results(s.RESULTS_PATH), s.RESULTS_PATH) + "\n"


def bd_fedproto_alternatives():
    from bench import bd_fedproto_alternatives as s

    return s.markdown(_json("bd_fedproto_alternatives.json"))


def prototypes_mnist():
    from bench import prototypes as s

    return s.markdown(s.load_results())


def prototypes_reference():
    from bench import fedproto_reference as s

    return s.markdown(_json("prototypes_reference.json"))


def glfc_proxy_case():
    from bench import glfc_proxy_case as s

    d = s.DEFAULTS
    setting = {**d, "degrade_epochs": d["epochs"], "lr_schedule": s.LR_SCHEDULE}
    stored = _json("glfc_proxy_case.json")
    return s.report([r for r in stored if r["setting"] == setting], [r for r in stored if r["setting"] != setting],
                    d["rounds_per_task"], d["eval_per_class"], d["epochs"], s.LR_SCHEDULE)


def glfc_regime():
    from bench import glfc_regime as s

    return s.report(_json("glfc_regime.json"))


def fccl_consensus():
    from bench import fccl_consensus as s

    return s.markdown(_json("fccl_consensus.json")["runs"])


def overhead():
    from bench import overhead as s

    return s.markdown(_json("overhead.json"))


def cold_start():
    from bench import cold_start as s

    return s.markdown(_json("cold_start.json"))


def checkpoint_cost():
    from bench import checkpoint_cost as s

    return s.markdown(_json("checkpoint_cost.json"))


def backbones():
    from bench import backbones as s

    return s.markdown(_json("backbones.json"))


def privacy():
    from bench import privacy as s

    return s.markdown(s.RunFiles(s.FOLDER).load())


def stragglers():
    from bench import stragglers as s

    return s.report(s.RunFiles(s.FOLDER).load(s.SETTING))


def secagg():
    from bench import secagg_report as s

    return s.markdown()


REPORTS = {"privacy.md": privacy, "secagg.md": secagg, "stragglers.md": stragglers, "fccl_digits_offline.md": fccl_study, "glfc_methods.md": glfc_study,
           "bd_fedproto_study.md": bd_fedproto_study, "bd_fedproto_alternatives.md": bd_fedproto_alternatives,
           "prototypes_mnist.md": prototypes_mnist, "prototypes_reference.md": prototypes_reference,
           "glfc_proxy_case.md": glfc_proxy_case, "glfc_regime.md": glfc_regime,
           "fccl_consensus.md": fccl_consensus, "overhead.md": overhead, "cold_start.md": cold_start,
           "checkpoint_cost.md": checkpoint_cost, "backbones.md": backbones}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_committed_report_is_its_json_through_the_kit(name):
    assert REPORTS[name]() == (RESULTS / name).read_text(), (
        f"bench/results/{name} differs from what its JSON gives now: regenerate it with the script's --report "
        "and say in the commit which number or verdict changed and why")


def test_fccl_single_run_reports_render_from_their_json(tmp_path):
    from bench import fccl

    for stem in ("fccl_digits_offline_message_api", "fccl_digits_offline_v2_core"):
        fccl.write_outputs(_json(f"{stem}.json"), tmp_path, stem)
        assert (tmp_path / f"{stem}.md").read_text() == (RESULTS / f"{stem}.md").read_text()


def test_solo_sizes_report_renders_from_its_json(tmp_path):
    from bench import fccl_solo_sizes

    fccl_solo_sizes.write_markdown(_json("fccl_solo_sizes.json"), tmp_path / "solo.md")
    assert (tmp_path / "solo.md").read_text() == (RESULTS / "fccl_solo_sizes.md").read_text()


def test_the_bd_fedproto_study_runs_its_presets_under_the_setting_its_results_were_made_with():
    """Every cell starts from its method's preset (conf/<method>-mnist-n<n>.toml); the presets must agree on
    the shared FedProto setting, and that setting is the one the committed results file was run with (else
    the study would refuse to add to it, or add runs of another setting under the same label)."""
    import argparse

    from bench import bd_fedproto_study as s

    args = argparse.Namespace(clients=20, rounds=50, evaluate_every=1, data_root="/data")
    setting = s.study_setting(args)
    assert setting == _json("bd_fedproto_study.json")["setting"]
    for ways in s.WAYS:
        for arm, (method, _variant, extra) in s.ARMS.items():
            config = s.run_config("fmnist-shot", ways, arm, 3, args, PROJECT_ROOT / "runs")
            assert config["method"] == method and config["shot-ways"] == ways and config["task"] == "fmnist-shot"
            assert {name: config[key] for name, key in s.SHARED_KEYS.items()} == \
                {name: setting[name] for name in s.SHARED_KEYS}, (arm, ways)
            assert config["num-server-rounds"] == 50 and config["seed"] == 3 and extra.items() <= config.items()


def test_committed_scale_report_is_its_run_files(tmp_path):
    """``bench/results/scale.md`` is what ``bench.scale``'s report makes of the committed run files (the
    identity summary's ratios included)."""
    from bench import scale

    for folder in ("scale", "scale-identity"):
        shutil.copytree(RESULTS / folder, tmp_path / folder)
    scale.report(tmp_path)
    assert (tmp_path / "scale.md").read_text() == (RESULTS / "scale.md").read_text()


def test_scale_floor_with_client_work_has_its_own_file_and_columns(tmp_path):
    """``--floor-work-ms``: its own result file beside the at-once floor's, passed to the app as ``work-ms``, and
    its row in the floor table with the work and the busiest actor's CPU (– for rows recorded before)."""
    from bench import scale
    from bench.overhead import floor_command

    assert scale.floor_file(tmp_path, 1000, 0) == tmp_path / "scale" / "floor" / "1000.json"
    assert scale.floor_file(tmp_path, 1000, 20.0) == tmp_path / "scale" / "floor" / "1000-work20.json"
    assert scale.floor_file(tmp_path, 1000, 2.5).name == "1000-work2.5.json"
    cmd = floor_command(tmp_path / "app", 10, 2, sampled=2, work_ms=20)
    assert "work-ms=20" in cmd[cmd.index("--run-config") + 1].split()
    assert "work-ms = 0" in (tmp_path / "app" / "pyproject.toml").read_text()
    (tmp_path / "scale" / "floor").mkdir(parents=True)
    shutil.copy(RESULTS / "scale" / "10.json", tmp_path / "scale" / "10.json")  # a Pollen row: a report to write
    before = {"clients": 1000, "sampled-per-round": 100, "rounds": 3, "rc": 0, "launch-wall-s": 27.1,
              "round-wall-s": [9.92, 1.72, 1.54], "ms-per-message": [49.6, 8.6, 7.7]}  # recorded before the columns
    scale.floor_file(tmp_path, 1000, 0).write_text(json.dumps(before))
    row = {"clients": 1000, "sampled-per-round": 100, "rounds": 3, "client-work-ms": 20, "rc": 0,
           "launch-wall-s": 40.0, "load-1min": 1.0, "round-wall-s": [9.0, 3.0, 3.2],
           "ms-per-message": [45.0, 15.0, 16.0], "time-to-round-1-s": 6.0, "busiest-actor-cpu-s": [3.5, 2.0, 2.1],
           "round-wall-per-busiest-actor": [2.57, 1.5, 1.52]}
    scale.floor_file(tmp_path, 1000, 20).write_text(json.dumps(row))
    scale.report(tmp_path)
    table = [x for x in (tmp_path / "scale.md").read_text().splitlines() if x.startswith("| 1,000 | 100 |")]
    assert table[-2:] == [
        "| 1,000 | 100 | 0 | 0 | – | – | 9.92 / 1.72 / 1.54 | 49.6 / 8.6 / 7.7 | – | – | 27.1 | – |",
        "| 1,000 | 100 | 20 | 0 | 6.0 | 15.0 | 9.0 / 3.0 / 3.2 | 45.0 / 15.0 / 16.0 | 3.5 / 2.0 / 2.1 | "
        "2.57 / 1.5 / 1.52 | 40.0 | 1.0 |"]


# --- bench/overhead.py: fixed and steady CPU apart ---------------------------------------------------------

def test_overhead_split_takes_the_median_round_after_round_1_and_leaves_the_rest_fixed():
    """Synthetic counter: 20 CPU-s of start-up, rounds of 3 CPU-s, round 1 with 5 more (actor start), the last
    with 2 more (the final evaluation), 4 of teardown after the last marker."""
    from bench.overhead import split_cpu

    steps = [3 + 5, 3, 3, 3, 3 + 2]
    at, used = [], 20.0
    for step in steps:
        used += step
        at.append(used)
    total = at[-1] + 4
    split = split_cpu(total, at, len(steps))
    assert split == {"steady-round-cpu-s": 3, "fixed-cpu-s": 20 + 5 + 2 + 4}
    assert split["fixed-cpu-s"] + len(steps) * split["steady-round-cpu-s"] == pytest.approx(total)
    # two rounds: the one increment after round 1 is the steady round (the evaluation in it included)
    assert split_cpu(40.0, [25.0, 30.0], 2) == {"steady-round-cpu-s": 5, "fixed-cpu-s": 30}


@pytest.mark.parametrize("at, rounds", [([25.0], 1), ([], 1), ([], 0), ([25.0, 30.0], 3), ([25.0], 2)])
def test_overhead_split_needs_two_rounds_and_every_marker(at, rounds):
    """One round has no increment after round 1, so nothing to call steady; a missing marker splits nothing."""
    from bench.overhead import split_cpu

    assert split_cpu(40.0, at, rounds) == {"steady-round-cpu-s": None, "fixed-cpu-s": None}


def _run(fixed, steady, **extra):
    return {"rc": 0, "wall-s": 1.0, "cpu-s": fixed + 3 * steady, "cpu-counted-by": "cgroup",
            "cpu-at-rounds-counted-by": "cgroup", "fixed-cpu-s": fixed, "steady-round-cpu-s": steady, **extra}


def test_overhead_report_judges_both_targets_per_pair_and_by_the_median():
    from bench import overhead as s

    pairs = [{"plain": _run(2.0, 10.0), "pollen": _run(f, st), "floor": _run(20.0, 1.0)}
             for f, st in ((28.0, 12.0), (31.0, 12.5), (35.0, 13.0))]
    assert s.pair_split(pairs[0]) == pytest.approx((8.0, 1.1))
    data = {"config": {"clients": 4, "ways": 3, "rounds": 3, "seed": 0, "cores": 2, "date": "d", "load-at-start": 0},
            "pairs": pairs, "summary": s.summarise(pairs)}
    summary = data["summary"]
    assert (summary["fixed-above-floor-cpu-s-min"], summary["fixed-above-floor-cpu-s-median"]) == (8.0, 11.0)
    assert (summary["steady-ratio-min"], summary["steady-ratio-median"]) == (1.1, 1.15)
    report = s.markdown(data)
    assert "| 1 | 2.00 | 10.000 | 28.00 | 12.000 | 20.00 | 1.000 | 8.00 | 1.100 |" in report
    assert "median 11.0 CPU-s; target < 10 CPU-s: not met" in report
    assert "median 1.15; target ≤ 1.15: met" in report
    # a pair without a floor run: shown, not judged
    del pairs[1]["floor"]
    assert s.pair_split(pairs[1]) is None and s.summarise(pairs)["split-pairs"] == 2


@pytest.mark.parametrize("cgroup", [True, False])
def test_overhead_measured_reads_the_cpu_counter_at_each_round_line(tmp_path, monkeypatch, cgroup):
    """A real command: three rounds of about 0.3 CPU-s each, a marker after each. With a cgroup, or with the
    ``/proc`` fallback (no cgroup here), the counter rises from marker to marker and the split adds up."""
    import os
    import sys

    from bench import overhead as s

    if not cgroup:
        monkeypatch.setattr(s, "CPUACCT", tmp_path / "no-cgroup")
    elif s.CpuGroup().path is None:
        pytest.skip("no cpuacct cgroup to create here")
    code = ("import time\n"
            "def burn(s):\n t = time.process_time()\n while time.process_time() - t < s: pass\n"
            "burn(0.2)\n"
            "for k in range(1, 4):\n burn(0.3)\n print(f'[floor] round {k}/3: x', flush=True)\n"
            "burn(0.1)\n")
    row = s.measured([sys.executable, "-c", code], dict(os.environ), tmp_path / "run.log", 3)
    assert row["rc"] == 0 and row["cpu-counted-by"] == ("cgroup" if cgroup else "rusage")
    assert row["cpu-at-rounds-counted-by"].startswith("cgroup" if cgroup else "proc-tree")
    assert (tmp_path / "run.log").read_text().count("[floor] round") == 3
    at = row["cpu-at-rounds"]
    assert len(at) == 3 and 0 < at[0] < at[1] < at[2] <= row["cpu-s"]
    assert 0.2 < row["steady-round-cpu-s"] < 0.6 and row["fixed-cpu-s"] > 0
    assert row["fixed-cpu-s"] + 3 * row["steady-round-cpu-s"] == pytest.approx(row["cpu-s"], abs=0.02)


def test_stragglers_pairs_each_arm_with_the_perfect_network_and_times_the_target_on_the_simulated_clock():
    from bench import stragglers as s

    def rec(arm, seed, acc, clock):
        return {"arm": arm, "seed": seed, "accuracy": acc, "clock": clock, "dropped": 1, "late": 2}

    perfect, cut = s.arm_name("fedavg", 0, 0, 0), s.arm_name("fedavg", 0.2, 0.2, 6.0)
    waited = s.arm_name("fedavg", 0.2, 0.2, 0.0)
    rows = s.summarize([rec(perfect, 0, [0.5, 0.8], [3.0, 6.0]), rec(cut, 0, [0.7, 0.76], [6.0, 12.0]),
                        rec(waited, 0, [0.6, 0.9], [3600.0, 7200.0]), rec(cut, 1, [0.1, 0.2], [6.0, 12.0])])
    assert rows[cut]["delta-final"] == {0: pytest.approx(-0.04)}  # seed 1 has no perfect run: unpaired
    assert rows[cut]["time-to-target"] == {0: 12.0}  # 0.95 × 0.8 = 0.76, reached in round 2; seed 1: no target
    assert rows[waited]["time-to-target"] == {0: 7200.0}
    assert rows[cut]["vs-wait"] == {0: pytest.approx(0.76 - 0.9)}
    assert s.time_to([None, 0.5], [1.0, 2.0], 0.5) == 2.0 and s.time_to([0.1], [1.0], 0.5) is None
