"""Records ↔ the arrays Pollen's method clients work with, one adapter per family.

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

from pollen.protocol import logits as logit_protocol
from pollen.protocol import prototypes as proto_protocol
from pollen.protocol.records import ARRAYS, CONFIG, METRICS, array_record, metric_record, reply_content


def _config(content: RecordDict) -> dict[str, Any]:
    return dict(content.get(CONFIG) or {})


def _arrays(content: RecordDict, key: str = ARRAYS) -> ArrayRecord:
    rec = content.get(key)
    return rec if isinstance(rec, ArrayRecord) else ArrayRecord()


def _named(record: ArrayRecord, keys: tuple[str, ...]) -> list[np.ndarray]:
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
def _state_in_client_order(client, record: ArrayRecord) -> tuple[list[str], list[np.ndarray]]:
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
    keys, params = _state_in_client_order(client, _arrays(content))
    arrays, n, metrics = client.fit(params, _config(content))
    return reply_content(dict(zip(keys, arrays)), n, metrics)


def _weights_evaluate(client, content: RecordDict) -> RecordDict:
    return evaluate_reply(client, _state_in_client_order(client, _arrays(content))[1], _config(content))


WEIGHTS = ClientAdapter(_weights_train, _weights_evaluate)


# -- local: nothing travels but metrics --------------------------------------------------------------
def _local_train(client, content: RecordDict) -> RecordDict:
    _, n, metrics = client.fit([], _config(content))
    return reply_content(ArrayRecord(), n, metrics)


LOCAL = ClientAdapter(_local_train, lambda client, content: evaluate_reply(client, [], _config(content)))


# -- prototypes ------------------------------------------------------------------------------------
_GLOBAL_KEYS = (proto_protocol.PROTOTYPES, proto_protocol.PRESENT, proto_protocol.MARGIN)


def _proto_train(client, content: RecordDict) -> RecordDict:
    arrays, n, metrics = client.fit(_named(_arrays(content), _GLOBAL_KEYS), _config(content))
    if len(arrays) == 3:  # dp-mode = payload: noisy sums, noisy counts, count noise std
        sums, noisy_counts, count_std = arrays
        return proto_protocol.encode_dp_prototype_reply(sums, noisy_counts, float(count_std[0]), metrics, n)
    protos, counts = arrays
    return proto_protocol.encode_prototype_reply(protos, counts, metrics, num_examples=n)


def _proto_evaluate(client, content: RecordDict) -> RecordDict:
    return evaluate_reply(client, _named(_arrays(content), _GLOBAL_KEYS), _config(content))


PROTOTYPES = ClientAdapter(_proto_train, _proto_evaluate)


# -- logits ----------------------------------------------------------------------------------------
def _logit_train(client, content: RecordDict) -> RecordDict:
    params = _named(_arrays(content), (logit_protocol.CONSENSUS, logit_protocol.CONTRIBUTORS))
    model_in = content.get(logit_protocol.MODEL)
    if isinstance(model_in, ArrayRecord) and len(model_in):
        params += _state_in_client_order(client, model_in)[1]
    arrays, n, metrics = client.fit(params, _config(content))
    if not arrays:  # SOLO: nothing leaves the client
        return reply_content(ArrayRecord(), n, metrics)
    model_out = None
    if len(arrays) > 1:  # homogeneous mode: the state dict by name
        model_out = array_record(dict(zip(client.state_keys(), arrays[1:])))
    return logit_protocol.encode_logit_reply(arrays[0], n, metrics, model=model_out)


LOGITS = ClientAdapter(_logit_train, lambda client, content: evaluate_reply(client, [], _config(content)))

