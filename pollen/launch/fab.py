"""The app folder ``flwr run`` packs, without its walk through everything the FAB leaves out.

``flwr run <app>`` builds the FAB (the archive of the app that the SuperLink stores and every node
installs) by listing every file under ``<app>`` and only then dropping what Flower's rules exclude:
the app's ``.gitignore``, ``.venv/``, ``__pycache__/``. A checkout with its virtual environment inside
(``make install`` puts it in ``.venv/``) holds some 45,000 such files, plus run folders and caches:
``flwr build`` of this checkout took 7.5 s (5.5 s of CPU; 16.6 s on a busy 2-core machine), of the same
files staged 1.4 s, nearly all of it the CLI's own start — and ``flwr run`` builds on every launch.

:func:`staged_app` lists the app the way Flower does (its own include, exclude and ``.gitignore`` rules,
from ``flwr.cli``), but never enters a folder those rules exclude whole, copies the files Flower keeps
into a temporary folder and hands that to ``flwr run``: the same files, so the same FAB, byte for byte
(``tests/test_fab.py``). Where this Flower lacks those rules, or cannot list the app, ``flwr run`` gets
the app folder itself, as before.

The copy leaves out the top-level folders no node runs (:data:`NOT_FOR_NODES`: benchmarks and their
results, documentation, the test suite) unless an app component's module lives there. Flower refuses a
FAB over 10 MiB, and this checkout's ``bench/results/`` alone is 6 MB and grows with every study; its own
``fab-exclude`` key cannot do this, since Flower refuses a pattern that matches nothing, and every app
derived from Pollen's ``pyproject.toml`` would inherit the key.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: Top-level folders of an app that its nodes never import or read; :func:`staged_app` leaves them out.
NOT_FOR_NODES = ("bench", "docs", "tests")


def fab_sources(app_dir: Path) -> dict[str, Path] | None:
    """``{relative POSIX path: file}`` of every file ``flwr run app_dir`` would consider for the FAB (what
    Flower's publish rules keep; the FAB rules then pick from these), or None when this Flower version
    does not have the rules this relies on.

    Walks like Flower's ``collect_files`` (symbolic links and files resolving outside the app are
    skipped) but prunes a folder when Flower's exclude patterns or the app's ``.gitignore`` exclude the
    folder itself — every file below it would be dropped anyway. A ``.gitignore`` with ``!`` patterns
    prunes nothing: one of them might take a file back.
    """
    try:
        from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns
        from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS
    except ImportError:
        return None
    root = Path(app_dir).expanduser().resolve()
    patterns = list(APP_PUBLISH_EXCLUDE_PATTERNS)
    gitignore = root / ".gitignore"
    if gitignore.is_file() and not gitignore.is_symlink():  # Flower skips a symlinked .gitignore
        patterns += load_gitignore_patterns(gitignore)
    if any(p.startswith("!") for p in patterns):
        patterns = [p for p in APP_PUBLISH_EXCLUDE_PATTERNS if not p.startswith("!")]
    excluded = build_pathspec(patterns)
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        # "dir/" matches exactly when the patterns exclude the folder, and then every path below it
        dirnames[:] = [d for d in dirnames if not excluded.match_file(f"{prefix}{d}/")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.resolve().is_relative_to(root):
                continue
            files[prefix + name] = path
    return {k: v for k, v in filter_paths_for_publish(files).items() if isinstance(v, Path)}


def component_packages(app_dir: Path) -> set[str]:
    """The top-level package or module of each component ``pyproject.toml`` names (``pollen`` for
    ``pollen.app.server_app:app``); empty when the file cannot be read — then Flower names the problem."""
    import tomllib

    try:
        app = tomllib.loads((Path(app_dir) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
        return {str(ref).split(":")[0].split(".")[0] for ref in app["components"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def node_files(files: dict[str, Path], app_dir: Path,
               leave_out: tuple[str, ...] = NOT_FOR_NODES) -> dict[str, Path]:
    """``files`` without those under the top-level folders ``leave_out`` names, except a folder that
    holds one of the app's components."""
    dropped = set(leave_out) - component_packages(app_dir)
    return {rel: path for rel, path in files.items() if rel.split("/")[0] not in dropped or "/" not in rel}


@contextlib.contextmanager
def staged_app(app_dir: Path, leave_out: tuple[str, ...] = NOT_FOR_NODES) -> Iterator[Path]:
    """A temporary copy of the files ``flwr run app_dir`` packs, less the top-level folders ``leave_out``
    names (see :func:`node_files`), under the app folder's own name, removed on exit; ``app_dir`` itself
    when they cannot be listed or copied — then Flower lists them, and reports any problem with the app,
    itself."""
    app_dir = Path(app_dir)
    try:
        files = fab_sources(app_dir)
    except Exception:  # e.g. a path too deep for Flower: its own build says so, naming the app
        files = None
    if files:
        files = node_files(files, app_dir, leave_out)
    staged, tmp = app_dir, None
    if files and "pyproject.toml" in files:
        try:
            tmp = tempfile.mkdtemp(prefix="pollen-app-")
            staged = Path(tmp) / app_dir.resolve().name
            for rel, src in files.items():
                dest = staged / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest)
        except OSError:  # no room for the copy: Flower lists the app itself
            staged = app_dir
    try:
        yield staged
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
