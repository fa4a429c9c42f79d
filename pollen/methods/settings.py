"""Typed settings: one frozen dataclass per method family, each field its run key's single source.

A field declared with :func:`setting` carries its run key, range and one line of help; the default is
the dataclass default. The app layer turns :func:`declared_keys` into its key table (validation,
``docs/usage.md``, the check of ``pyproject.toml``), and a client builds the object once per message
with :func:`from_values` — typed attributes instead of string lookups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


Choices = Sequence[str] | Callable[[], Sequence[str]]


def setting(key: str, default: Any, range: str, help: str, choices: Choices | None = None) -> Any:
    """A settings field: ``default``, and the run ``key`` with its ``range`` notation and ``help``; a
    ``choice`` key also names its allowed values (a sequence, or a function for a registry filled later)."""
    if (range == "choice") != (choices is not None):
        raise TypeError(f"run key {key!r}: a 'choice' range needs choices=, and only a choice key takes them")
    return dataclasses.field(default=default, metadata={"key": key, "range": range, "help": help,
                                                        "choices": choices})


def declared_keys(cls: type) -> dict[str, tuple[Any, str, str, Choices | None]]:
    """``run key -> (default, range, help, choices)`` of every field of the settings class, in field order."""
    out: dict[str, tuple[Any, str, str, Choices | None]] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "key" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(key, default, range, help)")
        out[meta["key"]] = (f.default, meta["range"], meta["help"], meta["choices"])
    return out


def from_values(cls: type[T], values: Mapping[str, Any]) -> T:
    """The settings object from already validated run-config values (keys as in ``declared_keys``);
    a missing key is an error, not a silent default, since the app layer fills every default."""
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f.metadata["key"]
        if key not in values:
            raise KeyError(f"run config has no key {key!r} for {cls.__name__}")
        kwargs[f.name] = values[key]
    return cls(**kwargs)
