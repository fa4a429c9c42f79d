"""The GLFC-family strategy on the Message API, driven by real Flower ``Message`` objects: node identity by
query, active-client sampling, head growth, reply screening, unweighted averaging, old-model sending,
server-side evaluation; the client's state across a task boundary through the records adapter; and a
whole run in process through the real ClientApp handlers."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from pollen.app.client_app import query as answer_query
from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.methods_glfc import (
    GLFC_ADAPTER,
    initial_arrays,
    make_client,
    make_strategy,
    settings_for,
)
from pollen.datasets.incremental import StreamConfig, plan_stream
from pollen.methods.glfc import build_lenet, build_stream_model
from pollen.protocol import glfc as protocol
from pollen.protocol.records import ARRAYS, CONFIG, METRICS, array_record, metric_record
from pollen.strategies import NoTrainingError
from pollen.strategies.glfc import IncrementalFedAvg, aia, average_forgetting
from tests.conftest import make_context
from pollen.testing import InProcessGrid, clientapp_node

torch.set_num_threads(1)
HEAD_W, HEAD_B = "head.weight", "head.bias"


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages can only be built inside a run: give this process a ServerApp identity."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def node_id(pid: int) -> int:
    return 5000 + 37 * pid  # node ids unrelated to partitions, as on a real SuperLink


def identity_grid(n: int, overrides=None) -> InProcessGrid:
    """Nodes that answer queries like Pollen's ClientApp (:func:`pollen.app.client_app.query`); nothing else."""
    def handler(pid):
        ctx = make_context({}, pid, n)

        def handle(msg):
            assert msg.metadata.message_type == MessageType.QUERY, "this grid's nodes only answer queries"
            return answer_query(msg, ctx)
        return handle
    overrides = overrides or {}
    return InProcessGrid({node_id(p): overrides.get(p) or handler(p) for p in range(n)})


def _strategy(old_model="proxy", clients_per_round=3, schedule=None, **kwargs):
    def make(n):
        return build_stream_model("mnist-fmnist-cil", "cnn_mnist", n, 1.0)
    test_x = torch.randn(20, 1, 28, 28)
    test_y = torch.arange(20) % 10
    if schedule is None:
        plan = plan_stream(StreamConfig(num_tasks=2, classes_per_task=5, initial_clients=3, new_clients=2,
                                        old_fraction=0.1, class_fraction=0.6, duplicate=False, max_per_class=0, seed=0))
        kwargs.update(plan=plan, rounds_per_task=2)
    else:
        kwargs.update(schedule=schedule)
    return IncrementalFedAvg(clients_per_round=clients_per_round, make_model=make,
                             lenet=build_lenet("mnist-fmnist-cil", 0) if old_model == "proxy" else None,
                             test_data=lambda n: (test_x[test_y < n], test_y[test_y < n]), old_model=old_model,
                             proxy_iterations=2, proxy_keep=1, seed=0, node_wait_s=0, **kwargs)


def _configure(strat, rnd, grid):
    return {strat.partition_of[m.metadata.dst_node_id]: m
            for m in strat.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)}


def _grad_set(strat, label=2, nan=False, bad_shape=False, drop=None, dtype=np.float32):
    lenet = strat.lenet
    out = lenet(torch.randn(1, 1, 28, 28))
    loss = torch.nn.functional.cross_entropy(out, torch.tensor([label]))
    names = [n for n, _ in lenet.named_parameters()]
    grads = torch.autograd.grad(loss, list(lenet.parameters()))
    g = {n: t.detach().numpy().astype(dtype) for n, t in zip(names, grads)}
    if nan:
        g[names[3]][0] = np.nan
    if bad_shape:
        g[names[0]] = g[names[0]][:, :, :3]
    if drop:
        del g[drop]
    return g


