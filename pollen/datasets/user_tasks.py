"""The user-data tasks, ``image-folder``, ``array`` and ``image-domains`` (readers in
:mod:`pollen.datasets.user_data`).

Where a client's data comes from:

* node config ``data-dir`` set: that folder is this node's data, used whole (no partitioning) — a
  fleet where every SuperNode trains and tests on its own files;
* otherwise run key ``data-dir``: one folder split across the partitions (``data-split`` = iid or
  dirichlet, its test set IID), so a whole federation can be tried on one machine.

``image-domains`` (the logit methods: FCCL, FedMD, FedDF, SOLO) is one image folder per *domain*:

* node config ``data-dir`` set: that folder is this node's domain (its name is the folder's), and the
  node tests on it alone — the other domains' test images never reach it, so only intra-domain
  accuracy is measured;
* otherwise run key ``data-dir`` holds one sub-folder per domain (sorted by name), partition ``i``
  trains on the ``i``-th, and tests on every domain (intra- and inter-domain accuracy), so the run
  needs exactly as many clients as there are sub-folders.

Classes and the model's input (side, channels) must be the same on every node and on the server,
which builds the model before any node has read a file: they come from the run keys ``classes``,
``image-size``, ``image-channels``, or are detected from the run key ``data-dir``. Normalisation
(``image-mean``/``image-std``) is data, not model: when not given, each data folder is normalised with
its own training images' statistics, recorded in the client's ``ClientData.fmt`` and in its
``final-model.json``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.partition import PartitionError, dirichlet, iid
from pollen.datasets.public import PUBLIC_FOLDER
from pollen.datasets.sources import ImageSet
from pollen.datasets.spec import (
    DOMAIN_MODELS,
    ClientData,
    DomainFacts,
    TaskError,
    TaskOptions,
    TaskSpec,
    cap_indices,
    register_task,
)
from pollen.datasets.transforms import ImageFormat, to_model_input
from pollen.datasets.user_data import (
    UserDataError,
    holdout,
    peek_arrays,
    peek_image_folder,
    read_arrays,
    read_image_folder,
)
from pollen.settings import declared_keys
from pollen.settings.common import UserDataKeys

if TYPE_CHECKING:
    import torch

USER_TASKS = ("image-folder", "array", "image-domains")
# Run keys only the user-data tasks read (refused with other tasks when set away from their defaults).
USER_KEYS = tuple(declared_keys(UserDataKeys))
# Placeholder format of the unresolved spec; resolve_task gives the real one.
_UNRESOLVED = ImageFormat(1, 1, (0.0,), (1.0,))


def _detect(name: str, opts: TaskOptions) -> tuple[tuple[str, ...], int, int]:
    """(classes, side, channels): the run's values, the gaps filled from the run key ``data-dir``."""
    classes, size, channels = opts.classes, opts.image_size, opts.image_channels
    if classes and size and channels:
        return classes, size, channels
    if not opts.data_dir:
        missing = [k for k, v in (("classes", classes), ("image-size", size), ("image-channels", channels)) if not v]
        raise TaskError(f"task {name!r}: run key(s) {missing} are empty and there is no run key 'data-dir' to "
                        "detect them from; every node and the server must agree on them, so set them in the run "
                        "config (nodes with their own folders: node config 'data-dir')")
    if name == "image-domains":
        info = peek_image_folder(domain_folders(opts.data_dir)[0])
        found, h, w, c = info.classes, info.height, info.width, info.channels
    elif name == "image-folder":
        info = peek_image_folder(opts.data_dir)
        found, h, w, c = info.classes, info.height, info.width, info.channels
    else:
        k, h, w, c = peek_arrays(opts.data_dir)
        found = tuple(str(i) for i in range(k))
    return classes or found, size or max(h, w), channels or c


