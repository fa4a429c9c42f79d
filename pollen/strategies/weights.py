"""Parameter averaging on the Message API: FedAvg / FedProx (one class) and local-only training.

The aggregation is a pure function (:func:`average_arrays`, or the robust rules of
:mod:`pollen.strategies.aggregation`); :class:`WeightAveraging` screens each reply against the current
global state (same names, shapes, dtypes, finite values, an update norm within ``max-update-norm`` —
see :mod:`pollen.protocol.weights`) and calls it. FedProx's μ travels to clients as ``proximal-mu``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol.records import ARRAYS, CONFIG, array_record
from pollen.protocol.weights import PROXIMAL_MU, decode_weights_reply
from pollen.settings import WEIGHTINGS
from pollen.strategies.aggregation import average_arrays  # noqa: F401  (public here since v2)
from pollen.strategies.base import PollenStrategy
from pollen.strategies.spread import UPDATE_NORM, update_norm


class WeightAveraging(PollenStrategy):
    """FedAvg (``proximal_mu = 0``) or FedProx (``proximal_mu > 0``) over the full model state.

    ``weighting = "samples"`` weights each client by its ``num-examples`` (McMahan et al.),
    ``"uniform"`` averages clients equally (as GLFC's code does). Sampling and screening options are
    :class:`~pollen.strategies.base.PollenStrategy`'s.
    """

    family = "weights"

    def __init__(self, *, weighting: str = "samples", proximal_mu: float = 0.0, **kwargs):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if not proximal_mu >= 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        super().__init__(**kwargs)
        self.weighting = weighting
        self.proximal_mu = float(proximal_mu)
        self.current: ArrayRecord | None = None
        self._noise_warned = False

    def __repr__(self) -> str:
        return (f"WeightAveraging(weighting={self.weighting}, proximal_mu={self.proximal_mu}, "
                f"aggregation={self.aggregation})")

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        arrays, values = super().state()
        if self.current is not None:
            arrays.update({f"model.{k}": a.numpy() for k, a in self.current.items()})
        return arrays, values

    def restore(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        super().restore(arrays, values)
        model = {k[len("model."):]: a for k, a in arrays.items() if k.startswith("model.")}
        self.current = array_record(model) if model else None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if len(arrays) == 0:
            raise ValueError("WeightAveraging needs the initial model state as initial_arrays")
        self.current = arrays
        nodes = self.sample(grid, self.fraction_train, self.min_train_nodes, server_round)
        if self.bounds.dp is not None and not self._noise_warned:
            self._noise_warned = True  # once per run: the model's size and k do not change
            warning = self.bounds.dp.model_noise_warning({k: a.numpy() for k, a in arrays.items()}, len(nodes))
            if warning is not None:
                LOGGER.warning("%s", warning)
        content = RecordDict({ARRAYS: arrays,
                              CONFIG: self.round_config(config, server_round, **{PROXIMAL_MU: self.proximal_mu})})
        return self.build_messages(server_round, nodes, MessageType.TRAIN, lambda _n: content)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        reference = self.current
        assert reference is not None  # configure_train sets it every round

        broadcast = {k: a.numpy() for k, a in reference.items()}
        dp = self.bounds.dp if self.bounds.dp is not None and self.bounds.dp.bounds_models else None

        def decode(msg: Message, _metrics: dict) -> tuple[object, str | None]:
            state, reason = decode_weights_reply(msg.content.get(ARRAYS), reference,
                                                 self.bounds.declared().max_update_norm, broadcast)
            if state is not None and dp is not None:
                reason = dp.check_update(state, broadcast)
            return (state, None) if reason is None else (None, reason)

        accepted = self.hold_to_round(server_round, self.screen(server_round, "train", replies, decode),
                                      lambda state: {UPDATE_NORM: update_norm(state, broadcast)})
        metrics = self.train_metrics(server_round, accepted)
        self.close_train_round(server_round, accepted)
        if not accepted:
            return None, metrics
        keys = list(reference.keys())
        weights = [float(a.num_examples) if self.weighting == "samples" else 1.0 for a in accepted]
        averaged = self.combine([[a.payload[k] for k in keys] for a in accepted], weights)
        self.current = array_record(dict(zip(keys, averaged)))
        return self.current, metrics


class LocalOnly(PollenStrategy):
    """No collaboration: each client trains its own model on its node; nothing is averaged.

    Rounds still exist so local training is scheduled, screened, evaluated and recorded exactly like
    the federated methods it is compared with. Every connected node trains every round.
    """

    family = "local"

    def __repr__(self) -> str:
        return "LocalOnly()"

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        nodes = self.sample(grid, 1.0, self.min_train_nodes)
        content = RecordDict({ARRAYS: ArrayRecord(), CONFIG: self.round_config(config, server_round)})
        return self.build_messages(server_round, nodes, MessageType.TRAIN, lambda _n: content)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        def decode(msg: Message, _metrics: dict) -> tuple[object, str | None]:
            rec = msg.content.get(ARRAYS)
            if rec is not None and len(rec) > 0:
                return None, f"local-only replies carry no arrays, got keys {list(rec.keys())[:5]}"
            return None, None

        accepted = self.screen(server_round, "train", replies, decode)
        metrics = self.train_metrics(server_round, accepted)
        self.close_train_round(server_round, accepted)
        return None, metrics

    def evaluate_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        return RecordDict({ARRAYS: ArrayRecord(), CONFIG: self.round_config(config, server_round)})
