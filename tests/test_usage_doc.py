"""docs/usage.md and pyproject.toml's run-key table are written from the declarations, with ranges the
validators enforce."""

from __future__ import annotations

import re
import runpy

import pytest

from pollen.app import registry
from pollen.app.config import ConfigError, parse_run_config
from pollen.app.registry import METHODS
from pollen.launch import app_run_config
from pollen.settings import COMMON
from tests.conftest import PROJECT_ROOT

GEN = runpy.run_path(str(PROJECT_ROOT / "docs" / "gen_usage.py"))


def test_every_run_key_is_declared_once_in_the_code_and_in_pyproject():
    in_code, in_toml = set(registry.all_keys()), set(app_run_config(PROJECT_ROOT))
    missing = sorted(in_toml - in_code)
    assert not missing, f"pyproject.toml keys without a setting() declaration: {missing}"
    absent = sorted(in_code - in_toml)
    assert not absent, f"declared keys missing from pyproject.toml (run docs/gen_usage.py): {absent}"
    families = [set(spec.keys) for spec in {id(s.keys): s for s in METHODS.values()}.values()]
    for i, own in enumerate(families):  # a key belongs to one family, and never shadows a common key
        assert not own & set(COMMON), own & set(COMMON)
        for other in families[i + 1:]:
            assert not own & other, own & other


def test_every_run_key_has_help_and_a_range():
    for key, (_default, kind, help_text, _choices) in registry.all_keys().items():
        assert help_text.strip() and "\n" not in help_text, key
        if kind == "choice":
            assert registry.choices(key), key
        else:
            assert _parse_range(kind) is not None, f"{key}: unreadable range {kind!r}"


def test_usage_page_is_generated_from_the_code():
    page = (PROJECT_ROOT / "docs" / "usage.md").read_text()
    assert GEN["render"]() == page, "run `python docs/gen_usage.py` to refresh docs/usage.md"
    for key in registry.all_keys():
        assert f"| `{key}` |" in page, key


def test_pyproject_table_is_generated_from_the_declarations():
    """Flower reads the defaults from pyproject.toml: the table is the declarations', written out."""
    text = (PROJECT_ROOT / "pyproject.toml").read_text()
    assert GEN["pyproject_with_table"](text) == text, "run `python docs/gen_usage.py` to refresh pyproject.toml"
    assert app_run_config(PROJECT_ROOT) == registry.all_defaults()


# --- documented ranges are the validators' ranges -------------------------------------------------------

_NUM = r"-?\d+(?:\.\d+)?"


def _parse_range(kind: str):
    """``int >= 1`` -> ("int", low, low_open, high, high_open); bool/string/path -> (kind,)."""
    if kind in ("bool", "string", "path"):
        return (kind,)
    m = re.fullmatch(rf"(int|float) (>=|>) ({_NUM})", kind)
    if m:
        return m[1], float(m[3]), m[2] == ">", None, False
    m = re.fullmatch(rf"(int|float) in ([\[(])({_NUM}), ({_NUM})([\])])", kind)
    if m:
        return m[1], float(m[3]), m[2] == "(", float(m[4]), m[5] == ")"
    return None


def _context(key: str) -> dict:
    """A valid configuration in which ``key`` is one of the method's own keys."""
    for spec in METHODS.values():
        if key in spec.defaults:
            if spec.family == "prototypes":
                return {"method": spec.name, "task": "mnist-shot"}
            if spec.family == "logits":
                return {"method": spec.name, "task": "digits-offline"}
            if spec.family == "glfc":
                return {"method": "glfc", "task": "mnist-fmnist-cil", "num-server-rounds": 8}
            return {"method": spec.name}
    return {}


def _outside(spec) -> list:
    if spec[0] in ("bool", "string", "path"):
        return [12345] if spec[0] != "bool" else ["yes", 1]
    kind, low, low_open, high, high_open = spec
    step = 1 if kind == "int" else 1e-3
    bad = [low if low_open else low - step]
    if high is not None:
        bad.append(high if high_open else high + step)
    if kind == "int":
        bad.append(low + 0.5 if not low_open else low + 1.5)
    return [int(v) if kind == "int" and float(v).is_integer() else v for v in bad]


CASES = [(key, value) for key, (_d, kind, _h, _c) in registry.all_keys().items() if kind != "choice"
         for value in _outside(_parse_range(kind) or ("string",))]


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_a_value_outside_the_documented_range_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        parse_run_config({**_context(key), key: value})


@pytest.mark.parametrize("key", [k for k, spec in registry.all_keys().items() if spec.range == "choice"])
def test_choice_keys_refuse_other_values_and_accept_the_documented_ones(key):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        parse_run_config({**_context(key), key: "no-such-value"})
    assert registry.choices(key)
