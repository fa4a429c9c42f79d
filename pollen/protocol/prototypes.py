"""Prototype family (FedProto, BD-FedProto): clients share one embedding per class, never weights.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays["prototypes"]`` | C×d | float32 | global prototypes; rows of absent classes are 0 |
| server → client | ``arrays["present"]`` | C | int64 (0/1) | classes some client has held |
| server → client | ``arrays["margin"]`` | 1 | float32 | CPA's margin (median distance) |
| server → client | ``config["server-round"]`` | | int | |
| client → server | ``arrays["prototypes"]`` | C×d | float32 | local class means, abs <= 1e6; rows with count 0 ignored |
| client → server | ``arrays["class-counts"]`` | C | int64 | training samples per class, >= 0 |
| client → server | ``metrics["num-examples"]`` | | int | |
| client → server, ``dp-mode = payload`` | ``arrays["proto-sums"]`` | C×d | float32 | noisy per-class sums of clipped embeddings, all classes; abs <= 1e6 |
| client → server, ``dp-mode = payload`` | ``arrays["noisy-counts"]`` | C | float32 | noisy class counts, all classes (may be < 0) |
| client → server, ``dp-mode = payload`` | ``arrays["count-noise-std"]`` | 1 | float32 | std of the count noise, > 0 |

Under ``dp-mode = payload`` a reply carries the three ``dp-mode`` keys instead of ``prototypes`` and
``class-counts`` (``docs/privacy.md``); the server divides: a class counts for a client when its noisy
count is at least ``DP_HELD_STDS`` stds of the count noise (and 1), its prototype is sum / count.

Round 1 (before any aggregation) the server sends an **empty** ``arrays`` record.

A client reads a message as a :class:`PrototypeInstruction` (:func:`decode_instruction`) and answers with
a :class:`PrototypeReply`, or under DP a :class:`PrivatePrototypeReply`: named values on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import array_record, arrays_of, config_of, reply_content
from pollen.protocol.screening import ArraySpec, decode_record

PROTOTYPES = "prototypes"
PRESENT = "present"
MARGIN = "margin"
CLASS_COUNTS = "class-counts"
PROTO_SUMS = "proto-sums"
NOISY_COUNTS = "noisy-counts"
COUNT_NOISE_STD = "count-noise-std"
# A noisy count below this many stds of its noise is indistinguishable from an absent class (one false
# positive in ~740 absent classes); dividing by it would blow the sum's noise up.
DP_HELD_STDS = 3.0
# How a server weighs each client's prototype of a class: by the class counts the reply carries, or equally.
PROTO_WEIGHTINGS = ("samples", "uniform")


@dataclass(frozen=True)
class GlobalPrototypes:
    """Server → client: the global prototypes (C×d), which classes some client has held (C; nonzero =
    held) and CPA's margin."""

    prototypes: np.ndarray
    present: np.ndarray
    margin: float

    def check(self, num_classes: int, embed_dim: int) -> None:
        """``ValueError`` unless the shapes are this client's (C classes, its model's d) and the held
        classes' prototypes and the margin are finite."""
        protos, present = np.asarray(self.prototypes), np.asarray(self.present)
        if protos.shape != (num_classes, embed_dim) or present.shape != (num_classes,):
            raise ValueError(f"global prototype payload shapes {protos.shape}, {present.shape} "
                             f"!= ({num_classes}, {embed_dim}), ({num_classes},)")
        if not np.isfinite(protos[present.astype(bool)]).all() or not np.isfinite(self.margin):
            raise ValueError("global prototype payload contains NaN or infinite values")


@dataclass(frozen=True)
class PrototypeInstruction:
    """Client side: a prototype-family train or evaluate message, decoded (``glob`` is None in round 1)."""

    glob: GlobalPrototypes | None
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server_round(self) -> int:
        return int(self.config.get("server-round", 0))

    @property
    def monitor(self) -> bool:
        """Whether the server evaluates this round (the client then reports its monitors)."""
        return bool(self.config.get("monitor", True))

    @classmethod
    def from_parameters(cls, parameters: Sequence[np.ndarray], config: Mapping[str, Any]) -> PrototypeInstruction:
        """A ``NumPyClient``'s positional parameters: none (round 1), or prototypes, presence and margin."""
        if len(parameters) == 0:
            return cls(None, dict(config))
        if len(parameters) != 3:
            raise ValueError(f"global prototype payload must be 3 arrays (protos, mask, margin), got {len(parameters)}")
        protos, present, margin = (np.asarray(a) for a in parameters)
        return cls(GlobalPrototypes(protos, present, _margin(margin)), dict(config))


