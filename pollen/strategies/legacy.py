"""Legacy adapters: the same aggregation and screening behind Flower's deprecated ``flwr.server.strategy`` API.

For projects still built on ``ServerAppComponents`` / ``server_fn`` / ``NumPyClient``: these classes
run under Flower's legacy ``Server`` loop with positional array lists (contracts in each class's
docstring). New projects use the Message-API strategies of :mod:`pollen.strategies`. Each class is named
``Legacy<Message-API class>`` (``LegacyWeightAveraging``, ``LegacyPrototypeStrategy``,
``LegacyLogitAveraging``, ``LegacyLocalOnly``), so the two APIs' classes are never confused in one import.

The adapters hold no rules of their own. A legacy reply is converted into what :mod:`pollen.protocol`
takes — its positional tensors become a named ``ArrayRecord`` whose dtypes and shapes come from each
tensor's ``np.save`` header (nothing is decoded before they pass), its metrics the numbers a
``MetricRecord`` could hold — and is screened by the same protocol functions as on the Message API, so
both APIs refuse the same replies for the same reasons, declared payload bounds
(:class:`~pollen.protocol.screening.PayloadBounds`) and metric ranges included. Accepted replies are
combined by the same pure functions (:func:`average_arrays`, :func:`aggregate_prototypes`,
:func:`mean_logits`).
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
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
from numpy.lib import format as npy_format

from pollen.log import LOGGER
from pollen.protocol.identity import PARTITION_ID
from pollen.protocol.logits import LOGITS, decode_logit_reply
from pollen.protocol.prototypes import CLASS_COUNTS, PROTOTYPES, decode_prototype_reply
from pollen.protocol.records import NUM_EXAMPLES, array_record
from pollen.protocol.screening import (
    COMMON_METRICS,
    PayloadBounds,
    check_accuracy_keys,
    check_metrics,
    metric_bounds,
)
from pollen.protocol.weights import decode_weights_reply
from pollen.strategies.base import PollenStrategy
from pollen.strategies.logits import mean_logits
from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.prototypes import PROTO_WEIGHTINGS, aggregate_prototypes, prototype_margin
from pollen.strategies.weights import WEIGHTINGS, average_arrays

# Seconds to wait for ``min_available_clients``: flwr's SimpleClientManager default, which its abstract
# ClientManager.wait_for does not declare.
WAIT_TIMEOUT = 86400
# The largest ``num-examples`` (and class count) a client may claim: the Message-API strategies' default,
# so both APIs accept the same counts.
MAX_EXAMPLES: int = inspect.signature(PollenStrategy.__init__).parameters["max_examples"].default
_PARTITION_BOUND = {PARTITION_ID: COMMON_METRICS[PARTITION_ID]}


def encode_global(protos: np.ndarray, present: np.ndarray, margin: float) -> list[np.ndarray]:
    """The legacy server → client prototype arrays: ``[protos, present (int64), margin (1,)]``."""
    return [protos.astype(np.float32), present.astype(np.int64), np.array([margin], dtype=np.float32)]


def param_keys(count: int) -> list[str]:
    """Names for positional model arrays, so screening reasons say which one (``'param[2]': ...``)."""
    return [f"param[{i}]" for i in range(count)]


def _npy_meta(data: bytes) -> tuple[str, tuple[int, ...]]:
    """dtype and shape from an ``np.save`` header alone: the metadata a Message-API ``Array`` carries."""
    fh = io.BytesIO(data)
    version = npy_format.read_magic(fh)
    if version == (1, 0):
        shape, _fortran, dtype = npy_format.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, _fortran, dtype = npy_format.read_array_header_2_0(fh)
    else:
        raise ValueError(f"npy format version {version}")
    return str(dtype), tuple(int(s) for s in shape)


def parameters_record(parameters: Parameters, keys: Sequence[str]) -> tuple[ArrayRecord | None, str | None]:
    """Legacy positional tensors as the named ``ArrayRecord`` that protocol screening takes (``keys`` in
    order), or the reason they cannot be: a different number of tensors, or no readable ``np.save`` header."""
    tensors = list(parameters.tensors)
    if len(tensors) != len(keys):
        return None, f"expected {len(keys)} arrays, got {len(tensors)}"
    arrays: dict[str, Array] = {}
    for key, data in zip(keys, tensors):
        try:
            dtype, shape = _npy_meta(data)
        except Exception as err:  # bytes that are no npy file are a bad reply, not a crash
            return None, f"'{key}': undecodable ({type(err).__name__}: {err})"
        arrays[key] = Array(dtype=dtype, shape=shape, stype=parameters.tensor_type, data=data)
    return ArrayRecord(arrays), None


def metric_values(num_examples: int, metrics: Mapping[str, Scalar] | None) -> dict[str, Any]:
    """A legacy reply's metrics as a ``MetricRecord`` would hold them, with its ``num-examples``.

    Legacy ``Scalar`` values may also be strings, bytes or bools; those are never averaged and a
    ``MetricRecord`` cannot carry them, so they are left out rather than refused.
    """
    out: dict[str, Any] = {k: v for k, v in (metrics or {}).items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out[NUM_EXAMPLES] = num_examples
    return out


def client_label(metrics: Mapping[str, Scalar] | None, fallback: str) -> str:
    """Name a client by its partition id when it reported a valid one, else by Flower's node id."""
    pid = (metrics or {}).get(PARTITION_ID)
    if pid is not None and check_metrics({PARTITION_ID: pid}, _PARTITION_BOUND) is None:
        return f"partition {int(pid)}"
    return f"node {fallback}"  # a missing or malformed id never crashes the server