def _reply(msg, pid, grads=(), num_examples=10, scale=1.0, state=None, **metrics):
    model = msg.content[ARRAYS]
    if state is None:
        state = {k: a.numpy() * (scale if a.numpy().dtype.kind == "f" else 1) for k, a in model.items()}
        state = {k: v.astype(model[k].numpy().dtype) for k, v in state.items()}
    m = {"partition-id": pid, "transition": 0, "old1-version": 0, "old2-version": 0, **metrics}
    content = protocol.encode_train_reply(state, num_examples, list(grads), m)
    return Message(content, reply_to=msg)


def test_unknown_nodes_are_queried_once_and_only_clients_that_exist_are_sampled():
    strat = _strategy(clients_per_round=10)
    grid = identity_grid(5)
    msgs = _configure(strat, 1, grid)
    queries = [m for m in grid.sent if m.metadata.message_type == MessageType.QUERY]
    assert sorted(m.metadata.dst_node_id for m in queries) == sorted(node_id(p) for p in range(5))
    assert strat.node_of == {p: node_id(p) for p in range(5)}
    assert sorted(msgs) == [0, 1, 2]  # partitions 3 and 4 join at task 1
    for pid, m in msgs.items():
        cfg = m.content[CONFIG]
        assert m.metadata.message_type == MessageType.TRAIN and m.metadata.dst_node_id == node_id(pid)
        assert (cfg["task"], cfg["num-classes"], cfg["round-in-task"], cfg["server-round"]) == (0, 5, 0, 1)
        assert (cfg["num-tasks"], cfg["classes-per-task"], cfg["rounds-per-task"]) == (2, 5, 2)
        assert not cfg["old1-sent"] and not cfg["old2-sent"] and "old-model-1" not in m.content
        assert m.content[ARRAYS][HEAD_W].shape[0] == 5
    head = strat.global_record()[HEAD_W].numpy().copy()
    grid.sent.clear()
    msgs = _configure(strat, 3, grid)  # round 3 = task 1: head grown, everybody exists
    assert not [m for m in grid.sent if m.metadata.message_type == MessageType.QUERY]  # asked once only
    assert sorted(msgs) == [0, 1, 2, 3, 4]
    grown = msgs[0].content[ARRAYS][HEAD_W].numpy()
    assert grown.shape[0] == 10 and np.array_equal(grown[:5], head)
    assert all(m.content[CONFIG]["num-classes"] == 10 and m.content[CONFIG]["round-in-task"] == 0
               for m in msgs.values())
    assert len(_configure(_strategy(clients_per_round=2), 1, identity_grid(5))) == 2


def test_a_node_that_cannot_say_its_partition_is_never_sampled_and_a_duplicate_claim_quarantines():
    def broken(msg):  # a ClientApp without a query handler: Flower turns its exception into an error reply
        return ValueError("No query function registered with name 'default'")

    def impostor(msg):  # claims partition 0, which another node serves
        return Message(protocol.encode_identity_reply(0), reply_to=msg)

    strat = _strategy(clients_per_round=10)
    grid = identity_grid(5, {1: broken, 2: impostor})
    msgs = _configure(strat, 1, grid)
    assert sorted(msgs) == []  # partition 0: quarantined (two claimants); 1: silent; 2: its node lies
    rep = strat.take_round_report(1)
    assert [f["stage"] for f in rep.failures] == ["query"] and "No query function" in rep.failures[0]["reason"]
    assert rep.failures[0]["client"] == f"node {node_id(1)}"
    assert [r["stage"] for r in rep.rejected] == ["query", "query"]
    assert all("partition 0 is quarantined" in r["reason"] for r in rep.rejected)
    assert rep.quarantined == [{"partition": 0, "nodes": [node_id(0), node_id(2)]}]
    assert _configure(strat, 2, grid) == {}  # never sampled, and still named every round
    assert strat.take_round_report(2).quarantined == [{"partition": 0, "nodes": [node_id(0), node_id(2)]}]
    # nobody identified at all: the round trains nobody and the run fails loudly
    lost = _strategy()
    nobody = identity_grid(3, {p: broken for p in range(3)})
    assert list(lost.configure_train(1, ArrayRecord(), ConfigRecord(), nobody)) == []
    with pytest.raises(NoTrainingError, match="no node was sampled"):
        lost.aggregate_train(1, [])


