"""Named federated tasks: which data, split how, into what input format, with which default model.

A task maps ``(partition id, number of partitions)`` to the :class:`ClientData` that client holds.
Everything is derived from the run seed, so every process (Ray actor, SuperNode, test) that asks
for the same partition gets the same samples without any coordination. Results are cached per
process: a client serving many rounds converts its data to model input once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pollen.datasets.partition import PartitionError, dirichlet, iid, n_way_k_shot
from pollen.datasets.sources import ImageSet, load_source
from pollen.datasets.transforms import CIFAR10_FORMAT, MNIST_FORMAT, ImageFormat, to_model_input


@dataclass(frozen=True)
class TaskOptions:
    """The run-config values a task reads (hashable, so built data can be cached)."""

    data_root: str | None = None
    download: bool = False
    seed: int = 0
    dirichlet_alpha: float = 0.5
    ways: int = 3
    shots: int = 100
    stdev: int = 2
    test_per_class: int = 40
    shot_split: str = "pollen"  # "official": FedProto's own draw (n_way_k_shot's official_k_high)
    max_train_samples: int = 0  # 0 = no cap; otherwise cap each client's training set
    # user-data tasks (image-folder, array): see pollen.datasets.user_data
    data_dir: str | None = None  # run key data-dir: one folder split across the partitions
    node_data_dir: str | None = None  # node config data-dir: this node's own folder, used whole
    classes: tuple[str, ...] = ()  # agreed class names in index order; () = detect from data_dir
    test_fraction: float = 0.2  # held out of train/ when the folder has no test/
    image_size: int = 0  # 0 = detect from data_dir
    image_channels: int = 0  # 0 = detect from data_dir
    image_mean: tuple[float, ...] = ()  # () = the training images' own statistics
    image_std: tuple[float, ...] = ()
    data_split: str = "iid"  # how data_dir is split across partitions: iid | dirichlet


@dataclass(frozen=True)
class ClientData:
    """One client's data, already converted to normalised float model input."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    classes: tuple[int, ...]  # labels this client holds (all classes for homogeneous tasks)
    domain: str | None = None
    fmt: ImageFormat | None = None
    # Other test sets the client evaluates on (e.g. other domains), name -> (x, y).
    extra_tests: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])


# What a task is, so that a method can say which tasks it runs on (``MethodSpec.task_kinds``):
# kind -> (how messages name it, what it means).
TASK_KINDS = {
    "partitioned": ("a partitioned task", "one dataset split across any number of clients"),
    "domains": ("a domain-per-client task", "one domain per client, a fixed number of clients"),
    "class-incremental": ("a class-incremental stream", "clients and classes arrive task by task"),
}


@dataclass(frozen=True)
class TaskSpec:
    """Static facts about a task: enough to build models and validate sizes without loading data.

    ``build`` makes one client's :class:`ClientData`; a class-incremental stream has none (``None``):
    its clients read their data per task from the stream plan (:mod:`pollen.datasets.incremental`).
    """

    name: str
    description: str
    num_classes: int
    fmt: ImageFormat
    default_model: str
    needs_data_root: bool
    build: Callable[[TaskOptions, int, int], ClientData] | None
    kind: str = "partitioned"
    # Fixed number of clients the task is defined for (e.g. one per domain); None = any number.
    fixed_partitions: int | None = None
    # Default architecture per partition for heterogeneous tasks (cycled when shorter).
    partition_models: tuple[str, ...] = ()
    # Tasks whose classes and input format come from the run (user data): options -> the concrete spec.
    resolve: Callable[[TaskOptions], TaskSpec] | None = None
    class_names: tuple[str, ...] = ()  # names in index order, when the task knows them

    def model_for(self, partition_id: int) -> str:
        if self.partition_models:
            return self.partition_models[partition_id % len(self.partition_models)]
        return self.default_model


class TaskError(ValueError):
    """The task cannot be built with these options (sizes, partitions)."""


def _cap(indices: np.ndarray, cap: int, seed: int) -> np.ndarray:
    if cap <= 0 or len(indices) <= cap:
        return indices
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(indices, size=cap, replace=False))


