"""Client memory between rounds, kept in Flower's ``context.state``.

Each message may be served by a fresh process (deployment) or any Ray actor (simulation), so
nothing a client must remember may live in Python objects. Flower persists ``context.state`` (a
``RecordDict``) per node and run; this module converts models, tensors and small JSON-able values to
and from its records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict


class ClientState:
    """Typed access to one node's ``context.state``."""

    def __init__(self, records: RecordDict):
        self.records = records

    def __contains__(self, key: str) -> bool:
        return key in self.records

    # models -------------------------------------------------------------------------------
    def save_module(self, key: str, module: torch.nn.Module) -> None:
        """Store a module's full state dict (buffers included, e.g. BatchNorm statistics)."""
        self.records[key] = ArrayRecord(
            {k: Array(v.detach().cpu().numpy()) for k, v in module.state_dict().items()})

    def load_module(self, key: str, module: torch.nn.Module) -> bool:
        """Load a stored state dict into ``module``; False when nothing is stored under ``key``."""
        if key not in self.records:
            return False
        record = self._array_record(key)
        device = next(module.parameters()).device
        state = {k: torch.from_numpy(np.array(record[k].numpy(), copy=True)).to(device) for k in record}
        module.load_state_dict(state)
        return True

    def _array_record(self, key: str) -> ArrayRecord:
        record = self.records[key]
        if not isinstance(record, ArrayRecord):
            raise TypeError(f"client state {key!r} holds a {type(record).__name__}, not an ArrayRecord")
        return record

    # arrays -------------------------------------------------------------------------------
    def save_arrays(self, key: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.records[key] = ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})

    def load_arrays(self, key: str) -> dict[str, np.ndarray] | None:
        if key not in self.records:
            return None
        record = self._array_record(key)
        return {k: np.array(record[k].numpy(), copy=True) for k in record}

    # small values -------------------------------------------------------------------------
    def save_values(self, key: str, values: Mapping[str, Any]) -> None:
        """Store JSON-serialisable values (lists, dicts, numbers) as one ConfigRecord entry."""
        self.records[key] = ConfigRecord({"json": json.dumps(values)})

    def load_values(self, key: str, default: Mapping[str, Any] | None = None) -> dict[str, Any]:
        if key not in self.records:
            return dict(default or {})
        return json.loads(str(self.records[key]["json"]))
