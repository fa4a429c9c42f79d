"""Classify images with a trained Pollen model: ``pollen predict``.

Loads a saved model — a node's personal ``final-model.safetensors`` (with its ``final-model.json``) or
a weights-family run's global model (``<run>/final/global.safetensors``, rebuilt from the run's
``config.json``) — and, for prototype methods, the run's global prototypes (nearest-prototype mode).
Classifies a named task's partition split (exactly the tensors the client evaluated) or a folder of
image files (converted to the model's channels and size and normalised exactly as the task's training
data); prints the accuracy when labels exist and writes the predictions as CSV.

A file that does not fit the model (missing or unexpected keys, other shapes, prototypes of another
embedding size), a missing JSON or run config, or bad input is refused with a message naming the file
and the mismatch, and exit code 2. Nothing is unpickled: weights are safetensors, metadata JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_USAGE = 0, 2
PROG = "pollen predict"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
# Tasks whose training images are decoded from files by PIL (RGB, resized to 32 with PIL bilinear)
# before ``to_model_input``: their --images input is decoded the same way (pollen.datasets.sources).
PIL_DECODED_TASKS = frozenset({"office-home"})
# Class names of the sources whose names are fixed (torchvision's order); other tasks: --class-names.
CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FASHION_NAMES = ("t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                 "ankle boot")
KNOWN_CLASS_NAMES = {"cifar10-shot": CIFAR10_NAMES, "fmnist-dirichlet": FASHION_NAMES, "fmnist-shot": FASHION_NAMES}


class PredictError(Exception):
    """Bad usage or input: printed as one message, exit code 2."""


# ---------------------------------------------------------------------------------- small helpers
def _short(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(repr(i) for i in items[:limit])
    return f"[{shown}{f', … and {len(items) - limit} more' if len(items) > limit else ''}]"


UNVERIFIED_HINT = ("; pass --allow-unverified to load it anyway (only for a file you trust: nothing checks that "
                   "its bytes are the ones Pollen wrote)")


def _refused(err: Exception) -> PredictError:
    """A file that failed its check, as ``pollen predict``'s error (exit 2), with the way out when its
    sidecar is missing."""
    from pollen.app.checkpoints import UnverifiedFileError

    return PredictError(str(err) + (UNVERIFIED_HINT if isinstance(err, UnverifiedFileError) else ""))


def _read_json(path: Path, what: str, beside: Path | None = None, *, allow_unverified: bool = False) -> dict[str, Any]:
    """A JSON file, verified against its ``.sha256`` sidecar (refused without one unless ``allow_unverified``)."""
    from pollen.app.checkpoints import CheckpointError, read_verified

    if not path.is_file():
        where = f" (expected beside {beside})" if beside is not None else ""
        raise PredictError(f"{path}: {what} not found{where}")
    try:
        data = json.loads(read_verified(path, allow_unverified=allow_unverified))
    except CheckpointError as err:
        raise _refused(err) from err
    except ValueError as err:
        raise PredictError(f"{path}: {what} is not readable JSON ({err})") from err
    if not isinstance(data, dict):
        raise PredictError(f"{path}: {what} must be a JSON object, got {type(data).__name__}")
    return data


def _read_arrays(path: Path, what: str, meta: dict[str, Any] | None = None, *,
                 allow_unverified: bool = False) -> dict[str, Any]:
    """Named arrays, verified against the file's ``.sha256`` sidecar (refused without one unless
    ``allow_unverified``) and against the digest its JSON ``meta`` records: a changed byte is refused by name."""
    from pollen.app.checkpoints import CheckpointError, load_arrays

    if not path.is_file():
        raise PredictError(f"{path}: {what} not found")
    try:
        return load_arrays(path, allow_unverified=allow_unverified, sha256=(meta or {}).get("sha256"))
    except CheckpointError as err:
        raise _refused(err) from err


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise PredictError(f"--set {item!r}: expected KEY=VALUE (a run-config key, e.g. shot-shots=12)")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


def input_format(task_name: str):
    """The :class:`ImageFormat` the task's *data* is normalised with (what its clients train on), as its
    ``TaskSpec`` declares it, whatever the task's kind."""
    from pollen.datasets.tasks import get_task

    return get_task(task_name).fmt


# ---------------------------------------------------------------------------------- models
@dataclass
class LoadedModel:
    model: Any  # SplitModel
    name: str
    info: dict[str, Any]  # method, task, round, partition-id (when a personal model), width, num-classes
    source: Path
    cfg: Any = None  # RunConfig, when one was found
    notes: list[str] = field(default_factory=list)


