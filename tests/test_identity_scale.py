"""Identity at scale: one seed samples the same partitions in every run, without a query per node.

Under Flower's simulation engine the strategy reads the engine's node → partition assignment from the
grid's link state and sends no query: the assignment is each node's provisional claim, confirmed by the
node's first reply; a reply that contradicts it is one WARNING, after which every node is asked once,
as everywhere else. These tests register nodes with the engine's own function (``_register_nodes``,
fresh random node ids per call) in Flower's own ``InMemoryGrid``, and answer the messages in this
process instead of Ray actors.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from pollen.protocol.identity import PARTITION_ID, encode_identity_reply
from pollen.protocol.weights import encode_weights_reply
from pollen.strategies import WeightAveraging
from pollen.strategies.sampling import engine_partitions
from pollen.testing import InProcessGrid, set_task_identity

STATE = {"w": np.zeros((2, 3), np.float32)}


def _record() -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in STATE.items()})


def _node(pid: int, claim: int | None = None):
    """A FedAvg client of partition ``pid`` that claims ``claim`` (default: ``pid``) in every reply."""
    said = pid if claim is None else claim

    def handle(msg: Message) -> RecordDict:
        if msg.metadata.message_type == MessageType.QUERY:
            return encode_identity_reply(said)
        if msg.metadata.message_type == MessageType.EVALUATE:
            return RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 1.0, PARTITION_ID: said})})
        got = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        return encode_weights_reply(got, 10, {PARTITION_ID: said})
    return handle


class EngineGrid(InMemoryGrid):
    """Flower's simulation grid over a link state whose nodes the engine's ``_register_nodes`` registered;
    messages are answered in this process by each node's handler (``make(partition)``), and kept in ``sent``."""

    def __init__(self, num_nodes: int, make=_node):
        set_task_identity()
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
        self.mapping = _register_nodes(num_nodes, factory)  # node id -> partition id, as the engine sets it
        super().__init__(state_factory=factory)
        run = Run.create_empty(1)
        run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID  # as the simulation pre-registers it
        self.state.run_ids[1] = RunRecord(run=run)
        self.state.task_store[1] = Task(task_id=1, run_id=1)
        self.set_run(run)
        self.answer = InProcessGrid({node: make(pid) for node, pid in self.mapping.items()})
        self.sent = self.answer.sent

    def send_and_receive(self, messages, *, timeout=None):
        return self.answer.send_and_receive(messages, timeout=timeout)


def _sampled(grid, seed: int = 5, rounds: int = 3, **options) -> tuple[list[list[str]], WeightAveraging]:
    strategy = WeightAveraging(fraction_train=0.05, fraction_evaluate=0.0, min_train_nodes=1, seed=seed,
                               identify_nodes=True, **options)
    strategy.start(grid=grid, initial_arrays=_record(), num_rounds=rounds)
    return [sorted(r.fit_clients) for _, r in sorted(strategy.reports.items())], strategy


def _queries(grid) -> int:
    return sum(m.metadata.message_type == MessageType.QUERY for m in grid.sent)


def test_the_engine_mapping_is_the_partition_each_node_is_given():
    grid = EngineGrid(50)
    assert engine_partitions(grid) == grid.mapping
    assert sorted(grid.mapping.values()) == list(range(50))
    assert engine_partitions(InProcessGrid({1: _node(0)})) is None  # no link state: ask the nodes


REFUTED = "the engine's node order does not hold"


def _queried(grid) -> list[tuple[int, int]]:
    """``(server round, node id)`` of every query sent, in order."""
    return [(int(m.content["config"]["server-round"]), int(m.metadata.dst_node_id))
            for m in grid.sent if m.metadata.message_type == MessageType.QUERY]


def _refutations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and REFUTED in r.getMessage()]