def _margin(margin: np.ndarray) -> float:
    if np.shape(margin) != (1,):
        raise ValueError(f"global prototype payload: '{MARGIN}' has shape {np.shape(margin)}, expected (1,)")
    return float(margin[0])


def decode_instruction(content: RecordDict) -> PrototypeInstruction:
    """Client side: the global prototypes by name (none in round 1) and the config; ``ValueError`` naming
    a missing key."""
    record = arrays_of(content)
    if len(record) == 0:
        return PrototypeInstruction(None, config_of(content))
    missing = [k for k in (PROTOTYPES, PRESENT, MARGIN) if k not in record]
    if missing:
        raise ValueError(f"server message lacks key(s) {missing}; got {list(record.keys())}")
    glob = GlobalPrototypes(record[PROTOTYPES].numpy(), record[PRESENT].numpy(), _margin(record[MARGIN].numpy()))
    return PrototypeInstruction(glob, config_of(content))


@dataclass(frozen=True)
class PrototypeReply:
    """Client side: local prototypes (C×d float32) and class counts (C, whole numbers)."""

    prototypes: np.ndarray
    class_counts: np.ndarray
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def released_counts(self) -> np.ndarray:
        return self.class_counts

    count_std = 0.0  # exact counts: no noise

    def content(self) -> RecordDict:
        return encode_prototype_reply(self.prototypes, self.class_counts, self.metrics, self.num_examples)

    def parameters(self) -> list[np.ndarray]:
        """As a ``NumPyClient`` returns it: prototypes, class counts."""
        return [self.prototypes, self.class_counts]


@dataclass(frozen=True)
class PrivatePrototypeReply:
    """Client side, under DP: what the mechanism released (noisy per-class sums C×d and noisy counts C,
    all classes) and the count noise's std (as it travels: float32)."""

    sums: np.ndarray
    noisy_counts: np.ndarray
    count_std: float
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def released_counts(self) -> np.ndarray:
        return self.noisy_counts

    def content(self) -> RecordDict:
        return encode_dp_prototype_reply(self.sums, self.noisy_counts, self.count_std, self.metrics, self.num_examples)

    def parameters(self) -> list[np.ndarray]:
        """As a ``NumPyClient`` returns it: noisy sums, noisy counts, count noise std (1,), float32."""
        return [np.asarray(self.sums, dtype=np.float32), np.asarray(self.noisy_counts, dtype=np.float32),
                np.array([self.count_std], dtype=np.float32)]


def encode_global_prototypes(protos: np.ndarray, present: np.ndarray, margin: float) -> ArrayRecord:
    """Server side: the global prototypes, presence mask and margin as one named record."""
    return array_record({PROTOTYPES: np.asarray(protos, dtype=np.float32),
                         PRESENT: np.asarray(present).astype(np.int64),
                         MARGIN: np.array([margin], dtype=np.float32)})


def decode_global_prototypes(record: ArrayRecord, num_classes: int,
                             embed_dim: int) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Client side: ``(protos C×d, present C bool, margin)``, or ``None`` for round 1's empty record.

    Raises ``ValueError`` naming the key for a malformed record.
    """
    if len(record) == 0:
        return None
    specs = [ArraySpec(PROTOTYPES, (num_classes, embed_dim), "float32", finite=False),
             ArraySpec(PRESENT, (num_classes,), "int64", nonnegative=True, max_value=1),
             ArraySpec(MARGIN, (1,), "float32", nonnegative=True)]
    arrays, reason = decode_record(record, specs)
    if arrays is None:
        raise ValueError(f"global prototypes: {reason}")
    present = arrays[PRESENT].astype(bool)
    if not np.isfinite(arrays[PROTOTYPES][present]).all():
        raise ValueError("global prototypes: 'prototypes' has NaN or infinite rows for present classes")
    return arrays[PROTOTYPES], present, float(arrays[MARGIN][0])


def encode_prototype_reply(protos: np.ndarray, counts: np.ndarray, metrics: Mapping[str, Any] | None = None,
                           num_examples: int | None = None) -> RecordDict:
    """Client side: a reply with local prototypes and class counts (``num-examples`` = Σ counts).

    Counts must be whole numbers: a fractional count would silently drop or shrink a class.
    """
    raw = np.asarray(counts)
    if raw.dtype.kind == "f" and not (np.isfinite(raw).all() and (raw == np.round(raw)).all()):
        raise ValueError(f"class counts must be whole numbers, got {raw.tolist()}")
    if raw.dtype.kind not in "iuf":
        raise ValueError(f"class counts must be numbers, got dtype {raw.dtype}")
    counts = raw.astype(np.int64)
    n = int(counts.sum()) if num_examples is None else int(num_examples)
    return reply_content({PROTOTYPES: np.asarray(protos, dtype=np.float32), CLASS_COUNTS: counts}, n, metrics)


def encode_dp_prototype_reply(sums: np.ndarray, counts: np.ndarray, count_std: float,
                              metrics: Mapping[str, Any] | None = None, num_examples: int = 1) -> RecordDict:
    """Client side, ``dp-mode = payload``: what the mechanism released (noisy sums and counts of all
    classes) and the count noise's std; ``num_examples`` should itself come from the noisy counts."""
    return reply_content({PROTO_SUMS: np.asarray(sums, dtype=np.float32),
                          NOISY_COUNTS: np.asarray(counts, dtype=np.float32),
                          COUNT_NOISE_STD: np.array([count_std], dtype=np.float32)}, num_examples, metrics)


