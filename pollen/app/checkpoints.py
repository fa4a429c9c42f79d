"""Files that outlive a process: server checkpoints, node state, final models. safetensors + JSON only.

Every file is written atomically (a temporary file in the same folder, fsync, rename), so a crash or a
full disk leaves the previous file intact, and every file a user loads again (final models, node
state, personal models) gets a ``<name>.sha256`` sidecar in ``sha256sum`` format: :func:`read_verified`
refuses a file whose bytes no longer match, naming it, so a flipped byte never becomes a silently
different model — and a file without its sidecar too (:class:`UnverifiedFileError`), since deleting the
sidecar must not turn the check into a warning; only a caller that says so (``pollen predict
--allow-unverified``) loads such a file, with a WARNING. A checkpoint is a pair ``round-NNNN.safetensors``
(the strategy's arrays) + ``round-NNNN.json`` (round, run config, the strategy's small values and the
SHA-256 of the arrays file); it is valid only when both parse and the hash matches. No pickle anywhere:
a checkpoint from an untrusted source cannot run code.

A node keeps its state per round (``<state-dir>/round-NNNN/``), back to the oldest round a kept server
checkpoint can restart from, so a resumed run rolls every node back to the checkpoint's round: a node
that trained round r before the interrupt, when the newest checkpoint is r - 1, must not train round r
on top of its own round-r model a second time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pollen.log import LOGGER

CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL = "final-model"  # <state-dir>/final-model.{safetensors,json}: a node's personal model
SIDECAR = ".sha256"  # <file>.sha256 beside every verified file: "<hex>  <name>" (sha256sum -c reads it)
SMALL_STATE = "small-state.json"
KEY_ORDER = "pollen-key-order"  # safetensors metadata: the arrays' names in the order saved (JSON list)
STATE_ROUND = re.compile(r"^round-(\d{4,})$")  # <state-dir>/round-NNNN/: a node's state after round NNNN


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or no valid one can be read."""


class UnverifiedFileError(CheckpointError):
    """A file to load has no sidecar: nothing says its bytes are the ones written."""


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as err:
        raise CheckpointError(f"cannot write {path}: {err.strerror or err}") from err
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path}: {err.strerror or err}") from err


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sidecar(path: Path) -> Path:
    """Where the SHA-256 of ``path`` is kept."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR)


def write_verified(path: Path, data: bytes) -> str:
    """Atomically write ``data`` and then its ``.sha256`` sidecar; returns the digest. A crash between
    the two leaves a pair that :func:`read_verified` refuses, never one it accepts wrongly."""
    digest = sha256_hex(data)
    atomic_write(path, data)
    atomic_write(sidecar(path), f"{digest}  {Path(path).name}\n".encode())
    return digest


def check_digest(path: Path, data: bytes, expected: str | None, source: str) -> None:
    """The one hash check: ``CheckpointError`` naming ``path`` when ``data`` is not what was recorded."""
    if sha256_hex(data) != expected:
        raise CheckpointError(f"{path}: content does not match its recorded SHA-256 (in {source}); the file was "
                              "altered or truncated after it was written, refusing to load it")


def read_verified(path: Path, *, allow_unverified: bool = False) -> bytes:
    """The bytes of ``path``, checked against its sidecar. A file without one is refused
    (:class:`UnverifiedFileError`) unless ``allow_unverified``: then read with a WARNING naming it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable ({err.strerror or err})") from err
    side = sidecar(path)
    try:
        recorded = side.read_text().split()
    except FileNotFoundError:
        if not allow_unverified:
            raise UnverifiedFileError(f"{path}: no {side.name} beside it, so nothing says its content is what "
                                      "was written; refusing to load it") from None
        LOGGER.warning("%s: no %s beside it: loaded UNVERIFIED, as asked", path, side.name)
        return data
    except OSError as err:
        raise CheckpointError(f"{side}: unreadable ({err.strerror or err})") from err
    check_digest(path, data, recorded[0] if recorded else None, side.name)
    return data


def save_arrays(path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> str:
    """Atomically write named arrays as safetensors (+ its sidecar); returns the file's SHA-256. The names'
    order goes into the file's metadata (``KEY_ORDER``): safetensors lays tensors out by dtype and name, and
    a state loaded in another order sums its per-array terms (an update norm, a clip norm) in another order,
    which moves the last bit of a float64 and breaks a bit-identical resume."""
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v) if v.ndim else v for k, v in arrays.items()},
                metadata={**(metadata or {}), KEY_ORDER: json.dumps(list(arrays))})
    return write_verified(path, data)