def check_state(model, arrays: dict[str, Any], path: Path, described: str) -> None:
    """Refuse ``arrays`` unless they are exactly ``model``'s state dict (names and shapes)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in arrays]
    unexpected = [k for k in arrays if k not in expected]
    shapes = [f"{k!r}: file {tuple(arrays[k].shape)} vs model {expected[k]}" for k in expected
              if k in arrays and tuple(arrays[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing keys {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    if shapes:
        more = f", … and {len(shapes) - 6} more" if len(shapes) > 6 else ""
        problems.append(f"shape mismatch {'; '.join(shapes[:6])}{more}")
    if problems:
        raise PredictError(f"{path}: does not match {described}: " + "; ".join(problems))


def _load_into(model, arrays: dict[str, Any]) -> None:
    import numpy as np
    import torch

    model.load_state_dict({k: torch.from_numpy(np.array(arrays[k], copy=True)) for k in model.state_dict()})


def _prepare(model, name: str):
    from pollen.models import SMALL_MODELS, to_channels_last

    model.eval()
    return model if name in SMALL_MODELS else to_channels_last(model)  # the layout clients use


def _run_config(raw: dict[str, Any], overrides: dict[str, Any], source: str):
    from pollen.app.config import ConfigError, parse_run_config

    merged = {**raw, **overrides, "device": "cpu"}  # only data and options are read from it
    try:
        return parse_run_config(merged)
    except ConfigError as err:
        raise PredictError(f"{source}: {err}") from err


def _find_run_config(model_path: Path) -> Path | None:
    """``<run>/config.json`` for a node state folder in the default layout ``<run>/nodes/partition-<i>``."""
    folder = model_path.resolve().parent
    if folder.parent.name == "nodes" and (folder.parent.parent / "config.json").is_file():
        return folder.parent.parent / "config.json"
    return None


def _config_path(path: Path) -> Path:
    return path / "config.json" if path.is_dir() else path


def _user_task_config(info: dict[str, Any]) -> dict[str, Any]:
    """The run config a user-data node recorded, with its agreed classes and input format spelled out:
    the run's ``data-dir`` (where they may have been detected) need not exist where predict runs."""
    raw = dict(info["config"])
    names = [str(n) for n in info["class-names"]]
    if not any("," in n for n in names):
        raw["classes"] = ",".join(names)
    raw["image-size"], raw["image-channels"] = int(info["image-size"]), int(info["in-channels"])
    if raw.get("data-dir") and not Path(str(raw["data-dir"])).exists():
        raw["data-dir"] = ""
    return raw


def load_personal_model(path: Path, config: Path | None, overrides: dict[str, Any], *,
                        allow_unverified: bool = False) -> LoadedModel:
    """A node's ``final-model.safetensors`` + ``final-model.json`` (+ the run config, when found)."""
    from pollen.models import ModelSpec

    path = Path(path)
    meta_path = path.with_suffix(".json")
    if not path.is_file():
        raise PredictError(f"{path}: model file not found")
    info = _read_json(meta_path, "the model's JSON", beside=path, allow_unverified=allow_unverified)
    if "family" in info:  # a run's final/global.* passed as --model
        if info["family"] == "weights":
            return load_global_model(path.parent.parent, overrides, weights=path, allow_unverified=allow_unverified)
        raise PredictError(f"{path}: is the final global state of a {info['family']}-family run "
                           f"(method {info.get('method')!r}), not a model"
                           + ("; pass it as --prototypes with a node's --model" if info["family"] == "prototypes"
                              else ""))
    needed = ("method", "task", "model", "width", "num-classes", "in-channels", "image-size")
    absent = [k for k in needed if k not in info]
    if absent:
        raise PredictError(f"{meta_path}: lacks {_short(absent)}; is it a Pollen final-model.json?")
    kwargs = info.get("model-kwargs") or {}
    notes = []
    config = config or _find_run_config(path)
    if config is not None:
        config = _config_path(Path(config))
        raw = _read_json(config, "run config", allow_unverified=allow_unverified)
        cfg = _run_config(raw, overrides, str(config))
        differ = [k for k, mine in (("method", cfg.method), ("task", cfg.task), ("seed", cfg.seed))
                  if info.get(k) != mine]
        if differ:
            detail = ", ".join(f"{k}: model {info.get(k)!r} vs config {getattr(cfg, k)!r}" for k in differ)
            raise PredictError(f"{config}: is not the run config of {path} ({detail})")
        notes.append(f"run config: {config}")
    elif "class-names" in info and isinstance(info.get("config"), dict):
        cfg = _run_config(_user_task_config(info), overrides, f"{meta_path} (its 'config', + --set)")
        notes.append(f"run config: the one recorded in {meta_path.name}")
    else:
        cfg = _run_config({"method": info["method"], "task": info["task"], "seed": info.get("seed", 0)},
                          overrides, f"{meta_path} (+ --set)")
        notes.append("no run config found (pass --config RUN_DIR to use the run's task options); task "
                     "options: defaults and --set, seed from the model's JSON")
    try:
        model = ModelSpec.from_json(info).build()
    except (ValueError, TypeError) as err:
        raise PredictError(f"{meta_path}: cannot rebuild the model it describes ({err})") from err
    described = (f"model {info['model']!r} (width {info['width']}, {info['num-classes']} classes, "
                 f"{info['in-channels']}×{info['image-size']}² input{f', {kwargs}' if kwargs else ''}) "
                 f"described by {meta_path.name}")
    arrays = _read_arrays(path, "model file", info, allow_unverified=allow_unverified)
    check_state(model, arrays, path, described)
    _load_into(model, arrays)
    return LoadedModel(_prepare(model, info["model"]), info["model"], dict(info), path, cfg, notes)