def test_replies_are_screened_before_decoding_and_averaged_unweighted():
    schedule = protocol.TaskSchedule(num_tasks=2, classes_per_task=2, rounds_per_task=2, population=(12, 12))
    strat = _strategy(clients_per_round=12, schedule=schedule)
    msgs = _configure(strat, 1, identity_grid(12))
    good1 = _reply(msgs[0], 0, [_grad_set(strat)], num_examples=10, scale=1.0, transition=1)
    good2 = _reply(msgs[1], 1, [], num_examples=1000, scale=3.0)
    fake_big = _reply(msgs[11], 11, [_grad_set(strat)])
    fake_big.content[protocol.PROTO_GRADS]["g0.head.weight"].shape = (10_000_000,)  # metadata lies: never decoded
    wrong_dtype = _reply(msgs[8], 8)
    wrong_dtype.content[ARRAYS] = array_record(
        {k: (a.numpy().astype(np.float64) if a.numpy().dtype.kind == "f" else a.numpy())
         for k, a in msgs[8].content[ARRAYS].items()})
    f64_grads = _reply(msgs[7], 7, [_grad_set(strat)])  # the encoder casts to float32: bypass it
    f64_grads.content[protocol.PROTO_GRADS] = array_record(
        {k: a.numpy().astype(np.float64) for k, a in f64_grads.content[protocol.PROTO_GRADS].items()})
    extra_record = _reply(msgs[9], 9)
    extra_record.content["surprise"] = array_record({"x": np.zeros(2, np.float32)})
    bad = [_reply(msgs[2], 2, [_grad_set(strat, nan=True)]),
           _reply(msgs[3], 3, [_grad_set(strat, bad_shape=True)]),
           _reply(msgs[4], 4, [_grad_set(strat, drop="head.bias")]),  # 7 arrays: not a whole set
           _reply(msgs[5], 5, [_grad_set(strat)] * 3),  # 3 sets > 2 classes per task
           _reply(msgs[6], 6, [_grad_set(strat)], num_examples=0),
           f64_grads, wrong_dtype, extra_record,
           _reply(msgs[10], 10, transition=2), fake_big]
    expected = {k: ((a.numpy() * 1.0 + a.numpy() * 3.0) / 2).astype(a.numpy().dtype) if a.numpy().dtype.kind == "f"
                else a.numpy() for k, a in msgs[0].content[ARRAYS].items()}
    arrays, metrics = strat.aggregate_train(1, [good1, good2] + bad)
    assert metrics["accepted"] == 2 and metrics["rejected"] == 10
    reasons = {r["client"]: r["reason"] for r in strat.take_round_report(1).rejected}
    assert "NaN" in reasons["partition 2"] and "'proto-grads': 'g0." in reasons["partition 2"]
    assert "shape" in reasons["partition 3"] and "g0.body.0.weight" in reasons["partition 3"]
    assert "whole number" in reasons["partition 4"]
    assert "more than 2 gradient sets" in reasons["partition 5"]
    assert "num-examples" in reasons["partition 6"]
    assert "dtype float64" in reasons["partition 7"] and "proto-grads" in reasons["partition 7"]
    assert "dtype float64" in reasons["partition 8"] and "'arrays'" in reasons["partition 8"]
    assert "surprise" in reasons["partition 9"]
    assert "transition" in reasons["partition 10"]
    assert "shape" in reasons["partition 11"] and "undecodable" not in reasons["partition 11"]
    for key, value in expected.items():  # unweighted: 10 vs 1000 examples does not matter
        assert np.allclose(arrays[key].numpy(), value, atol=1e-6), key
    assert metrics["proxy-gradients"] == 1 and metrics["proxy-monitor-size"] == 1 and metrics["transitions"] == 1
    assert strat.proxy.slot2.version > 0