@dataclass
class Rejection:
    """A dropped reply: when, at which stage, who sent it (partition id when known) and why."""

    server_round: int
    client: str
    reason: str
    stage: str = "train"

    def as_dict(self) -> dict:
        return {"round": self.server_round, "stage": self.stage, "client": self.client, "reason": self.reason}


class RejectionLog:
    """Mixin: screening of legacy replies through :mod:`pollen.protocol`, and the replies dropped since
    they were last taken (for logs and round metrics)."""

    max_examples: int
    bounds: PayloadBounds

    def _init_screening(self, max_examples: int, bounds: PayloadBounds | None) -> None:
        if isinstance(max_examples, bool) or int(max_examples) != max_examples or max_examples < 1:
            raise ValueError(f"max_examples must be an integer >= 1, got {max_examples}")
        self.max_examples = int(max_examples)
        self.bounds = bounds if bounds is not None else PayloadBounds()
        self.rejections: list[Rejection] = []

    def _dp_models(self):
        """The DP bound of model updates and logits when the bounds carry one that sizes their noise
        (``dp-mode = payload``), else ``None``: the same check as the Message-API strategies."""
        dp = self.bounds.dp
        return dp if dp is not None and dp.bounds_models else None

    def reject(self, server_round: int, client: str, reason: str, stage: str = "train") -> None:
        rej = Rejection(server_round, client, reason, stage)
        LOGGER.warning("round %d %s: dropped reply from %s: %s", server_round, stage, client, reason)
        self.rejections.append(rej)

    def take_rejections(self) -> list[Rejection]:
        taken, self.rejections = self.rejections, []
        return taken

    def screen_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                   decode: Callable[[ClientProxy, FitRes], tuple[Any, str | None]],
                   ) -> list[tuple[ClientProxy, Any, FitRes]]:
        """``(proxy, payload, res)`` for each reply whose metrics pass and that ``decode`` accepts (it
        returns ``(payload, None)`` or ``(None, reason)``); the rest are rejected with the reason."""
        bounds = metric_bounds(self.max_examples, evaluate=False)
        accepted = []
        for proxy, res in results:
            metrics = metric_values(res.num_examples, res.metrics)
            reason = check_metrics(metrics, bounds) or check_accuracy_keys(metrics)
            payload = None
            if reason is None:
                payload, reason = decode(proxy, res)
            if reason is not None:
                self.reject(server_round, client_label(res.metrics, proxy.cid), reason)
                continue
            accepted.append((proxy, payload, res))
        return accepted

    def screen_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                        ) -> list[tuple[ClientProxy, EvaluateRes]]:
        """The evaluate replies whose loss (screened as the ``loss`` metric) and metrics pass."""
        bounds = metric_bounds(self.max_examples, evaluate=True)
        accepted = []
        for proxy, res in results:
            metrics = {**metric_values(res.num_examples, res.metrics), "loss": res.loss}
            reason = check_metrics(metrics, bounds) or check_accuracy_keys(metrics)
            if reason is not None:
                self.reject(server_round, client_label(res.metrics, proxy.cid), reason, "evaluate")
                continue
            accepted.append((proxy, res))
        return accepted