def load_global_model(run_dir: Path, overrides: dict[str, Any], weights: Path | None = None, *,
                      allow_unverified: bool = False) -> LoadedModel:
    """A weights-family run's final global model, rebuilt from the run's ``config.json`` (as the
    ServerApp built its initial model: the task's default model unless ``model`` is set)."""
    from pollen.datasets.tasks import TaskOptions, resolve_task
    from pollen.models.spec import ModelSpec, choose_model

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PredictError(f"{run_dir}: run folder not found")
    config = run_dir / "config.json"
    raw = _read_json(config, "run config", allow_unverified=allow_unverified)
    weights = weights or run_dir / "final" / "global.safetensors"
    meta_path = weights.with_suffix(".json")
    from pollen.app.registry import METHODS

    spec = METHODS.get(str(raw.get("method", "fedavg")))
    if weights.is_file():
        meta = _read_json(meta_path, "the global state's JSON", beside=weights, allow_unverified=allow_unverified)
    elif spec is None or spec.family == "weights":
        raise PredictError(f"{weights}: not found — did the run finish? (a run writes final/ at its end)")
    else:
        meta = {"family": spec.family, "method": spec.name}
    family = meta.get("family")
    if family != "weights":
        nodes = sorted(run_dir.glob("nodes/partition-*/final-model.safetensors"))
        hint = ("use a node's personal model: --model <state-dir>/final-model.safetensors"
                + (f" (this run has {', '.join(str(n) for n in nodes[:3])}{' …' if len(nodes) > 3 else ''})"
                   if nodes else ""))
        if family == "prototypes":
            hint += f", with --prototypes {weights}"
        raise PredictError(f"{weights}: a {family}-family run (method {meta.get('method')!r}) has no global "
                           f"model; {hint}")
    cfg = _run_config(raw, overrides, str(config))
    differ = [k for k in ("method", "task") if meta.get(k) != getattr(cfg, k)]
    if differ:
        raise PredictError(f"{meta_path}: {differ} differ from {config}")
    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    if "model-spec" in meta:  # the model described beside it (runs before: rebuilt from the run config)
        try:
            described, source = ModelSpec.from_json(meta["model-spec"]), meta_path.name
        except ValueError as err:
            raise PredictError(f"{meta_path}: {err}") from err
    else:
        described, source = choose_model(cfg, task), str(config)
    model = described.build()
    arrays = {k[len("model."):]: v for k, v in _read_arrays(weights, "global state", meta,
                                                            allow_unverified=allow_unverified).items()
              if k.startswith("model.")}
    check_state(model, arrays, weights, f"model {described.name!r} (width {described.width}, "
                                        f"{described.num_classes} classes) built from {source}")
    _load_into(model, arrays)
    from pollen.launch.runs import RunFolderError, recorded_supernodes

    try:
        partitions = recorded_supernodes(run_dir)  # launch.json, or the run's nodes/partition-* folders
    except RunFolderError as err:
        raise PredictError(str(err)) from err
    info = {"method": cfg.method, "task": cfg.task, **described.to_json(), "round": meta.get("round"), "seed": cfg.seed}
    if partitions is not None:
        info["num-partitions"] = partitions
    if task.class_names:
        info["class-names"] = list(task.class_names)
        if cfg.image_mean and cfg.image_std:
            info["image-mean"], info["image-std"] = list(task.fmt.mean), list(task.fmt.std)
    return LoadedModel(_prepare(model, described.name), described.name, info, weights, cfg, [f"run config: {config}"])


# ---------------------------------------------------------------------------------- prototypes
@dataclass
class Prototypes:
    protos: Any  # C×d float32 tensor
    present: Any  # C bool tensor
    margin: float
    source: Path
    info: dict[str, Any]


