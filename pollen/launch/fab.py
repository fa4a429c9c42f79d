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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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


@contextlib.contextmanager
def staged_app(app_dir: Path) -> Iterator[Path]:
    """A temporary copy of the files ``flwr run app_dir`` packs (removed on exit), under the app
    folder's own name; ``app_dir`` itself when they cannot be listed or copied — then Flower lists them,
    and reports any problem with the app, itself."""
    app_dir = Path(app_dir)
    try:
        files = fab_sources(app_dir)
    except Exception:  # e.g. a path too deep for Flower: its own build says so, naming the app
        files = None
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
