import tomllib

import pytest

from pollen.app.config import DEFAULTS, ConfigError, parse_node_config, parse_run_config
from pollen.app.registry import METHODS, method_defaults
from pollen.datasets.tasks import get_task
from pollen.models.spec import choose_model
from tests.conftest import PROJECT_ROOT


def _width(cfg, name):
    return choose_model(cfg, get_task(cfg.task), name=name).width


def test_defaults_mirror_pyproject():
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    declared = pyproject["tool"]["flwr"]["app"]["config"]
    assert declared == {**DEFAULTS, **method_defaults()}


def test_no_federations_section_in_pyproject():
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    assert "federations" not in pyproject["tool"]["flwr"]


def test_defaults_parse():
    cfg = parse_run_config({})
    assert cfg.method == "fedavg" and cfg.task == "uci-dirichlet" and cfg.num_server_rounds == 10
    assert _width(cfg, "resnet18") == 0.25 and _width(cfg, "cnn_mnist") == 1.0
    assert _width(parse_run_config({"profile": "paper"}), "resnet18") == 1.0
    assert _width(parse_run_config({"model-width": 0.5}), "cnn_mnist") == 0.5


def test_unknown_method_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"method": "fedsgd"})
    msg = str(err.value)
    assert "'method'" in msg and "fedsgd" in msg
    for name in METHODS:
        assert name in msg


def test_unknown_task_and_key():
    with pytest.raises(ConfigError, match="'task'.*uci-dirichlet"):
        parse_run_config({"task": "imagenet"})
    with pytest.raises(ConfigError, match="unknown run config key"):
        parse_run_config({"num-rounds": 3})


@pytest.mark.parametrize("key,value,fragment", [
    ("num-server-rounds", 0, "expected an integer in [1, 1000000]"),
    ("num-server-rounds", 2.5, "integer"),
    ("fraction-fit", 0.0, "expected a number in (0, 1]"),
    ("fraction-fit", 1.5, "expected a number in (0, 1]"),
    ("lr", -1.0, "expected a number in (0, 10]"),
    ("torch-threads", 257, "expected an integer in [1, 256]"),
    ("lr", float("nan"), "finite"),
    ("device", "tpu", "auto, cpu, cuda"),
    ("download", "yes", "true or false"),
    ("batch-size", True, "integer"),
    ("avg-weighting", "median", "samples, uniform"),
    ("model", "vgg16", "resnet18"),
])
def test_bad_values_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_run_config({key: value})
    assert f"'{key}'" in str(err.value) and fragment in str(err.value)


def test_impossible_shot_sizes():
    with pytest.raises(ConfigError, match="shot-shots"):
        parse_run_config({"shot-shots": 2, "shot-stdev": 2})


def test_node_config_validation():
    node = parse_node_config({"partition-id": 2, "num-partitions": 4, "model": "resnet10"})
    assert (node.partition_id, node.num_partitions, node.model) == (2, 4, "resnet10")
    with pytest.raises(ConfigError, match="missing 'partition-id'.*--node-config"):
        parse_node_config({"num-partitions": 4})
    with pytest.raises(ConfigError, match="0 <= partition-id < num-partitions"):
        parse_node_config({"partition-id": 4, "num-partitions": 4})
    with pytest.raises(ConfigError, match="'model'"):
        parse_node_config({"partition-id": 0, "num-partitions": 4, "model": "alexnet"})


def test_sample_by_partition_reaches_the_strategy():
    for value in (True, False):
        cfg = parse_run_config({"method": "fedavg", "task": "uci-dirichlet", "sample-by-partition": value})
        assert METHODS["fedavg"].make_strategy(cfg).nodes.identify_nodes is value


