"""FCCL clients: state across rounds, shared public batch order, evaluation, config checks."""

import numpy as np
import pytest
import torch

from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.methods_logits import settings
from pollen.app.registry import METHODS
from pollen.methods.logits import public_view, topk_accuracy
from tests.conftest import make_context

torch.set_num_threads(1)

TINY = {"task": "digits-offline", "model-width": 0.125, "fccl-public": "photo_patches", "fccl-public-size": 40,
        "fccl-public-batch-size": 20, "fccl-train-sizes": "24,24,24,24", "fccl-solo-epochs": 1,
        "fccl-local-epochs": "1", "fccl-test-size": 20, "fccl-batch-size": 12}


def _client(method, run_config, context):
    cfg = parse_run_config(run_config)
    return METHODS[method].make_client(cfg, parse_node_config(context.node_config), context)


def _state(client, key):
    module = client.new_model()
    assert client.state.load_module(key, module)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_state_after_two_rounds(data_root):
    rc = {**TINY, "method": "fccl", "data-root": data_root}
    ctx = make_context(rc, partition_id=1, num_partitions=4)
    client = _client("fccl", rc, ctx)
    logits, n, metrics = client.fit([], {"server-round": 1})
    assert n == 24 and metrics["domain"] == "uci" and "collab-loss" not in metrics  # round 1: no consensus
    assert logits[0].shape == (40, 10) and logits[0].dtype == np.float32
    assert {"solo-intra-accuracy", "solo-inter-accuracy", "solo-acc-mnist"} <= set(metrics)
    solo_1, net_1 = _state(client, "fccl-solo"), _state(client, "fccl-net")
    assert _same(_state(client, "fccl-prev"), net_1)
    assert not _same(net_1, solo_1)  # the local update moved net away from the SOLO model

    consensus = np.random.default_rng(0).normal(size=(40, 10)).astype(np.float32)
    client = _client("fccl", rc, ctx)  # Flower builds a new client object for every message
    net, solo, prev, fresh = client.core.models()
    assert not fresh and _same(prev.state_dict(), net_1) and _same(solo.state_dict(), solo_1)
    _, _, metrics = client.fit([consensus, np.array([4], np.int64)], {"server-round": 2, "contributed": True})
    assert np.isfinite(metrics["collab-loss"]) and metrics["train-kl-inter"] >= 0
    assert _same(_state(client, "fccl-solo"), solo_1)  # the intra-domain teacher never changes
    net_2 = _state(client, "fccl-net")
    assert not _same(net_2, net_1) and _same(_state(client, "fccl-prev"), net_2)

    loss, n_test, ev = client.evaluate([], {"server-round": 2})
    assert n_test == 20 and np.isfinite(loss)
    others = [ev[f"acc-{d}"] for d in ("mnist", "mnistm", "syn")]
    assert ev["inter-accuracy"] == pytest.approx(np.mean(others)) and ev["intra-accuracy"] == ev["acc-uci"]


def test_leave_one_out_target_removes_the_clients_own_logits(data_root):
    rc = {**TINY, "method": "fedmd", "data-root": data_root, "fccl-target": "leave-one-out"}
    ctx = make_context(rc, partition_id=1, num_partitions=4)
    client = _client("fedmd", rc, ctx)
    reply, _, _ = client.fit([], {"server-round": 1})
    own = client.state.load_arrays("fccl-last-logits")["logits"]
    assert reply[0].shape == own.shape == (40, 10)  # it stores what it sent
    np.testing.assert_array_equal(reply[0], own)
    other = np.ones((40, 10), np.float32)
    mean = (own + other) / 2
    np.testing.assert_allclose(client.core.collaborative_target(mean, 2, contributed=True), other, atol=1e-5)
    np.testing.assert_array_equal(client.core.collaborative_target(mean, 2, contributed=False), mean)
    assert client.core.collaborative_target(own, 1, contributed=True) is None


def test_public_view_and_order_are_shared_by_all_clients():
    x = torch.randn(30, 3, 32, 32)
    a, b = public_view(x, 0, 3, True), public_view(x, 0, 3, True)
    assert torch.equal(a, b) and not torch.equal(a, x) and not torch.equal(a, public_view(x, 0, 4, True))
    assert public_view(x, 0, 3, False) is x


def test_topk_accuracy_hand_worked():
    logits = torch.tensor([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05], [0.2, 0.3, 0.5]])
    labels = torch.tensor([2, 0, 0])
    assert topk_accuracy(logits, labels, 1) == pytest.approx(1 / 3)
    assert topk_accuracy(logits, labels, 2) == pytest.approx(2 / 3)
    assert topk_accuracy(logits, labels, 5) == 1.0


