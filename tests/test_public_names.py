"""A leading underscore means "this package's own business": no module of ``pollen``, ``deploy`` or ``bench``
uses another package's underscore names, neither imported (``from pollen.x import _y``) nor reached through
a module (``x._y``). What one package offers another is a public name (for the launcher: the API that
``pollen.launch`` lists)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import PROJECT_ROOT

ROOTS = ("pollen", "deploy", "bench")


def _package(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def foreign_underscore_uses(path: Path, root: Path = PROJECT_ROOT) -> list[str]:
    """``file:line ...`` for each use in ``path`` of an underscore name of another package of ours."""
    module, is_package = _module_name(path, root)
    own = _package(module, is_package)
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> what of ours it stands for (a module, or a name in one)
    found = []

    def ours(name: str) -> bool:
        return name.split(".")[0] in ROOTS

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def owner(target: str) -> str:
        """The package whose business ``target``'s underscore names are: itself if it is a package."""
        is_dir = (root / Path(*target.split("."))).is_dir()
        return target if is_dir else target.rpartition(".")[0]

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            head = dotted(expr.value)
            return None if head is None else f"{head}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = own.split(".")[: len(own.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            if not ours(source):
                continue
            for alias in node.names:
                if private(alias.name) and owner(source) != own:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {alias.name} from {source}")
                bound[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            target = dotted(node.value)
            if target is not None and owner(target) != own:
                found.append(f"{path.relative_to(root)}:{node.lineno} uses {target}.{node.attr}")
    return found


def test_no_module_uses_another_packages_underscore_names():
    found = []
    for top in ROOTS:
        for path in sorted((PROJECT_ROOT / top).rglob("*.py")):
            found += foreign_underscore_uses(path)
    assert not found, "\n".join(found)


def test_the_check_finds_both_kinds_of_use(tmp_path):
    """The rule above can fail: an imported underscore name and one reached through a module are found;
    a package's use of its own underscore names is not."""
    package = tmp_path / "bench"
    package.mkdir()
    (package / "study.py").write_text(
        "from pollen.launch.launcher import _hidden\nfrom pollen.launch import launcher as launch\n"
        "from bench.kit import _own\nimport pollen.app.results\n"
        "def f():\n    a = launch._signal_name(9)\n    return a, pollen.app.results._clean({}), _own\n")
    for folder in ("pollen/launch", "pollen/app"):
        (tmp_path / folder).mkdir(parents=True)
    found = foreign_underscore_uses(package / "study.py", root=tmp_path)
    assert sorted(found) == ["bench/study.py:1 imports _hidden from pollen.launch.launcher",
                             "bench/study.py:6 uses pollen.launch.launcher._signal_name",
                             "bench/study.py:7 uses pollen.app.results._clean"], found