def arrays_from_bytes(data: bytes, name: str) -> dict[str, np.ndarray]:
    """The named arrays of a safetensors file's bytes, in the order they were saved in (``KEY_ORDER``; a
    file without it, e.g. written by another tool, in the file's own order); ``CheckpointError`` naming
    ``name`` for bytes that are not a valid safetensors file."""
    from safetensors.numpy import load

    try:
        arrays = dict(load(data))
        header_size = int.from_bytes(data[:8], "little")  # the format: an 8-byte length, then a JSON header
        order = json.loads(json.loads(data[8:8 + header_size]).get("__metadata__", {}).get(KEY_ORDER, "[]"))
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{name}: not a valid safetensors file ({err})") from err
    if isinstance(order, list) and sorted(order) == sorted(arrays):
        return {k: arrays[k] for k in order}
    return arrays


def load_arrays(path: Path, *, allow_unverified: bool = False, sha256: str | None = None) -> dict[str, np.ndarray]:
    """Named arrays from a safetensors file, verified against its sidecar (``CheckpointError`` naming it) and,
    when given, against ``sha256`` (the digest recorded in the JSON that describes the file)."""
    data = read_verified(path, allow_unverified=allow_unverified)
    if sha256 is not None:
        check_digest(path, data, sha256, f"{Path(path).with_suffix('.json').name}'s sha256")
    return arrays_from_bytes(data, str(path))


