import tomllib

import pytest

from pollen.app.config import DEFAULTS, ConfigError, parse_node_config, parse_run_config
from pollen.app.registry import METHODS, method_defaults
from tests.conftest import PROJECT_ROOT


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
    assert cfg.width_for("resnet18") == 0.25 and cfg.width_for("cnn_mnist") == 1.0
    assert parse_run_config({"profile": "paper"}).width_for("resnet18") == 1.0
    assert parse_run_config({"model-width": 0.5}).width_for("cnn_mnist") == 0.5


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
    ("num-server-rounds", 0, ">= 1"),
    ("num-server-rounds", 2.5, "integer"),
    ("fraction-fit", 0.0, "> 0.0"),
    ("fraction-fit", 1.5, "<= 1.0"),
    ("lr", -1.0, "> 0.0"),
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
        assert METHODS["fedavg"].make_strategy(cfg).identify_nodes is value
