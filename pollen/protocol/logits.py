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

A client reads a message as a :class:`LogitInstruction` (:func:`decode_instruction`) and answers with a
:class:`LogitReply`: named values on both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import array_record, arrays_of, config_of, reply_content
from pollen.protocol.screening import ArraySpec, PayloadBounds, decode_record

CONSENSUS = "consensus"
CONTRIBUTORS = "contributors"
LOGITS = "logits"
MODEL = "model"  # the extra ArrayRecord of homogeneous mode
PUBLIC_DIGEST = "public-digest"  # metric: which public images the logits are on


@dataclass(frozen=True)
class LogitInstruction:
    """Client side: a logit-family train or evaluate message, decoded: the consensus and how many
    clients it averages (none in round 1), the averaged model by name (homogeneous mode only)."""

    consensus: np.ndarray | None
    contributors: int = 0
    model: dict[str, np.ndarray] | None = None
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server_round(self) -> int:
        return int(self.config.get("server-round", 0))

    @classmethod
    def from_parameters(cls, parameters: Sequence[np.ndarray], config: Mapping[str, Any],
                        model_names: Sequence[str] = ()) -> LogitInstruction:
        """A ``NumPyClient``'s positional parameters: none (round 1), or the consensus and the contributor
        count, then (homogeneous mode) the model state in ``model_names`` order."""
        if len(parameters) == 0:
            return cls(None, 0, None, dict(config))
        if len(parameters) < 2:
            raise ValueError(f"logit payload must be the consensus and its contributor count, got {len(parameters)} "
                             "array(s)")
        consensus, contributors, *state = parameters
        if state and len(state) != len(model_names):
            raise ValueError(f"received {len(state)} model arrays for a model with {len(model_names)} state entries; "
                             "do server and client use the same model and width?")
        return cls(np.asarray(consensus), int(np.asarray(contributors).reshape(-1)[0]),
                   dict(zip(model_names, state)) if state else None, dict(config))


def decode_instruction(content: RecordDict) -> LogitInstruction:
    """Client side: the consensus by name (none in round 1), the ``model`` record by name (homogeneous
    mode) and the config; ``ValueError`` naming a missing key."""
    record = arrays_of(content)
    model_in = arrays_of(content, MODEL)
    model = {k: a.numpy() for k, a in model_in.items()} if len(model_in) else None
    if len(record) == 0:
        return LogitInstruction(None, 0, model, config_of(content))
    missing = [k for k in (CONSENSUS, CONTRIBUTORS) if k not in record]
    if missing:
        raise ValueError(f"server message lacks key(s) {missing}; got {list(record.keys())}")
    return LogitInstruction(record[CONSENSUS].numpy(), int(record[CONTRIBUTORS].numpy().reshape(-1)[0]), model,
                            config_of(content))


@dataclass(frozen=True)
class LogitReply:
    """Client side: the public-set logits (N0×C float32; None when nothing leaves the client, as SOLO's)
    and, in homogeneous mode, the trained model by name."""

    logits: np.ndarray | None
    model: Mapping[str, np.ndarray] | None
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def content(self) -> RecordDict:
        if self.logits is None:
            return reply_content(ArrayRecord(), self.num_examples, self.metrics)
        model = array_record(self.model) if self.model is not None else None
        return encode_logit_reply(self.logits, self.num_examples, self.metrics, model=model)

    def parameters(self) -> list[np.ndarray]:
        """As a ``NumPyClient`` returns it: the logits, then the model state in its order (or nothing)."""
        if self.logits is None:
            return []
        return [self.logits, *(self.model or {}).values()]


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


class LogitUpdate(NamedTuple):
    """Server side: one accepted reply: its logits and, in homogeneous mode, its model state by name."""

    logits: np.ndarray
    model: dict[str, np.ndarray] | None = None


def decode_logit_reply(record: Any, num_public: int, num_classes: int,
                       max_abs: float = PayloadBounds.max_logit_abs) -> tuple[np.ndarray | None, str | None]:
    """Server side: ``(logits, None)`` or ``(None, reason)``; every logit finite and within ±``max_abs``
    (``max-logit-abs``, :class:`~pollen.protocol.screening.PayloadBounds`)."""
    arrays, reason = decode_record(record, [ArraySpec(LOGITS, (num_public, num_classes), "float32",
                                                      max_abs=max_abs)])
    return (arrays[LOGITS] if arrays is not None else None), reason
