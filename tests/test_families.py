"""A family in one place: each registry entry (``Family``) names the modules that are the family's own.

The test prints them with their lines (``pytest -s tests/test_families.py``), bounds their number, and
checks the list against the files: every listed module exists and imports, every module named after a
family is listed by it, and what no family lists is shared machinery, printed too.
"""

from __future__ import annotations

import importlib

from pollen.app.registry import FAMILIES, METHODS
from tests.conftest import PROJECT_ROOT

# A family's own modules: protocol, strategy, settings, core, client and its registration make six; GLFC
# keeps its proxy server, its exemplar memory and its losses apart from its round for their size.
MAX_MODULES = 9
# The packages a family's own modules live in (tasks and models are shared by every family).
FAMILY_PACKAGES = ("protocol", "strategies", "methods", "clients", "app")
# Which file names belong to which family.
STEMS = {"weights": ("weights",), "prototypes": ("prototype",), "logits": ("logit",), "glfc": ("glfc",)}


def _path(module: str):
    return PROJECT_ROOT / (module.replace(".", "/") + ".py")


def _lines(module: str) -> int:
    return len(_path(module).read_text().splitlines())


def test_each_family_lists_its_own_modules_and_they_are_few():
    print()
    for family in FAMILIES.values():
        rows = [f"{m} ({_lines(m)})" for m in family.modules]
        print(f"{family.name}: {len(family.modules)} modules, {sum(_lines(m) for m in family.modules)} lines: "
              + ", ".join(rows))
        assert len(family.modules) <= MAX_MODULES, family.name
        for module in family.modules:
            assert _path(module).is_file(), f"{family.name}: {module} is not a module of this checkout"
            importlib.import_module(module)
    assert {spec.family for spec in METHODS.values()} == set(FAMILIES)


def test_every_module_named_after_a_family_is_listed_by_it():
    listed = {m for family in FAMILIES.values() for m in family.modules}
    modules = sorted(".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts)
                     for package in FAMILY_PACKAGES for p in (PROJECT_ROOT / "pollen" / package).glob("*.py")
                     if p.name != "__init__.py")
    for name, stems in STEMS.items():
        named = [m for m in modules if any(stem in m.rsplit(".", 1)[1] for stem in stems)]
        assert set(named) <= set(FAMILIES[name].modules), (name, sorted(set(named) - set(FAMILIES[name].modules)))
    shared = [m for m in modules if m not in listed]
    print("\nshared machinery:", ", ".join(shared))
    assert "pollen.app.registry" in shared and "pollen.strategies.base" in shared


def test_a_new_family_in_the_shape_of_the_prototypes_is_six_modules():
    """docs/development.md's worked example ("Add a family"): the prototype family's modules are the six
    a new family adds (its losses, split off its core, make the seventh) — with a test file and its row in
    docs/strategies.md, 8 files by hand."""
    own = FAMILIES["prototypes"].modules
    roles = ("pollen.protocol.", "pollen.strategies.", "pollen.methods.prototype_settings", "pollen.methods.prototypes",
             "pollen.clients.", "pollen.app.methods_")
    assert all(any(m.startswith(role) for m in own) for role in roles)
    assert len([m for m in own if m != "pollen.methods.prototype_losses"]) == len(roles) == 6