def held_at(count_std: float) -> float:
    """The count from which the server takes a class as held: ``max(1, DP_HELD_STDS × count_std)``
    (1 for exact counts, ``count_std`` 0)."""
    return max(1.0, DP_HELD_STDS * float(count_std))


def divide_release(sums: np.ndarray, counts: np.ndarray, count_std: float) -> tuple[np.ndarray, np.ndarray]:
    """``(prototypes C×d float32, weights C float64)`` from a DP release: sum / count where the noisy
    count is at least :func:`held_at`, weight = that count; elsewhere 0 and 0."""
    counts = np.asarray(counts, dtype=np.float64)
    held = counts >= held_at(count_std)
    protos = np.zeros(np.shape(sums), dtype=np.float64)
    protos[held] = np.asarray(sums, dtype=np.float64)[held] / counts[held, None]
    return protos.astype(np.float32), np.where(held, counts, 0.0)


class ClientPrototypes(NamedTuple):
    """Server side: one accepted reply, as the average reads it: prototypes C×d and each class's weight C
    (its count; under DP the noisy count where the class is taken as held, else 0)."""

    prototypes: np.ndarray
    weights: np.ndarray


def _decode_dp_reply(record: Any, num_classes: int, embed_dim: int,
                     max_count: int) -> tuple[ClientPrototypes | None, str | None]:
    specs = [ArraySpec(PROTO_SUMS, (num_classes, embed_dim), "float32", max_abs=MAX_PROTOTYPE_ABS),
             ArraySpec(NOISY_COUNTS, (num_classes,), "float32", max_abs=float(max_count)),
             ArraySpec(COUNT_NOISE_STD, (1,), "float32", nonnegative=True, max_value=float(max_count))]
    arrays, reason = decode_record(record, specs)
    if arrays is None:
        return None, reason
    std = float(arrays[COUNT_NOISE_STD][0])
    if std <= 0:
        return None, f"'{COUNT_NOISE_STD}': {std} is not > 0"
    return ClientPrototypes(*divide_release(arrays[PROTO_SUMS], arrays[NOISY_COUNTS], std)), None


# Embeddings far beyond this make squared distances (losses, CPA's margin) overflow float32 on every
# client once averaged in: one client could break everyone's training.
MAX_PROTOTYPE_ABS = 1e6


def decode_prototype_reply(record: Any, num_classes: int, embed_dim: int,
                           max_count: int) -> tuple[ClientPrototypes | None, str | None]:
    """Server side: ``((protos, counts), None)`` or ``(None, reason)``; nothing decoded before the
    metadata checks pass. Prototypes of held classes must be finite and within ``MAX_PROTOTYPE_ABS``;
    counts within ``max_count``. A ``dp-mode = payload`` reply (noisy sums and counts) comes back in the
    same form, divided (:func:`divide_release`), with float counts as weights."""
    if isinstance(record, ArrayRecord) and PROTO_SUMS in record:
        return _decode_dp_reply(record, num_classes, embed_dim, max_count)
    specs = [ArraySpec(PROTOTYPES, (num_classes, embed_dim), "float32", finite=False, max_abs=MAX_PROTOTYPE_ABS),
             ArraySpec(CLASS_COUNTS, (num_classes,), "int64", nonnegative=True, max_value=max_count)]
    arrays, reason = decode_record(record, specs)
    if arrays is None:
        return None, reason
    protos, counts = arrays[PROTOTYPES], arrays[CLASS_COUNTS]
    if int(counts.sum()) > max_count:
        return None, f"'{CLASS_COUNTS}': total {int(counts.sum())} above the plausible maximum {max_count}"
    held = counts > 0
    if not np.isfinite(protos[held]).all():
        bad = [int(c) for c in np.flatnonzero(held & ~np.isfinite(protos).all(axis=1))]
        return None, f"'{PROTOTYPES}': NaN or infinite values for held class(es) {bad}"
    return ClientPrototypes(protos, counts), None