def test_same_seed_same_partitions_across_runs_without_a_query(caplog):
    first_grid, second_grid = EngineGrid(400), EngineGrid(400)
    assert set(first_grid.mapping).isdisjoint(second_grid.mapping)  # new random node ids per run
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        first, strategy = _sampled(first_grid)
        second, _ = _sampled(second_grid)
    assert first == second and all(len(r) == 20 for r in first)
    assert _queries(first_grid) == _queries(second_grid) == 0  # not 400, and not even a check before round 1
    assert strategy.partition_of == first_grid.mapping and not _refutations(caplog)
    # the same partitions a run that asks every node samples (the in-process grid has no link state)
    asked_grid = InProcessGrid({node + 10**9: _node(pid) for node, pid in first_grid.mapping.items()})
    asked, _ = _sampled(asked_grid)
    assert asked == first and _queries(asked_grid) == 400
    other, _ = _sampled(EngineGrid(400), seed=6)
    assert other != first


def test_when_nodes_contradict_the_engine_round_1_warns_once_then_every_node_is_asked(caplog):
    """Nodes that answer another partition than the engine's order says (a Flower that registers nodes in
    another order): round 1 trains the nodes the engine's order picked, says so once, and counts each reply
    for the partition the node answered; from round 2 every node not heard from is asked once, and the draw
    runs over the partitions the nodes answered — the draw of a run that asks every node."""
    grid = EngineGrid(60, make=lambda pid: _node(pid, claim=59 - pid))
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        sampled, strategy = _sampled(grid, rounds=3)
    round_1 = {int(m.metadata.dst_node_id) for m in grid.sent if m.metadata.message_type == MessageType.TRAIN
               and m.content["config"]["server-round"] == 1}
    first = min(round_1, key=grid.mapping.__getitem__)  # replies are judged in the engine's partition order
    assert _refutations(caplog) == [
        f"round 1: node {first} answered partition {59 - grid.mapping[first]}, but the simulation engine assigned "
        f"it partition {grid.mapping[first]}: {REFUTED}; its assignment is dropped and every node will be asked "
        "its partition"]
    assert all(strategy.reports[r].accepted == 3 and not strategy.reports[r].rejected for r in (1, 2, 3))
    queried = _queried(grid)
    assert {r for r, _ in queried} == {2} and len(queried) == len({n for _, n in queried}) == 60 - 3
    assert {n for _, n in queried} == set(grid.mapping) - round_1  # round 1's nodes said it in their replies
    assert strategy.partition_of == {node: 59 - pid for node, pid in grid.mapping.items()}
    asked_grid = InProcessGrid({node + 10**9: _node(59 - pid) for node, pid in grid.mapping.items()})
    asked, _ = _sampled(asked_grid, rounds=3)
    assert sampled[1:] == asked[1:]  # by the partitions answered
    assert sampled[0] == sorted(f"partition {59 - int(label.split()[1])}" for label in asked[0])


def test_pins_win_over_the_engine_mapping(caplog):
    """A partition pinned to another node id is not given to the node the engine assigned it to; that
    node's replies claiming it are refused, and the pinned node is the one trusted with it."""
    grid = EngineGrid(40)
    engine_node = next(n for n, p in grid.mapping.items() if p == 7)
    pinned_elsewhere = 424242
    strategy = WeightAveraging(fraction_train=1.0, fraction_evaluate=0.0, identify_nodes=True,
                               partition_pins={7: pinned_elsewhere})
    strategy.identify(1, grid, sorted(grid.mapping))
    assert engine_node not in strategy.partition_of and strategy.node_of[7] == pinned_elsewhere
    assert all(strategy.partition_of[n] == p for n, p in grid.mapping.items() if p != 7)
    reason = f"partition 7 is pinned to node {pinned_elsewhere}, not to this node ({engine_node})"
    assert strategy.book.refusal(engine_node, 7) == reason
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        strategy.start(grid=grid, initial_arrays=_record(), num_rounds=2)
    for rnd in (1, 2):
        report = strategy.reports[rnd]
        assert report.accepted == 39 and [r["reason"] for r in report.rejected] == [reason]
    assert _queries(grid) == 0 and not _refutations(caplog) and strategy.node_of[7] == pinned_elsewhere


