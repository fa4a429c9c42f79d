"""pollen.launch.fab: ``flwr run`` gets a copy of the files it packs, so it never lists a checkout's
``.venv`` — and packs the same FAB, byte for byte, as from the app folder itself, less the top-level
``bench/``, ``docs/`` and ``tests/`` folders that no node runs."""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.cli.utils import collect_files, filter_paths_for_publish
from flwr.common.constant import FAB_MAX_SIZE

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


def _fab_names(fab_bytes: bytes) -> set[str]:
    return set(zipfile.ZipFile(io.BytesIO(fab_bytes)).namelist())


def test_folders_no_node_runs_are_left_out_unless_a_component_lives_there(app, tmp_path):
    for folder in fab.NOT_FOR_NODES:
        _write(app / folder / "helper.py")
        _write(app / folder / "results" / "study.json", "{}\n")
    _write(app / "conf" / "preset.toml", "a = 1\n")
    with fab.staged_app(app) as staged:
        staged_fab = build_fab_from_disk(staged)
    # the same bytes as Flower's own FAB of the app without those folders
    bare = tmp_path / "bare" / app.name
    shutil.copytree(app, bare, symlinks=True)
    for folder in fab.NOT_FOR_NODES:
        shutil.rmtree(bare / folder)
    assert staged_fab == build_fab_from_disk(bare)
    names = _fab_names(staged_fab)
    assert "conf/preset.toml" in names and "tinyapp/server.py" in names
    assert not [n for n in names if n.split("/")[0] in fab.NOT_FOR_NODES]

    # an app whose ClientApp lives in tests/ (a derived test app) keeps that folder
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"tinyapp.client:app"', '"tests.helper:app"'))
    with fab.staged_app(app) as staged:
        names = _fab_names(build_fab_from_disk(staged))
    assert "tests/helper.py" in names and "tests/results/study.json" in names
    assert "bench/helper.py" not in names and "docs/helper.py" not in names


def test_the_checkout_packs_only_what_nodes_run_and_stays_far_from_flowers_limit():
    """What `pollen run` submits holds the package and presets, not the benchmarks' results; and what a
    bare `flwr run .` of this checkout packs keeps a tenth of Flower's limit free (past the limit every
    `flwr run .` is refused: prune bench/results or leave more of it to the `.gitignore`)."""
    with fab.staged_app(PROJECT_ROOT) as staged:
        staged_fab = build_fab_from_disk(staged)
    names = _fab_names(staged_fab)
    assert "pollen/app/server_app.py" in names and "conf/fedproto-mnist-n3.toml" in names
    assert not [n for n in names if n.split("/")[0] in fab.NOT_FOR_NODES]
    assert len(staged_fab) < FAB_MAX_SIZE / 4, len(staged_fab)
    with fab.staged_app(PROJECT_ROOT, leave_out=()) as whole:
        whole_fab = build_fab_from_disk(whole)
    assert any(n.startswith("bench/results/") for n in _fab_names(whole_fab))
    assert len(whole_fab) < 0.9 * FAB_MAX_SIZE, f"{len(whole_fab) / 2**20:.1f} MiB of Flower's 10 MiB"
