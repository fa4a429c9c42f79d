"""Identity at scale: one seed samples the same partitions in every run, without a query per node.

Under Flower's simulation engine the strategy reads the engine's node → partition assignment from the
grid's link state and confirms it with two queries; everywhere else it asks every node once. These
tests register nodes with the engine's own function (``_register_nodes``, fresh random node ids per
call) in Flower's own ``InMemoryGrid``, and answer the messages in this process instead of Ray actors.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
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
from pollen.strategies.base import engine_partitions
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


def test_same_seed_same_partitions_across_runs_with_two_queries_not_one_per_node():
    first_grid, second_grid = EngineGrid(400), EngineGrid(400)
    assert set(first_grid.mapping).isdisjoint(second_grid.mapping)  # new random node ids per run
    first, strategy = _sampled(first_grid)
    second, _ = _sampled(second_grid)
    assert first == second and all(len(r) == 20 for r in first)
    assert _queries(first_grid) == _queries(second_grid) == 2  # the check, not 400 queries
    assert strategy.partition_of == first_grid.mapping
    # the same partitions a run that asks every node samples (the in-process grid has no link state)
    asked_grid = InProcessGrid({node + 10**9: _node(pid) for node, pid in first_grid.mapping.items()})
    asked, _ = _sampled(asked_grid)
    assert asked == first and _queries(asked_grid) == 400
    other, _ = _sampled(EngineGrid(400), seed=6)
    assert other != first


def test_when_nodes_contradict_the_engine_every_node_is_asked():
    """Nodes that answer another partition than the engine's order says (a Flower that registers nodes in
    another order) make the strategy ask everyone, and sample by their answers."""
    grid = EngineGrid(60, make=lambda pid: _node(pid, claim=59 - pid))
    sampled, strategy = _sampled(grid, rounds=1)
    assert _queries(grid) == 60
    assert strategy.partition_of == {node: 59 - pid for node, pid in grid.mapping.items()}
    report = strategy.reports[1]
    assert report.accepted == len(sampled[0]) == 3 and not report.rejected


def test_pins_win_over_the_engine_mapping():
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
    assert strategy._check_partition(engine_node, {PARTITION_ID: 7}) == (
        f"partition 7 is pinned to node {pinned_elsewhere}, not to this node ({engine_node})")


def test_a_node_that_later_claims_another_partition_is_rejected():
    """What the engine mapping gives a node is its claim: a train reply naming another partition is refused
    like any changed claim, and never takes the other partition from its node."""
    liar_partition = 3
    grid = EngineGrid(20, make=lambda pid: _node(pid, claim=11) if pid == liar_partition else _node(pid))
    liar = next(n for n, p in grid.mapping.items() if p == liar_partition)
    strategy = WeightAveraging(fraction_train=1.0, fraction_evaluate=0.0, identify_nodes=True)
    strategy.identify(1, grid, sorted(grid.mapping))  # the probes are partitions 0 and 19: the liar is not asked
    assert strategy.partition_of[liar] == liar_partition and _queries(grid) == 2
    strategy.start(grid=grid, initial_arrays=_record(), num_rounds=1)
    report = strategy.reports[1]
    assert report.accepted == 19 and [r["reason"] for r in report.rejected] == [
        f"partition-id 11 differs from partition {liar_partition} this node claimed before"]
    assert strategy.node_of[11] != liar


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
