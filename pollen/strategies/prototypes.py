"""FedProto / BD-FedProto on the server: class-wise prototype aggregation as a Flower ``Strategy``.

Clients never share model weights, only one embedding per class they hold (their *local prototype*)
and how many training samples of each class they have. The server averages each class over the
clients that hold it and sends every global prototype back, with a presence mask and CPA's margin.

Payload contract (numpy arrays, in this order):

* server → client: ``[protos C×d float32, present C int64 (0/1), margin (1,) float32]``; nothing (an
  empty list) before the first aggregation.
* client → server: ``[protos C×d float32, counts C int64]``; rows of classes with count 0 are ignored.

The math (:func:`aggregate_prototypes`, :func:`prototype_margin`) is pure numpy; the strategy works
with any client that follows the contract — nothing here imports Pollen's clients, models or data.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar,
                         ndarrays_to_parameters)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.validation import ArraySpec, check_arrays
from pollen.strategies.weights import RejectionLog

PROTO_WEIGHTINGS = ("samples", "uniform")


def aggregate_prototypes(protos: Sequence[np.ndarray], counts: Sequence[np.ndarray],
                         weighting: str = "samples") -> tuple[np.ndarray, np.ndarray]:
    """Class-wise average of client prototypes over the clients that hold each class.

    ``C̄^j = Σ_i w_ij C_i^j / Σ_i w_ij`` with ``w_ij = |D_ij|`` (``"samples"``, the paper) or
    ``w_ij = 1[|D_ij| > 0]`` (``"uniform"``, the official code). Returns ``(global C×d float32,
    present C bool)``; a class no client holds stays absent (its row is zeros and must not be read) —
    averaging zero vectors in would drag every embedding of that class towards the origin.
    """
    if weighting not in PROTO_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {PROTO_WEIGHTINGS}, got {weighting!r}")
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
    out[present] = (total[present] / weight[present, None]).astype(np.float32)
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


def encode_global(protos: np.ndarray, present: np.ndarray, margin: float) -> list[np.ndarray]:
    """The server → client arrays of the payload contract."""
    return [protos.astype(np.float32), present.astype(np.int64), np.array([margin], dtype=np.float32)]


class PrototypeStrategy(RejectionLog, Strategy):
    """FedProto (and BD-FedProto, whose extras live on the clients) as a legacy Flower ``Strategy``.

    Args:
        num_classes: C, rows of every prototype array.
        embed_dim: d, columns; every client's encoder must produce d-dimensional embeddings (the
            architectures may otherwise differ).
        weighting: ``"samples"`` (count-weighted, the paper) or ``"uniform"`` (the official code).
        fraction_fit / fraction_evaluate / min_available_clients: client sampling, as in FedAvg.
        evaluate_every: evaluate every this many rounds (and always in the last round,
            ``num_rounds``); prototype methods evaluate on clients only, so this just saves messages.
        num_rounds: the run's last round, so that it is always evaluated (``None``: unknown).

    Classes that no client sampled in a round reports keep their previous global prototype; classes
    no client ever held stay absent. Every reply is validated (array count, shapes, dtypes, counts
    ≥ 0, finite prototypes for held classes); a bad one is dropped with a logged reason and counted.
    """

    def __init__(self, *, num_classes: int, embed_dim: int, weighting: str = "samples",
                 fraction_fit: float = 1.0, fraction_evaluate: float = 1.0, min_available_clients: int = 2,
                 evaluate_every: int = 1, num_rounds: int | None = None):
        if num_classes < 1 or embed_dim < 1:
            raise ValueError(f"num_classes and embed_dim must be >= 1, got {num_classes} and {embed_dim}")
        if weighting not in PROTO_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {PROTO_WEIGHTINGS}, got {weighting!r}")
        if not 0 < fraction_fit <= 1 or not 0 <= fraction_evaluate <= 1:
            raise ValueError(f"need 0 < fraction_fit <= 1 and 0 <= fraction_evaluate <= 1, "
                             f"got {fraction_fit} and {fraction_evaluate}")
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every must be >= 1, got {evaluate_every}")
        self._init_rejections()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.weighting = weighting
        self.fraction_fit = fraction_fit
        self.fraction_evaluate = fraction_evaluate
        self.min_available_clients = min_available_clients
        self.evaluate_every = evaluate_every
        self.num_rounds = num_rounds
        self.protos = np.zeros((num_classes, embed_dim), dtype=np.float32)
        self.present = np.zeros(num_classes, dtype=bool)
        self.margin = 0.0

    def __repr__(self) -> str:
        return (f"PrototypeStrategy(C={self.num_classes}, d={self.embed_dim}, weighting={self.weighting}, "
                f"evaluate_every={self.evaluate_every})")

    # payloads ------------------------------------------------------------------------------
    def global_payload(self) -> list[np.ndarray]:
        """What clients receive now: nothing before the first aggregation."""
        if not self.present.any():
            return []
        return encode_global(self.protos, self.present, self.margin)

    def reply_specs(self) -> list[ArraySpec]:
        return [ArraySpec("prototypes", (self.num_classes, self.embed_dim), "float32", finite=False),
                ArraySpec("class-counts", (self.num_classes,), "int64", nonnegative=True)]

    def check_reply(self, arrays: Sequence[np.ndarray]) -> str | None:
        """``None`` for a reply that follows the contract, else the reason it does not."""
        reason = check_arrays(arrays, self.reply_specs())
        if reason is not None:
            return reason
        protos, counts = arrays
        held = counts > 0
        if not np.isfinite(protos[held]).all():
            bad = [int(c) for c in np.flatnonzero(held & ~np.isfinite(protos).all(axis=1))]
            return f"prototypes: NaN or infinite values for held class(es) {bad}"
        return None

    # Strategy API --------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def _sample(self, client_manager: ClientManager, fraction: float) -> list[ClientProxy]:
        client_manager.wait_for(self.min_available_clients)
        available = client_manager.num_available()
        n = max(1, int(available * fraction))
        return client_manager.sample(num_clients=n, min_num_clients=n)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        ins = FitIns(ndarrays_to_parameters(self.global_payload()), {"server-round": server_round})
        return [(c, ins) for c in self._sample(client_manager, self.fraction_fit)]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted = [(arrays, res) for _, arrays, res in
                    self.screen_replies(server_round, results, lambda arrays, _res: self.check_reply(arrays))]
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures)}
        if accepted:
            protos, present = aggregate_prototypes([a[0] for a, _ in accepted], [a[1] for a, _ in accepted],
                                                   self.weighting)
            self.protos[present] = protos[present]  # unreported classes keep their last prototype
            self.present |= present
            self.margin = prototype_margin(self.protos, self.present)
            metrics.update(mean_std_metrics([(r.num_examples, r.metrics) for _, r in accepted]))
        metrics["classes-present"] = int(self.present.sum())
        metrics["margin"] = float(self.margin)
        return ndarrays_to_parameters(self.global_payload()), metrics

    def _evaluates(self, server_round: int) -> bool:
        return server_round % self.evaluate_every == 0 or server_round == self.num_rounds

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        if self.fraction_evaluate <= 0 or not self._evaluates(server_round):
            return []
        ins = EvaluateIns(ndarrays_to_parameters(self.global_payload()), {"server-round": server_round})
        return [(c, ins) for c in self._sample(client_manager, self.fraction_evaluate)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        if not results:
            return None, {}
        total = sum(r.num_examples for _, r in results)
        loss = sum(r.loss * r.num_examples for _, r in results) / max(total, 1)
        return float(loss), mean_std_metrics([(r.num_examples, r.metrics) for _, r in results])

    def evaluate(self, server_round: int, parameters: Parameters):
        return None  # no global model: clients evaluate their own models

