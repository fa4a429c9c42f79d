"""A Flower grid served in this process, for driving Message-API strategies in unit tests.

``InProcessGrid`` has the two methods ``Strategy.start`` uses (``get_node_ids``,
``send_and_receive``) and hands each message to the handler of its destination node: a plain
function, or a real ``ClientApp`` with a real ``Context`` per node (:func:`clientapp_node`). Replies
are real ``Message`` objects built with ``reply_to``, so metadata (source node) is what Flower sets.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

Handler = Callable[[Message], Message | RecordDict | Exception | None]


def set_task_identity() -> None:
    """Messages can only be built inside a run; give this process one."""
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1


class InProcessGrid:
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
                out = Message(Error(code=2, reason=f"{type(out).__name__}: {out}"), reply_to=msg)
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
            return Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=msg)

    return handle
