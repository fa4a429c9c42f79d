"""Parameter-averaging strategies: FedAvg / FedProx (one class) and local-only training.

The aggregation itself is a pure function (:func:`average_arrays`); the Strategy classes are thin
adapters that validate replies against the current global model and call it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar,
                         ndarrays_to_parameters, parameters_to_ndarrays)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg, Strategy

from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.validation import (Rejection, check_arrays, client_label, log_rejection,
                                          specs_like)

WEIGHTINGS = ("samples", "uniform")


def average_arrays(client_arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
    """Weighted mean of each array position across clients, in float64, cast back to the input dtype.

    Integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are rounded, so the result keeps the
    exact dtypes the clients use.
    """
    if not client_arrays:
        raise ValueError("average_arrays needs at least one client")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(client_arrays),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {len(client_arrays)} non-negative numbers with a positive sum")
    w = w / w.sum()
    out = []
    for position in zip(*client_arrays):
        acc = sum(wi * a.astype(np.float64) for wi, a in zip(w, position))
        ref = position[0]
        out.append(np.rint(acc).astype(ref.dtype) if ref.dtype.kind in "iu" else acc.astype(ref.dtype))
    return out


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
        client_manager.wait_for(self.min_available_clients)
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