@functools.lru_cache(maxsize=16)
def _resolve(name: str, opts: TaskOptions) -> TaskSpec:
    classes, size, channels = _detect(name, opts)
    for key, values in (("image-mean", opts.image_mean), ("image-std", opts.image_std)):
        if values and len(values) != channels:
            raise TaskError(f"run key {key!r} lists {len(values)} value(s) for {channels}-channel input "
                            "(image-channels): give one per channel")
    fmt = ImageFormat(channels, size, opts.image_mean or (0.0,) * channels, opts.image_std or (1.0,) * channels)
    fixed = len(domain_folders(opts.data_dir)) if name == "image-domains" and opts.data_dir else None
    return replace(USER_SPECS[name], num_classes=len(classes), fmt=fmt, class_names=classes, resolve=None,
                   fixed_partitions=fixed)


def domain_folders(data_dir: str) -> list[str]:
    """The domain sub-folders of the run key ``data-dir`` (task image-domains), sorted by name."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UserDataError(f"data folder {data_dir!r} not found (task image-domains expects "
                            f"{data_dir}/<domain>/train/<class>/*.png)")
    found = sorted(str(p) for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise UserDataError(f"{data_dir}: no domain folders (task image-domains expects "
                            f"{data_dir}/<domain>/train/<class>/*.png, one sub-folder per domain)")
    return found


def _resolver(name: str) -> Callable[[TaskOptions], TaskSpec]:
    def resolve(opts: TaskOptions) -> TaskSpec:
        try:
            return _resolve(name, opts)
        except UserDataError as err:
            raise TaskError(f"task {name!r}: {err}") from err
    return resolve


def _statistics(images: torch.Tensor, channels: int, size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of the images as the model sees them (after channel/size conversion)."""
    x = to_model_input(images, ImageFormat(channels, size, (0.0,) * channels, (1.0,) * channels))
    mean = x.mean(dim=(0, 2, 3)).tolist()
    std = x.std(dim=(0, 2, 3), unbiased=False).clamp_min(1e-3).tolist()
    return tuple(round(v, 6) for v in mean), tuple(round(v, 6) for v in std)


def _data_format(fmt: ImageFormat, train: ImageSet, opts: TaskOptions) -> ImageFormat:
    """The run's normalisation, its gaps filled with this folder's own training statistics."""
    if opts.image_mean and opts.image_std:
        return fmt
    mean, std = _statistics(train.images, fmt.channels, fmt.size)
    return ImageFormat(fmt.channels, fmt.size, opts.image_mean or mean, opts.image_std or std)


def _read(name: str, path: str, spec: TaskSpec, opts: TaskOptions) -> tuple[ImageSet, ImageSet]:
    if name in ("image-folder", "image-domains"):
        train, test = read_image_folder(str(path), spec.class_names)
    else:
        train, test = read_arrays(str(path), spec.num_classes)
    if test is None:
        keep, held = holdout(train.labels.numpy(), opts.test_fraction, opts.seed)
        if len(held) == 0:
            raise UserDataError(f"{path}: no test data: add a test split ('test/' folder or test.npz) or set run "
                                "key 'test-fraction' > 0")
        train, test = train.subset(keep), train.subset(held)
    return train, test


