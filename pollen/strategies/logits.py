"""Public-logit aggregation on the Message API: the server side of FCCL, FedMD and FedDF.

Clients never send parameters (heterogeneous architectures have nothing to average); each sends its
logits on the shared unlabeled public set (contract: :mod:`pollen.protocol.logits`). The server keeps
their unweighted mean (the *consensus*) and sends it back next round with the number of contributors,
so a client whose own reply is in the mean can take it out again (leave-one-out target). With
``aggregation = median | trimmed-mean`` the consensus is that robust statistic instead (a client's
leave-one-out then only approximates removing its own logits).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from pollen.protocol.logits import MODEL, PUBLIC_DIGEST, LogitUpdate, decode_logit_reply, encode_consensus
from pollen.protocol.records import ARRAYS, CONFIG, METRICS, array_record
from pollen.protocol.weights import decode_weights_reply
from pollen.strategies.aggregation import robust_stack
from pollen.strategies.base import PollenStrategy
from pollen.strategies.spread import LOGIT_RMS, UPDATE_NORM, logit_size, update_norm


def mean_logits(client_logits: Sequence[np.ndarray]) -> np.ndarray:
    """Unweighted mean of equally shaped logit matrices, accumulated in float64, returned as float32."""
    if not client_logits:
        raise ValueError("mean_logits needs at least one logit matrix")
    shape = client_logits[0].shape
    for i, arr in enumerate(client_logits):
        if arr.shape != shape:
            raise ValueError(f"logit matrix {i} has shape {arr.shape}, expected {shape}")
    total = np.zeros(shape, dtype=np.float64)
    for arr in client_logits:
        total += arr
    return (total / len(client_logits)).astype(np.float32)


def _digest(value: object) -> bool:
    """A well-formed ``public-digest``: a 52-bit non-negative integer."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 52


