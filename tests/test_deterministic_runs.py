"""Two runs of one command write the same numbers, whichever node answers first.

Replies reach the server in the order the nodes finish, and node ids are new in every run; float sums
depend on the order of their terms. The strategies therefore take replies in partition order
(``PollenStrategy.reply_order``). Here the same clients answer from other node ids, run in another
order and are delivered in another order (:class:`ShuffledGrid`): every aggregate, every metric
average, the GLFC proxy's pool (its reconstructions) and a whole run's ``metrics.jsonl`` must be
bit-identical. Bit-equality holds by construction: the same terms are summed in the same order.

A float32 aggregate hides the order (its float64 sum rounds to the same float32 almost always), so the
FedAvg and homogeneous-logit states here are float64; prototypes and logits must be float32, and there
the order shows in the float64 metric averages; for GLFC in the proxy's pool as well. Each test fails
with replies taken in arrival order (checked by making ``reply_order`` a constant).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict

from pollen.protocol import glfc as glfc_protocol
from pollen.protocol.identity import encode_identity_reply
from pollen.protocol.logits import encode_logit_reply
from pollen.protocol.prototypes import encode_prototype_reply
from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import LogitAveraging, PrototypeStrategy, WeightAveraging
from pollen.testing import InProcessGrid, clientapp_node

PARTITIONS = 6
# Two runs' node ids: unrelated to the partitions, in opposite orders (sorted ids = partitions reversed in B).
NODE_IDS = ({p: 100 + p for p in range(PARTITIONS)}, {p: 9000 - 37 * p for p in range(PARTITIONS)})
# What metrics.jsonl measures in seconds: the only values two identical runs may differ in.
TIMING_FIELDS = frozenset({"wall-time-s", "elapsed-s", "proxy-seconds", "proxy-images-per-s"})


class ShuffledGrid(InProcessGrid):
    """An in-process grid whose nodes run in one shuffled order and whose replies arrive in another,
    both drawn from ``seed``: the arrival order of a real grid, made repeatable."""

    def __init__(self, handlers, seed: int):
        super().__init__(handlers)
        self.rng = random.Random(seed)
        self.arrivals: list[list[int]] = []  # source node ids of each send's replies, in delivery order

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.rng.shuffle(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        self.rng.shuffle(replies)
        self.arrivals.append([int(r.metadata.src_node_id) for r in replies])
        return replies


def _grid(make_handler, run: int, partitions: int = PARTITIONS) -> ShuffledGrid:
    ids = NODE_IDS[run]
    return ShuffledGrid({ids[p]: make_handler(p) for p in range(partitions)}, seed=run)


def _arrivals_by_partition(grid: ShuffledGrid, run: int) -> list[list[int]]:
    pid_of = {n: p for p, n in NODE_IDS[run].items()}
    return [[pid_of[n] for n in sent] for sent in grid.arrivals]


def _draws(pid: int, server_round: int) -> np.random.Generator:
    """A client's numbers for a round: the same whichever node id serves it and whenever it runs."""
    return np.random.default_rng([pid, server_round])


def _metrics(pid: int, server_round: int, **extra) -> dict:
    rng = _draws(pid, 1000 + server_round)
    return {"partition-id": pid, "train-loss": float(rng.random() * 3), "accuracy": float(rng.random()), **extra}


def _eval_reply(pid: int, msg: Message) -> RecordDict:
    r = int(msg.content["config"]["server-round"])
    rng = _draws(pid, 2000 + r)
    return RecordDict({"metrics": MetricRecord({"num-examples": int(rng.integers(5, 60)), "partition-id": pid,
                                                "loss": float(rng.random() * 2), "accuracy": float(rng.random())})})


def _exact(value):
    """Arrays as (dtype, shape, bytes) and metric records as dicts: ``==`` is then bit-equality."""
    if isinstance(value, ArrayRecord):
        return {k: (a.dtype, tuple(a.shape), a.numpy().tobytes()) for k, a in value.items()}
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, torch.Tensor):
        return _exact(value.detach().cpu().numpy())
    if isinstance(value, MetricRecord):
        return dict(value)
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    return value


def _outcome(strategy, result) -> dict:
    """What a run produced: final arrays, every round's metrics, and the per-client results' order."""
    return {"arrays": _exact(result.arrays),
            "train": _exact(dict(result.train_metrics_clientapp)),
            "evaluate": _exact(dict(result.evaluate_metrics_clientapp)),
            "fit-clients": {r: list(rep.fit_clients.items()) for r, rep in strategy.reports.items()},
            "evaluate-clients": {r: list(rep.evaluate_clients.items()) for r, rep in strategy.reports.items()}}


