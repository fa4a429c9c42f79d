"""Weight family (FedAvg, FedProx, local-only): the model state travels by parameter name.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays[<state-dict name>]`` | per parameter | per parameter | global model state |
| server → client | ``config["proximal-mu"]`` | | float | FedProx's μ (0 for FedAvg) |
| client → server | ``arrays[<state-dict name>]`` | as received | as received | same keys, shapes, dtypes; finite; ‖reply − broadcast‖ ≤ ``max-update-norm`` · max(‖broadcast‖, 1) |
| client → server | ``metrics["num-examples"]`` | | int | training samples (the FedAvg weight) |

Local-only training sends and receives an empty ``arrays`` record.

A client reads a message as a :class:`WeightsInstruction` (:func:`decode_instruction`) and answers with a
:class:`WeightsReply` (:meth:`WeightsReply.content`): named values on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import arrays_of, config_of, reply_content
from pollen.protocol.screening import ArraySpec, PayloadBounds, check_update_norm, decode_record

PROXIMAL_MU = "proximal-mu"


@dataclass(frozen=True)
class WeightsInstruction:
    """Client side: a weights-family train or evaluate message, decoded."""

    state: dict[str, np.ndarray]  # the global model state by parameter name (empty for local-only)
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server_round(self) -> int:
        return int(self.config.get("server-round", 0))

    @property
    def proximal_mu(self) -> float:
        return float(self.config.get(PROXIMAL_MU, 0.0))

    @classmethod
    def from_parameters(cls, names: Sequence[str], parameters: Sequence[np.ndarray],
                        config: Mapping[str, Any]) -> WeightsInstruction:
        """A ``NumPyClient``'s positional parameters: the state in ``names`` order (or none at all)."""
        if len(parameters) and len(parameters) != len(names):
            raise ValueError(f"received {len(parameters)} arrays for a model with {len(names)} state entries; "
                             "do server and client use the same model and width?")
        return cls(dict(zip(names, parameters)), dict(config))


def decode_instruction(content: RecordDict) -> WeightsInstruction:
    """Client side: the global state by name (as received) and the config."""
    return WeightsInstruction({k: a.numpy() for k, a in arrays_of(content).items()}, config_of(content))


@dataclass(frozen=True)
class WeightsReply:
    """Client side: the trained state by name (empty for local-only), the FedAvg weight, the metrics."""

    state: Mapping[str, np.ndarray]
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def content(self) -> RecordDict:
        return encode_weights_reply(self.state, self.num_examples, self.metrics)

    def parameters(self) -> list[np.ndarray]:
        """As a ``NumPyClient`` returns it: the state's arrays in its order."""
        return list(self.state.values())


def state_specs(reference: ArrayRecord) -> list[ArraySpec]:
    """A reply must carry exactly the reference's keys, shapes and dtypes."""
    return [ArraySpec(k, tuple(a.shape), str(np.dtype(a.dtype))) for k, a in reference.items()]


def encode_weights_reply(state: ArrayRecord | Mapping[str, np.ndarray], num_examples: int,
                         metrics: Mapping[str, Any] | None = None) -> RecordDict:
    """Client side: the trained state under the names it was received with."""
    return reply_content(state, num_examples, metrics)


def decode_weights_reply(record: Any, reference: ArrayRecord, max_update_norm: float = PayloadBounds.max_update_norm,
                         broadcast: Mapping[str, np.ndarray] | None = None,
                         ) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """Server side: the state by name, or the reason it does not match ``reference`` (the broadcast
    state) or moves further from it than ``max_update_norm`` allows (:class:`PayloadBounds`).
    ``broadcast``: ``reference`` already decoded (a strategy decodes it once per round, not per reply)."""
    state, reason = decode_record(record, state_specs(reference))
    if state is None:
        return None, reason
    if broadcast is None:
        broadcast = {k: a.numpy() for k, a in reference.items()}
    reason = check_update_norm(state, broadcast, max_update_norm)
    return (None, reason) if reason is not None else (state, None)
