"""The GLFC-family strategy: active-client sampling, head growth, reply validation, unweighted
averaging, old-model sending; and the client's state across a task boundary on real data."""

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager

from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.methods_glfc import make_client, settings_for
from pollen.clients.glfc import build_lenet, build_stream_model
from pollen.datasets.incremental import StreamConfig, plan_stream
from pollen.strategies.glfc import IncrementalFedAvg, aia, average_forgetting
from tests.conftest import make_context, stub_node

torch.set_num_threads(1)
OK = Status(Code.OK, "")


def _strategy(old_model="proxy", clients_per_round=3):
    plan = plan_stream(StreamConfig(num_tasks=2, classes_per_task=5, initial_clients=3, new_clients=2, seed=0))
    make = lambda n: build_stream_model("mnist-fmnist-cil", "cnn_mnist", n, 1.0)  # noqa: E731
    test_x = torch.randn(20, 1, 28, 28)
    test_y = torch.arange(20) % 10
    return IncrementalFedAvg(plan=plan, rounds_per_task=2, clients_per_round=clients_per_round, make_model=make,
                             lenet=build_lenet("mnist-fmnist-cil", 0) if old_model == "proxy" else None,
                             test_data=lambda n: (test_x[test_y < n], test_y[test_y < n]), old_model=old_model,
                             proxy_iterations=2, proxy_keep=1, seed=0)


def _manager(n=5):
    cm = SimpleClientManager()
    for pid in range(n):
        cm.register(stub_node(f"node-{(pid * 37) % 101}", pid))
    return cm


def test_samples_only_clients_that_exist_and_grows_the_head():
    strat = _strategy(clients_per_round=10)
    cm = _manager()
    params = strat.initialize_parameters(cm)
    ins = strat.configure_fit(1, params, cm)
    assert sorted(p.partition for p, _ in ins) == [0, 1, 2]  # the 2 joining clients are not there yet
    assert all(i.config["task"] == 0 and i.config["num-classes"] == 5 for _, i in ins)
    head_w = strat._global[-2].copy()
    ins = strat.configure_fit(3, params, cm)  # round 3 = task 1
    assert sorted(p.partition for p, _ in ins) == [0, 1, 2, 3, 4]
    assert strat._global[-2].shape[0] == 10 and np.array_equal(strat._global[-2][:5], head_w)
    assert all(i.config["num-classes"] == 10 and i.config["round-in-task"] == 0 for _, i in ins)
    few = _strategy(clients_per_round=2)
    assert len(few.configure_fit(1, params, _manager())) == 2