def _assert_same_whichever_arrives_first(run, rounds: int, partitions: int = PARTITIONS):
    """``run(i)`` → (strategy, result, grid) for node-id set ``i``; both runs must agree bit for bit."""
    outcomes, orders = [], []
    for i in (0, 1):
        strategy, result, grid = run(i)
        outcomes.append(_outcome(strategy, result))
        orders.append(_arrivals_by_partition(grid, i))
    assert orders[0] != orders[1], "the two runs must see replies in different orders"
    assert outcomes[0] == outcomes[1]
    labels = [f"partition {p}" for p in range(partitions)]
    for r in range(1, rounds + 1):  # per-client results in partition order, not arrival order
        assert [k for k, _ in outcomes[0]["fit-clients"][r]] == labels
        assert [k for k, _ in outcomes[0]["evaluate-clients"][r]] == labels
    return outcomes[0]


# -- (a) one family at a time: the same replies in other arrival orders ------------------------------------
STATE = {"w": np.linspace(-1, 1, 20).reshape(4, 5), "b": np.zeros(5), "steps": np.array(3, np.int64)}


def _record(state) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()})


def test_fedavg_aggregate_and_metric_averages_do_not_depend_on_arrival_order():
    def node(pid):
        def handle(msg):
            if msg.metadata.message_type == MessageType.EVALUATE:
                return _eval_reply(pid, msg)
            r = int(msg.content["config"]["server-round"])
            rng = _draws(pid, r)
            state = {k: (a.numpy() + rng.normal(size=a.shape) if a.numpy().dtype.kind == "f" else a.numpy())
                     for k, a in msg.content["arrays"].items()}
            return encode_weights_reply(state, int(rng.integers(5, 60)), _metrics(pid, r))
        return handle

    def run(i):
        grid = _grid(node, i)
        strategy = WeightAveraging(min_available_nodes=PARTITIONS)
        return strategy, strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=3), grid

    out = _assert_same_whichever_arrives_first(run, rounds=3)
    assert out["arrays"]["w"][0] == "float64" and out["train"][3]["accepted"] == PARTITIONS


def test_prototype_pooling_and_metric_averages_do_not_depend_on_arrival_order():
    classes, dim = 5, 4

    def node(pid):
        def handle(msg):
            if msg.metadata.message_type == MessageType.EVALUATE:
                return _eval_reply(pid, msg)
            r = int(msg.content["config"]["server-round"])
            rng = _draws(pid, r)
            counts = rng.integers(0, 30, size=classes) * (rng.random(classes) < 0.8)
            protos = rng.normal(size=(classes, dim)).astype(np.float32)
            return encode_prototype_reply(protos, counts, _metrics(pid, r))
        return handle

    def run(i):
        grid = _grid(node, i)
        strategy = PrototypeStrategy(num_classes=classes, embed_dim=dim, min_available_nodes=PARTITIONS)
        return strategy, strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3), grid

    out = _assert_same_whichever_arrives_first(run, rounds=3)
    assert out["train"][3]["classes-present"] == classes


def test_logit_consensus_averaged_weights_and_metric_averages_do_not_depend_on_arrival_order():
    public, classes, digest = 7, 3, 0xC0FFEE

    def node(pid):
        def handle(msg):
            if msg.metadata.message_type == MessageType.EVALUATE:
                return _eval_reply(pid, msg)
            r = int(msg.content["config"]["server-round"])
            rng = _draws(pid, r)
            model = {k: a.numpy() + rng.normal(size=a.shape) if a.numpy().dtype.kind == "f" else a.numpy()
                     for k, a in msg.content["model"].items()}
            logits = (rng.normal(size=(public, classes)) * 4).astype(np.float32)
            return encode_logit_reply(logits, int(rng.integers(5, 60)), _metrics(pid, r, **{"public-digest": digest}),
                                      model=_record(model))
        return handle

    def run(i):
        grid = _grid(node, i)
        strategy = LogitAveraging(num_public=public, num_classes=classes, average_weights=True,
                                  min_available_nodes=PARTITIONS)
        result = strategy.start(grid=grid, initial_arrays=_record(STATE), num_rounds=3)
        result.arrays = ArrayRecord({**dict(result.arrays.items()), **dict(strategy.weights.items())})
        return strategy, result, grid

    out = _assert_same_whichever_arrives_first(run, rounds=3)
    assert {"consensus", "w"} <= set(out["arrays"])


