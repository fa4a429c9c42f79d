"""Public-logit aggregation: the server side of FCCL, FedMD and FedDF.

Clients never send parameters (heterogeneous architectures have nothing to average); each sends its
logits on the shared unlabeled public set, N0×C float32, rows in public-sample order. The server
keeps only their mean (the *consensus*) and sends it back next round, with the number of
contributors, so a client whose own reply is in the mean can take it out again (leave-one-out target,
see :func:`pollen.clients.logit_losses.leave_one_out_target`).

Payloads (lists of ndarrays):

* server → client, ``FitIns.parameters``: ``[]`` before any consensus exists (round 1), else
  ``[consensus N0×C float32, contributors (1,) int64]`` followed, in homogeneous mode
  (``average_weights=True``), by the averaged model state. ``FitIns.config``: ``server-round`` and
  ``contributed`` (whether this client's logits are in the consensus).
* client → server, ``FitRes.parameters``: ``[logits N0×C float32]`` (+ model state in homogeneous mode).

Every reply is validated (array count, shape, dtype, finite); a bad one is dropped with a logged
reason and counted in the round's metrics. The mean is unweighted: every participant counts once,
as in FCCL's and FedMD's code.
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
from pollen.strategies.validation import ArraySpec, check_arrays, specs_like
from pollen.strategies.weights import RejectionLog, average_arrays


def mean_logits(client_logits: Sequence[np.ndarray]) -> np.ndarray:
    """Unweighted mean of equally shaped logit matrices, accumulated in float64, returned as float32."""
    if not client_logits:
        raise ValueError("mean_logits needs at least one logit matrix")
    shape = client_logits[0].shape
    for i, arr in enumerate(client_logits):
        if arr.shape != shape:
            raise ValueError(f"logit matrix {i} has shape {arr.shape}, expected {shape}")
    return (sum(a.astype(np.float64) for a in client_logits) / len(client_logits)).astype(np.float32)


class LogitAveraging(RejectionLog, Strategy):
    """Averages clients' public-set logits into a consensus; never sees model parameters.

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
        client_manager.wait_for(self.min_available_clients)
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
        return float(loss), mean_std_metrics([(1, r.metrics) for _, r in results])

    def evaluate(self, server_round: int, parameters: Parameters):
        return None