def test_a_method_without_proxy_refuses_gradients_and_a_stranger_is_rejected():
    strat = _strategy(old_model="previous-task")
    msgs = _configure(strat, 1, identity_grid(5))
    lenet_grads = {f"g0.{n}": np.zeros(tuple(p.shape), np.float32)
                   for n, p in build_lenet("mnist-fmnist-cil", 0).named_parameters()}
    reply = _reply(msgs[0], 0, [{k[3:]: v for k, v in lenet_grads.items()}])
    # a reply from a node that was not asked this round (partition 3 is not active at task 0)
    never_sent = Message(RecordDict(), dst_node_id=node_id(3), message_type=MessageType.TRAIN)
    stranger = Message(protocol.encode_train_reply({k: a.numpy() for k, a in msgs[1].content[ARRAYS].items()}, 5,
                                                   metrics={"partition-id": 3}), reply_to=never_sent)
    _, metrics = strat.aggregate_train(1, [reply, stranger, _reply(msgs[2], 2)])
    reasons = {r["client"]: r["reason"] for r in strat.take_round_report(1).rejected}
    assert metrics["accepted"] == 1 and "runs no proxy" in reasons["partition 0"]
    assert "not sampled" in reasons["partition 3"]


def test_old_model_is_sent_only_when_its_version_changed():
    strat = _strategy(old_model="previous-task", clients_per_round=5)
    grid = identity_grid(5)
    assert not any(m.content[CONFIG]["old1-sent"] for m in _configure(strat, 1, grid).values())
    msgs = _configure(strat, 3, grid)  # task 1: the previous task's model is slot 1
    version = strat.proxy.slot1.version
    for m in msgs.values():
        cfg = m.content[CONFIG]
        assert cfg["old1-sent"] and cfg["old1-classes"] == 5 and cfg["old1-version"] == version
        old = m.content[protocol.OLD_MODEL[1]]
        assert list(old.keys()) == list(m.content[ARRAYS].keys()) and old[HEAD_W].shape[0] == 5
        assert protocol.OLD_MODEL[2] not in m.content
    strat.aggregate_train(3, [_reply(msgs[0], 0, **{"old1-version": version})])
    msgs = _configure(strat, 4, grid)
    assert not msgs[0].content[CONFIG]["old1-sent"] and protocol.OLD_MODEL[1] not in msgs[0].content
    assert msgs[1].content[CONFIG]["old1-sent"]
    # a claimed version the server never issued is rejected
    strat.aggregate_train(4, [_reply(msgs[1], 1, **{"old1-version": version + 100}), _reply(msgs[2], 2)])
    assert "old1-version" in strat.take_round_report(4).rejected[0]["reason"]


def test_cached_old_model_versions_survive_a_restore_and_a_node_that_failed_is_sent_them_again():
    strat = _strategy(old_model="previous-task", clients_per_round=5)
    grid = identity_grid(5)
    _configure(strat, 1, grid)
    msgs = _configure(strat, 3, grid)
    version = strat.proxy.slot1.version
    strat.aggregate_train(3, [_reply(msgs[p], p, **{"old1-version": version}) for p in (0, 1)])
    arrays, values = strat.state()
    assert values["old-models-cached"] == {"0": [version, 0], "1": [version, 0]}
    resumed = _strategy(old_model="previous-task", clients_per_round=5)
    resumed.restore(arrays, values)  # new node ids after a restart: the versions follow the partitions
    msgs = _configure(resumed, 4, identity_grid(5))
    assert [p for p, m in sorted(msgs.items()) if m.content[CONFIG]["old1-sent"]] == [2, 3, 4]
    assert resumed.state()[1]["old-models-cached"] == values["old-models-cached"]
    error = Message(Error(code=2, reason="ValueError: the server did not send old model 1"), reply_to=msgs[0])
    resumed.aggregate_train(4, [error, _reply(msgs[1], 1, **{"old1-version": version})])
    msgs = _configure(resumed, 4, identity_grid(5))
    assert [p for p, m in sorted(msgs.items()) if m.content[CONFIG]["old1-sent"]] == [0, 2, 3, 4]


