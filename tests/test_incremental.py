"""The class-incremental environment: population per task, S_n/S_b/S_o, class draws, shards."""

import math

import numpy as np
import pytest

from pollen.datasets.incremental import (
    StreamConfig,
    StreamError,
    class_permutation,
    client_task_data,
    client_task_indices,
    plan_stream,
    shard_indices,
    stream_data,
)

CFG = StreamConfig(num_tasks=4, classes_per_task=5, initial_clients=6, new_clients=3, old_fraction=0.2,
                   class_fraction=0.6, duplicate=False, max_per_class=0, seed=4)


def stream(**given) -> StreamConfig:
    """A stream of 4 tasks of 5 classes, 4 clients then 2 more each task (the glfc-… keys' defaults but
    no cap on images per class), with ``given`` instead."""
    return StreamConfig(**{"num_tasks": 4, "classes_per_task": 5, "initial_clients": 4, "new_clients": 2,
                           "old_fraction": 0.1, "class_fraction": 0.6, "duplicate": False, "max_per_class": 0,
                           "seed": 0, **given})


def _labels(per_class=30, classes=20):
    return np.repeat(np.arange(classes), per_class)


def test_population_and_groups_per_task():
    plan = plan_stream(CFG)
    assert plan.population == (6, 9, 12, 15) and plan.num_clients == 15
    assert plan.groups[0] == {"new": (0, 1, 2, 3, 4, 5), "b": (), "o": ()}
    for t in range(1, 4):
        g = plan.groups[t]
        existing = plan.population[t - 1]
        assert g["new"] == tuple(range(existing, existing + 3))
        assert len(g["b"]) == int(existing * 0.8) and len(g["o"]) == existing - len(g["b"])
        assert sorted(g["b"] + g["o"]) == list(range(existing))
        assert list(plan.active_clients(t)) == list(range(plan.population[t]))
        for c in g["new"] + g["b"]:  # 60% of the task's 5 classes, all from this task
            cls = plan.client_classes(c, t)
            assert len(cls) == 3 == len(set(cls)) and set(cls) <= set(plan.task_classes(t))
        for c in g["o"]:  # S_o keep the classes they had
            assert plan.client_classes(c, t) == plan.client_classes(c, t - 1)
            assert plan.group_of(c, t) == "o"
    assert plan.client_classes(14, 0) == () and plan.group_of(14, 0) is None
    assert plan.seen_classes(2) == 15 and plan.task_classes(3) == (15, 16, 17, 18, 19)
    with pytest.raises(StreamError, match="task 4"):
        plan.task_classes(4)


def test_plan_is_deterministic_and_depends_on_the_seed():
    assert plan_stream(CFG) == plan_stream(CFG)
    other = plan_stream(StreamConfig(**{**CFG.__dict__, "seed": 5}))
    assert other.groups != plan_stream(CFG).groups or other.classes != plan_stream(CFG).classes


def test_disjoint_shards_cover_each_drawn_class():
    plan = plan_stream(CFG)
    labels = _labels()
    for cls in range(20):
        holders = plan.holders(cls)
        shards = [shard_indices(plan, labels, c, cls) for c in holders]
        joined = np.concatenate(shards) if shards else np.zeros(0, int)
        assert len(joined) == len(set(joined.tolist()))  # disjoint
        if holders:
            assert sorted(joined.tolist()) == np.flatnonzero(labels == cls).tolist()  # and complete
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1
        for c in range(plan.num_clients):
            if c not in holders:
                assert shard_indices(plan, labels, c, cls).size == 0
    # a client's data at a task is exactly its classes' shards; S_o clients keep theirs
    t = 2
    for c in plan.groups[t]["o"]:
        assert np.array_equal(client_task_indices(plan, labels, c, t), client_task_indices(plan, labels, c, t - 1))
    idx = client_task_indices(plan, labels, 0, t)
    assert set(labels[idx].tolist()) == set(plan.client_classes(0, t))


def test_duplicated_data_and_cap():
    dup = plan_stream(StreamConfig(**{**CFG.__dict__, "duplicate": True}))
    labels = _labels()
    for cls in range(5):
        for c in dup.holders(cls):
            assert len(shard_indices(dup, labels, c, cls)) == 30  # every holder has all images
    capped = plan_stream(StreamConfig(**{**CFG.__dict__, "duplicate": True, "max_per_class": 7}))
    assert all(len(shard_indices(capped, labels, c, 0)) == 7 for c in capped.holders(0))


