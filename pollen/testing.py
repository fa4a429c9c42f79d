"""Pollen's strategies and ClientApps in one process, without Ray or a SuperLink: for tests and studies.

:class:`InProcessGrid` has the two methods ``Strategy.start`` uses (``get_node_ids``,
``send_and_receive``) and hands each message to the handler of its destination node: a plain function,
or a real ``ClientApp`` with a real ``Context`` per node (:func:`clientapp_node`). Replies are real
``Message`` objects built with ``reply_to``, so metadata (source node) is what Flower sets. A node that
raises answers with an error reply, as Flower's engine does. :func:`run_inprocess` runs a whole Pollen
run this way: the messages ``flwr run`` carries, every node a real ClientApp with its own state.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

Handler = Callable[[Message], Message | RecordDict | Exception | None]
FIRST_NODE_ID = 1000  # node ids of run_inprocess: 1000 + partition id


def set_task_identity() -> None:
    """Messages can only be built inside a run; give this process one."""
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1


def error_reply(msg: Message, err: BaseException) -> Message:
    """What Flower's engine answers for a node whose ClientApp raised."""
    return Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=msg)


class InProcessGrid:
    """A grid whose nodes are handlers in this process; ``sent`` keeps every message sent."""

    def __init__(self, handlers: dict[int, Handler]):
        set_task_identity()
        self.handlers = dict(handlers)
        self.sent: list[Message] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.handlers)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            out = self.handlers[msg.metadata.dst_node_id](msg)
            if out is None:  # no reply before the timeout
                continue
            if isinstance(out, Exception):
                out = error_reply(msg, out)
            elif isinstance(out, RecordDict):
                out = Message(content=out, reply_to=msg)
            replies.append(out)
        return replies


def clientapp_node(app, run_config: dict, partition_id: int, num_partitions: int,
                   node_id: int | None = None, state_dir: str | None = None,
                   node_config: dict | None = None) -> Handler:
    """A node that answers with a real ``ClientApp`` and keeps its ``Context`` (state) across messages.

    Its on-disk state folder is a fresh temporary one unless ``state_dir`` is given, so no test ever
    reads another run's saved models. ``node_config`` adds keys (e.g. ``data-dir``) to the node config.
    """
    state_dir = state_dir or tempfile.mkdtemp(prefix=f"pollen-node-{partition_id}-")
    context = Context(run_id=1, node_id=node_id if node_id is not None else 100 + partition_id,
                      node_config={"partition-id": partition_id, "num-partitions": num_partitions,
                                   "state-dir": state_dir, **(node_config or {})},
                      state=RecordDict(), run_config=dict(run_config))

    def handle(msg: Message) -> Message:
        try:
            return app(msg, context)
        except Exception as err:  # as the engine does: an error reply, not a crash
            return error_reply(msg, err)

    return handle


class _StopAfter(Exception):
    pass


def run_inprocess(run_config: dict, num_nodes: int | None = None, *,
                  offline: Callable[[int, int], bool] | None = None,
                  overrides: Callable[[int, int], dict | None] | None = None,
                  stop_after: int | None = None, echo: bool = True) -> list[dict[str, Any]]:
    """Drive the method's Message-API strategy through ``strategy.start`` in this process, each node a real
    ClientApp (Pollen's ``train``/``evaluate``/``query`` handlers) with its own ``Context`` and a temporary
    state folder; returns one record per round (fit metrics, the server's evaluation, rejections).

    ``num_nodes`` defaults to what the method asks for (GLFC: its final population; else the task's fixed
    count, else 3). ``offline(server_round, partition_id)`` -> True makes that node miss that round's
    training message (as a node that is not connected); ``overrides(server_round, partition_id)`` -> run
    config keys that node trains with that round; ``stop_after`` ends the run after that round."""
    from pollen.app.client_app import app as client_app
    from pollen.app.client_app import query as answer_query
    from pollen.app.config import validated_run_config
    from pollen.app.registry import METHODS
    from pollen.app.secure import secure_grid

    set_task_identity()
    cfg = validated_run_config(run_config)  # the ClientApps below reuse this check
    spec = METHODS[cfg.method]
    strategy = spec.make_strategy(cfg)
    if num_nodes is None:
        schedule = getattr(strategy, "schedule", None)
        num_nodes = schedule.num_clients if schedule is not None else (spec.required_nodes(cfg) or 3)
    tmp = tempfile.TemporaryDirectory(prefix="pollen-inprocess-nodes-")  # the nodes' state, removed at the end
    state_root = Path(tmp.name)
    contexts = {FIRST_NODE_ID + pid: Context(run_id=1, node_id=FIRST_NODE_ID + pid, node_config={
        "partition-id": pid, "num-partitions": num_nodes, "state-dir": str(state_root / f"partition-{pid}")},
        state=RecordDict(), run_config=dict(run_config)) for pid in range(num_nodes)}

    def node(msg: Message) -> Message | None:
        ctx = contexts[msg.metadata.dst_node_id]
        pid = msg.metadata.dst_node_id - FIRST_NODE_ID
        training = msg.metadata.message_type == MessageType.TRAIN
        # SecAgg+'s key stages carry no config: only its collect stage is "the round's training message"
        sent_round = msg.content["config"]["server-round"] if training and "config" in msg.content else 0
        server_round = int(sent_round) if isinstance(sent_round, (int, float)) else 0
        if training and offline is not None and offline(server_round, pid):
            return None
        extra = overrides(server_round, pid) if training and overrides is not None else None
        if extra:
            ctx.run_config = {**run_config, **extra}
        try:
            return (answer_query(msg, ctx) if msg.metadata.message_type == MessageType.QUERY
                    else client_app(msg, ctx))
        except Exception as err:  # as Flower does: an error reply, not a crash
            return error_reply(msg, err)
        finally:
            ctx.run_config = dict(run_config)

    rounds: list[dict[str, Any]] = []
    clock = {"t": time.perf_counter()}

    server_evaluate = getattr(strategy, "evaluate_global", None)  # a server-side test set (GLFC), else none

    def end_of_round(rnd: int, arrays):
        ev = server_evaluate(rnd, arrays) if server_evaluate is not None else None
        if rnd > 0:
            rep = strategy.take_round_report(rnd)
            rounds.append({"round": rnd, "fit": dict(rep.fit), "evaluate": dict(rep.evaluate),
                           "server-evaluate": dict(ev or {}),
                           "rejected": rep.rejected, "failures": len(rep.failures),
                           "network": dict(rep.network), "secure-aggregation": dict(rep.secure),
                           "wall-time-s": time.perf_counter() - clock["t"]})
            if echo:
                shown = f"acc {ev['accuracy']:.4f} " if ev and "accuracy" in ev else ""
                print(f"  round {rnd}: {shown}({time.perf_counter() - clock['t']:.1f}s)", flush=True)
            if stop_after is not None and rnd >= stop_after:
                raise _StopAfter
        clock["t"] = time.perf_counter()
        return ev

    # a Grid to ``start`` (the two methods it calls), secure as the ServerApp makes it
    grid = secure_grid(cast(Grid, InProcessGrid(dict.fromkeys(contexts, node))), cfg, strategy)
    with tmp:
        try:
            strategy.start(grid=grid, initial_arrays=spec.initial_arrays(cfg),
                           num_rounds=cfg.num_server_rounds, evaluate_fn=end_of_round)
        except _StopAfter:
            pass
    return rounds
