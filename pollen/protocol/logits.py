"""Logit family (FCCL, FedMD, FedDF): clients share logits on an unlabeled public set, never weights.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays["consensus"]`` | N0×C | float32 | mean of last round's accepted logits |
| server → client | ``arrays["contributors"]`` | 1 | int64 | how many clients the mean averages |
| server → client | ``config["contributed"]`` | | bool | this client's logits are in the mean |
| server → client | ``config["contributor-partitions"]`` | k | int list | partitions whose logits are in the mean (when known); a node restarted under a new id finds its own here |
| server → client | ``model`` (ArrayRecord) | state dict | any | homogeneous mode only: averaged weights |
| client → server | ``arrays["logits"]`` | N0×C | float32 | rows in public-sample order, finite, within ±``max-logit-abs`` |
| client → server | ``model`` (ArrayRecord) | state dict | any | homogeneous mode only |
| client → server | ``metrics["num-examples"]`` | | int | private training samples |
| client → server | ``metrics["public-digest"]`` | | int | ``public_fingerprint`` of the client's public set as stored (before normalisation); a reply whose digest is not the federation's (most replies' in round 1) is refused |

Round 1 the server sends an **empty** ``arrays`` record (no consensus yet).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import array_record, reply_content
from pollen.protocol.screening import ArraySpec, PayloadBounds, decode_record

CONSENSUS = "consensus"
CONTRIBUTORS = "contributors"
LOGITS = "logits"
MODEL = "model"  # the extra ArrayRecord of homogeneous mode
PUBLIC_DIGEST = "public-digest"  # metric: which public images the logits are on


def encode_consensus(consensus: np.ndarray, contributors: int) -> ArrayRecord:
    return array_record({CONSENSUS: np.asarray(consensus, dtype=np.float32),
                         CONTRIBUTORS: np.array([contributors], dtype=np.int64)})


def decode_consensus(record: ArrayRecord, num_public: int, num_classes: int) -> tuple[np.ndarray, int] | None:
    """Client side: ``(consensus N0×C, contributors)``, or ``None`` for round 1's empty record."""
    if len(record) == 0:
        return None
    arrays, reason = decode_record(record, [ArraySpec(CONSENSUS, (num_public, num_classes), "float32"),
                                            ArraySpec(CONTRIBUTORS, (1,), "int64", nonnegative=True)])
    if arrays is None:
        raise ValueError(f"consensus: {reason}")
    return arrays[CONSENSUS], int(arrays[CONTRIBUTORS][0])


def public_fingerprint(public: np.ndarray) -> int:
    """52 bits of SHA-256 over the public set's dtype, shape and bytes: equal sets, equal fingerprints.

    Fingerprint the images as every node stores them (e.g. uint8 before normalisation), so nodes that
    normalise differently still agree. 52 bits: an integer metric that a float64 also holds exactly.
    """
    data = np.ascontiguousarray(public)
    header = f"{data.dtype}:{data.shape}".encode()
    return int(hashlib.sha256(header + data.tobytes()).hexdigest()[:13], 16)


def encode_logit_reply(logits: np.ndarray, num_examples: int, metrics: Mapping[str, Any] | None = None,
                       model: ArrayRecord | None = None, *, public_digest: int | None = None) -> RecordDict:
    """Client side: public-set logits (+ the model state in homogeneous mode). ``public_digest``
    (:func:`public_fingerprint` of the public set) is required by the server; it may also come in
    ``metrics["public-digest"]``."""
    extra = {MODEL: model} if model is not None else {}
    if public_digest is not None:
        metrics = {**(metrics or {}), PUBLIC_DIGEST: int(public_digest)}
    return reply_content({LOGITS: np.asarray(logits, dtype=np.float32)}, num_examples, metrics, **extra)


def decode_logit_reply(record: Any, num_public: int, num_classes: int,
                       max_abs: float = PayloadBounds.max_logit_abs) -> tuple[np.ndarray | None, str | None]:
    """Server side: ``(logits, None)`` or ``(None, reason)``; every logit finite and within ±``max_abs``
    (``max-logit-abs``, :class:`~pollen.protocol.screening.PayloadBounds`)."""
    arrays, reason = decode_record(record, [ArraySpec(LOGITS, (num_public, num_classes), "float32",
                                                      max_abs=max_abs)])
    return (arrays[LOGITS] if arrays is not None else None), reason