def sample_clients(client_manager: ClientManager, min_available: int, fraction: float,
                   minimum: int = 1) -> list[ClientProxy]:
    """``max(fraction × available, minimum, 1)`` clients, once ``min_available`` are connected."""
    client_manager.wait_for(min_available, WAIT_TIMEOUT)
    n = max(int(client_manager.num_available() * fraction), minimum, 1)
    return client_manager.sample(num_clients=n, min_num_clients=n)


def weighted_evaluate(results: list[tuple[ClientProxy, EvaluateRes]],
                      weight: Callable[[EvaluateRes], float]) -> tuple[float | None, dict[str, Scalar]]:
    """Loss and metrics of accepted evaluate replies, each client weighted by ``weight``."""
    if not results:
        return None, {}
    weights = [float(weight(r)) for _, r in results]
    loss = sum(w * r.loss for w, (_, r) in zip(weights, results)) / max(sum(weights), 1.0)
    return float(loss), dict(mean_std_metrics([(w, r.metrics) for w, (_, r) in zip(weights, results)]))


class LegacyWeightAveraging(RejectionLog, FedAvg):
    """FedAvg (``proximal_mu = 0``) or FedProx (``proximal_mu > 0``) over full model state.

    ``weighting = "samples"`` weights each client by its number of training examples (McMahan et al.),
    ``"uniform"`` averages clients equally (as GLFC's code does). Each reply must match the current
    global model's array count, shapes and dtypes, be finite and move it no further than
    ``bounds.max_update_norm`` allows (:mod:`pollen.protocol.weights`); anything else is dropped and
    counted. Under ``bounds.dp`` (``dp-mode = payload``) the update's DP bound replaces that norm, as on the
    Message API. The proximal coefficient travels to clients in the fit config as ``proximal-mu``.
    """

    def __init__(self, *, initial_parameters: Parameters, weighting: str = "samples",
                 proximal_mu: float = 0.0, max_examples: int = MAX_EXAMPLES, bounds: PayloadBounds | None = None,
                 **kwargs):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        kwargs.setdefault("fit_metrics_aggregation_fn", mean_std_metrics)
        kwargs.setdefault("evaluate_metrics_aggregation_fn", mean_std_metrics)
        super().__init__(initial_parameters=initial_parameters, **kwargs)
        self._init_screening(max_examples, bounds)
        self.weighting = weighting
        self.proximal_mu = proximal_mu
        self._global = parameters_to_ndarrays(initial_parameters)

    def __repr__(self) -> str:
        return f"LegacyWeightAveraging(weighting={self.weighting}, proximal_mu={self.proximal_mu})"

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
        keys = param_keys(len(self._global))
        broadcast = dict(zip(keys, self._global))
        reference = array_record(broadcast)
        dp = self._dp_models()

        def decode(_proxy: ClientProxy, res: FitRes) -> tuple[list[np.ndarray] | None, str | None]:
            record, reason = parameters_record(res.parameters, keys)
            if record is None:
                return None, reason
            state, reason = decode_weights_reply(record, reference, self.bounds.declared().max_update_norm,
                                                 broadcast)
            if state is not None and dp is not None:
                reason = dp.check_update(state, broadcast)
            return (None, reason) if state is None or reason is not None else ([state[k] for k in keys], None)

        accepted = [(arrays, res) for _, arrays, res in self.screen_fit(server_round, results, decode)]
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures)}
        if not accepted:
            return None, metrics
        weights = [float(r.num_examples) if self.weighting == "samples" else 1.0 for _, r in accepted]
        self._global = average_arrays([a for a, _ in accepted], weights)
        metrics.update(mean_std_metrics([(r.num_examples, r.metrics) for _, r in accepted]))
        return ndarrays_to_parameters(self._global), metrics

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        return super().aggregate_evaluate(server_round, self.screen_evaluate(server_round, results), failures)


