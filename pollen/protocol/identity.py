"""Node identity: which partition a node serves, asked once with a ``query`` message.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``config["query"]`` | | str | ``"partition-id"``; a ``MessageType.QUERY`` message, once per node |
| client → server | ``metrics["partition-id"]`` | | int | the node's partition; the whole reply |

Flower's node ids are drawn afresh for every run, so a strategy that samples by node id draws
different partitions from one run to the next even with the same seed. Knowing the partitions lets it
sample by partition instead (``identify_nodes``), and GLFC needs them to follow its client plan.
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


def encode_identity_reply(partition_id: int) -> RecordDict:
    """Client side: the answer to a query message."""
    return RecordDict({METRICS: metric_record(0, {PARTITION_ID: int(partition_id)})})
