"""A misbehaving client for end-to-end tests: Pollen's own ClientApp, with one partition's train replies
corrupted on the wire by a Flower mod — the way a buggy or hostile client would send them, with no
switch in Pollen's code.

:func:`faulty_app_dir` writes a Flower app folder (Pollen's ``pyproject.toml`` with another
``clientapp``) whose ClientApp is built by :func:`make_app` from this file, copied next to it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

# The kinds of bad reply: the record (by name) and the array in it each corrupts, and how.
KINDS = {
    "prototypes-shape": ("arrays", "prototypes", "drop the last embedding column"),
    "prototypes-nan": ("arrays", "prototypes", "NaN in the first present class's prototype"),
    "logits-shape": ("arrays", "logits", "drop the last class column"),
    "proto-grads-nan": ("proto-grads", None, "NaN in the first gradient array"),
}


def corrupt(content_record: ArrayRecord, kind: str) -> ArrayRecord:
    """The record with the damage of ``kind`` done to it (other arrays untouched)."""
    _record, key, _what = KINDS[kind]
    arrays = {k: a.numpy() for k, a in content_record.items()}
    if kind == "proto-grads-nan":
        if not arrays:
            return content_record  # no gradients shared this round: nothing to corrupt
        first = sorted(arrays)[0]
        arrays[first] = np.full_like(arrays[first], np.nan)
    elif kind.endswith("-shape"):
        arrays[key] = np.ascontiguousarray(arrays[key][:, :-1])
    else:  # prototypes-nan: a class the client holds (its counts are > 0)
        counts = arrays.get("class-counts")
        row = int(np.flatnonzero(counts > 0)[0]) if counts is not None and (counts > 0).any() else 0
        arrays[key] = arrays[key].copy()
        arrays[key][row] = np.nan
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def make_app(partition: int, kind: str) -> ClientApp:
    """Pollen's ClientApp whose ``partition`` sends every train reply damaged as ``kind`` says."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(KINDS)}")
    from pollen.app import client_app as pollen

    record_name, key, _what = KINDS[kind]

    def fault_mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        own = int(context.node_config.get("partition-id", -1))
        if own == partition and msg.metadata.message_type.startswith("train") and reply.has_content() \
                and record_name in reply.content.array_records \
                and (key is None or key in reply.content.array_records[record_name]):
            reply.content[record_name] = corrupt(reply.content.array_records[record_name], kind)
        return reply

    app = ClientApp(mods=[fault_mod])
    app.train()(pollen.train)
    app.query()(pollen.query)
    app.evaluate()(pollen.evaluate)
    return app


def faulty_app_dir(root: Path, project_root: Path, *, partition: int, kind: str) -> Path:
    """A Flower app folder under ``root``: Pollen's ServerApp and run config, this file's ClientApp."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(KINDS)}")
    app_dir = root / "faulty-app"
    app_dir.mkdir(parents=True, exist_ok=True)
    pyproject = (project_root / "pyproject.toml").read_text()
    pyproject, n = re.subn(r'^clientapp = ".*"$', 'clientapp = "faulty_client:app"', pyproject, flags=re.M)
    assert n == 1, "pyproject.toml names no clientapp"
    (app_dir / "pyproject.toml").write_text(pyproject)
    shutil.copy(Path(__file__), app_dir / "pollen_faults.py")
    (app_dir / "faulty_client.py").write_text(
        '"""Pollen\'s ClientApp with a test-only fault (tests/faults.py)."""\n\n'
        "from pollen_faults import make_app\n\n"
        f"app = make_app({int(partition)}, {kind!r})\n")
    return app_dir