def _glfc_strategy():
    from pollen.datasets.incremental import StreamConfig, plan_stream
    from pollen.methods.glfc import build_lenet, build_stream_model
    from pollen.strategies.glfc import IncrementalFedAvg

    plan = plan_stream(StreamConfig(num_tasks=2, classes_per_task=5, initial_clients=4, new_clients=2,
                                    old_fraction=0.1, class_fraction=0.6, duplicate=False, max_per_class=0, seed=0))
    test_x = torch.randn(30, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    test_y = torch.arange(30) % 10
    return IncrementalFedAvg(plan=plan, rounds_per_task=1, clients_per_round=PARTITIONS,
                             make_model=lambda n: build_stream_model("mnist-fmnist-cil", "cnn_mnist", n, 1.0),
                             lenet=build_lenet("mnist-fmnist-cil", 0), old_model="proxy",
                             test_data=lambda n: (test_x[test_y < n], test_y[test_y < n]),
                             proxy_iterations=3, proxy_keep=2, seed=0, node_wait_s=0)


def test_glfc_average_and_the_proxys_pooled_gradients_do_not_depend_on_arrival_order():
    from pollen.methods.glfc import build_lenet

    lenet = build_lenet("mnist-fmnist-cil", 0)
    names = [n for n, _ in lenet.named_parameters()]

    def gradient_set(pid: int, r: int, label: int) -> dict[str, np.ndarray]:
        x = torch.randn(1, 1, 28, 28, generator=torch.Generator().manual_seed(pid * 100 + r * 10 + label))
        loss = torch.nn.functional.cross_entropy(lenet(x), torch.tensor([label]))
        return {n: g.detach().numpy() for n, g in zip(names, torch.autograd.grad(loss, list(lenet.parameters())))}

    def node(pid):
        def handle(msg):
            if msg.metadata.message_type == MessageType.QUERY:
                return encode_identity_reply(pid)
            r = int(msg.content["config"]["server-round"])
            task = int(msg.content["config"]["task"])
            rng = _draws(pid, r)
            state = {k: (a.numpy() * np.float32(1 + 0.01 * rng.normal()) if a.numpy().dtype.kind == "f"
                         else a.numpy()) for k, a in msg.content["arrays"].items()}
            labels = [5 * task + int(c) for c in rng.choice(5, size=1 + pid % 2, replace=False)]
            metrics = _metrics(pid, r, transition=0, **{"old1-version": 0, "old2-version": 0})
            return glfc_protocol.encode_train_reply(state, int(rng.integers(5, 60)),
                                                    [gradient_set(pid, r, c) for c in labels], metrics)
        return handle

    outcomes, orders = [], []
    for i in (0, 1):
        strategy = _glfc_strategy()
        grid = _grid(node, i)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2,
                                evaluate_fn=strategy.evaluate_global)
        proxy = strategy.proxy
        train = {r: {k: v for k, v in m.items() if k not in TIMING_FIELDS}
                 for r, m in result.train_metrics_clientapp.items()}
        outcomes.append({"arrays": _exact(result.arrays), "train": train,
                         "server": _exact(dict(result.evaluate_metrics_serverapp)),
                         "pooled": _exact({"x": proxy.monitor_x, "y": proxy.monitor_y}),
                         "slots": [_exact(np.concatenate([a.ravel() for a in s.arrays]))
                                   for s in (proxy.slot1, proxy.slot2) if s.arrays is not None],
                         "fit-clients": {r: list(rep.fit_clients) for r, rep in strategy.reports.items()}})
        orders.append([o for o in _arrivals_by_partition(grid, i) if len(o) > 1])  # the train replies
    assert orders[0] != orders[1]
    assert outcomes[0] == outcomes[1]
    out = outcomes[0]
    assert [out["train"][r]["proxy-gradients"] for r in (1, 2)] == [1 + 2 + 1 + 2, 1 + 2 + 1 + 2 + 1 + 2]
    assert out["pooled"]["x"][1][0] > 0 and out["slots"]
    assert out["fit-clients"][2] == [f"partition {p}" for p in range(PARTITIONS)]


# -- (b) whole runs: real ServerApp and ClientApps, two node-id sets and arrival orders ---------------------
def _without_timing(line: str) -> str:
    """A metrics.jsonl line with its timing fields removed, written back as the recorder writes it."""
    rec = json.loads(line)
    for where in (rec, rec.get("fit", {}), rec.get("evaluate", {}), rec.get("server-evaluate", {})):
        for key in TIMING_FIELDS & set(where):
            del where[key]
    return json.dumps(rec, sort_keys=True)


def _whole_run(run_config: dict, partitions: int, run: int, tmp_path: Path) -> list[str]:
    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main

    out_dir = tmp_path / f"run-{run}"
    rc = {**run_config, "out-dir": str(out_dir)}
    ids = NODE_IDS[run]
    grid = ShuffledGrid({ids[p]: clientapp_node(client_app, rc, p, partitions, node_id=ids[p],
                                                state_dir=str(tmp_path / f"nodes-{run}" / f"p{p}"))
                         for p in range(partitions)}, seed=run)
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    (metrics,) = out_dir.glob("*/metrics.jsonl")
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert any(len(o) > 1 and o != sorted(o) for o in _arrivals_by_partition(grid, run))
    return metrics.read_text().splitlines()


