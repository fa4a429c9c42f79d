"""FedProto / BD-FedProto on the server: class-wise prototype aggregation on the Message API.

Clients never share model weights, only one embedding per class they hold (their *local prototype*)
and how many training samples of each class they have (contract: :mod:`pollen.protocol.prototypes`).
The server averages each class over the clients that hold it and sends every global prototype back,
with a presence mask and CPA's margin. The math (:func:`aggregate_prototypes`,
:func:`prototype_margin`) is pure numpy; nothing here imports Pollen's clients, models or data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from pollen.protocol.prototypes import (
    COUNT_NOISE_STD,
    NOISY_COUNTS,
    PROTO_SUMS,
    PROTO_WEIGHTINGS,
    ClientPrototypes,
    decode_prototype_reply,
    encode_global_prototypes,
)
from pollen.protocol.records import ARRAYS, CONFIG
from pollen.strategies.aggregation import DEFAULT_TRIM_FRACTION, check_aggregation, robust_stack
from pollen.strategies.base import PollenStrategy
from pollen.strategies.spread import PROTOTYPE_NORM, prototype_size


def aggregate_prototypes(protos: Sequence[np.ndarray], counts: Sequence[np.ndarray],
                         weighting: str = "samples", aggregation: str = "mean",
                         trim_fraction: float = DEFAULT_TRIM_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """Class-wise average of client prototypes over the clients that hold each class.

    ``C̄^j = Σ_i w_ij C_i^j / Σ_i w_ij`` with ``w_ij = |D_ij|`` (``"samples"``, the paper) or
    ``w_ij = 1[|D_ij| > 0]`` (``"uniform"``, the official code). Returns ``(global C×d float32,
    present C bool)``; a class no client holds stays absent (its row is zeros and must not be read) —
    averaging zero vectors in would drag every embedding of that class towards the origin.
    ``aggregation = median | trimmed-mean`` replaces the weighted mean by that coordinate-wise statistic
    over the holders of each class, unweighted (:mod:`pollen.strategies.aggregation`).
    """
    if weighting not in PROTO_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {PROTO_WEIGHTINGS}, got {weighting!r}")
    check_aggregation(aggregation, trim_fraction)
    if len(protos) != len(counts) or not protos:
        raise ValueError(f"need the same positive number of prototype and count arrays, "
                         f"got {len(protos)} and {len(counts)}")
    shape = protos[0].shape
    if len(shape) != 2:
        raise ValueError(f"prototypes must be C×d arrays, got shape {shape}")
    num_classes, dim = shape
    total = np.zeros((num_classes, dim), dtype=np.float64)
    weight = np.zeros(num_classes, dtype=np.float64)
    for i, (p, c) in enumerate(zip(protos, counts)):
        if p.shape != shape or np.shape(c) != (num_classes,):
            raise ValueError(f"client {i}: prototypes {p.shape} / counts {np.shape(c)} do not match "
                             f"{shape} / ({num_classes},)")
        c = np.asarray(c)
        if (c < 0).any():
            raise ValueError(f"client {i}: class counts must be >= 0")
        held = c > 0
        w = c.astype(np.float64) if weighting == "samples" else held.astype(np.float64)
        total[held] += w[held, None] * p[held].astype(np.float64)
        weight += np.where(held, w, 0.0)
    present = weight > 0
    out = np.zeros((num_classes, dim), dtype=np.float32)
    if aggregation == "mean":
        out[present] = (total[present] / weight[present, None]).astype(np.float32)
        return out, present
    for j in np.flatnonzero(present):
        holders = [p[j] for p, c in zip(protos, counts) if np.asarray(c)[j] > 0]
        out[j] = robust_stack(holders, aggregation, trim_fraction).astype(np.float32)
    return out, present


def prototype_margin(protos: np.ndarray, present: np.ndarray) -> float:
    """CPA's margin ``m = median_{j≠k} d(C̄^j, C̄^k)`` over present classes, d = element-wise MSE.

    0 when fewer than two classes are present (no pair to measure, and no negatives matter then).
    """
    idx = np.flatnonzero(np.asarray(present, dtype=bool))
    if idx.size < 2:
        return 0.0
    p = protos[idx].astype(np.float64)
    dist = ((p[:, None, :] - p[None, :, :]) ** 2).mean(axis=2)
    upper = dist[np.triu_indices(idx.size, k=1)]
    return float(np.median(upper))


def _size(update: ClientPrototypes) -> dict[str, float]:
    """A reply's size for the round's spread: its largest held prototype row (none held: no vote)."""
    held = np.asarray(update.weights) > 0
    return {PROTOTYPE_NORM: prototype_size(update.prototypes, update.weights)} if held.any() else {}


class PrototypeStrategy(PollenStrategy):
    """FedProto (and BD-FedProto, whose extras live on the clients) as a Message-API strategy.

    Args:
        num_classes: C, rows of every prototype array.
        embed_dim: d, columns; every client's encoder must produce d-dimensional embeddings (the
            architectures may otherwise differ).
        weighting: ``"samples"`` (count-weighted, the paper) or ``"uniform"`` (the official code).
        **kwargs: sampling and screening options of :class:`~pollen.strategies.base.PollenStrategy`.

    Classes that no client sampled in a round reports keep their previous global prototype; classes
    no client ever held stay absent. ``aggregate_train`` returns the global record (prototypes,
    presence, margin), so Flower's ``Result.arrays`` holds the final prototypes.
    """

    family = "prototypes"

    def __init__(self, *, num_classes: int, embed_dim: int, weighting: str = "samples", **kwargs):
        if num_classes < 1 or embed_dim < 1:
            raise ValueError(f"num_classes and embed_dim must be >= 1, got {num_classes} and {embed_dim}")
        if weighting not in PROTO_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {PROTO_WEIGHTINGS}, got {weighting!r}")
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.weighting = weighting
        self.protos = np.zeros((num_classes, embed_dim), dtype=np.float32)
        self.present = np.zeros(num_classes, dtype=bool)
        self.margin = 0.0

    def __repr__(self) -> str:
        return (f"PrototypeStrategy(C={self.num_classes}, d={self.embed_dim}, weighting={self.weighting}, "
                f"evaluate_every={self.evaluate_every})")

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        arrays, values = super().state()
        arrays.update({"prototypes": self.protos.copy(), "present": self.present.astype(np.int64)})
        values["margin"] = float(self.margin)
        return arrays, values

    def restore(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        super().restore(arrays, values)
        if arrays["prototypes"].shape != self.protos.shape:
            raise ValueError(f"checkpoint prototypes {arrays['prototypes'].shape} != {self.protos.shape}")
        self.protos = arrays["prototypes"].astype(np.float32)
        self.present = arrays["present"].astype(bool)
        self.margin = float(values["margin"])

    def global_record(self) -> ArrayRecord:
        """What clients receive now: an empty record before the first aggregation."""
        if not self.present.any():
            return ArrayRecord()
        return encode_global_prototypes(self.protos, self.present, self.margin)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        nodes = self.sample(grid, self.fraction_train, self.min_train_nodes, server_round)
        # "monitor": clients compute their diagnostics (an extra pass) only on rounds that are evaluated
        content = RecordDict({ARRAYS: self.global_record(),
                              CONFIG: self.round_config(config, server_round, monitor=self.evaluates(server_round))})
        return self.build_messages(server_round, nodes, MessageType.TRAIN, lambda _n: content)

    def _check_dp(self, record: ArrayRecord) -> str | None:
        """Under DP every reply must be a release (noisy sums and counts) within the DP bound."""
        assert self.bounds.dp is not None
        if PROTO_SUMS not in record:
            return f"under {self.bounds.dp.source} a reply must carry the noisy release '{PROTO_SUMS}'"
        return self.bounds.dp.check_prototypes(record[PROTO_SUMS].numpy(), record[NOISY_COUNTS].numpy(),
                                               float(record[COUNT_NOISE_STD].numpy()[0]), self.max_examples)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        def decode(msg: Message, _metrics: dict) -> tuple[object, str | None]:
            record = msg.content.get(ARRAYS)
            decoded, reason = decode_prototype_reply(record, self.num_classes, self.embed_dim, self.max_examples)
            if decoded is not None and self.bounds.dp is not None and isinstance(record, ArrayRecord):
                reason = self._check_dp(record)
            return (decoded, None) if reason is None else (None, reason)

        accepted = self.hold_to_round(server_round, self.screen(server_round, "train", replies, decode), _size)
        if accepted:
            protos, present = aggregate_prototypes([a.payload.prototypes for a in accepted],
                                                   [a.payload.weights for a in accepted], self.weighting,
                                                   self.aggregation, self.trim_fraction)
            self.protos[present] = protos[present]  # unreported classes keep their last prototype
            self.present |= present
            self.margin = prototype_margin(self.protos, self.present)
        metrics = self.train_metrics(server_round, accepted, **{"classes-present": int(self.present.sum()),
                                                                "margin": float(self.margin)})
        self.close_train_round(server_round, accepted)
        return (self.global_record() if accepted else None), metrics

    def evaluate_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        return RecordDict({ARRAYS: self.global_record(), CONFIG: self.round_config(config, server_round)})