def _build(name: str) -> Callable[[TaskOptions, int, int], ClientData]:
    def build(opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
        spec = _resolver(name)(opts)
        path = opts.node_data_dir or opts.data_dir
        if not path:
            raise TaskError(f"task {name!r} reads your data: set run key 'data-dir' (one folder split across "
                            "the partitions) or node config 'data-dir' (this node's own folder)")
        try:
            train, test = _read(name, path, spec, opts)
        except UserDataError as err:
            raise TaskError(f"task {name!r}: {err}") from err
        fmt = _data_format(spec.fmt, train, opts)
        if opts.node_data_dir:  # the node's own folder: all of it
            mine, test_part = np.arange(len(train)), np.arange(len(test))
        else:
            try:
                if opts.data_split == "dirichlet":
                    parts = dirichlet(train.labels.numpy(), num_partitions, opts.dirichlet_alpha, opts.seed)
                else:
                    parts = iid(len(train), num_partitions, opts.seed)
                test_part = iid(len(test), num_partitions, opts.seed)[partition_id]
            except PartitionError as err:
                raise TaskError(f"task {name!r} cannot split {path} ({len(train)} training and {len(test)} test "
                                f"samples) into {num_partitions} partitions: {err}") from err
            mine = parts[partition_id]
        mine = cap_indices(mine, opts.max_train_samples, opts.seed + partition_id)
        x_train, x_test = train.subset(mine), test.subset(test_part)
        held = tuple(int(c) for c in np.unique(x_train.labels.numpy()))
        return ClientData(x_train=to_model_input(x_train.images, fmt), y_train=x_train.labels.clone(),
                          x_test=to_model_input(x_test.images, fmt), y_test=x_test.labels.clone(),
                          num_classes=spec.num_classes, classes=held, fmt=fmt, classes_from_data=True)
    return build


def _build_domains(opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
    """Partition ``partition_id``'s domain: its own folder whole, plus (run key ``data-dir`` only) the
    other domains' test sets for inter-domain accuracy, normalised as this node's own data."""
    spec = _resolver("image-domains")(opts)
    try:
        if opts.node_data_dir:
            own, others = opts.node_data_dir, []
        elif opts.data_dir:
            folders = domain_folders(opts.data_dir)
            if num_partitions != len(folders):
                raise TaskError(f"task 'image-domains' has one client per domain: {opts.data_dir} holds "
                                f"{len(folders)} domain folder(s), so num-partitions must be {len(folders)}, "
                                f"got {num_partitions}")
            own, others = folders[partition_id], [f for i, f in enumerate(folders) if i != partition_id]
        else:
            raise TaskError("task 'image-domains' reads your data: set node config 'data-dir' (this node's "
                            "domain folder) or run key 'data-dir' (one sub-folder per domain)")
        train, test = _read("image-domains", own, spec, opts)
        other_tests = {Path(f).name: _read("image-domains", f, spec, opts)[1] for f in others}
    except UserDataError as err:
        raise TaskError(f"task 'image-domains': {err}") from err
    fmt = _data_format(spec.fmt, train, opts)
    train = train.subset(cap_indices(np.arange(len(train)), opts.max_train_samples, opts.seed + partition_id))
    return ClientData(x_train=to_model_input(train.images, fmt), y_train=train.labels.clone(),
                      x_test=to_model_input(test.images, fmt), y_test=test.labels.clone(),
                      num_classes=spec.num_classes, classes=tuple(range(spec.num_classes)), domain=Path(own).name,
                      fmt=fmt, extra_tests={name: (to_model_input(t.images, fmt), t.labels.clone())
                                            for name, t in other_tests.items()})


USER_SPECS: dict[str, TaskSpec] = {}
for _name, _description in (
        ("image-folder", "your images: <data-dir>/train/<class>/*.png|jpg (+ optional test/); classes, size and "
                         "channels from run keys or detected (docs/data.md)"),
        ("array", "your arrays: <data-dir>/train.npz (+ optional test.npz) or one .npz with 'x' and 'y' "
                  "(docs/data.md)")):
    USER_SPECS[_name] = register_task(TaskSpec(
        name=_name, description=_description, num_classes=0, fmt=_UNRESOLVED, default_model="cnn_mnist",
        needs_data_root=False, build=_build(_name), resolve=_resolver(_name)))
USER_SPECS["image-domains"] = register_task(TaskSpec(
    name="image-domains", description="your domains, one image folder per client: node config data-dir, or "
                                      "run key data-dir with one sub-folder per domain; public set: a folder "
                                      "of unlabeled images (docs/data.md)",
    num_classes=0, fmt=_UNRESOLVED, default_model="resnet10", needs_data_root=False, build=_build_domains,
    resolve=_resolver("image-domains"), partition_models=DOMAIN_MODELS, kind="domains",
    # as many domains as folders, every image of each, a public folder of your own
    domains=DomainFacts(names=(), train_sizes=(), public_default=PUBLIC_FOLDER)))
