"""A node's ε ledger on disk: every release it ever made, append-only, never rolled back.

Why a file of its own: a node's state (``context.state``, saved per round under ``<state-dir>``) is
rolled back when a run resumes from a checkpoint, falls back to an older one, or a SuperNode restarts:
the node trains the rolled-back rounds again. But a release that left the node cannot be taken back —
the server, or whoever read the reply, may have seen it. So every release is appended here, beside the
node state (``<state-dir>/dp-ledger.json``), *before* the reply that carries it leaves, and ε is always
composed over everything in the file: after any resume the ledger holds every release the server may
have seen (a release whose reply never left is counted too: the error is on the safe side).

The file is one JSON document, replaced atomically on every append (a temporary file in the same
folder, fsync, rename: a crash leaves the old ledger or the new one, never a part) and hash-checked
(the SHA-256 of its releases, inside it: a ledger edited or damaged on disk is refused, naming the
file, and the node stops releasing rather than compose from a wrong count)::

    {"format": "pollen-dp-ledger/1",
     "releases": [{"mechanism": "gaussian", "noise-multiplier": 2.0, "sampling-probability": 1.0,
                   "count": 1, "unit": "client", "neighbour": "replace-one", "seq": 0, "time": 1700000000.0}, ...],
     "sha256": "<hex of the canonical JSON of releases>"}

The API, for every mode that releases (``payload``, ``sample``, and a distributed mode that adds noise
to a sum the server sees): a release is :class:`~pollen.privacy.accounting.Release` — mechanism
(Gaussian), unit (``record``, ``client``, ``row-given-model``), neighbour (``replace-one``,
``add-remove``) and sampling (Poisson probability, invocations) — and

* ``LedgerFile(path).releases()`` reads every release made so far (``[]`` before the first);
* ``LedgerFile(path).append(*releases)`` adds releases (one atomic write for all of them) and returns
  the whole list; nothing removes one;
* :class:`pollen.privacy.budget.Budget` composes them (``Ledger``), refuses a release that would pass
  the cap, appends, and reports the ε metrics.

A state folder belongs to one run (the node state beside it does too): a new run in a used
``state-dir`` continues its ledger.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pollen.privacy.accounting import Release

LEDGER_FILE = "dp-ledger.json"  # <state-dir>/dp-ledger.json
FORMAT = "pollen-dp-ledger/1"


class LedgerError(RuntimeError):
    """A ledger file that cannot be read back as written (damaged, edited, unreadable, unwritable)."""


def _digest(entries: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class LedgerFile:
    """The append-only ledger at ``path`` (normally ``<state-dir>/dp-ledger.json``)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    @classmethod
    def in_folder(cls, folder: str | os.PathLike[str]) -> LedgerFile:
        return cls(Path(folder) / LEDGER_FILE)

    def entries(self) -> list[dict[str, Any]]:
        """Every release as written (with its ``seq`` and ``time``), checked against its hash."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise LedgerError(f"{self.path}: privacy ledger unreadable ({err.strerror or err})") from err
        try:
            data = json.loads(text)
        except ValueError as err:
            raise LedgerError(f"{self.path}: privacy ledger is not valid JSON ({err}); refusing to release "
                              "without knowing what was released before") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("releases"), list):
            raise LedgerError(f"{self.path}: not a privacy ledger of format {FORMAT!r}")
        entries = data["releases"]
        if _digest(entries) != data.get("sha256"):
            raise LedgerError(f"{self.path}: privacy ledger does not match its recorded SHA-256: it was altered "
                              "or damaged after it was written; refusing to release without knowing what was "
                              "released before")
        return entries

    def releases(self) -> list[Release]:
        out = []
        for i, entry in enumerate(self.entries()):
            try:
                out.append(Release.from_json(entry))
            except ValueError as err:
                raise LedgerError(f"{self.path}: release {i} of the privacy ledger is malformed: {err}") from err
        return out

    def append(self, *releases: Release) -> list[Release]:
        """Append ``releases`` (one atomic, fsynced write) and return every release in the ledger."""
        with self._locked():
            entries = self.entries()
            now = time.time()
            for release in releases:
                entries.append({**release.to_json(), "seq": len(entries), "time": now})
            self._write({"format": FORMAT, "releases": entries, "sha256": _digest(entries)})
        return [Release.from_json(e) for e in entries]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time (a node serves its messages one by one; this guards a second process)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot write the privacy ledger ({err.strerror or err})") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, data: dict[str, Any]) -> None:
        payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot write the privacy ledger ({err.strerror or err})") from err
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            folder = os.open(self.path.parent, os.O_RDONLY)  # the rename itself survives a power cut
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            raise LedgerError(f"{self.path}: cannot write the privacy ledger ({err.strerror or err})") from err
