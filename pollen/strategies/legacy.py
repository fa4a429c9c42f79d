"""Legacy adapters: the same aggregation math behind Flower's deprecated ``flwr.server.strategy`` API.

For projects still built on ``ServerAppComponents`` / ``server_fn`` / ``NumPyClient``: these classes
run under Flower's legacy ``Server`` loop with positional array lists (contracts in each class's
docstring). New projects use the Message-API strategies of :mod:`pollen.strategies`. Both paths call
the same pure functions (:func:`average_arrays`, :func:`aggregate_prototypes`, :func:`mean_logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg, Strategy

from pollen.strategies.logits import mean_logits
from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.prototypes import PROTO_WEIGHTINGS, aggregate_prototypes, prototype_margin
from pollen.strategies.validation import ArraySpec, Rejection, check_arrays, client_label, log_rejection, specs_like
from pollen.strategies.weights import WEIGHTINGS, average_arrays

# Seconds to wait for ``min_available_clients``: flwr's SimpleClientManager default, which its abstract
# ClientManager.wait_for does not declare.
WAIT_TIMEOUT = 86400


def encode_global(protos: np.ndarray, present: np.ndarray, margin: float) -> list[np.ndarray]:
    """The legacy server → client prototype arrays: ``[protos, present (int64), margin (1,)]``."""
    return [protos.astype(np.float32), present.astype(np.int64), np.array([margin], dtype=np.float32)]


class RejectionLog:
    """Mixin: the replies a strategy dropped in the current round, for logs and round metrics."""

    def _init_rejections(self) -> None:
        self.rejections: list[Rejection] = []

    def reject(self, server_round: int, client: str, reason: str) -> None:
        rej = Rejection(server_round, client, reason)
        log_rejection(rej)
        self.rejections.append(rej)

    def take_rejections(self) -> list[Rejection]:
        taken, self.rejections = self.rejections, []
        return taken

    def screen_replies(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                       check: Callable[[list[np.ndarray], FitRes], str | None],
                       ) -> list[tuple[ClientProxy, list[np.ndarray], FitRes]]:
        """Decode each reply and keep those ``check`` accepts; the rest are rejected with the reason."""
        accepted = []
        for proxy, res in results:
            label = client_label(res.metrics, proxy.cid)
            try:
                arrays = parameters_to_ndarrays(res.parameters)
            except Exception as err:  # undecodable bytes are a bad reply, not a crash
                self.reject(server_round, label, f"undecodable parameters ({err})")
                continue
            reason = check(arrays, res)
            if reason is not None:
                self.reject(server_round, label, reason)
                continue
            accepted.append((proxy, arrays, res))
        return accepted


class WeightAveraging(RejectionLog, FedAvg):
    """FedAvg (``proximal_mu = 0``) or FedProx (``proximal_mu > 0``) over full model state.

    ``weighting = "samples"`` weights each client by its number of training examples (McMahan et al.),
    ``"uniform"`` averages clients equally (as GLFC's code does). Each reply must match the current
    global model's array count, shapes and dtypes and be finite; anything else is dropped and counted.
    The proximal coefficient travels to clients in the fit config as ``proximal-mu``.
    """

    def __init__(self, *, initial_parameters: Parameters, weighting: str = "samples",
                 proximal_mu: float = 0.0, **kwargs):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        kwargs.setdefault("fit_metrics_aggregation_fn", mean_std_metrics)
        kwargs.setdefault("evaluate_metrics_aggregation_fn", mean_std_metrics)
        super().__init__(initial_parameters=initial_parameters, **kwargs)
        self._init_rejections()
        self.weighting = weighting
        self.proximal_mu = proximal_mu
        self._global = parameters_to_ndarrays(initial_parameters)

    def __repr__(self) -> str:
        return f"WeightAveraging(weighting={self.weighting}, proximal_mu={self.proximal_mu})"

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        instructions = super().configure_fit(server_round, parameters, client_manager)
        for _, ins in instructions:
            ins.config["server-round"] = server_round
            ins.config["proximal-mu"] = float(self.proximal_mu)
        return instructions

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        instructions = super().configure_evaluate(server_round, parameters, client_manager)
        for _, ins in instructions:
            ins.config["server-round"] = server_round
        return instructions

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        specs = specs_like(self._global)

        def check(arrays: list[np.ndarray], res: FitRes) -> str | None:
            reason = check_arrays(arrays, specs)
            if reason is None and res.num_examples <= 0:
                reason = f"num_examples = {res.num_examples} (must be > 0)"
            return reason

        accepted = [(arrays, res) for _, arrays, res in self.screen_replies(server_round, results, check)]
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures)}
        if not accepted:
            return None, metrics
        weights = [float(r.num_examples) if self.weighting == "samples" else 1.0 for _, r in accepted]
        self._global = average_arrays([a for a, _ in accepted], weights)
        metrics.update(mean_std_metrics([(r.num_examples, r.metrics) for _, r in accepted]))
        return ndarrays_to_parameters(self._global), metrics


class LocalOnly(RejectionLog, Strategy):
    """No collaboration: every client trains its own model, kept in its state; nothing is averaged.

    Rounds still exist so that local training is scheduled, evaluated and recorded exactly like the
    federated methods it is compared with.
    """

    def __init__(self, *, fraction_evaluate: float = 1.0, min_available_clients: int = 2):
        self._init_rejections()
        self.fraction_evaluate = fraction_evaluate
        self.min_available_clients = min_available_clients

    def __repr__(self) -> str:
        return "LocalOnly()"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def _all(self, client_manager: ClientManager, fraction: float) -> list[ClientProxy]:
        client_manager.wait_for(self.min_available_clients, WAIT_TIMEOUT)
        available = client_manager.num_available()
        n = max(1, int(round(available * fraction)))
        return client_manager.sample(num_clients=n, min_num_clients=n)

    def configure_fit(self, server_round, parameters, client_manager):
        ins = FitIns(ndarrays_to_parameters([]), {"server-round": server_round})
        return [(c, ins) for c in self._all(client_manager, 1.0)]

    def aggregate_fit(self, server_round, results, failures):
        metrics = mean_std_metrics([(r.num_examples, r.metrics) for _, r in results])
        metrics.update({"accepted": len(results), "rejected": 0, "failures": len(failures)})
        return ndarrays_to_parameters([]), metrics

    def configure_evaluate(self, server_round, parameters, client_manager):
        if self.fraction_evaluate <= 0:
            return []
        ins = EvaluateIns(ndarrays_to_parameters([]), {"server-round": server_round})
        return [(c, ins) for c in self._all(client_manager, self.fraction_evaluate)]

    def aggregate_evaluate(self, server_round, results: list[tuple[ClientProxy, EvaluateRes]], failures):
        if not results:
            return None, {}
        total = sum(r.num_examples for _, r in results)
        loss = sum(r.loss * r.num_examples for _, r in results) / max(total, 1)
        return float(loss), mean_std_metrics([(r.num_examples, r.metrics) for _, r in results])

    def evaluate(self, server_round, parameters):
        return None

class PrototypeStrategy(RejectionLog, Strategy):
    """FedProto (and BD-FedProto, whose extras live on the clients) as a legacy Flower ``Strategy``.

    Payload: server → client ``[protos C×d float32, present C int64, margin (1,) float32]`` (``[]``
    before the first aggregation); client → server ``[protos C×d float32, counts C int64]``.

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
        client_manager.wait_for(self.min_available_clients, WAIT_TIMEOUT)
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
        return float(loss), dict(mean_std_metrics([(r.num_examples, r.metrics) for _, r in results]))

    def evaluate(self, server_round: int, parameters: Parameters):
        return None  # no global model: clients evaluate their own models


class LogitAveraging(RejectionLog, Strategy):
    """Averages clients' public-set logits into a consensus; never sees model parameters.

    Payload: server → client ``[]`` in round 1, else ``[consensus N0×C float32, contributors (1,)
    int64]`` (+ averaged model state in homogeneous mode), config ``contributed``; client → server
    ``[logits N0×C float32]`` (+ model state).

    ``num_public`` × ``num_classes`` is the logit shape every reply must have. With
    ``average_weights=True`` (homogeneous mode: every client runs the same architecture) replies also
    carry the model state, which is averaged FedAvg-style (weighted by training samples) and sent back
    with the consensus — FCCL "+ averaging" of the paper's Table 3, or FedAvg when the client does no
    collaborative step.
    """

    def __init__(self, *, num_public: int, num_classes: int, fraction_fit: float = 1.0,
                 fraction_evaluate: float = 1.0, min_fit_clients: int = 1,
                 min_available_clients: int = 1, average_weights: bool = False):
        if num_public < 1 or num_classes < 1:
            raise ValueError(f"num_public and num_classes must be >= 1, got {num_public} and {num_classes}")
        if not 0.0 < fraction_fit <= 1.0:
            raise ValueError(f"fraction_fit must be in (0, 1], got {fraction_fit}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        self._init_rejections()
        self.num_public = num_public
        self.num_classes = num_classes
        self.fraction_fit = fraction_fit
        self.fraction_evaluate = fraction_evaluate
        self.min_fit_clients = min_fit_clients
        self.min_available_clients = min_available_clients
        self.average_weights = average_weights
        self.consensus: np.ndarray | None = None
        self.contributors: set[str] = set()
        self.weights: list[np.ndarray] | None = None

    def __repr__(self) -> str:
        return (f"LogitAveraging(num_public={self.num_public}, num_classes={self.num_classes}, "
                f"average_weights={self.average_weights})")

    @property
    def logit_spec(self) -> ArraySpec:
        return ArraySpec("public-logits", (self.num_public, self.num_classes), "float32")

    # sampling ------------------------------------------------------------------------------
    def _sample(self, client_manager: ClientManager, fraction: float, minimum: int) -> list[ClientProxy]:
        client_manager.wait_for(self.min_available_clients, WAIT_TIMEOUT)
        n = max(int(client_manager.num_available() * fraction), minimum)
        return client_manager.sample(num_clients=n, min_num_clients=n)

    # Flower Strategy API --------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def payload(self) -> list[np.ndarray]:
        """What every sampled client receives this round (see the module docstring)."""
        if self.consensus is None:
            return []
        out = [self.consensus, np.array([len(self.contributors)], dtype=np.int64)]
        if self.average_weights and self.weights is not None:
            out.extend(self.weights)
        return out

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        params = ndarrays_to_parameters(self.payload())
        return [(proxy, FitIns(params, {"server-round": server_round,
                                        "contributed": proxy.cid in self.contributors}))
                for proxy in self._sample(client_manager, self.fraction_fit, self.min_fit_clients)]

    def _reply_specs(self, arrays: list[np.ndarray], reference: list[np.ndarray] | None) -> list[ArraySpec]:
        if not self.average_weights:
            return [self.logit_spec]
        if reference is None:  # first weights ever: any float/int state, shapes fixed by the first reply
            return [self.logit_spec] + [ArraySpec(f"param[{i}]", tuple(a.shape), "any")
                                        for i, a in enumerate(arrays[1:])]
        return [self.logit_spec] + specs_like(reference)

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        reference = self.weights

        def check(arrays: list[np.ndarray], res: FitRes) -> str | None:
            nonlocal reference
            reason = check_arrays(arrays, self._reply_specs(arrays, reference))
            if reason is None and res.num_examples <= 0:
                reason = f"num_examples = {res.num_examples} (must be > 0)"
            if reason is None and self.average_weights and reference is None:
                reference = arrays[1:]  # the first good reply fixes the shapes of round 1
            return reason

        accepted = self.screen_replies(server_round, results, check)
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures)}
        if not accepted:  # keep last round's consensus: better stale than nothing
            return None, metrics
        self.consensus = mean_logits([arrays[0] for _, arrays, _ in accepted])
        self.contributors = {proxy.cid for proxy, _, _ in accepted}
        if self.average_weights:
            self.weights = average_arrays([arrays[1:] for _, arrays, _ in accepted],
                                          [float(res.num_examples) for _, _, res in accepted])
        metrics.update(mean_std_metrics([(1, res.metrics) for _, _, res in accepted]))
        return ndarrays_to_parameters(self.payload()), metrics

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        if self.fraction_evaluate <= 0:
            return []
        ins = EvaluateIns(ndarrays_to_parameters([]), {"server-round": server_round})
        return [(proxy, ins) for proxy in self._sample(client_manager, self.fraction_evaluate, 1)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        """Participants count equally: inter-domain accuracy is a mean over clients (FCCL's code)."""
        if not results:
            return None, {}
        loss = sum(r.loss for _, r in results) / len(results)
        return float(loss), dict(mean_std_metrics([(1, r.metrics) for _, r in results]))

    def evaluate(self, server_round: int, parameters: Parameters):
        return None