def test_evaluate_global_reports_seen_classes_and_per_task_accuracy():
    strat = _strategy()
    grid = identity_grid(5)
    m0 = strat.evaluate_global(0, strat.global_record())
    assert m0["seen-classes"] == 5 and "aia" not in m0
    _configure(strat, 1, grid)
    m = strat.evaluate_global(1)
    assert m["seen-classes"] == 5 and "task0-accuracy" in m and "task1-accuracy" not in m and "loss" in m
    assert "aia" not in m  # round 1 of 2: not the end of the task
    m2 = strat.evaluate_global(2)
    assert m2["aia"] == pytest.approx(m2["accuracy"]) and m2["forgetting"] == 0.0
    _configure(strat, 3, grid)
    m = strat.evaluate_global(3)
    assert m["seen-classes"] == 10 and "task1-accuracy" in m
    m4 = strat.evaluate_global(4)
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
    with pytest.raises(ConfigError, match="needs a class-incremental stream: set task to one of .*mnist-fmnist-cil"):
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


def test_task_schedule_checks_and_plan():
    s = protocol.TaskSchedule(3, 4, 2, (2, 3, 3))
    assert [s.task_of_round(r) for r in range(8)] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert s.round_in_task(4) == 1 and s.num_clients == 3 and s.seen_classes(2) == 12 and s.num_rounds == 6
    for bad in [dict(population=(2, 1, 3)), dict(population=(2, 3)), dict(rounds_per_task=0)]:
        with pytest.raises(ValueError):
            protocol.TaskSchedule(**{**dict(num_tasks=3, classes_per_task=4, rounds_per_task=2,
                                            population=(2, 3, 3)), **bad})


UCI_RC = {"method": "glfc", "task": "uci-digits-cil", "num-server-rounds": 4, "glfc-tasks": 2,
          "glfc-rounds-per-task": 2, "glfc-initial-clients": 3, "glfc-new-clients": 2,
          "model": "cnn_mnist", "glfc-max-per-class": 12, "glfc-memory-size": 8, "glfc-oracle-boundary": True,
          "glfc-perturb-steps": 2, "local-epochs": 1, "lr": 0.1, "momentum": 0.0, "glfc-proxy-iterations": 2,
          "glfc-proxy-keep": 1, "glfc-clients-per-round": 3, "glfc-eval-per-class": 10}


def _content(model: ArrayRecord, rnd: int, task: int, detect_only=False) -> RecordDict:
    num_classes = model[HEAD_W].shape[0]
    cfg = {"server-round": rnd, "task": task, "round-in-task": (rnd - 1) % 2, "num-classes": num_classes,
           "old1-sent": False, "old2-sent": False, "old1-version": 0, "old2-version": 0, "transition-slot": 2,
           "num-tasks": 2, "classes-per-task": 5, "rounds-per-task": 2}
    if detect_only:
        cfg[protocol.DETECT_ONLY] = True
    return protocol.encode_train_content(model, ConfigRecord(cfg))


