"""What a task is: the options it reads, the data a client gets, its static facts, and the registry.

:data:`TASKS` is the one registry of every task, whatever its kind: a domain-per-client task or a
class-incremental stream is a :class:`TaskSpec` too, its kind's own facts hanging off it
(:class:`DomainFacts`, :class:`StreamFacts`), so a caller asks :func:`get_task` and no second table can
disagree with the first. Task modules (:mod:`pollen.datasets.tasks` for the partitioned datasets,
:mod:`~pollen.datasets.domain_tasks`, :mod:`~pollen.datasets.incremental`, :mod:`~pollen.datasets.user_tasks`)
build on this module and register their tasks here; none of them imports another, so the catalog has no
import circle (look tasks up through :mod:`pollen.datasets.tasks`, which imports every task module). They
import torch inside the functions that load or convert data, never at module level, so the catalog (names,
kinds, formats, sizes) imports without torch: the launcher and numpy-only ServerApps read it (issue 30:
start-up cost; ``tests/test_torch_free_imports.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.transforms import ImageFormat
from pollen.settings import NodeConfig, RunConfig, floats
from pollen.settings.common import PathKeys, RunKeys, TaskKeys, TrainingKeys, UserDataKeys

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TaskOptions:
    """The run-config values a task reads (hashable, so built data can be cached); :meth:`of` is the one
    mapping from a run config. Defaults are the keys' declared defaults (:mod:`pollen.settings.common`)."""

    data_root: str | None = None
    download: bool = PathKeys.download
    seed: int = RunKeys.seed
    dirichlet_alpha: float = TaskKeys.dirichlet_alpha
    ways: int = TaskKeys.shot_ways
    shots: int = TaskKeys.shot_shots
    stdev: int = TaskKeys.shot_stdev
    test_per_class: int = TaskKeys.shot_test_per_class
    shot_split: str = TaskKeys.shot_split  # "official": FedProto's own draw (n_way_k_shot's official_k_high)
    max_train_samples: int = TrainingKeys.max_train_samples  # 0 = no cap; otherwise cap each client's training set
    # user-data tasks (image-folder, array): see pollen.datasets.user_data
    data_dir: str | None = None  # run key data-dir: one folder split across the partitions
    node_data_dir: str | None = None  # node config data-dir: this node's own folder, used whole
    classes: tuple[str, ...] = ()  # agreed class names in index order; () = detect from data_dir
    test_fraction: float = UserDataKeys.test_fraction  # held out of train/ when the folder has no test/
    image_size: int = UserDataKeys.image_size  # 0 = detect from data_dir
    image_channels: int = UserDataKeys.image_channels  # 0 = detect from data_dir
    image_mean: tuple[float, ...] = ()  # () = the training images' own statistics
    image_std: tuple[float, ...] = ()
    data_split: str = UserDataKeys.data_split  # how data_dir is split across partitions: iid | dirichlet

    @classmethod
    def of(cls, cfg: RunConfig, node: NodeConfig | None = None) -> TaskOptions:
        """The options of run ``cfg`` as ``node`` sees them (its data root and own data folder, when it has them)."""
        return cls(
            data_root=(node.data_root if node is not None else None) or cfg.data_root, download=cfg.download,
            seed=cfg.seed, dirichlet_alpha=cfg.dirichlet_alpha, ways=cfg.shot_ways, shots=cfg.shot_shots,
            stdev=cfg.shot_stdev, test_per_class=cfg.shot_test_per_class, shot_split=cfg.shot_split,
            max_train_samples=cfg.max_train_samples, data_dir=cfg.data_dir or None,
            node_data_dir=node.data_dir if node is not None else None, classes=cfg.class_names,
            test_fraction=cfg.test_fraction, image_size=cfg.image_size, image_channels=cfg.image_channels,
            image_mean=floats(cfg.image_mean), image_std=floats(cfg.image_std), data_split=cfg.data_split)

    def without_user_data(self) -> TaskOptions:
        """These options with the user-data fields at their defaults: what a task other than the run's is
        built with (``pollen predict --task``), as the run's folder, classes and format describe its own data."""
        plain = TaskOptions()
        return replace(self, **{name: getattr(plain, name) for name in USER_DATA_FIELDS})


# The TaskOptions fields only the user-data tasks read (pollen.datasets.user_tasks).
USER_DATA_FIELDS = ("data_dir", "node_data_dir", "classes", "test_fraction", "image_size", "image_channels",
                    "image_mean", "image_std", "data_split")


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
    # Whether ``classes`` was read off the training labels (user data) rather than fixed by the task's
    # plan: a statistic of the dataset, which DP-SGD keeps out of every per-sample loss.
    classes_from_data: bool = False

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
class DomainFacts:
    """What a domain-per-client task adds to its spec: its domains, and the logit family's defaults on them."""

    names: tuple[str, ...]  # one per client, in partition order; () = the run's own folders (image-domains)
    train_sizes: tuple[int, ...]  # the paper's private training set per domain; () = every image
    public_default: str  # the public set X0 when run key fccl-public is empty
    loader: str = "digits"  # how a domain is read: "digits" (domains.load_domain) or "officehome" (sources)


@dataclass(frozen=True)
class StreamFacts:
    """What a class-incremental stream adds to its spec (its classes, format and model are the spec's)."""

    augment: bool = False  # GLFC's CIFAR pipeline: RandomCrop(32, 4), HFlip, ColorJitter(brightness 0.247)


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
    top_k: int = 1  # the accuracy its results report: top-1 (Office-Home: top-5, as the FCCL paper)
    domains: DomainFacts | None = None  # kind "domains" only
    stream: StreamFacts | None = None  # kind "class-incremental" only

    def domain_facts(self) -> DomainFacts:
        """The domains of this domain-per-client task; another kind is refused, naming the tasks that have them."""
        if self.domains is None:
            raise wrong_kind(self.name, "domains")
        return self.domains

    def model_for(self, partition_id: int) -> str:
        if self.partition_models:
            return self.partition_models[partition_id % len(self.partition_models)]
        return self.default_model


class TaskError(ValueError):
    """The task cannot be built with these options (sizes, partitions)."""


def cap_indices(indices: np.ndarray, cap: int, seed: int) -> np.ndarray:
    """At most ``cap`` of ``indices`` (0: all), a seeded draw kept in order."""
    if cap <= 0 or len(indices) <= cap:
        return indices
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(indices, size=cap, replace=False))


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
    if (spec.domains is not None) != (spec.kind == "domains"):
        raise ValueError(f"task {spec.name!r}: a domain-per-client task, and only one, has DomainFacts")
    if (spec.stream is not None) != (spec.kind == "class-incremental"):
        raise ValueError(f"task {spec.name!r}: a class-incremental task, and only one, has StreamFacts")
    TASKS[spec.name] = spec
    return spec


def get_task(name: str, kind: str | None = None) -> TaskSpec:
    """The registered task ``name``; with ``kind``, only a task of that kind (the error names those that are)."""
    spec = TASKS.get(name)
    if kind is not None and (spec is None or spec.kind != kind):
        raise wrong_kind(name, kind)
    if spec is None:
        raise TaskError(f"unknown task {name!r}; available tasks: {', '.join(sorted(TASKS))}")
    return spec


def wrong_kind(name: str, kind: str) -> TaskError:
    """Task ``name`` is not of ``kind``: the error that says which tasks are."""
    allowed = [n for n, t in TASKS.items() if t.kind == kind]
    return TaskError(f"task {name!r} is not {TASK_KINDS[kind][0]}; allowed: {', '.join(allowed)}")
