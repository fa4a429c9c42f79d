"""The dependency direction of docs/development.md (DESIGN v4), read from the source: a layer that imports
one above it fails here, naming the file, the line and the import. Every import counts: lazy ones inside
functions and type-only ones under ``if TYPE_CHECKING:`` alike (an annotation that names a layer above
is a dependency on it, and a circle through one is still a circle)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pollen"

# package -> the Pollen packages it must never import (at any depth, lazily, type-only or not)
# (``launch`` is the `pollen` command and ``testing`` the in-process runner: the top of the house, nothing in
# a layer imports them; nothing below ``app`` imports it.)
FORBIDDEN = {
    "app": ("launch", "testing"),
    "strategies": ("launch", "testing", "app", "clients", "methods"),
    "methods": ("launch", "testing", "app", "clients", "strategies"),
    "clients": ("launch", "testing", "app", "strategies"),
    "datasets": ("launch", "testing", "app", "clients", "methods", "strategies", "privacy"),
    "models": ("launch", "testing", "app", "clients", "methods", "strategies", "datasets", "privacy"),
}
# package -> the only Pollen packages it may import: the ground floor imports nothing of Pollen, the wire
# contract only the settings, privacy and secure aggregation nothing above the contract.
ONLY = {
    "settings": (),
    "protocol": ("settings",),
    "privacy": ("settings", "protocol"),
    "secagg": ("settings", "protocol", "log"),  # pollen.log: Flower's child logger, imports nothing of Pollen
}


def pollen_imports(path):
    """(line, imported module) of every ``import pollen...`` / ``from pollen... import`` in ``path``,
    including imports inside functions and those under ``if TYPE_CHECKING:``; relative imports are
    resolved against the file's package."""
    package = ".".join(path.relative_to(PROJECT_ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from pollen import app` imports pollen.app
                yield node.lineno, f"{module}.{alias.name}"


def _refused(layer: str, imported: str) -> bool:
    if layer in ONLY:
        return imported != layer and imported not in ONLY[layer]
    return imported in FORBIDDEN[layer]


@pytest.mark.parametrize("layer", sorted({*FORBIDDEN, *ONLY}))
def test_no_layer_imports_one_above_it(layer):
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in pollen_imports(path):
            parts = module.split(".")
            if parts[0] == "pollen" and len(parts) > 1 and parts[1] != "__init__" and _refused(layer, parts[1]):
                bad.append(f"{path.relative_to(PROJECT_ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_every_package_has_a_rule():
    """A new package gets its place in the house here before it lands."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages <= {*FORBIDDEN, *ONLY, "launch"}, sorted(packages - {*FORBIDDEN, *ONLY, "launch"})


def _package_graph() -> dict[str, set[str]]:
    """Pollen package -> the Pollen packages its modules import at run time (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PROJECT_ROOT)
        if len(rel.parts) < 3:
            continue
        for _, module in pollen_imports(path):
            parts = module.split(".")
            if parts[0] == "pollen" and len(parts) > 1 and (PACKAGE / parts[1]).is_dir() and parts[1] != rel.parts[1]:
                graph.setdefault(rel.parts[1], set()).add(parts[1])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_packages():
    circle = _cycle(_package_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def _module_graph() -> dict[str, set[str]]:
    """Pollen module -> the Pollen modules it imports at run time (lazy imports included; a package's
    ``__init__`` stands for the package)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for _, module in pollen_imports(path):
            while module and module not in modules:  # `from pollen.app.config import X` -> pollen.app.config
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):
                graph.setdefault(name, set()).add(module)
    return graph


def test_no_import_circle_between_modules():
    """Not even through a lazy import: a module that needs another at run time must not be needed by it."""
    circle = _cycle(_module_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_circle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The rule above can fail: a lazy, relative import and a type-only import of the app from a method
    module are found, and so is anything of Pollen but the settings in the protocol."""
    fake = tmp_path / "pollen" / "methods"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pollen.app import x\n"
                                 "def f():\n    from ..app import config\n    return config\n")
    monkeypatch.setattr(sys.modules[__name__], "PROJECT_ROOT", tmp_path)
    modules = [m for _, m in pollen_imports(fake / "bad.py")]
    assert "pollen.app" in modules and "pollen.app.config" in modules and "pollen.app.x" in modules
    assert _refused("methods", "app") and _refused("protocol", "privacy") and not _refused("protocol", "settings")
    assert _refused("settings", "protocol") and not _refused("privacy", "protocol")


@pytest.mark.parametrize("package", ["pollen.strategies", "pollen.secagg"])
def test_importing_the_strategies_does_not_import_torch(package):
    """Flower projects import Pollen's strategies (and the SecAgg+ mod) on machines that may have no torch."""
    code = f"import sys, {package}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True)
    assert out.stdout.strip() == "False", out.stderr


IMPORT_EACH_FIRST = r"""
import importlib, os, pkgutil, sys, traceback
import numpy, torch, flwr  # third-party loaded once; each child imports Pollen from nothing
import pollen
names = sorted(m.name for m in pkgutil.walk_packages(pollen.__path__, "pollen."))
for name in list(sys.modules):
    if name == "pollen" or name.startswith("pollen."):
        del sys.modules[name]
failed = []
for name in names:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
print("modules:", len(names))
print("failed:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    """A user (or a benchmark) may import any module first: registration must not hide an import cycle.

    ``pollen.datasets.domain_tasks`` imported first used to fail with a circular ImportError while the
    usual entry points (``pollen.datasets.tasks`` first) worked.
    """
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert int(proc.stdout.split("modules:")[1].split()[0]) > 50
