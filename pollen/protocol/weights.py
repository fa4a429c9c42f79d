"""Weight family (FedAvg, FedProx, local-only): the model state travels by parameter name.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays[<state-dict name>]`` | per parameter | per parameter | global model state |
| server → client | ``config["proximal-mu"]`` | | float | FedProx's μ (0 for FedAvg) |
| client → server | ``arrays[<state-dict name>]`` | as received | as received | same keys, shapes, dtypes; finite; ‖reply − broadcast‖ ≤ ``max-update-norm`` · max(‖broadcast‖, 1) |
| client → server | ``metrics["num-examples"]`` | | int | training samples (the FedAvg weight) |

Local-only training sends and receives an empty ``arrays`` record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import reply_content
from pollen.protocol.screening import ArraySpec, PayloadBounds, check_update_norm, decode_record

PROXIMAL_MU = "proximal-mu"


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