class LegacyLocalOnly(RejectionLog, Strategy):
    """No collaboration: every client trains its own model, kept in its state; nothing is averaged.

    Rounds still exist so that local training is scheduled, evaluated and recorded exactly like the
    federated methods it is compared with. Replies carry no arrays; their metrics are screened.
    """

    def __init__(self, *, fraction_evaluate: float = 1.0, min_available_clients: int = 2,
                 max_examples: int = MAX_EXAMPLES):
        self._init_screening(max_examples, None)
        self.fraction_evaluate = fraction_evaluate
        self.min_available_clients = min_available_clients

    def __repr__(self) -> str:
        return "LegacyLocalOnly()"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def configure_fit(self, server_round, parameters, client_manager):
        ins = FitIns(ndarrays_to_parameters([]), {"server-round": server_round})
        return [(c, ins) for c in sample_clients(client_manager, self.min_available_clients, 1.0)]

    def aggregate_fit(self, server_round, results, failures):
        accepted = self.screen_fit(server_round, results, lambda _proxy, _res: (None, None))
        metrics = mean_std_metrics([(r.num_examples, r.metrics) for _, _, r in accepted])
        metrics.update({"accepted": len(accepted), "rejected": len(results) - len(accepted),
                        "failures": len(failures)})
        return ndarrays_to_parameters([]), metrics

    def configure_evaluate(self, server_round, parameters, client_manager):
        if self.fraction_evaluate <= 0:
            return []
        ins = EvaluateIns(ndarrays_to_parameters([]), {"server-round": server_round})
        return [(c, ins) for c in sample_clients(client_manager, self.min_available_clients, self.fraction_evaluate)]

    def aggregate_evaluate(self, server_round, results: list[tuple[ClientProxy, EvaluateRes]], failures):
        return weighted_evaluate(self.screen_evaluate(server_round, results), lambda r: r.num_examples)

    def evaluate(self, server_round, parameters):
        return None