def _reply(strat, pid, grads=(), num_examples=10, scale=1.0, **metrics):
    arrays = [a.astype(a.dtype) * (scale if a.dtype.kind == "f" else 1) for a in strat._global] + list(grads)
    m = {"partition-id": pid, "num-gradients": len(grads) // 8, **metrics}
    return stub_node(f"n{pid}", pid), FitRes(OK, ndarrays_to_parameters(arrays), num_examples, m)


def _grad_set(strat, label=2, nan=False, bad_shape=False):
    lenet = strat.lenet
    x = torch.randn(1, 28, 28)
    out = lenet(x.unsqueeze(0))
    loss = torch.nn.functional.cross_entropy(out, torch.tensor([label]))
    g = [t.detach().numpy().copy() for t in torch.autograd.grad(loss, list(lenet.parameters()))]
    if nan:
        g[3][0] = np.nan
    if bad_shape:
        g[0] = g[0][:, :, :3]
    return g


def test_replies_are_validated_and_averaged_unweighted():
    strat = _strategy()
    cm = _manager()
    strat.configure_fit(1, strat.initialize_parameters(cm), cm)
    good1 = _reply(strat, 0, _grad_set(strat), num_examples=10, scale=1.0)
    good2 = _reply(strat, 1, [], num_examples=1000, scale=3.0)
    bad = [_reply(strat, 2, _grad_set(strat, nan=True)),
           _reply(strat, 3, _grad_set(strat, bad_shape=True)),
           _reply(strat, 4, _grad_set(strat)[:7]),  # 7 arrays for num-gradients = 0
           _reply(strat, 5, _grad_set(strat), num_examples=0)]
    expected = [((a * 1.0 + a * 3.0) / 2).astype(a.dtype) if a.dtype.kind == "f" else a for a in strat._global]
    params, metrics = strat.aggregate_fit(1, [good1, good2] + bad, [])
    assert metrics["accepted"] == 2 and metrics["rejected"] == 4
    reasons = {r.client: r.reason for r in strat.take_rejections()}
    assert "NaN" in reasons["partition 2"]
    assert "shape" in reasons["partition 3"]
    assert "7 gradient arrays" in reasons["partition 4"]
    assert "num_examples" in reasons["partition 5"]
    got = parameters_to_ndarrays(params)
    for g, e in zip(got, expected):  # unweighted: 10 vs 1000 examples does not matter
        assert np.allclose(g, e, atol=1e-6)
    assert metrics["proxy-gradients"] == 1 and metrics["proxy-monitor-size"] == 1
    assert strat.proxy.slot2.version > 0


def test_old_model_is_sent_only_when_its_version_changed():
    strat = _strategy(old_model="previous-task", clients_per_round=5)
    cm = _manager()
    params = strat.initialize_parameters(cm)
    ins = strat.configure_fit(1, params, cm)
    assert not any(i.config["old1-sent"] for _, i in ins)  # no old model during the first task
    ins = strat.configure_fit(3, params, cm)
    n_model = len(strat._global)
    for _, i in ins:
        assert i.config["old1-sent"] and i.config["old1-classes"] == 5
        assert len(parameters_to_ndarrays(i.parameters)) == n_model + i.config["old1-arrays"]
    version = strat.proxy.slot1.version
    strat.aggregate_fit(3, [_reply(strat, 0, **{"old1-version": version})], [])
    ins = {p.partition: i for p, i in strat.configure_fit(4, params, cm)}
    assert not ins[0].config["old1-sent"] and len(parameters_to_ndarrays(ins[0].parameters)) == n_model
    assert ins[1].config["old1-sent"]


def test_evaluate_reports_seen_classes_and_per_task_accuracy():
    strat = _strategy()
    cm = _manager()
    strat.configure_fit(1, strat.initialize_parameters(cm), cm)
    _, m = strat.evaluate(1, None)
    assert m["seen-classes"] == 5 and "task0-accuracy" in m and "task1-accuracy" not in m
    assert "aia" not in m  # round 1 of 2: not the end of the task
    _, m2 = strat.evaluate(2, None)
    assert m2["aia"] == pytest.approx(m2["accuracy"]) and m2["forgetting"] == 0.0
    strat.configure_fit(3, None, cm)
    _, m = strat.evaluate(3, None)
    assert m["seen-classes"] == 10 and "task1-accuracy" in m
    _, m4 = strat.evaluate(4, None)
    assert m4["aia"] == pytest.approx((m2["accuracy"] + m4["accuracy"]) / 2)
    assert m4["forgetting"] == pytest.approx(m2["task0-accuracy"] - m4["task0-accuracy"])


def test_incremental_metrics():
    assert aia([0.9, 0.7, 0.6]) == pytest.approx(0.7333333)
    acc = [[0.9], [0.8, 0.95], [0.5, 0.6, 0.9]]
    # task 0: best 0.9 -> 0.5 (0.4); task 1: best 0.95 -> 0.6 (0.35)
    assert average_forgetting(acc) == pytest.approx(0.375)
    assert average_forgetting([[0.9]]) == 0.0


def test_config_validation():
    base = {"method": "glfc", "task": "mnist-fmnist-cil", "num-server-rounds": 8}
    assert parse_run_config(base).extra["glfc-tasks"] == 4
    with pytest.raises(ConfigError, match="class-incremental task"):
        parse_run_config({**base, "task": "uci-dirichlet"})
    with pytest.raises(ConfigError, match="num-server-rounds"):
        parse_run_config({**base, "num-server-rounds": 5})
    with pytest.raises(ConfigError, match="glfc-tau"):
        parse_run_config({**base, "glfc-classes-per-task": 3})  # ln 3 < 1.2: could never fire
    parse_run_config({**base, "glfc-classes-per-task": 3, "glfc-oracle-boundary": True})
    with pytest.raises(ConfigError, match="exceeds"):
        parse_run_config({**base, "glfc-classes-per-task": 6})
    with pytest.raises(ConfigError, match="glfc-lr-schedule"):
        parse_run_config({**base, "glfc-lr-schedule": "step"})


def test_client_learns_classes_herds_exemplars_and_shares_gradients():
    rc = {"method": "glfc", "task": "uci-digits-cil", "num-server-rounds": 4, "glfc-tasks": 2,
          "glfc-rounds-per-task": 2, "glfc-initial-clients": 3, "glfc-new-clients": 2,
          "model": "cnn_mnist", "glfc-max-per-class": 12, "glfc-memory-size": 8, "glfc-oracle-boundary": True,
          "glfc-perturb-steps": 2, "local-epochs": 1, "lr": 0.1, "momentum": 0.0}
    cfg = parse_run_config(rc)
    plan = plan_stream(settings_for(cfg).stream)
    pid = next(c for c in plan.groups[1]["b"])  # an existing client that gets new classes at task 1
    ctx = make_context(rc, pid, 5)
    node = parse_node_config(ctx.node_config)
    strat = _strategy()
    cm = _manager()
    params = parameters_to_ndarrays(strat.initialize_parameters(cm))

    def config(rnd, task, num_classes):
        return {"server-round": rnd, "task": task, "round-in-task": (rnd - 1) % 2, "num-classes": num_classes,
                "model-arrays": len(params), "old1-sent": False, "old2-sent": False}

    arrays, n, m = make_client(cfg, node, ctx).fit(params, config(1, 0, 5))
    k = len(plan.client_classes(pid, 0))
    assert m["transition"] == 1 and m["num-gradients"] == k and len(arrays) == len(params) + 8 * k
    assert m["learned-classes"] == 0 and m["exemplars"] == 0 and n == 12 * k
    _, _, m = make_client(cfg, node, ctx).fit(params, config(2, 0, 5))
    assert m["transition"] == 0 and m["num-gradients"] == 0
    strat.configure_fit(3, None, cm)
    grown = strat._global
    arrays, n, m = make_client(cfg, node, ctx).fit(grown, {**config(3, 1, 10), "model-arrays": len(grown)})
    assert m["transition"] == 1 and m["learned-classes"] == k
    quota = 8 // k
    assert m["exemplars"] == quota * k and n == 12 * len(plan.client_classes(pid, 1)) + quota * k
    assert arrays[len(grown) - 2].shape[0] == 10
    # the code's every-client detection: an unsampled client updates its memory through evaluate()
    other = [c for c in plan.groups[1]["b"] if c != pid][0]
    ctx2 = make_context(rc, other, 5)
    node2 = parse_node_config(ctx2.node_config)
    make_client(cfg, node2, ctx2).fit(params, config(1, 0, 5))
    _, _, em = make_client(cfg, node2, ctx2).evaluate(
        grown, {"task": 1, "num-classes": 10, "model-arrays": len(grown), "detect-only": True})
    k2 = len(plan.client_classes(other, 0))
    assert em["transition"] == 1 and em["learned-classes"] == k2 and em["exemplars"] == (8 // k2) * k2

def test_detect_all_clients_contacts_the_unsampled_existing_clients():
    strat = _strategy(clients_per_round=2)
    cm = _manager()
    params = strat.initialize_parameters(cm)
    assert strat.configure_evaluate(1, params, cm) == []  # ours: only sampled clients detect
    strat.detect_all_clients = True
    sampled = {p.partition for p, _ in strat.configure_fit(1, params, cm)}
    ins = strat.configure_evaluate(1, params, cm)
    assert {p.partition for p, _ in ins} == {0, 1, 2} - sampled
    assert all(i.config["detect-only"] for _, i in ins)


def test_transition_clients_distil_from_the_previous_tasks_best_model():
    strat = _strategy()
    strat.proxy.task = 0  # task 0's gradients have arrived
    assert strat.transition_slot(0) == 1
    assert strat.transition_slot(1) == 2  # task 1 started, its gradients not yet in: slot 2 = task 0's best
    strat.proxy.receive(1, torch.zeros(2, 1, 28, 28), torch.tensor([5, 6]))
    assert strat.transition_slot(1) == 1  # rotated: task 0's best now sits in slot 1
