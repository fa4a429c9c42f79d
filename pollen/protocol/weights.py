"""Weight family (FedAvg, FedProx, local-only): the model state travels by parameter name.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays[<state-dict name>]`` | per parameter | per parameter | global model state |
| server → client | ``config["proximal-mu"]`` | | float | FedProx's μ (0 for FedAvg) |
| client → server | ``arrays[<state-dict name>]`` | as received | as received | same keys, shapes, dtypes; finite |
| client → server | ``metrics["num-examples"]`` | | int | training samples (the FedAvg weight) |

Local-only training sends and receives an empty ``arrays`` record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from pollen.protocol.records import reply_content
from pollen.protocol.screening import ArraySpec, decode_record

PROXIMAL_MU = "proximal-mu"


def state_specs(reference: ArrayRecord) -> list[ArraySpec]:
    """A reply must carry exactly the reference's keys, shapes and dtypes."""
    return [ArraySpec(k, tuple(a.shape), str(np.dtype(a.dtype))) for k, a in reference.items()]


def encode_weights_reply(state: ArrayRecord | Mapping[str, np.ndarray], num_examples: int,
                         metrics: Mapping[str, Any] | None = None) -> RecordDict:
    """Client side: the trained state under the names it was received with."""
    return reply_content(state, num_examples, metrics)


def decode_weights_reply(record: Any, reference: ArrayRecord) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """Server side: the state by name, or the reason it does not match ``reference``."""
    return decode_record(record, state_specs(reference))
