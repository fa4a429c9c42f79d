"""Node identity: which partition a node serves, asked once with a ``query`` message.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``config["query"]`` | | str | ``"partition-id"``; a ``MessageType.QUERY`` message, once per node |
| client → server | ``metrics["partition-id"]`` | | int | the node's partition; the whole reply |

Flower's node ids are drawn afresh for every run, so a strategy that samples by node id draws
different partitions from one run to the next even with the same seed. Knowing the partitions lets it
sample by partition instead (``identify_nodes``), and GLFC needs them to follow its client plan.
Under Flower's simulation engine the strategy reads the engine's own assignment instead and sends no
query (``pollen.strategies.base.engine_partitions``): the assignment is each node's provisional claim,
confirmed by the ``partition-id`` of the node's first train or evaluate reply. A reply that contradicts
it makes the strategy drop the assignment and send this query to every node, as in a deployment.

A node's answer is a claim, not proof: the strategies trust a partition to a node only when no other
connected node claims it, or when the operator *pinned* it to that node id (``partition-pins``,
:func:`parse_partition_pins`). The node id is the identity Flower gives the ServerApp
(``Message.metadata.src_node_id``); with SuperNode authentication it is the id the SuperLink assigned
when the node's public key was registered, so a pin then names a key-holder.
"""

from __future__ import annotations

import math

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from pollen.protocol.records import CONFIG, METRICS, metric_record
from pollen.protocol.screening import MAX_PARTITION_ID

QUERY = "query"
PARTITION_ID = "partition-id"


def query_content(server_round: int) -> RecordDict:
    """A query message asking a node which partition it serves."""
    return RecordDict({CONFIG: ConfigRecord({"server-round": int(server_round), QUERY: PARTITION_ID})})


def decode_identity_reply(content: RecordDict) -> tuple[int | None, str | None]:
    """Server side: the partition id of a query reply, or a reason."""
    metrics = content.get(METRICS)
    if not isinstance(metrics, MetricRecord) or PARTITION_ID not in metrics:
        return None, f"query reply lacks metrics['{PARTITION_ID}']"
    value = metrics[PARTITION_ID]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or int(value) != value or not 0 <= value <= MAX_PARTITION_ID:
        return None, f"metric '{PARTITION_ID}' = {value!r} is not a whole number in [0, {MAX_PARTITION_ID}]"
    return int(value), None


def parse_partition_pins(text: str) -> dict[int, int]:
    """``"0:4312, 1:9876"`` -> ``{0: 4312, 1: 9876}`` (partition -> node id); ``ValueError`` naming the
    entry for anything else: a partition outside [0, MAX_PARTITION_ID], a node id < 1, a partition or a
    node pinned twice."""
    pins: dict[int, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        pid_text, sep, node_text = entry.partition(":")
        try:
            pid, node = int(pid_text.strip()), int(node_text.strip())
        except ValueError:
            pid = node = -1
        if not sep or not 0 <= pid <= MAX_PARTITION_ID or node < 1:
            raise ValueError(f"partition pin {entry!r} is not <partition>:<node id> (a partition in "
                             f"[0, {MAX_PARTITION_ID}], a node id >= 1)")
        if pid in pins:
            raise ValueError(f"partition {pid} is pinned twice")
        if node in pins.values():
            raise ValueError(f"node {node} is pinned to two partitions")
        pins[pid] = node
    return pins


def format_partition_pins(pins: dict[int, int]) -> str:
    """The run-config text of ``pins`` (the inverse of :func:`parse_partition_pins`)."""
    return ",".join(f"{pid}:{node}" for pid, node in sorted(pins.items()))


def encode_identity_reply(partition_id: int) -> RecordDict:
    """Client side: the answer to a query message."""
    return RecordDict({METRICS: metric_record(0, {PARTITION_ID: int(partition_id)})})