class LegacyPrototypeStrategy(RejectionLog, Strategy):
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
        max_examples: the largest ``num-examples`` and class count a client may claim.

    Classes that no client sampled in a round reports keep their previous global prototype; classes
    no client ever held stay absent. Every reply is screened as a Message-API prototype reply
    (:mod:`pollen.protocol.prototypes`: shapes, dtypes, counts in [0, ``max_examples``], finite
    prototypes within the plausible magnitude for held classes); a bad one is dropped with a logged
    reason and counted.
    """

    def __init__(self, *, num_classes: int, embed_dim: int, weighting: str = "samples",
                 fraction_fit: float = 1.0, fraction_evaluate: float = 1.0, min_available_clients: int = 2,
                 evaluate_every: int = 1, num_rounds: int | None = None, max_examples: int = MAX_EXAMPLES):
        if num_classes < 1 or embed_dim < 1:
            raise ValueError(f"num_classes and embed_dim must be >= 1, got {num_classes} and {embed_dim}")
        if weighting not in PROTO_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {PROTO_WEIGHTINGS}, got {weighting!r}")
        if not 0 < fraction_fit <= 1 or not 0 <= fraction_evaluate <= 1:
            raise ValueError(f"need 0 < fraction_fit <= 1 and 0 <= fraction_evaluate <= 1, "
                             f"got {fraction_fit} and {fraction_evaluate}")
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every must be >= 1, got {evaluate_every}")
        self._init_screening(max_examples, None)
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
        return (f"LegacyPrototypeStrategy(C={self.num_classes}, d={self.embed_dim}, weighting={self.weighting}, "
                f"evaluate_every={self.evaluate_every})")

    # payloads ------------------------------------------------------------------------------
    def global_payload(self) -> list[np.ndarray]:
        """What clients receive now: nothing before the first aggregation."""
        if not self.present.any():
            return []
        return encode_global(self.protos, self.present, self.margin)

    def decode_reply(self, parameters: Parameters) -> tuple[tuple[np.ndarray, np.ndarray] | None, str | None]:
        """``((protos, counts), None)`` for a reply that follows the contract, else ``(None, reason)``."""
        record, reason = parameters_record(parameters, (PROTOTYPES, CLASS_COUNTS))
        if record is None:
            return None, reason
        return decode_prototype_reply(record, self.num_classes, self.embed_dim, self.max_examples)

    # Strategy API --------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        ins = FitIns(ndarrays_to_parameters(self.global_payload()), {"server-round": server_round})
        return [(c, ins) for c in sample_clients(client_manager, self.min_available_clients, self.fraction_fit)]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted = [(payload, res) for _, payload, res in
                    self.screen_fit(server_round, results, lambda _proxy, res: self.decode_reply(res.parameters))]
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures)}
        if accepted:
            protos, present = aggregate_prototypes([p[0] for p, _ in accepted], [p[1] for p, _ in accepted],
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
        return [(c, ins) for c in sample_clients(client_manager, self.min_available_clients, self.fraction_evaluate)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        return weighted_evaluate(self.screen_evaluate(server_round, results), lambda r: r.num_examples)

    def evaluate(self, server_round: int, parameters: Parameters):
        return None  # no global model: clients evaluate their own models


class LegacyLogitAveraging(RejectionLog, Strategy):
    """Averages clients' public-set logits into a consensus; never sees model parameters.

    Payload: server → client ``[]`` in round 1, else ``[consensus N0×C float32, contributors (1,)
    int64]`` (+ averaged model state in homogeneous mode), config ``contributed``; client → server
    ``[logits N0×C float32]`` (+ model state).

    ``num_public`` × ``num_classes`` is the logit shape every reply must have; every logit finite and
    within ``bounds.max_logit_abs`` (under ``bounds.dp``: within the logits' DP bound instead). With
    ``average_weights=True`` (homogeneous mode: every client runs
    the same architecture) replies also carry the model state, which is averaged FedAvg-style (weighted
    by training samples) and sent back with the consensus — FCCL "+ averaging" of the paper's Table 3,
    or FedAvg when the client does no collaborative step. The first accepted state fixes its shapes;
    each state moves no further than ``bounds.max_update_norm`` allows from the one last sent (from
    the zero model before any was sent).
    """

    def __init__(self, *, num_public: int, num_classes: int, fraction_fit: float = 1.0,
                 fraction_evaluate: float = 1.0, min_fit_clients: int = 1,
                 min_available_clients: int = 1, average_weights: bool = False, max_examples: int = MAX_EXAMPLES,
                 bounds: PayloadBounds | None = None):
        if num_public < 1 or num_classes < 1:
            raise ValueError(f"num_public and num_classes must be >= 1, got {num_public} and {num_classes}")
        if not 0.0 < fraction_fit <= 1.0:
            raise ValueError(f"fraction_fit must be in (0, 1], got {fraction_fit}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        self._init_screening(max_examples, bounds)
        if average_weights and self.bounds.dp is not None:
            raise ValueError("average_weights (homogeneous mode) cannot run under differential privacy: the "
                             "model states it averages are not privatized; use the logits alone")
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
        return (f"LegacyLogitAveraging(num_public={self.num_public}, num_classes={self.num_classes}, "
                f"average_weights={self.average_weights})")

    # Flower Strategy API --------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters([])

    def payload(self) -> list[np.ndarray]:
        """What every sampled client receives this round (see the class docstring)."""
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
                for proxy in sample_clients(client_manager, self.min_available_clients, self.fraction_fit,
                                            self.min_fit_clients)]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        reference: ArrayRecord | None = None  # the state layout replies must have
        broadcast: dict[str, np.ndarray] = {}  # what the update bound is measured from
        if self.weights is not None:
            broadcast = dict(zip(param_keys(len(self.weights)), self.weights))
            reference = array_record(broadcast)
        dp = self._dp_models()

        def decode(_proxy: ClientProxy, res: FitRes) -> tuple[list[np.ndarray] | None, str | None]:
            nonlocal reference, broadcast
            count = len(reference) if reference is not None else len(res.parameters.tensors) - 1
            keys = param_keys(max(count, 0)) if self.average_weights else []
            record, reason = parameters_record(res.parameters, [LOGITS, *keys])
            if record is None:
                return None, reason
            logits, reason = decode_logit_reply(ArrayRecord({LOGITS: record[LOGITS]}), self.num_public,
                                                self.num_classes, self.bounds.declared().max_logit_abs)
            if logits is not None and dp is not None:
                reason = dp.check_logits(logits)
                if reason is not None:
                    return None, reason
            if logits is None or not self.average_weights:
                return (None, reason) if logits is None else ([logits], None)
            if not keys:
                return None, "homogeneous mode needs the model state after the logits"
            state_record = ArrayRecord({k: record[k] for k in keys})
            first = reference is None  # round 1: the first good reply fixes the shapes, bound from zero
            ref = state_record if reference is None else reference
            base = {k: np.zeros(a.shape, a.dtype) for k, a in ref.items()} if first else broadcast
            state, reason = decode_weights_reply(state_record, ref, self.bounds.max_update_norm, base)
            if state is None:
                return None, f"model: {reason}"
            if first:
                reference, broadcast = ref, base
            return [logits, *(state[k] for k in keys)], None

        accepted = self.screen_fit(server_round, results, decode)
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
        return [(proxy, ins) for proxy in sample_clients(client_manager, self.min_available_clients,
                                                         self.fraction_evaluate)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        """Participants count equally: inter-domain accuracy is a mean over clients (FCCL's code)."""
        return weighted_evaluate(self.screen_evaluate(server_round, results), lambda _r: 1.0)

    def evaluate(self, server_round: int, parameters: Parameters):
        return None
