import numpy as np
import pytest
import torch

from pollen.datasets.tasks import TaskError, TaskOptions, build_client_data, get_task


def test_default_task_needs_no_files_and_splits_everything_once():
    opts = TaskOptions(seed=3)
    parts = [build_client_data("uci-dirichlet", opts, i, 4) for i in range(4)]
    total_train = sum(p.num_train for p in parts)
    total_test = sum(len(p.y_test) for p in parts)
    assert total_train + total_test == 1797  # every UCI digit exactly once
    assert all(p.x_train.shape[1:] == (1, 28, 28) and p.x_train.dtype == torch.float32 for p in parts)
    sizes = [len(p.y_test) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # IID test shares
    label_sets = [np.bincount(p.y_train.numpy(), minlength=10) for p in parts]
    assert np.std([c / c.sum() for c in label_sets], axis=0).mean() > 0.05  # Dirichlet skew is visible


def test_cap_and_errors():
    capped = build_client_data("uci-dirichlet", TaskOptions(max_train_samples=50), 0, 2)
    assert capped.num_train == 50
    with pytest.raises(TaskError, match="partition id"):
        build_client_data("uci-dirichlet", TaskOptions(), 5, 2)
    with pytest.raises(TaskError, match="unknown task"):
        get_task("nope")


def test_mnist_shot_task_matches_fedproto_rules(data_root):
    opts = TaskOptions(data_root=data_root, ways=3, shots=100, stdev=2, test_per_class=40)
    seen = []
    for pid in range(20):
        d = build_client_data("mnist-shot", opts, pid, 20)
        assert 2 <= len(d.classes) <= 5
        assert set(d.y_train.tolist()) == set(d.classes) == set(d.y_test.tolist())
        assert len(d.y_test) == 40 * len(d.classes)
        assert 98 * len(d.classes) <= d.num_train <= 102 * len(d.classes)
        seen.append(d)
    assert len({tuple(d.classes) for d in seen}) > 5


def test_every_task_declares_its_kind_and_methods_refuse_the_kinds_they_do_not_run_on():
    from pollen.app.config import ConfigError, parse_run_config
    from pollen.datasets.tasks import TASK_KINDS, TASKS, TaskSpec, register_task

    kinds = {name: spec.kind for name, spec in TASKS.items()}
    assert set(kinds.values()) == set(TASK_KINDS)
    assert kinds["mnist-shot"] == "partitioned" and kinds["image-folder"] == "partitioned"
    assert kinds["digits-offline"] == "domains" and kinds["mnist-fmnist-cil"] == "class-incremental"
    # refused before any data or process, naming the tasks that fit
    for method, task, fitting in (("fedavg", "mnist-fmnist-cil", "a partitioned task: set task to one of"),
                                  ("fedproto", "digits-offline", "mnist-shot"),
                                  ("fccl", "mnist-shot", "a domain-per-client task: set task to one of digits, "
                                                         "digits-offline, image-domains, office-home")):
        with pytest.raises(ConfigError, match=f"method '{method}' needs .*{fitting}") as err:
            parse_run_config({"method": method, "task": task})
        assert f"task '{task}' is " in str(err.value)
    # a stream task has no per-client build: asking for one says why
    with pytest.raises(TaskError, match="stream plan"):
        build_client_data("mnist-fmnist-cil", TaskOptions(), 0, 4)
    spec = get_task("uci-dirichlet")
    with pytest.raises(ValueError, match="kind 'other'"):
        register_task(TaskSpec(**{**spec.__dict__, "name": "x-other", "kind": "other"}))
    with pytest.raises(ValueError, match="stream plan"):
        register_task(TaskSpec(**{**spec.__dict__, "name": "x-stream", "kind": "class-incremental"}))
    with pytest.raises(ValueError, match="needs a build"):
        register_task(TaskSpec(**{**spec.__dict__, "name": "x-none", "build": None}))
    assert not {"x-other", "x-stream", "x-none"} & set(TASKS)


def test_one_registry_holds_every_kind_with_its_facts():
    """Domain tasks and streams are TaskSpecs of their kind: their facts hang off the spec, a lookup by kind
    names the tasks of that kind, and a spec whose facts do not match its kind is refused."""
    from pollen.datasets.spec import USER_DATA_FIELDS
    from pollen.datasets.tasks import TASKS, TaskSpec, register_task

    for name, spec in TASKS.items():
        assert (spec.domains is not None) == (spec.kind == "domains"), name
        assert (spec.stream is not None) == (spec.kind == "class-incremental"), name
    office = get_task("office-home", "domains")
    assert office.top_k == 5 and office.domain_facts().names == ("Art", "Clipart", "Product", "Real_World")
    assert office.fixed_partitions == 4 and office.domain_facts().loader == "officehome"
    assert get_task("image-domains").domain_facts().names == ()  # the run's folders
    assert get_task("cifar100-cil", "class-incremental").stream.augment
    assert not get_task("mnist-fmnist-cil").stream.augment
    with pytest.raises(TaskError, match="'mnist-shot' is not a domain-per-client task; allowed: digits-offline, "
                                        "digits, office-home, image-domains"):
        get_task("mnist-shot", "domains")
    with pytest.raises(TaskError, match="'nope' is not a class-incremental stream; allowed: mnist-fmnist-cil"):
        get_task("nope", "class-incremental")
    with pytest.raises(TaskError, match="not a domain-per-client task"):
        get_task("uci-dirichlet").domain_facts()
    plain = get_task("uci-dirichlet")
    with pytest.raises(ValueError, match="DomainFacts"):
        register_task(TaskSpec(**{**plain.__dict__, "name": "x-domains", "kind": "domains"}))
    with pytest.raises(ValueError, match="StreamFacts"):
        register_task(TaskSpec(**{**plain.__dict__, "name": "x-facts", "stream": get_task("cifar100-cil").stream}))
    assert not {"x-domains", "x-facts"} & set(TASKS)
    # a task other than the run's (pollen predict --task) is built without the run's own data's options
    full = TaskOptions(seed=4, shots=7, data_dir="/d", node_data_dir="/n", classes=("a",), image_size=8,
                       image_mean=(0.5,), data_split="dirichlet", test_fraction=0.3)
    assert full.without_user_data() == TaskOptions(seed=4, shots=7)
    assert set(USER_DATA_FIELDS) <= set(TaskOptions.__dataclass_fields__)


def test_partition_data_takes_domain_sizes_only_where_a_task_has_built_in_domains(data_root):
    """One function builds any task's partition; the domain tasks' sizes reach the domain split, and a
    task without built-in domains refuses per-domain training sizes rather than ignoring them."""
    from pollen.datasets.domain_tasks import domain_client_data
    from pollen.datasets.tasks import partition_data

    opts = TaskOptions(seed=3)
    plain = partition_data("uci-dirichlet", opts, 1, 4, test_size=7)  # a test size is not read here
    assert plain is build_client_data("uci-dirichlet", opts, 1, 4)
    with pytest.raises(TaskError, match="no built-in domains.*training sizes"):
        partition_data("uci-dirichlet", opts, 1, 4, train_sizes=(5, 5, 5, 5))
    opts = TaskOptions(data_root=data_root, seed=2)
    sized = partition_data("digits-offline", opts, 1, 4, (9, 8, 7, 6), 11)
    assert len(sized.y_train) == 8 and len(sized.y_test) == 11
    assert torch.equal(sized.x_train, domain_client_data("digits-offline", opts, 1, 4, (9, 8, 7, 6), 11).x_train)
    assert partition_data("digits-offline", opts, 1, 4) is build_client_data("digits-offline", opts, 1, 4)