def test_config_errors_and_class_order():
    with pytest.raises(StreamError, match="old_fraction"):
        stream(old_fraction=1.0)
    with pytest.raises(StreamError, match="class_fraction"):
        stream(class_fraction=0.0)
    with pytest.raises(StreamError, match="num_tasks"):
        stream(num_tasks=0)
    assert class_permutation(5, "label", 0).tolist() == [0, 1, 2, 3, 4]
    perm = class_permutation(20, "shuffled", 3)
    assert sorted(perm.tolist()) == list(range(20)) and perm.tolist() == class_permutation(20, "shuffled", 3).tolist()
    with pytest.raises(StreamError, match="class order"):
        class_permutation(5, "random", 0)
    assert CFG.classes_per_client == 3 and math.isclose(CFG.class_fraction * 5, 3.0)


def test_mnist_fmnist_stream_from_real_files(data_root):
    train = stream_data("mnist-fmnist-cil", data_root, "train")
    assert train.images.shape == (120000, 1, 28, 28) and set(np.unique(train.y.numpy())) == set(range(20))
    plan = plan_stream(stream(initial_clients=3, max_per_class=40))
    x, y, idx = client_task_data("mnist-fmnist-cil", plan, data_root, 4, 1)
    assert set(y.tolist()) == set(plan.client_classes(4, 1)) and len(y) == 40 * 3
    assert x.shape == (120, 1, 28, 28) and abs(float(x.mean())) < 1.0
    shuffled = stream_data("mnist-fmnist-cil", data_root, "train", "shuffled", 0)
    perm = class_permutation(20, "shuffled", 0)
    # stream class k of the shuffled order holds the images of source class perm[k]
    k = 3
    assert np.array_equal(np.flatnonzero(shuffled.y.numpy() == k), np.flatnonzero(train.y.numpy() == perm[k]))


def test_cifar100_stream_and_client_on_fixture_files(tmp_path, monkeypatch):
    """CIFAR-100 in its real pickle layout (tiny fixture): stream labels, LeNet 3×32×32 → 768 → 100 gradients."""
    import pickle

    import torchvision.datasets.cifar as tv_cifar
    from torchvision.datasets.utils import check_integrity

    from pollen.app.config import parse_node_config, parse_run_config
    from pollen.app.methods_glfc import make_client
    from pollen.methods.glfc import build_lenet, build_stream_model
    from pollen.methods.training import model_state
    from pollen.protocol.glfc import TrainInstruction
    from tests.conftest import make_context
    from tests.test_sources import write_cifar_batch

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda fpath, md5=None: check_integrity(fpath, None))
    rng = np.random.default_rng(0)
    base = tmp_path / "cifar-100-python"
    labels = np.repeat(np.arange(100), 6)
    write_cifar_batch(base / "train", rng.integers(0, 256, (600, 3072), dtype=np.uint8), labels.tolist(), "fine_labels")
    write_cifar_batch(base / "test", rng.integers(0, 256, (100, 3072), dtype=np.uint8), list(range(100)), "fine_labels")
    with open(base / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    train = stream_data("cifar100-cil", str(tmp_path), "train")
    assert train.images.shape == (600, 3, 32, 32) and train.fmt.size == 32

    rc = {"method": "glfc", "task": "cifar100-cil", "data-root": str(tmp_path), "num-server-rounds": 2,
          "glfc-tasks": 2, "glfc-classes-per-task": 10, "glfc-rounds-per-task": 1, "glfc-initial-clients": 2,
          "glfc-new-clients": 1, "glfc-max-per-class": 0, "glfc-oracle-boundary": True, "glfc-perturb-steps": 1,
          "model": "resnet10", "model-width": 0.125, "local-epochs": 1, "lr": 0.1, "momentum": 0.0}
    cfg = parse_run_config(rc)
    ctx = make_context(rc, 0, 3)
    model = build_stream_model("cifar100-cil", "resnet10", 10, 0.125)
    config = {"server-round": 1, "task": 0, "round-in-task": 0, "num-classes": 10,
              "old1-sent": False, "old2-sent": False}
    ins = TrainInstruction(model_state(model), {}, config)
    reply = make_client(cfg, parse_node_config(ctx.node_config), ctx).train(ins)
    state, grads, n, samples = reply.state, reply.gradients, reply.num_examples, reply.samples
    lenet_shapes = {name: tuple(p.shape) for name, p in build_lenet("cifar100-cil", 0).named_parameters()}
    assert lenet_shapes["head.weight"] == (100, 768)  # the DLG LeNet of the paper: FC 768 -> 100
    assert list(state) == list(model.state_dict())  # the trained state by name
    assert len(grads) == 6 and all({k: g.shape for k, g in gset.items()} == lenet_shapes for gset in grads)
    assert samples == []  # the true perturbed samples travel only under leak-audit
    plan = plan_stream(stream(num_tasks=2, classes_per_task=10, initial_clients=2, new_clients=1))
    # each of its 6 classes has 6 images, split evenly among the clients that drew it
    assert n == sum(6 // len(plan.holders(c)) for c in plan.client_classes(0, 0))