def _turncoat(pid: int, later: int):
    """A client of partition ``pid`` that says so in its first reply and claims ``later`` afterwards."""
    replies = [_node(pid), _node(pid, claim=later)]
    calls: list[Message] = []

    def handle(msg: Message) -> RecordDict:
        calls.append(msg)
        return replies[min(len(calls), 2) - 1](msg)
    return handle


def test_a_confirmed_node_that_later_claims_another_partition_is_rejected(caplog):
    """What the engine mapping gives a node and its first reply confirms is its claim: a later train reply
    naming another partition is refused like any changed claim, and never takes the other partition from
    its node; the engine's order stands (no WARNING, no query)."""
    liar_partition = 3
    grid = EngineGrid(20, make=lambda pid: _turncoat(pid, 11) if pid == liar_partition else _node(pid))
    liar = next(n for n, p in grid.mapping.items() if p == liar_partition)
    strategy = WeightAveraging(fraction_train=1.0, fraction_evaluate=0.0, identify_nodes=True)
    strategy.identify(1, grid, sorted(grid.mapping))  # what a draw of a fraction does first
    assert strategy.partition_of == grid.mapping
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        strategy.start(grid=grid, initial_arrays=_record(), num_rounds=2)
    assert strategy.reports[1].accepted == 20 and not strategy.reports[1].rejected
    report = strategy.reports[2]
    assert report.accepted == 19 and [r["reason"] for r in report.rejected] == [
        f"partition-id 11 differs from partition {liar_partition} this node claimed before"]
    assert strategy.partition_of[liar] == liar_partition and strategy.node_of[11] != liar
    assert _queries(grid) == 0 and not _refutations(caplog) and not report.quarantined


def test_a_provisional_node_whose_first_reply_matches_is_confirmed(caplog):
    """A node whose reply said the partition the engine gave it keeps it for the run: when a later round
    finds two nodes the engine's order got wrong, only the nodes not heard from yet are asked."""
    honest, _ = _sampled(EngineGrid(60), rounds=2)
    one, two = ({int(label.split()[1]) for label in r} for r in honest)
    a = min(two - one)
    b = min(set(range(60)) - one - two)
    swap = {a: b, b: a}  # partitions a (sampled in round 2 only) and b (never sampled) swapped
    grid = EngineGrid(60, make=lambda pid: _node(pid, claim=swap.get(pid, pid)))
    with caplog.at_level(logging.WARNING, logger="flwr.pollen"):
        sampled, strategy = _sampled(grid, rounds=3)
    assert sampled[:2] == [sorted(f"partition {swap.get(p, p)}" for p in r) for r in (one, two)]
    assert len(_refutations(caplog)) == 1 and _refutations(caplog)[0].startswith("round 2: ")
    round_1 = {n for n, p in grid.mapping.items() if p in one}
    round_2 = {n for n, p in grid.mapping.items() if p in two}
    queried = _queried(grid)
    assert {r for r, _ in queried} == {3} and {n for _, n in queried} == set(grid.mapping) - round_1 - round_2
    assert len(queried) == 60 - len(one | two)
    assert strategy.partition_of == {n: swap.get(p, p) for n, p in grid.mapping.items()}


