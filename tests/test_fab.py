"""pollen.launch.fab: ``flwr run`` gets a copy of the files it packs, so it never lists a checkout's
``.venv`` — and packs the same FAB, byte for byte, as from the app folder itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.cli.utils import collect_files, filter_paths_for_publish

from pollen.launch import fab
from tests.conftest import PROJECT_ROOT

# Flower builds its path specs with pathspec's older pattern name; pathspec warns on every one
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tinyapp"
version = "1.0.0"
dependencies = ["flwr>=1.42"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "tinyapp.server:app"
clientapp = "tinyapp.client:app"

[tool.flwr.app.config]
num-server-rounds = 1
"""


def _write(path: Path, text: str = "x = 1\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def app(tmp_path) -> Path:
    """A small app with everything Flower's rules drop around it: a virtual environment, ignored run
    folders, caches, test files, files of no packed type, a symbolic link, a nested folder of one name
    that is ignored only at the top."""
    root = tmp_path / "tinyapp"
    _write(root / "pyproject.toml", PYPROJECT)
    _write(root / ".gitignore", "runs/\n*.egg-info/\n/build\nlogs/*.json\n")
    _write(root / "LICENSE", "MIT\n")
    _write(root / "README.md", "# tiny\n")
    for name in ("__init__.py", "server.py", "client.py", "sub/deep/model.py", "sub/test_model.py"):
        _write(root / "tinyapp" / name)
    _write(root / "tinyapp" / "config.json", "{}\n")
    _write(root / "tinyapp" / "notes.txt", "not packed\n")
    _write(root / "tinyapp" / "__pycache__" / "server.cpython-311.pyc", "bytecode")
    _write(root / "tinyapp" / "build" / "kept.py")  # "/build" ignores the top-level folder only
    _write(root / "build" / "lib" / "dropped.py")
    _write(root / "logs" / "a.json", "{}\n")  # "logs/*.json" drops the files, not the folder
    _write(root / "logs" / "b.yaml", "a: 1\n")
    for i in range(30):
        _write(root / ".venv" / "lib" / f"pkg{i}" / "__init__.py")
        _write(root / "runs" / f"run-{i}" / "metrics.jsonl", "{}\n")
    _write(root / "tinyapp.egg-info" / "PKG-INFO.json", "{}\n")
    (root / "tinyapp" / "link.py").symlink_to(root / "tinyapp" / "server.py")
    return root


def test_the_staged_app_packs_the_same_fab_without_entering_excluded_folders(app, monkeypatch):
    walked: list[str] = []
    real_walk = os.walk

    def recording_walk(top, *args, **kwargs):
        for entry in real_walk(top, *args, **kwargs):
            walked.append(Path(entry[0]).relative_to(app).as_posix())
            yield entry

    with monkeypatch.context() as patched:
        patched.setattr(os, "walk", recording_walk)
        listed = fab.fab_sources(app)
    assert listed is not None and "tinyapp/server.py" in listed and "tinyapp/link.py" not in listed
    with fab.staged_app(app) as staged:
        assert staged != app and staged.name == app.name
        staged_fab = build_fab_from_disk(staged)
    assert not staged.exists()  # removed once `flwr run` has read it
    assert staged_fab == build_fab_from_disk(app)
    assert not [d for d in walked if d.split("/")[0] in (".venv", "runs", "tinyapp.egg-info", "build")
                or "__pycache__" in d], walked
    assert "logs" in walked and "tinyapp/build" in walked  # folders the rules do not exclude whole


def test_a_gitignore_that_takes_files_back_prunes_only_by_flowers_own_rules(app):
    (app / ".gitignore").write_text("runs/\n!runs/run-1/metrics.jsonl\n")
    assert fab.fab_sources(app) == filter_paths_for_publish(collect_files(app))
    with fab.staged_app(app) as staged:
        assert build_fab_from_disk(staged) == build_fab_from_disk(app)


def test_an_app_flower_cannot_list_is_handed_over_as_it_is(tmp_path):
    bare = tmp_path / "no-app"
    bare.mkdir()
    with fab.staged_app(bare) as staged:  # no pyproject.toml: `flwr run` names the problem itself
        assert staged == bare


def test_the_checkout_lists_the_files_flower_lists():
    """This checkout, `.venv` and run folders included, as Flower's own walk sees it."""
    assert fab.fab_sources(PROJECT_ROOT) == filter_paths_for_publish(collect_files(PROJECT_ROOT))
