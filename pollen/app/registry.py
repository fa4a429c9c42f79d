"""One table from method name to (Message-API strategy, NumPyClient + records adapter, method run keys),
and the run keys of every registered family.

Method families register here; the ServerApp and ClientApp only ever look methods up by name, so a
new method is one entry, and ``method = "..."`` errors list exactly what exists. The mechanism
(:class:`Family`, :class:`MethodSpec`, :func:`register_method`) is :mod:`pollen.app.method_spec`; importing
this module fills the table from the ``methods_<family>`` modules, each a family in one place.

Filling the table imports no torch (nor any client): the launcher checks run configs with it and a
ServerApp whose strategy is numpy-only never needs torch (issue 30: start-up cost). So a ``make_client``
imports its client when a node first calls it, and the weights family's ``initial_model_arrays`` imports
torch when its server builds its starting model.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from pollen.app.method_spec import (
    FAMILIES,
    METHODS,
    Family,
    MethodSpec,
    check_task_kind,
    method_defaults,
    register_family,
    register_method,
    strategy_options,
)
from pollen.datasets.tasks import TASKS
from pollen.models.catalog import MODEL_NAMES
from pollen.settings import COMMON, Key, allowed_values

__all__ = ["FAMILIES", "METHODS", "Family", "MethodSpec", "all_defaults", "all_keys", "check_task_kind", "choices",
           "method_defaults", "register_family", "register_method", "registered_choices", "strategy_options"]


def all_keys() -> dict[str, Key]:
    """Every run key: the common ones, then each registered method family's."""
    out = dict(COMMON)
    for spec in METHODS.values():
        out.update(spec.keys)
    return out


def all_defaults() -> dict[str, object]:
    """Every run key the code knows, with its declared default."""
    return {key: spec.default for key, spec in all_keys().items()}


def registered_choices() -> dict[str, list[str]]:
    """The allowed values of the keys whose choices are a registry above the settings."""
    return {"method": sorted(METHODS), "task": sorted(TASKS), "model": ["", *MODEL_NAMES]}


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a ``choice`` key, as its declaration (or the registry it names) gives them."""
    return allowed_values(key, all_keys()[key], registered_choices())


# Every family registers itself on import: each ``pollen/app/methods_<family>.py`` module, found rather than
# listed, so a new family is its own module and nothing here (the default method's family first, then by name).
for _family in sorted((m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                       if m.name.startswith("methods_")), key=lambda name: (name != "methods_weights", name)):
    importlib.import_module(f"pollen.app.{_family}")