def test_glfc_follows_its_plan_on_the_engine_assignment_and_falls_back_to_asking():
    """GLFC samples partitions of its plan, so it needs node_of for every active client: the engine's
    assignment gives it without a query; nodes that contradict it are counted for what they answered, and
    the rest are asked before the next round."""
    import torch  # noqa: F401  (GLFC's strategy builds its model with torch)

    from pollen.methods.glfc import build_stream_model
    from pollen.protocol import glfc as protocol
    from pollen.strategies.glfc import IncrementalFedAvg

    schedule = protocol.TaskSchedule(num_tasks=2, classes_per_task=5, rounds_per_task=2, population=(3, 5))

    def client(pid: int, claim: int | None = None):
        said = pid if claim is None else claim

        def handle(msg: Message):
            cfg = msg.content["config"]
            if msg.metadata.message_type == MessageType.QUERY:
                return encode_identity_reply(said)
            if said not in schedule.active_clients(int(cfg["task"])):  # as Pollen's client: it has no data yet
                return RuntimeError(f"partition {said} was contacted at task {cfg['task']} but joins later")
            state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
            return protocol.encode_train_reply(state, 10, [], {PARTITION_ID: said, "transition": 0,
                                                                 "old1-version": 0, "old2-version": 0})
        return handle

    def run(grid):
        strategy = IncrementalFedAvg(schedule=schedule, clients_per_round=3, old_model="none", seed=0,
                                     make_model=lambda n: build_stream_model("mnist-fmnist-cil", "cnn_mnist", n, 1.0))
        strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=4, train_config=ConfigRecord())
        return [sorted(r.fit_clients) for _, r in sorted(strategy.reports.items())], strategy

    honest_grid = EngineGrid(5, make=client)
    honest, strategy = run(honest_grid)
    assert _queries(honest_grid) == 0 and strategy.node_of == {p: n for n, p in honest_grid.mapping.items()}
    asked_grid = InProcessGrid({node + 10**9: client(pid) for node, pid in honest_grid.mapping.items()})
    assert run(asked_grid)[0] == honest and _queries(asked_grid) == 5
    swap = {0: 1, 1: 0}  # two clients of task 0 the engine's order gets wrong
    grid = EngineGrid(5, make=lambda pid: client(pid, swap.get(pid)))
    swapped, strategy = run(grid)
    assert swapped == honest and all(not strategy.reports[r].rejected for r in (1, 2, 3, 4))
    assert sorted(_queried(grid)) == sorted((2, n) for n, p in grid.mapping.items() if p in (3, 4))
    assert strategy.node_of == {swap.get(p, p): n for n, p in grid.mapping.items()}


def test_the_clientapp_answers_a_query_from_the_node_config_alone(monkeypatch):
    """A query must cost nothing of Pollen's: no run config, state, data or model."""
    import pollen.app.client_app as client_app

    def refuse(*_args, **_kwargs):
        raise AssertionError("a query built the method's client")

    monkeypatch.setattr(client_app, "_prepare", refuse)
    set_task_identity()
    context = Context(run_id=1, node_id=77, node_config={"partition-id": 4, "num-partitions": 9},
                      state=RecordDict(), run_config={"method": "no-such-method"})
    query = Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=77)
    query.metadata.__dict__["_message_id"] = "q1"
    reply = client_app.app(query, context)
    assert reply.content["metrics"][PARTITION_ID] == 4 and len(context.state) == 0


def test_simulation_sampling_waits_for_the_engine_to_finish_registering():
    """The engine registers its nodes just after the ServerApp starts: a draw over the nodes seen so far
    would depend on timing, so the first answer waits until the count holds still."""
    class InMemoryGrid(EngineGrid):  # the name the simulation's grid has
        def __init__(self, num_nodes: int):
            super().__init__(num_nodes)
            self.calls = 0

        def get_node_ids(self):
            self.calls += 1
            registered = list(self.mapping)[:10 * self.calls]
            return registered

    grid = InMemoryGrid(50)
    strategy = WeightAveraging(identify_nodes=True)
    assert strategy.wait_for_nodes(grid, 5) == sorted(grid.mapping)
    assert grid.calls == 6  # grew for five calls, then held still once
    assert strategy.wait_for_nodes(grid, 5) == sorted(grid.mapping) and grid.calls == 7  # settled: no more waiting
