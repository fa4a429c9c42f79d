"""A misbehaving client for end-to-end tests: Pollen's own ClientApp, with one partition's train replies
corrupted on the wire by a Flower mod — the way a buggy or hostile client would send them, with no
switch in Pollen's code.

Two sorts of damage: a malformed reply (``KINDS``: a wrong shape, NaN), and a well-formed reply that
sends ``k`` × its honest update (``scale-<k>``, or ``scale-by-round``: ×10, ×100, ×1000 in rounds 1, 2, 3
and on) — finite, the right shapes, inside the declared bounds. What "its update" is depends on the
family (:func:`scale`): a model's change from the state it was sent, prototypes, logits, GLFC's
gradient sets.

:func:`faulty_app_dir` writes a Flower app folder (Pollen's ``pyproject.toml`` with another
``clientapp``) whose ClientApp is built by :func:`make_app` from this file, copied next to it. In
process, ``make_app`` is the ClientApp itself (``pollen.testing.clientapp_node(make_app(...), ...)``).
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


# scale-by-round: the factor of each round (the last one for every later round)
ROUND_FACTORS = (10.0, 100.0, 1000.0)
_SCALED = ("prototypes", "proto-sums", "logits")  # a reply's own values, scaled as they are


def factor_of(kind: str, server_round: int) -> float:
    """The factor a ``scale-…`` kind applies in ``server_round``."""
    if kind == "scale-by-round":
        return ROUND_FACTORS[min(server_round, len(ROUND_FACTORS)) - 1]
    return float(kind.removeprefix("scale-"))


def _check_kind(kind: str) -> None:
    if kind in KINDS or kind == "scale-by-round":
        return
    try:
        factor_of(kind, 1)
    except ValueError:
        raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(KINDS)}, scale-<k>, scale-by-round") from None


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def _moved(sent: dict[str, np.ndarray], got: dict[str, np.ndarray], k: float) -> ArrayRecord:
    """``sent + k · (got − sent)`` for float entries the message held; everything else as it was."""
    out = {}
    for name, value in got.items():
        base = sent.get(name)
        if value.dtype.kind == "f" and base is not None and base.shape == value.shape:
            value = (base.astype(np.float64) + k * (value.astype(np.float64) - base)).astype(value.dtype)
        out[name] = value
    return ArrayRecord({n: Array(v.copy(order="C")) for n, v in out.items()})


def scale(msg: Message, reply: Message, k: float) -> None:
    """Make ``reply`` carry ``k`` × its honest update, family by family: a model (``arrays`` holding the
    state the message sent, or homogeneous mode's ``model``) moves ``k`` × as far from what it was sent;
    prototypes (or DP's noisy sums) and logits are multiplied by ``k``; GLFC's ``proto-grads`` too."""
    records = reply.content.array_records
    sent = msg.content.array_records
    for name, record in list(records.items()):
        arrays = _arrays(record)
        if name == "proto-grads" or any(key in arrays for key in _SCALED):
            scaled = {n: (v * k if v.dtype.kind == "f" and (name == "proto-grads" or n in _SCALED) else v)
                      for n, v in arrays.items()}
            reply.content[name] = ArrayRecord({n: Array(v.copy(order="C")) for n, v in scaled.items()})
        elif name in sent and set(arrays) == set(sent[name].keys()):
            reply.content[name] = _moved(_arrays(sent[name]), arrays, k)


def make_app(partition: int, kind: str) -> ClientApp:
    """Pollen's ClientApp whose ``partition`` sends every train reply damaged as ``kind`` says."""
    _check_kind(kind)
    from pollen.app import client_app as pollen

    record_name, key, _what = KINDS.get(kind, ("", None, ""))

    def fault_mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        own = int(context.node_config.get("partition-id", -1))
        if own != partition or not msg.metadata.message_type.startswith("train") or not reply.has_content():
            return reply
        if kind.startswith("scale-"):
            scale(msg, reply, factor_of(kind, int(msg.content.config_records["config"]["server-round"])))
        elif record_name in reply.content.array_records \
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
    _check_kind(kind)
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
