"""FedProto / BD-FedProto clients against independent computations, on real data and real Flower contexts."""

import numpy as np
import pytest
import torch

from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.registry import METHODS
from pollen.clients.prototypes import heterogeneous_channels
from pollen.methods.prototype_losses import dynamic_lambda
from pollen.strategies.legacy import encode_global
from pollen.strategies.prototypes import aggregate_prototypes, prototype_margin
from tests.conftest import make_context

torch.set_num_threads(1)

UCI = {"task": "uci-dirichlet", "max-train-samples": 48, "batch-size": 8, "lr": 0.05}


def _client(run_config, pid, num, ctx=None):
    cfg = parse_run_config(run_config)
    ctx = ctx or make_context(run_config, pid, num)
    return METHODS[cfg.method].make_client(cfg, parse_node_config(ctx.node_config), ctx), ctx


def test_fedproto_reply_is_class_means_of_the_stored_model_and_proto_accuracy_is_nearest_prototype():
    rc = {"method": "fedproto", **UCI}
    client, ctx = _client(rc, 1, 3)
    (protos, counts), n, metrics = client.fit([], {"server-round": 1})
    data = client.data
    assert protos.shape == (10, 50) and protos.dtype == np.float32 and counts.dtype == np.int64
    assert n == data.num_train and metrics["partition-id"] == 1 and "loss-proto" not in metrics
    np.testing.assert_array_equal(counts, np.bincount(data.y_train.numpy(), minlength=10))
    # independent: reload the private model from context.state, embed sample by sample, average per class
    fresh, _ = _client(rc, 1, 3, ctx)
    model = fresh.load_model().eval()
    with torch.no_grad():
        z = [model.features(data.x_train[i:i + 1])[0].numpy() for i in range(data.num_train)]
    for c in range(10):
        rows = [z[i] for i in range(data.num_train) if int(data.y_train[i]) == c]
        if rows:
            np.testing.assert_allclose(protos[c], np.mean(rows, axis=0), rtol=1e-4, atol=1e-5)
    # evaluation with global prototypes = this client's own (all classes held on UCI Dirichlet)
    present = counts > 0
    glob = encode_global(protos, present, prototype_margin(protos, present))
    loss, n_test, ev = fresh.evaluate(glob, {"server-round": 1})
    with torch.no_grad():
        zt = model.features(data.x_test).numpy()
    correct = 0
    for zi, yi in zip(zt, data.y_test.numpy()):
        best = min((float(((zi - protos[c]) ** 2).mean()), c) for c in data.classes if present[c])[1]
        correct += int(best == yi)
    assert ev["proto-accuracy"] == pytest.approx(correct / n_test)
    assert 0.0 <= ev["accuracy"] <= 1.0 and n_test == len(data.y_test) and loss > 0


def test_private_model_persists_between_rounds():
    rc = {"method": "fedproto", **UCI}
    client, ctx = _client(rc, 0, 3)
    client.fit([], {"server-round": 1})
    again, _ = _client(rc, 0, 3, ctx)
    trained = again.load_model().state_dict()
    new_ctx_client, _ = _client(rc, 0, 3)
    initial = new_ctx_client.load_model().state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    # the same partition starts from the same initial weights in any process
    other, _ = _client(rc, 0, 3)
    assert all(torch.equal(initial[k], v) for k, v in other.load_model().state_dict().items())


def test_model_heterogeneous_clients_differ_in_width_but_share_d():
    rc = {"method": "fedproto", "proto-model-heter": True, **UCI}
    widths = {}
    for pid in (0, 9, 15):
        client, _ = _client(rc, pid, 20)
        model = client.load_model()
        widths[pid] = model.conv2.out_channels
        assert model.feature_dim == 50
    assert widths == {0: 18, 9: 20, 15: 22}
    assert [heterogeneous_channels(p) for p in (6, 7, 13, 14)] == [18, 20, 20, 22]