def write_json(path: Path, values: Mapping[str, Any]) -> None:
    """Atomically write ``values`` as JSON (+ its sidecar)."""
    write_verified(path, (json.dumps(values, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path, *, allow_unverified: bool = False) -> Any:
    """A JSON file written by :func:`write_json`, verified (``CheckpointError`` naming it)."""
    try:
        return json.loads(read_verified(path, allow_unverified=allow_unverified))
    except ValueError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err


# ---------------------------------------------------------------------------------- server checkpoints
@dataclass
class Checkpoint:
    round: int
    arrays: dict[str, np.ndarray]
    values: dict[str, Any]
    config: dict[str, Any]
    path: Path


def checkpoint_paths(run_dir: Path, server_round: int) -> tuple[Path, Path]:
    folder = Path(run_dir) / CHECKPOINT_DIR
    return folder / f"round-{server_round:04d}.safetensors", folder / f"round-{server_round:04d}.json"


def write_checkpoint(run_dir: Path, server_round: int, arrays: Mapping[str, np.ndarray],
                     values: Mapping[str, Any], config: Mapping[str, Any], keep: int) -> Path:
    """Write round ``server_round``'s checkpoint, then prune all but the newest ``keep``."""
    tensors, meta = checkpoint_paths(run_dir, server_round)
    digest = save_arrays(tensors, arrays)
    write_json(meta, {"round": server_round, "sha256": digest, "strategy": dict(values), "config": dict(config)})
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        for path in checkpoint_paths(run_dir, old):
            path.unlink(missing_ok=True)
            sidecar(path).unlink(missing_ok=True)
    return tensors


def list_checkpoints(run_dir: Path) -> list[int]:
    """Rounds that have a checkpoint metadata file, oldest first (validity is checked on read)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    rounds = []
    for path in folder.glob("round-*.json"):
        try:
            rounds.append(int(path.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(rounds)


def read_checkpoint(run_dir: Path, server_round: int) -> Checkpoint:
    """One checkpoint, verified; ``CheckpointError`` naming the file otherwise."""
    tensors, meta = checkpoint_paths(run_dir, server_round)
    try:
        values = read_json(meta)
        data = tensors.read_bytes()
    except (OSError, CheckpointError) as err:
        raise CheckpointError(f"{meta.name}: unreadable ({err})") from err
    check_digest(tensors, data, values.get("sha256"), meta.name)
    arrays = arrays_from_bytes(data, tensors.name)
    return Checkpoint(int(values["round"]), arrays, dict(values["strategy"]), dict(values["config"]), tensors)


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest valid checkpoint; invalid ones are refused by name (logged), older ones tried next."""
    problems = []
    for server_round in reversed(list_checkpoints(run_dir)):
        try:
            return read_checkpoint(run_dir, server_round)
        except CheckpointError as err:
            LOGGER.warning("refusing checkpoint: %s", err)
            problems.append(str(err))
    detail = "; ".join(problems) if problems else "none written"
    raise CheckpointError(f"no valid checkpoint under {Path(run_dir) / CHECKPOINT_DIR}: {detail}")


# ---------------------------------------------------------------------------------- node state
def state_rounds(folder: Path) -> list[int]:
    """Rounds with a complete saved node state under ``folder``, oldest first."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    return sorted(int(m[1]) for e in entries if e.is_dir() and (m := STATE_ROUND.match(e.name)))


def state_folder(folder: Path, server_round: int) -> Path:
    return Path(folder) / f"round-{server_round:04d}"


def rounds_to_keep(rounds: list[int], newest: int, keep_back: int) -> set[int]:
    """Every state a resume may roll back to: a kept server checkpoint is at most ``keep_back`` rounds
    older than ``newest``, and the state it needs is the newest one at or before its round — so every
    round after ``newest - keep_back``, plus the newest at or before it."""
    horizon = newest - max(keep_back, 1)
    older = [r for r in rounds if r <= horizon]
    return {r for r in rounds if r > horizon} | ({max(older)} if older else set())


def save_records(folder: Path, records, server_round: int = 0, keep_back: int = 1) -> list[str]:
    """Persist a node's ``context.state`` (a RecordDict) as its state after ``server_round``: one
    safetensors per ArrayRecord, one JSON for the rest, each with a sidecar, in ``round-NNNN/``
    (completed in a temporary folder, then renamed, so a crash never leaves half a state). States a
    resume can no longer need (:func:`rounds_to_keep`) are removed. Returns the files written."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".round-{server_round:04d}.", dir=folder))
    except OSError as err:
        raise CheckpointError(f"cannot write {folder}: {err.strerror or err}") from err
    small: dict[str, Any] = {}
    written = []
    try:
        for key, record in records.items():
            if isinstance(record, ArrayRecord):
                path = work / f"{key}.safetensors"
                save_arrays(path, {k: a.numpy() for k, a in record.items()})
                written.append(path.name)
            elif isinstance(record, (ConfigRecord, MetricRecord)):
                kind = "config" if isinstance(record, ConfigRecord) else "metrics"
                small[key] = {"kind": kind, "values": {k: (v.hex() if isinstance(v, bytes) else v)
                                                       for k, v in record.items()}}
        write_json(work / SMALL_STATE, small)
        target = state_folder(folder, server_round)
        if target.exists():  # the same round trained again (after a resume): replace it whole
            old = Path(tempfile.mkdtemp(prefix=".replaced.", dir=folder))
            os.replace(target, old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(work, target)
    except OSError as err:
        raise CheckpointError(f"cannot write {folder}: {err.strerror or err}") from err
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rounds = state_rounds(folder)
    for r in set(rounds) - rounds_to_keep(rounds, server_round, keep_back):
        shutil.rmtree(state_folder(folder, r), ignore_errors=True)
    for legacy in [folder / SMALL_STATE, *folder.glob("*.safetensors")]:  # the flat layout of older runs
        if legacy.stem != FINAL_MODEL:
            legacy.unlink(missing_ok=True)
            sidecar(legacy).unlink(missing_ok=True)
    return written + [SMALL_STATE]


def load_records(folder: Path, records, before_round: int | None = None) -> bool:
    """Fill an empty ``context.state`` from ``folder``: the newest saved state of a round before
    ``before_round`` (the round about to run; ``None``: the newest). False when there is none, i.e. the
    node had trained nothing before that round. Every file is verified (``CheckpointError`` naming it)."""
    folder = Path(folder)
    rounds = [r for r in state_rounds(folder) if before_round is None or r < before_round]
    if rounds:
        source = state_folder(folder, rounds[-1])
    elif (folder / SMALL_STATE).exists():  # the flat layout of runs written before per-round states
        source = folder
    else:
        return False
    return _load_state(source, records)


def _load_state(source: Path, records) -> bool:
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    small = read_json(source / SMALL_STATE)
    for path in sorted(source.glob("*.safetensors")):
        if path.stem == FINAL_MODEL:  # the end product of a finished run, not part of the state
            continue
        records[path.stem] = ArrayRecord({k: Array(np.asarray(v)) for k, v in load_arrays(path).items()})
    for key, entry in small.items():
        cls = ConfigRecord if entry["kind"] == "config" else MetricRecord
        records[key] = cls(entry["values"])
    return True


# What Pollen writes with a sidecar in a run folder, besides every safetensors file: the JSON files a later
# step loads (the run config, a user-data task, checkpoints, final states, node states and personal models).
VERIFIED_JSON = ("config.json", "task.json", f"{CHECKPOINT_DIR}/*.json", "final/*.json", "nodes/**/*.json")


def verify_files(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file under ``folder`` that a later step loads and that no longer matches its sidecar, or has
    none, as messages naming it (a run folder checked before a resume starts anything). Folders named in
    ``skip`` are left to their own reader (checkpoints: :func:`latest_checkpoint` falls back past a bad
    one); hidden files and folders (a write a crash left unfinished) are not loaded, so not checked."""
    folder = Path(folder)
    loaded = set(folder.rglob("*.safetensors")).union(*(folder.glob(p) for p in VERIFIED_JSON))
    problems = []
    for path in sorted(loaded):
        parts = path.relative_to(folder).parts
        if parts[0] in skip or any(part.startswith(".") for part in parts):
            continue
        try:
            read_verified(path)
        except CheckpointError as err:
            problems.append(str(err))
    return problems