def _assert_identical_apart_from_timing(a: list[str], b: list[str], rounds: int) -> None:
    assert len(a) == len(b) == rounds
    assert [_without_timing(x) for x in a] == [_without_timing(x) for x in b]
    assert all("wall-time-s" in json.loads(x) and "elapsed-s" in json.loads(x) for x in a)


def test_two_fedavg_runs_write_the_same_metrics_whichever_node_answers_first(tmp_path):
    rc = {"method": "fedavg", "task": "uci-dirichlet", "seed": 3, "local-epochs": 1, "num-server-rounds": 2}
    first, second = (_whole_run(rc, 5, run, tmp_path) for run in (0, 1))
    _assert_identical_apart_from_timing(first, second, rounds=2)
    last = json.loads(first[-1])
    assert sorted(last["fit-clients"]) == [f"partition {p}" for p in range(5)]
    assert "train-loss-client-std" in last["fit"] and "accuracy" in last["evaluate"]


GLFC_RC = {"method": "glfc", "task": "uci-digits-cil", "num-server-rounds": 2, "glfc-tasks": 2,
           "glfc-rounds-per-task": 1, "glfc-initial-clients": 3, "glfc-new-clients": 2, "model": "cnn_mnist",
           "glfc-max-per-class": 12, "glfc-memory-size": 8, "glfc-oracle-boundary": True, "glfc-perturb-steps": 2,
           "local-epochs": 1, "lr": 0.1, "momentum": 0.0, "glfc-proxy-iterations": 2, "glfc-proxy-keep": 1,
           "glfc-clients-per-round": 3, "glfc-eval-per-class": 10, "seed": 5}


def test_two_glfc_runs_with_one_seed_write_the_same_metrics_whichever_node_answers_first(tmp_path):
    first, second = (_whole_run(GLFC_RC, 5, run, tmp_path) for run in (0, 1))
    _assert_identical_apart_from_timing(first, second, rounds=2)
    fits = [json.loads(x)["fit"] for x in first]
    assert sum(f.get("proxy-gradients", 0) for f in fits) > 0  # the proxy pooled gradients, identically


# -- (c) end to end: `make run`'s shape at 2 rounds, twice, through the launcher's simulation -------------
def _check_a_completed_simulation_and_its_files(outcome, run_dir: Path, clients: int) -> None:
    """What every finished simulation writes and says: both rounds with every client, traffic both ways, a
    summary well above chance, the curves, the console's round line, and the app's own summary ending the
    launcher's wait (not Flower's wind-down) with its closing line still read."""
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(len(r["fit-clients"]) == clients and len(r["evaluate-clients"]) == clients for r in rounds)
    assert all(r["bytes-up"] > 0 and r["bytes-down"] > 0 for r in rounds)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["rejected-total"] == 0
    assert 0.2 < summary["final-accuracy"]["mean"] <= 1.0  # 10 classes: well above chance after 2 rounds
    assert (run_dir / "curves.png").stat().st_size > 0
    assert "[pollen] round 2/2" in outcome.log
    assert outcome.status_from == "app"  # the app's summary ended the wait, not Flower's wind-down
    assert "[pollen] done in" in outcome.log  # its closing line was still read


@pytest.mark.e2e
def test_two_launches_of_make_runs_shape_complete_and_write_the_same_metrics(tmp_path):
    """Ray runs the 5 ClientApps on as many actors as there are cores: replies arrive as they finish. Each
    launch is also the suite's check of a completed simulation's results."""
    from pollen.launch import DEFAULT_SUPERNODES, simulate
    from tests.conftest import PROJECT_ROOT

    lines = []
    for run in (0, 1):
        out = tmp_path / f"runs-{run}"
        outcome = simulate(app_dir=PROJECT_ROOT, flwr_home=tmp_path / f"flwr-{run}", num_supernodes=DEFAULT_SUPERNODES,
                           run_config=f"num-server-rounds=2 out-dir='{out}'", timeout=300, echo=False)
        assert outcome.completed, outcome.log[-4000:]
        _check_a_completed_simulation_and_its_files(outcome, out / str(outcome.run_id), DEFAULT_SUPERNODES)
        (metrics,) = out.glob("*/metrics.jsonl")
        lines.append(metrics.read_text().splitlines())
    _assert_identical_apart_from_timing(lines[0], lines[1], rounds=2)
    assert len(json.loads(lines[0][-1])["fit-clients"]) == DEFAULT_SUPERNODES