def load_prototypes(path: Path, loaded: LoadedModel, *, allow_unverified: bool = False) -> Prototypes:
    import numpy as np
    import torch

    path = Path(path)
    if path.is_dir():
        path = path / "final" / "global.safetensors"
    meta_path = path.with_suffix(".json")
    if not path.is_file():
        raise PredictError(f"{path}: prototype file not found")
    meta = _read_json(meta_path, "the global state's JSON", beside=path, allow_unverified=allow_unverified)
    if meta.get("family") != "prototypes":
        raise PredictError(f"{path}: holds the global state of a {meta.get('family')!r}-family run "
                           f"(method {meta.get('method')!r}), not prototypes")
    arrays = _read_arrays(path, "prototype file", meta, allow_unverified=allow_unverified)
    absent = [k for k in ("prototypes", "present") if k not in arrays]
    if absent:
        raise PredictError(f"{path}: missing keys {_short(absent)} (a prototypes run's final/global.safetensors "
                           "has 'prototypes' C×d and 'present' C)")
    protos, present = np.asarray(arrays["prototypes"]), np.asarray(arrays["present"])
    model = loaded.model
    if protos.ndim != 2 or present.shape != (protos.shape[0],):
        raise PredictError(f"{path}: 'prototypes' {protos.shape} and 'present' {present.shape} are not C×d and C")
    if protos.shape[1] != model.feature_dim:
        raise PredictError(f"{path}: prototypes have d = {protos.shape[1]} but the model's features have "
                           f"feature_dim = {model.feature_dim} ({loaded.source})")
    if protos.shape[0] != model.num_classes:
        raise PredictError(f"{path}: {protos.shape[0]} class prototypes but the model has "
                           f"{model.num_classes} classes ({loaded.source})")
    mask = present.astype(bool)
    if not mask.any():
        raise PredictError(f"{path}: no class is present (no client ever reported a prototype)")
    if not np.isfinite(protos[mask]).all():
        raise PredictError(f"{path}: present prototypes contain NaN or infinite values")
    if meta.get("task") != loaded.info.get("task"):
        raise PredictError(f"{path}: prototypes of task {meta.get('task')!r} but the model was trained on "
                           f"{loaded.info.get('task')!r} ({loaded.source})")
    return Prototypes(torch.from_numpy(protos.astype(np.float32)), torch.from_numpy(mask),
                      float(meta.get("values", {}).get("margin", 0.0)), path, meta)


# ---------------------------------------------------------------------------------- inputs
@dataclass
class Inputs:
    x: Any  # N×C×H×W float tensor, normalised
    y: Any  # N int64 tensor, -1 = no label
    names: list[str]
    description: str
    classes: tuple[int, ...] | None = None  # the partition's classes (task split only)


def task_split(loaded: LoadedModel, task_name: str, partition: int, num_partitions: int, split: str,
               data_root: str | None, data_dir: str | None = None) -> Inputs:
    """The partition's split as its client builds it: the same task function
    (:func:`~pollen.datasets.tasks.partition_data`) with the run config's options and seed, and the sizes
    the run's method builds domain tasks with (``MethodSpec.data_sizes``). No client is made: building
    data is the task's business, and a client would also set threads, a device and state."""
    from pollen.app.registry import METHODS
    from pollen.datasets.tasks import TaskOptions, get_task, partition_data
    from pollen.settings import NodeConfig

    cfg = loaded.cfg
    get_task(task_name)
    node = NodeConfig(partition_id=partition, num_partitions=num_partitions, data_root=data_root, data_dir=data_dir)
    if task_name == cfg.task:
        train_sizes, test_size = METHODS[cfg.method].data_sizes(cfg)
        data = partition_data(task_name, TaskOptions.of(cfg, node), partition, num_partitions, train_sizes, test_size)
    else:  # another task: the run's options, less those of the run's own data (its folder, classes, format)
        data = partition_data(task_name, TaskOptions.of(cfg, node).without_user_data(), partition, num_partitions)
    x, y = (data.x_test, data.y_test) if split == "test" else (data.x_train, data.y_train)
    if data_dir:
        names = [f"{data_dir}/{split}/{i}" for i in range(len(y))]
        where = f"data folder {data_dir} (task {task_name}, as a node with node config data-dir reads it)"
    else:
        names = [f"{task_name}/partition-{partition}/{split}/{i}" for i in range(len(y))]
        where = f"task {task_name} partition {partition}/{num_partitions}"
    return Inputs(x, y.clone(), names, f"{where}, {split} split", tuple(int(c) for c in data.classes))