def test_client_learns_classes_herds_exemplars_and_shares_named_gradients():
    cfg = parse_run_config(UCI_RC)
    plan = plan_stream(settings_for(cfg).stream)
    pid = plan.groups[1]["b"][0]  # an existing client that gets new classes at task 1
    ctx = make_context(UCI_RC, pid, 5)
    node = parse_node_config(ctx.node_config)
    model = initial_arrays(cfg)
    lenet_names = [n for n, _ in build_lenet("uci-digits-cil", 0).named_parameters()]

    out = GLFC_ADAPTER.train(make_client(cfg, node, ctx), _content(model, 1, 0))
    m, grads = out[METRICS], out[protocol.PROTO_GRADS]
    k = len(plan.client_classes(pid, 0))
    assert m["transition"] == 1 and "num-gradients" not in m and m["partition-id"] == pid
    assert sorted(grads.keys()) == sorted(protocol.grad_key(i, n) for i in range(k) for n in lenet_names)
    assert [(k, a.shape, a.dtype) for k, a in out[ARRAYS].items()] == [(k, a.shape, a.dtype) for k, a in model.items()]
    assert m["learned-classes"] == 0 and m["exemplars"] == 0 and m["num-examples"] == 12 * k
    out = GLFC_ADAPTER.train(make_client(cfg, node, ctx), _content(model, 2, 0))
    assert out[METRICS]["transition"] == 0 and protocol.PROTO_GRADS not in out

    strat = make_strategy(cfg)
    strat._grow(1)
    grown = strat.global_record()
    out = GLFC_ADAPTER.train(make_client(cfg, node, ctx), _content(grown, 3, 1))
    m = out[METRICS]
    assert m["transition"] == 1 and m["learned-classes"] == k
    quota = 8 // k
    assert m["exemplars"] == quota * k and m["num-examples"] == 12 * len(plan.client_classes(pid, 1)) + quota * k
    assert out[ARRAYS][HEAD_W].shape[0] == 10
    # the code's every-client detection: an unsampled client updates its memory through a detect-only evaluate
    other = [c for c in plan.groups[1]["b"] if c != pid][0]
    ctx2 = make_context(UCI_RC, other, 5)
    node2 = parse_node_config(ctx2.node_config)
    GLFC_ADAPTER.train(make_client(cfg, node2, ctx2), _content(model, 1, 0))
    em = GLFC_ADAPTER.evaluate(make_client(cfg, node2, ctx2), _content(grown, 3, 1, detect_only=True))[METRICS]
    k2 = len(plan.client_classes(other, 0))
    assert em["transition"] == 1 and em["learned-classes"] == k2 and em["exemplars"] == (8 // k2) * k2


def test_client_caches_old_models_by_version_from_named_records():
    cfg = parse_run_config({**UCI_RC, "method": "glfc-wo-proxy"})
    ctx = make_context(UCI_RC, 0, 5)
    node = parse_node_config(ctx.node_config)
    model = initial_arrays(cfg)
    content = _content(model, 3, 1)
    content[CONFIG]["old1-sent"], content[CONFIG]["old1-version"], content[CONFIG]["old1-classes"] = True, 7, 5
    with pytest.raises(ValueError, match="old-model-1"):
        GLFC_ADAPTER.train(make_client(cfg, node, ctx), content)
    content[protocol.OLD_MODEL[1]] = model
    out = GLFC_ADAPTER.train(make_client(cfg, node, ctx), content)
    assert out[METRICS]["old1-version"] == 7 and out[METRICS]["old2-version"] == 0
    # not sent again: the cached one is used; a node that lost its state says so instead of training without it
    later = _content(model, 4, 1)
    later[CONFIG]["old1-version"], later[CONFIG]["old1-classes"] = 7, 5
    assert GLFC_ADAPTER.train(make_client(cfg, node, ctx), later)[METRICS]["old1-version"] == 7
    fresh = make_context(UCI_RC, 0, 5)
    with pytest.raises(ValueError, match="old model 1 version 7, believing this node caches it, but it caches version 0"
                       ):
        GLFC_ADAPTER.train(make_client(cfg, parse_node_config(fresh.node_config), fresh), later)


def test_answer_query_replies_with_the_node_partition():
    msg = Message(protocol.query_content(1), dst_node_id=node_id(4), message_type=MessageType.QUERY)
    reply = answer_query(msg, make_context({}, 4, 5))
    assert protocol.decode_identity_reply(reply.content) == (4, None)
    assert reply.metadata.src_node_id == node_id(4) and reply.metadata.message_type == MessageType.QUERY
    bad = RecordDict({METRICS: metric_record(0, {"partition-id": 1.5})})
    assert "whole number" in protocol.decode_identity_reply(bad)[1]


def client_app_grid(run_config: dict, n: int, state_root) -> InProcessGrid:
    """Nodes running Pollen's real ClientApp (train/evaluate) with a real Context each; queries are
    answered by :func:`pollen.app.client_app.query`, the handler the ClientApp registers for them."""
    from pollen.app.client_app import app

    def handler(pid):
        node = clientapp_node(app, run_config, pid, n, node_id=node_id(pid), state_dir=str(state_root / f"p{pid}"))
        ctx = make_context({}, pid, n)
        return lambda msg: answer_query(msg, ctx) if msg.metadata.message_type == MessageType.QUERY else node(msg)
    return InProcessGrid({node_id(p): handler(p) for p in range(n)})


@pytest.mark.parametrize("method", ["glfc", "fedavg-icarl"])
def test_a_whole_run_in_process_through_the_client_app(method, tmp_path):
    rc = {**UCI_RC, "method": method, "glfc-detect-all-clients": True, "out-dir": str(tmp_path / "runs")}
    cfg = parse_run_config(rc)
    strat = make_strategy(cfg)
    grid = client_app_grid(rc, 5, tmp_path)
    result = strat.start(grid=grid, initial_arrays=initial_arrays(cfg), num_rounds=4, evaluate_fn=strat.evaluate_global)
    reports = [strat.take_round_report(r) for r in range(1, 5)]
    assert all(rep.accepted == 3 and not rep.rejected and not rep.failures for rep in reports), \
        [(rep.rejected, rep.failures) for rep in reports]
    assert [sorted(int(k.split()[-1]) for k in rep.fit_clients) <= [0, 1, 2] for rep in reports[:2]] == [True] * 2
    assert {rep.evaluated for rep in reports} <= {0, 2}  # the unsampled active nodes detect
    assert [result.evaluate_metrics_serverapp[r]["seen-classes"] for r in range(5)] == [5, 5, 5, 10, 10]
    assert result.arrays[HEAD_W].shape[0] == 10 and "aia" in result.evaluate_metrics_serverapp[4]
    if method == "glfc":
        assert sum(result.train_metrics_clientapp[r]["proxy-gradients"] for r in range(1, 5)) > 0
    assert len([m for m in grid.sent if m.metadata.message_type == MessageType.QUERY]) == 5


def test_transition_clients_distil_from_the_previous_tasks_best_model():
    strat = _strategy()
    strat.proxy.task = 0  # task 0's gradients have arrived
    assert strat.transition_slot(0) == 1
    assert strat.transition_slot(1) == 2  # task 1 started, its gradients not yet in: slot 2 = task 0's best
    strat.proxy.receive(1, torch.zeros(2, 1, 28, 28), torch.tensor([5, 6]))
    assert strat.transition_slot(1) == 1  # rotated: task 0's best now sits in slot 1


def test_the_strategy_module_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, pollen.strategies, pollen.strategies.glfc, pollen.protocol.glfc; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_run_resumed_from_its_state_ends_where_an_uninterrupted_one_does(tmp_path):
    from pollen.app.checkpoints import latest_checkpoint, write_checkpoint

    rc = {**UCI_RC, "out-dir": str(tmp_path / "runs")}
    cfg = parse_run_config(rc)
    whole = make_strategy(cfg)
    full = whole.start(grid=client_app_grid(rc, 5, tmp_path / "a"), initial_arrays=initial_arrays(cfg), num_rounds=4,
                       evaluate_fn=whole.evaluate_global)
    first = make_strategy(cfg)
    grid = client_app_grid(rc, 5, tmp_path / "b")
    first.start(grid=grid, initial_arrays=initial_arrays(cfg), num_rounds=2, evaluate_fn=first.evaluate_global)
    arrays, values = first.state()
    assert {"model.head.weight", "old2.head.weight", "proxy.monitor-x"} <= set(arrays)
    write_checkpoint(tmp_path / "ckpt", 2, arrays, values, {}, keep=1)  # safetensors + JSON, as the ServerApp does
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    second = make_strategy(cfg)
    second.restore(ckpt.arrays, ckpt.values)
    rest = second.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=4, evaluate_fn=second.evaluate_global,
                        first_round=3)
    for key in full.arrays.keys():
        assert np.array_equal(full.arrays[key].numpy(), rest.arrays[key].numpy()), key
    assert dict(full.evaluate_metrics_serverapp[4]) == dict(rest.evaluate_metrics_serverapp[4])