class LogitAveraging(PollenStrategy):
    """Averages clients' public-set logits into a consensus; never sees model parameters.

    ``num_public`` × ``num_classes`` is the logit shape every reply must have. With
    ``average_weights=True`` (homogeneous mode: every client runs the same architecture) replies also
    carry the model state in a ``model`` record, averaged FedAvg-style (weighted by ``num-examples``)
    and sent back with the consensus. Participants count equally in the consensus and in evaluation
    (inter-domain accuracy is a mean over clients, as in FCCL's code).
    """

    family = "logits"

    def __init__(self, *, num_public: int, num_classes: int, average_weights: bool = False, **kwargs):
        if num_public < 1 or num_classes < 1:
            raise ValueError(f"num_public and num_classes must be >= 1, got {num_public} and {num_classes}")
        super().__init__(**kwargs)
        self.num_public = num_public
        self.num_classes = num_classes
        self.average_weights = average_weights
        self.consensus: np.ndarray | None = None
        self.contributors: set[int] = set()  # node ids whose logits are in the consensus
        self.contributor_partitions: set[int] = set()  # the same, by partition: survives a restart
        self.weights: ArrayRecord | None = None
        self._broadcast: dict[str, np.ndarray] | None = None  # self.weights decoded, once per round
        # The federation's public images (their digest): fixed by the first round's majority.
        self.public_digest: int | None = None

    def __repr__(self) -> str:
        return (f"LogitAveraging(num_public={self.num_public}, num_classes={self.num_classes}, "
                f"average_weights={self.average_weights})")

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Consensus and averaged weights; contributors by partition (node ids change on restart)."""
        arrays, values = super().state()
        if self.consensus is not None:
            arrays["consensus"] = self.consensus.copy()
        if self.weights is not None:
            arrays.update({f"model.{k}": a.numpy() for k, a in self.weights.items()})
        values["contributor-partitions"] = sorted(self.contributor_partitions)
        values["contributors"] = len(self.contributors)
        values["public-digest"] = self.public_digest
        return arrays, values

    def restore(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        super().restore(arrays, values)
        self.consensus = arrays.get("consensus")
        model = {k[len("model."):]: a for k, a in arrays.items() if k.startswith("model.")}
        self.weights = array_record(model) if model else None
        # Node ids are new after a restart: keep the count (it scales the consensus), not the ids;
        # the partitions tell each node whether its own logits are in the mean.
        self.contributors = set(range(-int(values["contributors"]), 0))
        self.contributor_partitions = {int(p) for p in values.get("contributor-partitions", [])}
        digest = values.get("public-digest")
        self.public_digest = None if digest is None else int(digest)

    def consensus_record(self) -> ArrayRecord:
        if self.consensus is None:
            return ArrayRecord()
        return encode_consensus(self.consensus, len(self.contributors))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.average_weights and self.weights is None and len(arrays) > 0:
            self.weights = arrays  # the caller's initial model fixes the shapes replies must have
        nodes = self.sample(grid, self.fraction_train, self.min_train_nodes, server_round)
        consensus = self.consensus_record()

        extra: dict[str, Any] = {}
        if self.contributor_partitions:
            extra["contributor-partitions"] = sorted(self.contributor_partitions)

        def content(node: int) -> RecordDict:
            contributed = node in self.contributors or self.partition_of.get(node, -1) in self.contributor_partitions
            rd = RecordDict({ARRAYS: consensus, CONFIG: self.round_config(
                config, server_round, contributed=contributed, **extra)})
            if self.average_weights and self.weights is not None:
                rd[MODEL] = self.weights
            return rd

        return self.build_messages(server_round, nodes, MessageType.TRAIN, content)

    def _check_public(self, metrics: dict) -> str | None:
        digest = metrics.get(PUBLIC_DIGEST)
        if not _digest(digest):
            return f"metric '{PUBLIC_DIGEST}' (the public set's fingerprint) is missing or not a 52-bit integer"
        if digest != self.public_digest:
            return (f"its logits are on other public images (digest {digest:013x}, the federation's is "
                    f"{self.public_digest:013x}): every node must hold the same public set (same "
                    "fccl-public, fccl-public-size, seed, and for 'folder' the same files)")
        return None

    def _majority_digest(self, replies: list[Message]) -> int | None:
        """The public-set digest most replies share (smallest on a tie): one node with another copy of the
        public folder, answering first, must not decide what the federation's public set is."""
        counts: dict[int, int] = {}
        for msg in replies:
            metrics = None if msg.has_error() else msg.content.get(METRICS)
            digest = metrics.get(PUBLIC_DIGEST) if isinstance(metrics, MetricRecord) else None
            if isinstance(digest, int) and _digest(digest):
                counts[digest] = counts.get(digest, 0) + 1
        return min(counts, key=lambda d: (-counts[d], d)) if counts else None

    def _decode(self, msg: Message, reference: ArrayRecord | None, metrics: dict) -> tuple[object, str | None]:
        reason = self._check_public(metrics)
        if reason is not None:
            return None, reason
        logits, reason = decode_logit_reply(msg.content.get(ARRAYS), self.num_public, self.num_classes,
                                            self.bounds.declared().max_logit_abs)
        dp = self.bounds.dp
        if logits is not None and dp is not None and dp.bounds_models:
            reason = dp.check_logits(logits)
        if logits is None or reason is not None:
            return None, reason
        if not self.average_weights:
            return LogitUpdate(logits), None
        model = msg.content.get(MODEL)
        if reference is None:
            return None, f"homogeneous mode needs the model state under '{MODEL}'"
        state, reason = decode_weights_reply(model, reference, self.bounds.max_update_norm, self._broadcast)
        return (LogitUpdate(logits, state), None) if reason is None else (None, f"{MODEL}: {reason}")

    def _majority_state(self, replies: list[Message]) -> ArrayRecord | None:
        """Without an initial model, the state layout most round-1 replies share (on a tie, the least in
        name order): neither one odd or hostile client nor the order of answers decides the model's shapes."""
        layouts: dict[tuple, list[ArrayRecord]] = {}
        for msg in replies:
            model = None if msg.has_error() else msg.content.get(MODEL)
            if isinstance(model, ArrayRecord) and len(model):
                key = tuple((k, tuple(a.shape), a.dtype) for k, a in model.items())
                layouts.setdefault(key, []).append(model)
        if not layouts:
            return None
        best = min(layouts, key=lambda layout: (-len(layouts[layout]), layout))
        return layouts[best][0]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        reference = self.weights
        if self.average_weights and reference is None:
            reference = self._majority_state(replies)
        if self.public_digest is None:
            self.public_digest = self._majority_digest(replies)

        # The update bound is relative to the model broadcast last round; before any (no initial model),
        # to the zero model: the norm itself is then bounded by max-update-norm.
        if reference is not None:
            self._broadcast = {k: (a.numpy() if self.weights is not None else np.zeros(a.shape, a.dtype))
                               for k, a in reference.items()}

        def decode(msg: Message, metrics: dict) -> tuple[object, str | None]:
            return self._decode(msg, reference, metrics)

        def size(update: LogitUpdate) -> dict[str, float]:
            out = {LOGIT_RMS: logit_size(update.logits)}
            if update.model is not None and self._broadcast is not None:
                out[UPDATE_NORM] = update_norm(update.model, self._broadcast)
            return out

        accepted = self.hold_to_round(server_round, self.screen(server_round, "train", replies, decode), size)
        metrics = self.train_metrics(server_round, accepted)
        self.close_train_round(server_round, accepted)
        if not accepted:  # keep last round's consensus: better stale than nothing
            return None, metrics
        self.consensus = (mean_logits([a.payload.logits for a in accepted]) if self.aggregation == "mean" else
                          robust_stack([a.payload.logits for a in accepted], self.aggregation,
                                       self.trim_fraction).astype(np.float32))
        self.contributors = {a.node_id for a in accepted}
        self.contributor_partitions = {self.partition_of[a.node_id] for a in accepted if a.node_id in self.partition_of}
        if self.average_weights:
            assert reference is not None  # without a reference state _decode rejects every reply
            keys = list(reference.keys())
            averaged = self.combine([[a.payload.model[k] for k in keys] for a in accepted],
                                    [float(a.num_examples) for a in accepted])
            self.weights = array_record(dict(zip(keys, averaged)))
        return self.consensus_record(), metrics

    def evaluate_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        return RecordDict({ARRAYS: ArrayRecord(), CONFIG: self.round_config(config, server_round)})

    def evaluate_weight(self, accepted) -> float:
        return 1.0