def _decode_one(path: Path):
    """uint8 1×C×H×W (C = 1 for grey images, 3 otherwise) exactly as stored in the file."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        if img.mode in ("I;16", "I;16B", "I;16L"):
            arr = (np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8)[..., None]
        elif img.mode in ("1", "L", "LA", "I", "F"):
            arr = np.asarray(img.convert("L"), dtype=np.uint8)[..., None]
        else:
            arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True)).permute(2, 0, 1).unsqueeze(0)


def _class_index(folder: str, names: Sequence[str] | None, num_classes: int, where: Path) -> int:
    if names:
        if folder in names:
            return list(names).index(folder)
        lowered = [n.lower() for n in names]
        if folder.lower() in lowered:
            return lowered.index(folder.lower())
    if folder.isdigit():
        index = int(folder)
        if index < num_classes:
            return index
        raise PredictError(f"{where}: class folder {folder!r} is outside 0..{num_classes - 1} "
                           f"(the model has {num_classes} classes)")
    known = f"; known class names: {', '.join(names)}" if names else \
        "; name class folders by class index (0, 1, …) or pass --class-names"
    raise PredictError(f"{where}: class folder {folder!r} is neither a class index nor a class name{known}")


def _user_format(info: dict[str, Any], folder: Path):
    """A user-data model's input format: its agreed side and channels, and the normalisation its node
    trained with (recorded in final-model.json, or the run's image-mean/image-std)."""
    from pollen.datasets.transforms import ImageFormat

    if "image-mean" not in info or "image-std" not in info:
        raise PredictError(f"{folder}: the model's run normalised each node's data with that node's own statistics, "
                           "which a global model does not carry: classify a node's folder with --data-dir DIR "
                           "(its training images give the statistics), or a node's personal model")
    return ImageFormat(int(info["in-channels"]), int(info["image-size"]), tuple(info["image-mean"]),
                       tuple(info["image-std"]))


def image_folder(folder: Path, task_name: str, loaded: LoadedModel, class_names: Sequence[str] | None) -> Inputs:
    """Every image file in ``folder`` (unlabelled) and in its subfolders (labelled by the folder's name)."""
    import torch

    from pollen.datasets.sources import FOLDER_IMAGE_SIZE, decode_images
    from pollen.datasets.transforms import to_model_input

    folder = Path(folder)
    if not folder.is_dir():
        raise PredictError(f"{folder}: image folder not found")
    info = loaded.info
    fmt = _user_format(info, folder) if "class-names" in info and task_name == info["task"] else input_format(task_name)
    if (fmt.channels, fmt.size) != (int(info.get("in-channels", fmt.channels)), int(info.get("image-size", fmt.size))):
        raise PredictError(f"task {task_name!r} feeds {fmt.channels}×{fmt.size}² input but {loaded.source} was "
                           f"built for {info.get('in-channels')}×{info.get('image-size')}²")
    names = class_names or info.get("class-names") or KNOWN_CLASS_NAMES.get(task_name)
    files: list[tuple[Path, int]] = []
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix.lower() in IMAGE_EXTENSIONS:
            files.append((entry, -1))
        elif entry.is_dir() and not entry.name.startswith("."):
            label = _class_index(entry.name, names, loaded.model.num_classes, entry)
            files.extend((f, label) for f in sorted(entry.iterdir())
                         if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise PredictError(f"{folder}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in it or its class subfolders")
    xs = []
    for path, _ in files:
        try:
            if task_name in PIL_DECODED_TASKS:
                raw = decode_images([str(path)], FOLDER_IMAGE_SIZE)
            else:
                raw = _decode_one(path)
        except (OSError, ValueError) as err:
            raise PredictError(f"{path}: cannot be read as an image ({err})") from err
        xs.append(to_model_input(raw, fmt))
    x = torch.cat(xs)
    y = torch.tensor([label for _, label in files], dtype=torch.int64)
    labelled = int((y >= 0).sum())
    return Inputs(x, y, [str(p) for p, _ in files],
                  f"folder {folder}: {len(files)} images, {labelled} labelled by class folder")


# ---------------------------------------------------------------------------------- prediction
def classify(model, x, device, batch_size: int = 512):
    """(predictions, softmax probability of each prediction, logits) from the classifier head."""
    import torch

    from pollen.methods.training import predict_logits

    with torch.no_grad():
        logits = predict_logits(model, x, device, batch_size)
    if len(x) == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0, model.num_classes)
    probs = torch.softmax(logits, dim=1)
    pred = logits.argmax(1)
    return pred, probs.gather(1, pred[:, None])[:, 0], logits


def nearest_prototype(model, x, protos: Prototypes, candidates, device, batch_size: int = 512):
    """(predictions, squared distance to the nearest prototype): argmin over ``candidates`` of
    FedProto's distance mean_k (z_k - p_ck)² on ``model.features``, as the client's proto-accuracy."""
    import torch

    from pollen.methods.prototype_losses import squared_distances

    model.eval()
    with torch.no_grad():
        chunks = [model.features(x[i:i + batch_size].to(device)) for i in range(0, len(x), batch_size)]
        z = torch.cat(chunks) if chunks else torch.zeros(0, model.feature_dim, device=device)
        cand = torch.as_tensor(candidates, dtype=torch.long, device=device)
        dist = squared_distances(z, protos.protos.to(device)[cand])
        best = dist.argmin(dim=1)
        return cand[best].cpu(), dist.gather(1, best[:, None])[:, 0].float().cpu()


def accuracy(pred, y, logits=None, top_k: int = 1) -> tuple[float, int, int] | None:
    """(accuracy, correct, labelled) over the labelled rows (y >= 0); with ``top_k`` > 1 (and the
    logits) a row is correct when its label is among the k largest logits, as FCCL's clients count."""
    mask = y >= 0
    n = int(mask.sum())
    if n == 0:
        return None
    if top_k > 1 and logits is not None:
        k = min(top_k, logits.shape[1])
        hits = (logits[mask].topk(k, dim=1).indices == y[mask][:, None]).any(dim=1)
    else:
        hits = pred[mask] == y[mask]
    correct = int(hits.sum())
    return correct / n, correct, n


def write_csv(path: Path | None, inputs: Inputs, pred, score) -> None:
    """Predictions as CSV (file,label,prediction,score) to ``path``, or to stdout when ``None``."""
    if path is None:
        _csv_rows(sys.stdout, inputs, pred, score)
        sys.stdout.flush()
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        _csv_rows(fh, inputs, pred, score)


def _csv_rows(fh, inputs: Inputs, pred, score) -> None:
    out = csv.writer(fh, lineterminator="\n")
    out.writerow(["file", "label", "prediction", "score"])
    for name, label, p, s in zip(inputs.names, inputs.y.tolist(), pred.tolist(), score.tolist()):
        out.writerow([name, "" if label < 0 else label, p, f"{s:.6g}"])


# ---------------------------------------------------------------------------------- CLI
DESCRIPTION = __doc__

EPILOG = """\
model (one of):
  --model PATH     a node's personal model: <state-dir>/final-model.safetensors, written after the last
                   round by clients of methods with a private model (local, fedproto, bd-fedproto, fccl…);
                   final-model.json beside it (method, task, model, width, classes, input, round,
                   partition-id, seed) says how to rebuild it. The run's task options come from --config,
                   or from <run>/config.json when the state folder is <run>/nodes/partition-<i> (the
                   simulation default); otherwise the defaults, the JSON's seed and --set are used.
  --run RUN_DIR    a weights-family run (fedavg, fedprox): RUN_DIR/final/global.safetensors, the global
                   model rebuilt from RUN_DIR/config.json (the task's default model unless 'model' is
                   set; width from 'model-width' / the profile). --model RUN_DIR/final/global.safetensors
                   does the same.
mode:
  classifier head (default), or with --prototypes PATH (a fedproto / bd-fedproto run's
  final/global.safetensors, or its run folder) nearest-prototype: the class whose global prototype is
  nearest to model.features(x) in FedProto's squared distance (mean over d), among the classes present
  in the file — on a task split, by default (--proto-classes auto) only the partition's own classes,
  which is what the client's "proto-accuracy" measures.
input (one of):
  --partition I [--num-partitions N] [--task NAME] [--split test|train]
                   partition I's split of the task (default: the model's task), built exactly as its
                   client builds it, from the run's seed and options; --partition defaults to the
                   personal model's partition-id, --num-partitions to what the model's JSON (or the
                   run folder's launch.json) records, else the task's fixed count.
  --data-dir DIR   a node's own data folder (tasks image-folder, array; docs/data.md): its test split
                   (or --split train), read and normalised exactly as a node with node config
                   data-dir=DIR reads it.
  --images DIR     image files (png, jpg, bmp, gif, tif, webp) in DIR (unlabelled) and in DIR/<class>/
                   (labelled; <class> is a class index 0..C-1 or a name from --class-names / the task's
                   known names). Images are converted to the model's channels (grey->RGB repeats,
                   RGB->grey BT.601 luma) and size (antialiased bilinear) and normalised with the
                   statistics of the task's training data (pollen.datasets.transforms.to_model_input);
                   office-home images are first decoded as its training files are (RGB, PIL bilinear
                   to 32x32, pollen.datasets.sources).
output:
  prints the accuracy over labelled inputs ("accuracy: A (correct/labelled)"; top-k with --top-k, by
  default for office-home whose clients report top-5) and the predictions as CSV rows on stdout
  (--out FILE writes them to FILE instead): file,label,prediction,score — score = softmax
  probability of the prediction (classifier) or the squared distance to the nearest prototype
  (prototypes; smaller is nearer). label is empty for unlabelled images; file is
  <task>/partition-<i>/<split>/<index> for a task split.
refused (exit code 2, naming the file and the mismatch):
  a file whose bytes changed since Pollen wrote it (its .sha256 sidecar, or the sha256 its JSON records),
  a file without its sidecar (unless --allow-unverified), a safetensors whose keys or shapes differ
  from the model its JSON / run config describes, a missing or unreadable JSON or config.json, a global
  state without a model (prototypes, logits, local runs), prototypes whose d differs from the model's
  feature_dim or whose class count or task differs, and bad usage or input (unknown task, partition out
  of range, missing data, unreadable images).
examples:
  pollen predict --model runs/7/nodes/partition-0/final-model.safetensors --partition 0 --num-partitions 3
  pollen predict --model state/final-model.safetensors --prototypes runs/7 --images my-digits/ --out p.csv
  pollen predict --run runs/12 --partition 2 --num-partitions 10 --data-root ~/data
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is 2 as well; keep its wording, add ours
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=Path, metavar="PATH",
                       help="a node's final-model.safetensors (its final-model.json beside it)")
    which.add_argument("--run", type=Path, metavar="RUN_DIR",
                       help="a fedavg/fedprox run folder: its final/global.safetensors + config.json")
    p.add_argument("--prototypes", type=Path, metavar="PATH",
                   help="a prototype run's final/global.safetensors (or run folder): nearest-prototype mode")
    p.add_argument("--proto-classes", choices=("auto", "partition", "present"), default="auto",
                   help="candidate classes in nearest-prototype mode: present = every class with a global "
                        "prototype; partition = those of the partition (as the client's proto-accuracy); "
                        "auto = partition for a task split, present for --images (default)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--images", type=Path, metavar="DIR", help="a folder of images, optionally in class subfolders")
    src.add_argument("--partition", type=int, metavar="I", help="classify partition I's split of the task")
    src.add_argument("--data-dir", metavar="DIR",
                     help="a node's own data folder (tasks image-folder, array): classify its split exactly as a "
                          "node with node config data-dir=DIR builds it (whole folder, its own normalisation)")
    p.add_argument("--task", metavar="NAME", help="task of the split / of the images' normalisation "
                                                  "(default: the model's task)")
    p.add_argument("--num-partitions", type=int, metavar="N", help="partitions the run's task was split into")
    p.add_argument("--split", choices=("test", "train"), default="test", help="which split (default test)")
    p.add_argument("--data-root", metavar="DIR", help="dataset root (default: run config, then $POLLEN_DATA_ROOT)")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="the run's config.json (or its run folder), for --model: task options and seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config key (e.g. --set shot-shots=12); repeatable")
    p.add_argument("--class-names", metavar="NAMES",
                   help="class names in index order, comma-separated or a file with one per line "
                        "(to label --images subfolders by name)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="count a prediction correct when the label is among the K largest logits (default: "
                        "the task's, as its clients report: 5 for office-home, else 1)")
    p.add_argument("--out", type=Path, metavar="FILE", help="write predictions as CSV (file,label,prediction,score)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = cuda when available (default)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="load a model, JSON or run config that has no .sha256 sidecar (refused by default, like a "
                        "changed byte: exit 2), with a warning; a file whose bytes do not match its sidecar or the "
                        "digest its JSON records is refused even then")
    return p


def _class_names(value: str | None) -> list[str] | None:
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise PredictError(f"--class-names {value!r}: no names")
    return names


def run(args: argparse.Namespace) -> int:
    import torch

    from pollen.datasets.tasks import TASKS
    from pollen.methods.training import pick_device

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
    except RuntimeError as err:
        raise PredictError(f"--device cuda: {err}") from err
    overrides = _parse_set(args.set)
    if args.run is not None:
        if args.config is not None:
            raise PredictError("--config is for --model; --run reads RUN_DIR/config.json")
        loaded = load_global_model(args.run, overrides, allow_unverified=args.allow_unverified)
    else:
        loaded = load_personal_model(args.model, args.config, overrides, allow_unverified=args.allow_unverified)
    protos = (load_prototypes(args.prototypes, loaded, allow_unverified=args.allow_unverified)
              if args.prototypes is not None else None)

    task_name = args.task or loaded.info["task"]
    if task_name not in TASKS:
        raise PredictError(f"--task {task_name!r}: unknown task; available: {', '.join(sorted(TASKS))}")
    if task_name != loaded.info["task"]:
        loaded.notes.append(f"note: the model was trained on task {loaded.info['task']!r}; classifying "
                            f"{task_name!r} data, normalised as that task's")
    if overrides:
        loaded.notes.append(f"run-config overrides (--set): {overrides}")
    if args.top_k is not None and args.top_k < 1:
        raise PredictError(f"--top-k {args.top_k}: must be >= 1")
    top_k = args.top_k or TASKS[task_name].top_k
    if args.top_k and args.top_k > 1 and args.prototypes is not None:
        raise PredictError("--top-k counts the classifier's k largest logits; it has no meaning with --prototypes")
    if args.images is not None:
        inputs = image_folder(args.images, task_name, loaded, _class_names(args.class_names))
    elif args.data_dir is not None:
        data_dir = str(Path(args.data_dir).expanduser().resolve())
        if not Path(data_dir).exists():
            raise PredictError(f"--data-dir {args.data_dir}: no such file or folder")
        if "class-names" not in loaded.info or task_name != loaded.info["task"]:
            raise PredictError(f"--data-dir is for models of the user-data tasks (image-folder, array); this one "
                               f"was trained on {loaded.info['task']!r}")
        pid = int(loaded.info.get("partition-id") or 0)
        inputs = task_split(loaded, task_name, pid, pid + 1, args.split, args.data_root, data_dir)
    else:
        partition: int | None = args.partition
        if partition is None:
            partition = loaded.info.get("partition-id")
        if partition is None:
            raise PredictError("give the input: --images DIR, or --partition I (with --num-partitions N)")
        spec = TASKS[task_name]
        saved = loaded.info.get("num-partitions") if task_name == loaded.info["task"] else None
        num = args.num_partitions or saved or spec.fixed_partitions
        if num is None:
            raise PredictError(f"--num-partitions is needed: into how many partitions was {task_name!r} split? "
                               f"({loaded.source} does not record it)")
        if args.num_partitions and saved and args.num_partitions != saved:
            loaded.notes.append(f"note: the run split {task_name!r} into {saved} partitions; classifying partition "
                                f"{partition} of {args.num_partitions} (--num-partitions)")
        if not 0 <= partition < num:
            raise PredictError(f"--partition {partition} is outside 0..{num - 1}")
        if loaded.info.get("partition-id") not in (None, partition):
            loaded.notes.append(f"note: the model is partition {loaded.info['partition-id']}'s, classifying "
                                f"partition {partition}")
        inputs = task_split(loaded, task_name, partition, num, args.split, args.data_root)

    model = loaded.model.to(device)
    info = loaded.info
    who = f", partition {info['partition-id']}" if "partition-id" in info else ""
    print(f"model: {loaded.name} (width {info.get('width')}, {model.num_classes} classes) from {loaded.source} "
          f"[method {info.get('method')}, task {info.get('task')}, round {info.get('round')}{who}]")
    for note in loaded.notes:
        print(note)
    print(f"input: {inputs.description}, {len(inputs.y)} samples")
    if protos is not None:
        present = torch.nonzero(protos.present).flatten().tolist()
        mode = args.proto_classes
        if mode == "auto":
            mode = "partition" if inputs.classes is not None else "present"
        if mode == "partition":
            if inputs.classes is None:
                raise PredictError("--proto-classes partition needs a task split (--partition), not --images")
            candidates = [c for c in inputs.classes if c in present]
            if not candidates:
                raise PredictError(f"{protos.source}: none of the partition's classes {list(inputs.classes)} "
                                   f"has a global prototype (present: {present})")
        else:
            candidates = present
        print(f"mode: nearest prototype ({protos.source}, round {protos.info.get('round')}); candidate classes "
              f"{candidates} ({mode})")
        pred, score = nearest_prototype(model, inputs.x, protos, candidates, device)
        logits, top_k = None, 1
    else:
        print("mode: classifier head")
        pred, score, logits = classify(model, inputs.x, device)
    acc = accuracy(pred, inputs.y, logits, top_k)
    label = "accuracy" if top_k == 1 else f"top-{top_k} accuracy"
    if acc is None:
        print(f"{label}: n/a (no labels)")
    else:
        print(f"{label}: {acc[0]:.8f} ({acc[1]}/{acc[2]})")
    if args.out is not None:
        write_csv(args.out, inputs, pred, score)
        print(f"predictions: {args.out} ({len(inputs.y)} rows)")
    else:
        print(f"predictions ({len(inputs.y)} rows, CSV; --out FILE writes them to a file instead):")
        write_csv(None, inputs, pred, score)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pollen.app.config import ConfigError
    from pollen.datasets.partition import PartitionError
    from pollen.datasets.sources import DatasetMissingError
    from pollen.datasets.tasks import TaskError
    from pollen.datasets.user_data import UserDataError

    try:
        return run(args)
    except PredictError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
    except (TaskError, ConfigError, PartitionError, DatasetMissingError, UserDataError) as err:
        print(f"{PROG}: error: {type(err).__name__}: {err}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