def _as_data(train: ImageSet, test: ImageSet, fmt: ImageFormat, classes: tuple[int, ...],
             domain: str | None = None) -> ClientData:
    return ClientData(
        x_train=to_model_input(train.images, fmt),
        y_train=train.labels.clone(),
        x_test=to_model_input(test.images, fmt),
        y_test=test.labels.clone(),
        num_classes=train.num_classes,
        classes=classes,
        domain=domain,
        fmt=fmt,
    )


def _dirichlet_task(source: str, fmt: ImageFormat) -> Callable[[TaskOptions, int, int], ClientData]:
    """Homogeneous label skew: Dirichlet(alpha) over the training set, IID shares of the test set.

    The test set is split IID so that the sample-weighted mean of per-client accuracies of one global
    model equals its accuracy on the whole test set.
    """

    def build(opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
        train = load_source(source, opts.data_root, "train", download=opts.download)
        test = load_source(source, opts.data_root, "test", download=opts.download)
        parts, test_parts = _dirichlet_splits(source, opts, num_partitions)
        mine = _cap(parts[partition_id], opts.max_train_samples, opts.seed + partition_id)
        test_part = test_parts[partition_id]
        classes = tuple(range(train.num_classes))
        return _as_data(train.subset(mine), test.subset(test_part), fmt, classes)

    return build


def _shot_task(source: str, fmt: ImageFormat) -> Callable[[TaskOptions, int, int], ClientData]:
    """FedProto's N-way K-shot split: each client holds a few classes with ~K samples each."""

    def build(opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
        split = _shot_splits(source, opts, num_partitions)[partition_id]
        train = load_source(source, opts.data_root, "train", download=opts.download)
        test = load_source(source, opts.data_root, "test", download=opts.download)
        return _as_data(train.subset(split.train), test.subset(split.test), fmt, split.classes)

    return build


@functools.lru_cache(maxsize=8)
def _dirichlet_splits(source: str, opts: TaskOptions, num_partitions: int):
    """All clients' train (Dirichlet) and test (IID) indices, drawn once per process and setting: a
    client's data must not cost a redraw of the whole population (O(N) per message, O(N²) per round)."""
    train = load_source(source, opts.data_root, "train", download=opts.download)
    test = load_source(source, opts.data_root, "test", download=opts.download)
    try:
        parts = dirichlet(train.labels.numpy(), num_partitions, opts.dirichlet_alpha, opts.seed)
    except PartitionError as err:
        raise TaskError(f"task cannot split {source} into {num_partitions} clients: {err}") from err
    return parts, iid(len(test), num_partitions, opts.seed)


@functools.lru_cache(maxsize=8)
def _shot_splits(source: str, opts: TaskOptions, num_partitions: int):
    train = load_source(source, opts.data_root, "train", download=opts.download)
    test = load_source(source, opts.data_root, "test", download=opts.download)
    try:
        k_high = None
        if opts.shot_split == "official":  # the code's exclusive bound of k: MNIST shots+stdev-1, else +1
            k_high = opts.shots + opts.stdev + (-1 if source == "mnist" else 1)
        return n_way_k_shot(train.labels.numpy(), test.labels.numpy(), num_partitions, opts.ways,
                            opts.shots, opts.stdev, opts.test_per_class, train.num_classes, opts.seed,
                            official_k_high=k_high)
    except PartitionError as err:
        raise TaskError(f"task cannot split {source} {opts.ways}-way {opts.shots}-shot (stdev "
                        f"{opts.stdev}) over {num_partitions} clients: {err}") from err


# Fashion-MNIST's own statistics (the format declared is the one its data is normalised with).
FMNIST_FORMAT = ImageFormat(1, 28, (0.2860,), (0.3530,))
# UCI digits are 8x8; upsampled to 28x28 so the same MNIST CNN serves both.
UCI_FORMAT = ImageFormat(channels=1, size=28, mean=(0.305,), std=(0.32,))
# One architecture per domain client, by partition (the FCCL paper's Digits assignment).
DOMAIN_MODELS = ("resnet10", "resnet12", "efficientnet_b0", "mobilenet_v2")

TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add a task to the registry (method modules may register their own tasks); a name is taken once."""
    if spec.name in TASKS:
        raise ValueError(f"task {spec.name!r} is already registered")
    if spec.kind not in TASK_KINDS:
        raise ValueError(f"task {spec.name!r} has kind {spec.kind!r}; kinds: {', '.join(TASK_KINDS)}")
    if spec.build is None and spec.kind != "class-incremental":
        raise ValueError(f"task {spec.name!r}: a {spec.kind} task needs a build function")
    if spec.build is not None and spec.kind == "class-incremental":
        raise ValueError(f"task {spec.name!r}: a class-incremental task takes its data from the stream plan, "
                         "not from a build function")
    TASKS[spec.name] = spec
    return spec


register_task(TaskSpec(
    name="uci-dirichlet",
    description="UCI handwritten digits (embedded in scikit-learn, 8x8), Dirichlet label skew; "
                "needs no files — the default task",
    num_classes=10, fmt=UCI_FORMAT, default_model="cnn_mnist", needs_data_root=False,
    build=_dirichlet_task("uci_digits", UCI_FORMAT)))
register_task(TaskSpec(
    name="mnist-dirichlet", description="MNIST, Dirichlet label skew (needs data-root)",
    num_classes=10, fmt=MNIST_FORMAT, default_model="cnn_mnist", needs_data_root=True,
    build=_dirichlet_task("mnist", MNIST_FORMAT)))
register_task(TaskSpec(
    name="fmnist-dirichlet", description="Fashion-MNIST, Dirichlet label skew (needs data-root)",
    num_classes=10, fmt=FMNIST_FORMAT, default_model="cnn_mnist", needs_data_root=True,
    build=_dirichlet_task("fashion_mnist", FMNIST_FORMAT)))
register_task(TaskSpec(
    name="mnist-shot", description="FedProto MNIST: N-way K-shot with stdev (needs data-root)",
    num_classes=10, fmt=MNIST_FORMAT, default_model="cnn_mnist", needs_data_root=True,
    build=_shot_task("mnist", MNIST_FORMAT)))
register_task(TaskSpec(
    name="cifar10-shot", description="FedProto CIFAR-10: N-way K-shot, ResNet-18 (needs data-root)",
    num_classes=10, fmt=CIFAR10_FORMAT, default_model="resnet18", needs_data_root=True,
    build=_shot_task("cifar10", CIFAR10_FORMAT)))


register_task(TaskSpec(
    name="fmnist-shot", description="Fashion-MNIST: FedProto's N-way K-shot with stdev (needs data-root)",
    num_classes=10, fmt=FMNIST_FORMAT, default_model="cnn_mnist", needs_data_root=True,
    build=_shot_task("fashion_mnist", FMNIST_FORMAT)))


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; available tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def resolve_task(name: str, opts: TaskOptions | None) -> TaskSpec:
    """The task's spec with classes and input format fixed for these options (user-data tasks take
    them from the run config or detect them); other tasks' specs are static and returned as they are."""
    spec = get_task(name)
    if spec.resolve is None or opts is None:
        return spec
    return spec.resolve(opts)


@functools.lru_cache(maxsize=4)
def build_client_data(task: str, opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
    """The data of one client (cached per process; callers must not modify the tensors)."""
    spec = get_task(task)
    if spec.fixed_partitions is not None and num_partitions != spec.fixed_partitions:
        raise TaskError(f"task {task!r} is defined for exactly {spec.fixed_partitions} clients "
                        f"(one per domain), got num-partitions = {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise TaskError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
    if spec.build is None:
        name, meaning = TASK_KINDS[spec.kind]
        raise TaskError(f"task {task!r} is {name} ({meaning}): its clients read their data per task from "
                        "the stream plan; run it with a class-incremental method (README's methods table)")
    return spec.build(opts, partition_id, num_partitions)

from pollen.datasets import (
    domain_tasks,  # noqa: E402,F401  (registers digits-offline, digits, office-home)
    incremental,  # noqa: E402,F401  (registers mnist-fmnist-cil, uci-digits-cil, cifar100-cil)
    user_tasks,  # noqa: E402,F401  (registers image-folder, array)
)
