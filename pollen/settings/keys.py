"""A run key, declared once: a :func:`setting` field of a frozen settings class.

A field declared with :func:`setting` carries its run key, its range and one line of help; its default
is the dataclass default, the only place the key's default is written. :func:`declared_keys` reads a
class's declarations as :class:`Key` values (validation, ``docs/usage.md``, the ``pyproject.toml`` table
all come from them), :func:`check_value` is the one type-and-range check of every run key, and
:func:`from_values` builds the settings object from a validated run config.

Range notation: ``int >= 1``, ``int in [1, 256]``, ``float > 0``, ``float >= 0``, ``float in [0, 1]``,
``float in (0, 1]``, ``float in [0, 1)``, ``bool``, ``string``, ``path``, or ``choice`` (the declaration
then names its allowed values, ``choices=``: a sequence, or :class:`Registered` for a registry that a
layer above this one fills, such as the methods or the tasks).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from pollen.settings.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Registered:
    """The allowed values of a choice key are the names of a registry above the settings (the methods,
    the tasks, the models): whoever validates a run config hands them over (``registered=``)."""

    what: str  # how docs and errors name the registry ("the registered methods")


Choices = Sequence[str] | Registered


class Key(NamedTuple):
    """One run key as its declaration states it: default, range (the notation above), one line of help
    and, for a ``choice`` key, its allowed values."""

    default: Any
    range: str
    help: str
    choices: Choices | None = None


def setting(key: str, default: Any, range: str, help: str, choices: Choices | None = None) -> Any:
    """A settings field: ``default``, and the run ``key`` with its ``range`` notation and ``help``; a
    ``choice`` key also names its allowed values."""
    if (range == "choice") != (choices is not None):
        raise TypeError(f"run key {key!r}: a 'choice' range needs choices=, and only a choice key takes them")
    parse_range(range)  # a declaration with unreadable notation fails on import, naming the key
    return dataclasses.field(default=default, metadata={"key": Key(default, range, help, choices), "name": key})


def derived(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field of a settings class that is no run key of its own (computed from others while reading)."""
    return dataclasses.field(default=default, metadata={"derived": True}, **kwargs)


def declared_keys(cls: type) -> dict[str, Key]:
    """``run key -> Key`` of every :func:`setting` field of ``cls``, in field order."""
    out: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        if "key" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(key, default, range, help)")
        out[f.metadata["name"]] = f.metadata["key"]
    return out


def field_keys(cls: type) -> dict[str, str]:
    """``field name -> run key`` of every :func:`setting` field of ``cls``."""
    return {f.name: f.metadata["name"] for f in dataclasses.fields(cls) if "name" in f.metadata}


def from_values(cls: type[T], values: Mapping[str, Any]) -> T:
    """The settings object from already validated run-config values (keys as in :func:`declared_keys`);
    a missing key is an error, not a silent default, since reading a run config fills every default."""
    kwargs = {}
    for name, key in field_keys(cls).items():
        if key not in values:
            raise KeyError(f"run config has no key {key!r} for {cls.__name__}")
        kwargs[name] = values[key]
    return cls(**kwargs)


# --- the range notation and the one check -------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class Range:
    """A parsed range: ``kind`` is int, float, bool, string, path or choice; bounds for numbers."""

    kind: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def expected(self) -> str:
        """How an error message names the range: ``an integer >= 1``, ``a number in (0, 1]``."""
        noun = "an integer" if self.kind == "int" else "a number"
        low = _plain(self.low)
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {low}"
        return (f"{noun} in {'(' if self.low_open else '['}{low}, {_plain(self.high)}"
                f"{')' if self.high_open else ']'}")


def _plain(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def parse_range(spec: str) -> Range:
    """``"int in [1, 256]"`` -> Range("int", 1, False, 256, False); raises ValueError on bad notation."""
    if spec in ("bool", "string", "path", "choice"):
        return Range(spec)
    m = re.fullmatch(rf"(int|float) (>=|>) ({_NUMBER})", spec)
    if m:
        return Range(m[1], float(m[3]), m[2] == ">")
    m = re.fullmatch(rf"(int|float) in ([\[(])({_NUMBER}), ({_NUMBER})([\])])", spec)
    if m:
        return Range(m[1], float(m[3]), m[2] == "(", float(m[4]), m[5] == ")")
    raise ValueError(f"not a range: {spec!r}")


def allowed_values(key: str, spec: Key, registered: Mapping[str, Sequence[str]] | None = None) -> tuple[str, ...]:
    """The allowed values of choice key ``key``: its declaration's, or the registry's (``registered[key]``)."""
    if spec.choices is None:
        raise KeyError(f"{key!r} is not a choice key")
    if isinstance(spec.choices, Registered):
        if registered is None or key not in registered:
            raise KeyError(f"run key {key!r} takes {spec.choices.what}: the caller must name them (registered=)")
        return tuple(registered[key])
    return tuple(spec.choices)


def check_value(key: str, spec: Key, value: Any, registered: Mapping[str, Sequence[str]] | None = None) -> Any:
    """``value`` of run key ``key`` if it is of the key's type and within its range (ints and floats
    come back as such), else a :class:`ConfigError` naming the key and the range."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")

    rng = parse_range(spec.range)
    if rng.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if rng.kind in ("string", "path"):
        if not isinstance(value, str):
            raise bad("a path (string)" if rng.kind == "path" else "a string")
        return value
    if rng.kind == "choice":
        allowed = allowed_values(key, spec, registered)
        if not isinstance(value, str) or value not in allowed:
            shown = ", ".join(v for v in allowed if v)
            raise bad(("empty or one of " if "" in allowed else "one of ") + shown)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad("an integer" if rng.kind == "int" else "a number")
    if not math.isfinite(value):
        raise bad("a finite number")
    if rng.kind == "int" and int(value) != value:
        raise bad("an integer")
    if not rng.admits(value):
        raise bad(rng.expected())
    return int(value) if rng.kind == "int" else float(value)
