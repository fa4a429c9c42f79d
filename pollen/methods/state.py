"""What a method core needs from client state: modules and small values by key.

The client adapter passes :class:`pollen.clients.state.ClientState` (Flower's ``context.state``); any
object with these four methods works, so a core runs (and is tested) without Flower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class StateStore(Protocol):
    def save_module(self, key: str, module: torch.nn.Module) -> None: ...

    def load_module(self, key: str, module: torch.nn.Module) -> bool: ...

    def save_values(self, key: str, values: Mapping[str, Any]) -> None: ...

    def load_values(self, key: str, default: Mapping[str, Any] | None = None) -> dict[str, Any]: ...