def test_settings_follow_profile_and_keys():
    cfg = parse_run_config({"method": "fccl", "task": "digits-offline"})
    s = settings(cfg)
    assert (s.public, s.public_size, s.public_batch_size, s.public_epochs) == ("fashion_mnist", 1000, 250, 1)
    assert s.train_sizes == (150, 80, 500, 500) and s.local_epochs == (10, 10, 2, 2)
    cfg = parse_run_config({"method": "fccl", "task": "digits", "profile": "paper"})
    s = settings(cfg)
    assert (s.public, s.public_size, s.public_batch_size) == ("cifar100", 5000, 512)
    assert s.train_sizes == (150, 80, 5000, 1800) and s.local_epochs == (40, 35, 3, 4) and s.solo_epochs == 40


@pytest.mark.parametrize("override, message", [
    ({"task": "uci-dirichlet"}, "domain-per-client task"),
    ({"fccl-target": "median"}, "mean, leave-one-out"),
    ({"fccl-public": "imagenet"}, "fashion_mnist"),
    ({"fccl-public-size": 100, "fccl-public-batch-size": 200}, "fccl-public-batch-size"),
    ({"fccl-local-epochs": "1,2"}, "fccl-local-epochs"),
    ({"fccl-lr": 0.0}, "fccl-lr"),
])
def test_bad_method_keys_fail_early(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({"method": "fccl", "task": "digits-offline", **override})


def test_homogeneous_mode_sends_and_loads_averaged_weights(data_root):
    """``solo`` + ``fccl-average-weights`` is FedAvg: with 0 local epochs, net == the average received."""
    from pollen.app.client_app import app
    from pollen.strategies import LogitAveraging
    from pollen.testing import InProcessGrid, clientapp_node

    rc = {**TINY, "method": "solo", "data-root": data_root, "model": "resnet10", "fccl-average-weights": True,
          "fccl-local-epochs": "0"}
    strategy = METHODS["solo"].make_strategy(parse_run_config(rc))
    assert isinstance(strategy, LogitAveraging) and strategy.average_weights
    nodes = {100 + p: clientapp_node(app, rc, p, 4) for p in (0, 3)}
    grid = InProcessGrid(nodes)
    strategy.min_available_nodes = 2
    strategy.start(grid=grid, initial_arrays=METHODS["solo"].initial_arrays(parse_run_config(rc)), num_rounds=2)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 4 and "model" not in train[0].content  # round 1: nothing to load yet
    sent = train[2].content["model"]  # round 2: the average of round 1's two replies
    assert train[2].content["config"]["contributed"] is True
    assert train[2].content["arrays"]["consensus"].shape == (40, 10)
    # each client's round-2 net is the received average (0 local epochs); its reply is that state
    # with 0 local epochs both round-2 replies are the state received, so their average is it again
    # (a mean of equal values is exact)
    assert list(sent.keys()) == list(strategy.weights.keys())
    for key in sent.keys():
        np.testing.assert_array_equal(strategy.weights[key].numpy(), sent[key].numpy())
    assert strategy.report(2) is not None and not strategy.reports[2].rejected


def test_paper_tasks_need_their_files(tmp_path):
    from pollen.datasets.domain_tasks import domain_client_data
    from pollen.datasets.sources import DatasetMissingError
    from pollen.datasets.tasks import TaskError, TaskOptions, get_task

    assert get_task("office-home").top_k == 5 and get_task("digits").top_k == 1
    assert get_task("digits").model_for(2) == "efficientnet_b0" and get_task("office-home").num_classes == 65
    with pytest.raises(DatasetMissingError, match="usps"):
        domain_client_data("digits", TaskOptions(data_root=str(tmp_path)), 1, 4)
    with pytest.raises(DatasetMissingError, match="officehome"):
        domain_client_data("office-home", TaskOptions(data_root=str(tmp_path)), 0, 4)
    with pytest.raises(TaskError, match="one client per domain"):
        domain_client_data("digits-offline", TaskOptions(data_root=str(tmp_path)), 0, 3)


def test_solo_cache_is_shared_by_identical_runs_only(data_root, tmp_path):
    """``fccl-solo-cache``: a second run with the same SOLO recipe loads the first one's model; another
    training size pretrains (and caches) its own."""
    rc = {**TINY, "method": "fccl", "data-root": data_root, "fccl-solo-cache": str(tmp_path)}
    first = _client("fccl", rc, make_context(rc, partition_id=0, num_partitions=4))
    first.fit([], {"server-round": 1})
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("solo-digits-offline-p0-")
    again = _client("fccl", rc, make_context(rc, partition_id=0, num_partitions=4))  # a new node state
    again.fit([], {"server-round": 1})
    assert sorted(tmp_path.iterdir()) == files
    assert _same(_state(again, "fccl-solo"), _state(first, "fccl-solo"))
    other = {**rc, "fccl-train-sizes": "30,24,24,24"}
    _client("fccl", other, make_context(other, partition_id=0, num_partitions=4)).fit([], {"server-round": 1})
    assert len(list(tmp_path.iterdir())) == 2
