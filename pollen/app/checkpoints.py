"""Files that outlive a process: server checkpoints, node state, final models. safetensors + JSON only.

Every file is written atomically (a temporary file in the same folder, fsync, rename), so a crash or a
full disk leaves the previous file intact. A checkpoint is a pair ``round-NNNN.safetensors`` (the
strategy's arrays) + ``round-NNNN.json`` (round, run config, the strategy's small values and the
SHA-256 of the arrays file); it is valid only when both parse and the hash matches. No pickle
anywhere: a checkpoint from an untrusted source cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from pollen.log import LOGGER

CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL = "final-model"  # <state-dir>/final-model.{safetensors,json}: a node's personal model


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or no valid one can be read."""


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


def save_arrays(path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> str:
    """Atomically write named arrays as safetensors; returns the file's SHA-256."""
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v) if v.ndim else v for k, v in arrays.items()},
                metadata=dict(metadata or {}) or None)
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    return dict(load_file(str(path)))


def write_json(path: Path, values: Mapping[str, Any]) -> None:
    atomic_write(path, (json.dumps(values, indent=2, sort_keys=True) + "\n").encode())


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
        values = json.loads(meta.read_text())
        data = tensors.read_bytes()
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta.name}: unreadable ({err})") from err
    if hashlib.sha256(data).hexdigest() != values.get("sha256"):
        raise CheckpointError(f"{tensors.name}: content does not match its recorded SHA-256 (truncated or altered)")
    from safetensors.numpy import load

    try:
        arrays = dict(load(data))
    except Exception as err:
        raise CheckpointError(f"{tensors.name}: not a valid safetensors file ({err})") from err
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
def save_records(folder: Path, records) -> list[str]:
    """Persist a node's ``context.state`` (a RecordDict): one safetensors per ArrayRecord, one JSON for
    the rest. Returns the files written."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    folder = Path(folder)
    small: dict[str, Any] = {}
    written = []
    for key, record in records.items():
        if isinstance(record, ArrayRecord):
            path = folder / f"{key}.safetensors"
            save_arrays(path, {k: a.numpy() for k, a in record.items()})
            written.append(path.name)
        elif isinstance(record, (ConfigRecord, MetricRecord)):
            kind = "config" if isinstance(record, ConfigRecord) else "metrics"
            small[key] = {"kind": kind, "values": {k: (v.hex() if isinstance(v, bytes) else v)
                                                   for k, v in record.items()}}
    write_json(folder / "small-state.json", small)
    return written + ["small-state.json"]


def load_records(folder: Path, records) -> bool:
    """Fill an empty ``context.state`` from ``folder``; False when nothing was saved there."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    folder = Path(folder)
    small_path = folder / "small-state.json"
    if not small_path.exists():
        return False
    for path in sorted(folder.glob("*.safetensors")):
        if path.stem == FINAL_MODEL:  # the end product of a finished run, not part of the state
            continue
        records[path.stem] = ArrayRecord({k: Array(np.asarray(v)) for k, v in load_arrays(path).items()})
    for key, entry in json.loads(small_path.read_text()).items():
        cls = ConfigRecord if entry["kind"] == "config" else MetricRecord
        records[key] = cls(entry["values"])
    return True