def test_training_time_prototypes_option():
    rc = {"method": "fedproto", "proto-local-protos": "training", **UCI}
    client, _ = _client(rc, 2, 3)
    (protos, counts), _, _ = client.fit([], {"server-round": 1})
    held = counts > 0
    assert np.isfinite(protos).all() and held.any()
    # training-time (dropout on, weights moving) means differ from a no-grad pass over the same model
    post, _ = _client({**rc, "proto-local-protos": "post-pass"}, 2, 3)
    (protos_post, _), _, _ = post.fit([], {"server-round": 1})
    assert not np.allclose(protos[held], protos_post[held])


def test_training_time_prototypes_need_no_extra_pass_unless_the_round_is_monitored(monkeypatch):
    """With prototypes from the training pass, the no-grad pass over the training set only serves the
    monitors (MI), which the server asks for on evaluated rounds only; the reply is the same either way."""
    from pollen.methods.prototypes import PrototypeRound

    passes = []
    embed = PrototypeRound.embed
    monkeypatch.setattr(PrototypeRound, "embed", lambda self, model, x, **kw: passes.append(len(x)) or embed(
        self, model, x, **kw))
    rc = {"method": "fedproto", "proto-local-protos": "training", **UCI}
    quiet, _ = _client(rc, 2, 3)
    (protos, counts), _, metrics = quiet.fit([], {"server-round": 1, "monitor": False})
    assert passes == [] and "mi-classifier" not in metrics
    monitored, _ = _client(rc, 2, 3)
    (protos_m, counts_m), _, metrics_m = monitored.fit([], {"server-round": 1, "monitor": True})
    assert passes == [monitored.data.num_train] and "mi-classifier" in metrics_m
    np.testing.assert_array_equal(protos, protos_m)
    np.testing.assert_array_equal(counts, counts_m)
    passes.clear()  # post-pass prototypes need the pass on every round
    post, _ = _client({**rc, "proto-local-protos": "post-pass"}, 2, 3)
    post.fit([], {"server-round": 1, "monitor": False})
    assert passes == [post.data.num_train]


def test_bd_fedproto_clients_use_negatives_and_da_follows_the_loss_history(data_root):
    rc = {"method": "bd-fedproto", "task": "mnist-shot", "data-root": data_root, "shot-ways": 2,
          "shot-stdev": 0, "shot-shots": 12, "shot-test-per-class": 4, "batch-size": 4, "lr": 0.05}
    ctxs = [make_context(rc, pid, 4) for pid in range(4)]
    payload, per_round = [], []
    for rnd in range(1, 5):
        replies, metrics = [], []
        for pid, ctx in enumerate(ctxs):
            client, _ = _client(rc, pid, 4, ctx)
            arrays, _, m = client.fit(payload, {"server-round": rnd})
            replies.append(arrays)
            metrics.append(m)
        per_round.append(metrics)
        protos, present = aggregate_prototypes([a[0] for a in replies], [a[1] for a in replies])
        payload = encode_global(protos, present, prototype_margin(protos, present))
    # rounds 2+ train against prototypes, with negatives from classes the client does not hold
    assert all("loss-proto" in m and "loss-neg" in m and "mi" in m for m in per_round[1])
    assert all(m["lambda"] == 1.0 for r in per_round[:3] for m in r)  # < 2 rounds of history
    for pid in range(4):
        history = [(per_round[r][pid]["loss-ce"], per_round[r][pid]["loss-proto"]) for r in (1, 2)]
        expected = dynamic_lambda(history, 1.0, 1.0, 4)
        assert per_round[3][pid]["lambda"] == pytest.approx(expected, rel=1e-9)


def test_proto_keys_are_validated_with_the_key_name():
    with pytest.raises(ConfigError, match="proto-negative"):
        parse_run_config({"method": "bd-fedproto", "proto-negative": "triplet"})
    with pytest.raises(ConfigError, match="proto-lambda"):
        parse_run_config({"method": "fedproto", "proto-lambda": 0})
    with pytest.raises(ConfigError, match="proto-da-kappa"):
        parse_run_config({"method": "bd-fedproto", "proto-da-kappa": 1.5})
    with pytest.raises(ConfigError, match="proto-fault-partition"):  # fault injection is tests/faults.py's
        parse_run_config({"method": "fedproto", "proto-fault-partition": 1})
