"""Records ↔ the arrays Pollen's method clients work with: the adapter type, its shared helpers, and the
weights and local families' adapters (each other family keeps its adapter in its ``methods_*`` module).

Pollen's method clients are ``NumPyClient`` subclasses (the local training unit: state, data, losses);
they take and return plain lists of arrays. An adapter turns a message's named records into that list
and the client's answer into a named reply, using only :mod:`pollen.protocol` — so the records on the
wire are exactly what an external client would send.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import ARRAYS, CONFIG, METRICS, metric_record, reply_content


def config_of(content: RecordDict) -> dict[str, Any]:
    return dict(content.get(CONFIG) or {})


def arrays_of(content: RecordDict, key: str = ARRAYS) -> ArrayRecord:
    rec = content.get(key)
    return rec if isinstance(rec, ArrayRecord) else ArrayRecord()


def named_arrays(record: ArrayRecord, keys: tuple[str, ...]) -> list[np.ndarray]:
    """The arrays under ``keys`` in that order; ``[]`` for an empty record; a clear error otherwise."""
    if len(record) == 0:
        return []
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"server message lacks key(s) {missing}; got {list(record.keys())}")
    return [record[k].numpy() for k in keys]


def evaluate_reply(client, params: list[np.ndarray], config: dict[str, Any]) -> RecordDict:
    loss, n, metrics = client.evaluate(params, config)
    return RecordDict({METRICS: metric_record(n, {**metrics, "loss": float(loss)})})


@dataclass(frozen=True)
class ClientAdapter:
    """How one family's messages reach its ``NumPyClient``: ``train``/``evaluate`` content → reply content."""

    train: Callable[[Any, RecordDict], RecordDict]
    evaluate: Callable[[Any, RecordDict], RecordDict]


# -- weights: the state dict by name, in and out ----------------------------------------------------
def state_in_client_order(client, record: ArrayRecord) -> tuple[list[str], list[np.ndarray]]:
    """The received state as the client's positional list: matched by name, not by arrival order."""
    keys = client.state_keys()
    if sorted(keys) != sorted(record.keys()):
        missing = sorted(set(keys) - set(record.keys()))[:5]
        extra = sorted(set(record.keys()) - set(keys))[:5]
        raise ValueError(f"server model state does not match this client's model {client.model_name!r}: "
                         f"missing {missing}, unexpected {extra}; do server and client use the same model "
                         "and width?")
    return keys, [record[k].numpy() for k in keys]


def _weights_train(client, content: RecordDict) -> RecordDict:
    keys, params = state_in_client_order(client, arrays_of(content))
    arrays, n, metrics = client.fit(params, config_of(content))
    return reply_content(dict(zip(keys, arrays)), n, metrics)


def _weights_evaluate(client, content: RecordDict) -> RecordDict:
    return evaluate_reply(client, state_in_client_order(client, arrays_of(content))[1], config_of(content))


WEIGHTS = ClientAdapter(_weights_train, _weights_evaluate)


# -- local: nothing travels but metrics --------------------------------------------------------------
def _local_train(client, content: RecordDict) -> RecordDict:
    _, n, metrics = client.fit([], config_of(content))
    return reply_content(ArrayRecord(), n, metrics)


LOCAL = ClientAdapter(_local_train, lambda client, content: evaluate_reply(client, [], config_of(content)))
