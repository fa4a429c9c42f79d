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


REPORTS = {"privacy.md": privacy, "fccl_digits_offline.md": fccl_study, "glfc_methods.md": glfc_study,
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