@pytest.mark.parametrize("spec,inside,outside", [
    ("int >= 1", [1, 7, 3.0], [0, -2, 1.5, True, "3", float("inf")]),
    ("int in [1, 256]", [1, 256], [0, 257, 2.5]),
    ("float > 0", [1e-9, 5], [0, -1.0, float("nan"), False]),
    ("float in (0, 1]", [1e-6, 1.0], [0.0, 1.0001]),
    ("float in [0, 1)", [0.0, 0.999], [1.0, -0.001]),
    ("float in [0, 0.9]", [0.9, 0], [0.91]),
])
def test_the_one_validator_reads_the_range_notation(spec, inside, outside):
    """Hand-picked values on both sides of each bound, for each form of the notation."""
    from pollen.settings import Key, check_value

    key = Key(0, spec, "a key for this test")
    for value in inside:
        assert check_value("some-key", key, value) == value
        assert type(check_value("some-key", key, value)) is (int if spec.startswith("int") else float)
    for value in outside:
        with pytest.raises(ConfigError, match=r"run config key 'some-key' = .* is invalid: expected"):
            check_value("some-key", key, value)


def test_the_one_validator_refuses_unknown_notation():
    from pollen.settings import parse_range

    for bad in ("int >=1", "integer >= 1", "float in [0, 1", "number"):
        with pytest.raises(ValueError, match="not a range"):
            parse_range(bad)


def test_the_recorded_config_holds_the_shared_keys_and_the_methods_own_only():
    """What config.json records: no FCCL or GLFC keys in a FedProto run, no method keys in a FedAvg one."""
    proto = parse_run_config({"method": "fedproto", "task": "mnist-shot"}).to_dict()
    assert proto["proto-lambda"] == 1.0 and proto["lr"] == 0.05
    assert not [k for k in proto if k.startswith(("fccl-", "glfc-"))]
    fedavg = parse_run_config({"method": "fedavg"}).to_dict()
    assert not [k for k in fedavg if k.startswith(("proto-", "fccl-", "glfc-"))]
    assert parse_run_config(fedavg).to_dict() == fedavg  # what was recorded parses back to itself


def test_every_common_key_is_one_run_config_field_and_back():
    """A common key is declared once (a setting() field of RunConfig's sections) and read by rule into the
    field of its name, so a key without a field (or a field without a key) fails here rather than being
    silently dropped."""
    import dataclasses

    from pollen.settings import COMMON, RunConfig, field_name

    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"extra", "class_names"}
    assert {field_name(k) for k in COMMON} == fields
    cfg = parse_run_config({"lr": 0.25, "run-name": "  named  ", "dp-mode": "off"})
    assert cfg.lr == 0.25 and cfg.run_name == "named"
    assert set(COMMON) <= set(cfg.to_dict())  # config.json records every common key


def test_a_run_config_is_validated_once_per_process_and_anew_when_anything_it_reads_changes(monkeypatch, tmp_path):
    """``validated_run_config`` (ServerApp, every ClientApp message, the in-process runner): the same config
    is checked once and its value shared; another value of any key, another ``POLLEN_DATA_ROOT`` or working
    directory is checked anew; a refused config is refused every time."""
    from pollen.app import config

    calls = []
    parse = config.parse_run_config
    monkeypatch.setattr(config, "parse_run_config", lambda raw: calls.append(dict(raw)) or parse(raw))
    config._validated.cache_clear()
    try:
        first = {"method": "fedavg", "task": "uci-dirichlet", "lr": 0.05}
        a = config.validated_run_config(first)
        assert config.validated_run_config(dict(reversed(first.items()))) is a and len(calls) == 1
        c = config.validated_run_config({**first, "lr": 0.1})
        assert len(calls) == 2 and c.lr == 0.1 and a.lr == 0.05
        monkeypatch.setenv("POLLEN_DATA_ROOT", str(tmp_path))
        assert config.validated_run_config(first).data_root == str(tmp_path) and len(calls) == 3
        own = {**first, "task": "array", "data-dir": "here", "classes": "a,b", "image-size": 8, "image-channels": 1}
        monkeypatch.chdir(tmp_path)
        assert config.validated_run_config(own).data_dir == str(tmp_path / "here")
        monkeypatch.chdir(PROJECT_ROOT)
        assert config.validated_run_config(own).data_dir == str(PROJECT_ROOT / "here")
        assert len(calls) == 5
        for _ in range(2):
            with pytest.raises(ConfigError, match="unknown run config key"):
                config.validated_run_config({**first, "no-such-key": 1})
        assert len(calls) == 7
    finally:
        config._validated.cache_clear()
