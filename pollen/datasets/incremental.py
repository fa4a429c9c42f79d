"""Class-incremental federated streams (GLFC's setting): tasks of new classes, a growing population.

A stream has ``T`` tasks of ``s`` classes each; task t holds stream labels ``[t·s, (t+1)·s)``. The
population starts with ``initial_clients`` clients and grows by ``new_clients`` at every new task:

* ``S_n`` — the new clients of task t (ids continue after the existing ones);
* ``S_b`` — a random ``1 - old_fraction`` of the existing clients, who receive new classes;
* ``S_o`` — the other existing clients, who keep their previous classes.

Each client in ``S_n``/``S_b`` draws ``round(class_fraction · s)`` of the task's classes. By default
(ours) the images of a class are split into disjoint shards among the clients that drew it; with
``duplicate = True`` every such client gets all of them, as the official code does.

Everything is a pure function of the :class:`StreamConfig` (seeded), so the server (which samples
only the clients that exist at the current task) and every client compute the same plan without
talking. A client learns its identity from its node config (``partition-id``); partition ``i`` is
stream client ``i``. Flower's simulation has a fixed number of SuperNodes: start it with
:meth:`StreamPlan.num_clients` (the final population); the partitions of clients that have not joined
yet are simply never sampled.

The tasks registered here (``mnist-fmnist-cil``, ``cifar100-cil``, and ``uci-digits-cil`` which needs no
files) are only meaningful for the GLFC
family of methods, whose clients read their data through :func:`client_task_data` (the generic
:class:`~pollen.datasets.tasks.ClientData` of one fixed training set does not describe a stream).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pollen.datasets.sources import ImageSet, load_source
from pollen.datasets.spec import UCI_FORMAT, StreamFacts, TaskError, TaskSpec, get_task, register_task
from pollen.datasets.transforms import CIFAR100_FORMAT, ImageFormat, to_model_input

if TYPE_CHECKING:
    import torch

GROUPS = ("new", "b", "o")  # S_n, S_b, S_o


# The orders a stream can give its classes: by label, or shuffled by the run seed.
CLASS_ORDERS = ("label", "shuffled")


class StreamError(ValueError):
    """The stream configuration is impossible (sizes, fractions, class counts)."""


@dataclass(frozen=True)
class StreamConfig:
    """Sizes and randomness of a class-incremental stream (see the module docstring); no defaults here:
    the run keys ``glfc-…`` (``pollen.methods.glfc_settings.GlfcOptions``) declare them."""

    num_tasks: int
    classes_per_task: int
    initial_clients: int
    new_clients: int
    old_fraction: float
    class_fraction: float
    duplicate: bool
    max_per_class: int  # cap on one client's images of one class (0 = no cap)
    seed: int

    def __post_init__(self) -> None:
        for name in ("num_tasks", "classes_per_task", "initial_clients"):
            if getattr(self, name) < 1:
                raise StreamError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.new_clients < 0 or self.max_per_class < 0:
            raise StreamError(f"new_clients and max_per_class must be >= 0, got {self.new_clients}, "
                              f"{self.max_per_class}")
        if not 0.0 <= self.old_fraction < 1.0:
            raise StreamError(f"old_fraction must be in [0, 1), got {self.old_fraction}")
        if not 0.0 < self.class_fraction <= 1.0:
            raise StreamError(f"class_fraction must be in (0, 1], got {self.class_fraction}")

    @property
    def total_classes(self) -> int:
        return self.num_tasks * self.classes_per_task

    @property
    def classes_per_client(self) -> int:
        return max(1, int(round(self.class_fraction * self.classes_per_task)))


@dataclass(frozen=True)
class StreamPlan:
    """Who exists at each task, in which group, holding which classes."""

    config: StreamConfig
    population: tuple[int, ...]  # number of clients at task t
    groups: tuple[dict[str, tuple[int, ...]], ...]  # task -> {"new"|"b"|"o": client ids}
    classes: tuple[dict[int, tuple[int, ...]], ...]  # task -> client -> its current classes

    @property
    def num_clients(self) -> int:
        """The final population (how many SuperNodes / partitions a run needs)."""
        return self.population[-1]

    def active_clients(self, task: int) -> range:
        return range(self.population[self._task(task)])

    def task_classes(self, task: int) -> tuple[int, ...]:
        s = self.config.classes_per_task
        t = self._task(task)
        return tuple(range(t * s, (t + 1) * s))

    def seen_classes(self, task: int) -> int:
        return (self._task(task) + 1) * self.config.classes_per_task

    def client_classes(self, client: int, task: int) -> tuple[int, ...]:
        """Current classes of ``client`` at ``task`` (empty when it has not joined yet)."""
        return self.classes[self._task(task)].get(int(client), ())

    def group_of(self, client: int, task: int) -> str | None:
        for name, ids in self.groups[self._task(task)].items():
            if client in ids:
                return name
        return None

    def holders(self, cls: int) -> tuple[int, ...]:
        """Clients that drew ``cls`` when its task arrived (the owners of its shards)."""
        t = cls // self.config.classes_per_task
        return tuple(sorted(c for c in self.groups[t]["new"] + self.groups[t]["b"]
                            if cls in self.classes[t][c]))

    def _task(self, task: int) -> int:
        if not 0 <= task < self.config.num_tasks:
            raise StreamError(f"task {task} outside 0..{self.config.num_tasks - 1}")
        return task


def plan_stream(cfg: StreamConfig) -> StreamPlan:
    """The seeded population and class draws of every task."""
    rng = np.random.default_rng([cfg.seed, 0xC1A55])
    k = cfg.classes_per_client
    population, groups, classes = [], [], []
    current: dict[int, tuple[int, ...]] = {}
    n = 0
    for t in range(cfg.num_tasks):
        task_cls = np.arange(t * cfg.classes_per_task, (t + 1) * cfg.classes_per_task)
        if t == 0:
            new = list(range(cfg.initial_clients))
            b: list[int] = []
            o: list[int] = []
        else:
            new = list(range(n, n + cfg.new_clients))
            n_b = int(n * (1.0 - cfg.old_fraction))
            b = sorted(int(c) for c in rng.choice(n, size=n_b, replace=False))
            o = [c for c in range(n) if c not in set(b)]
        n += len(new)
        for c in sorted(new + b):
            current[c] = tuple(sorted(int(x) for x in rng.choice(task_cls, size=k, replace=False)))
        population.append(n)
        groups.append({"new": tuple(new), "b": tuple(b), "o": tuple(o)})
        classes.append(dict(current))
    return StreamPlan(cfg, tuple(population), tuple(groups), tuple(classes))


def shard_indices(plan: StreamPlan, labels: np.ndarray, client: int, cls: int) -> np.ndarray:
    """Indices (into ``labels``) of ``client``'s images of class ``cls``; empty if it never drew it."""
    holders = plan.holders(cls)
    if client not in holders:
        return np.zeros(0, dtype=np.int64)
    idx = np.flatnonzero(np.asarray(labels) == cls)
    rng = np.random.default_rng([plan.config.seed, 0x5EED, int(cls)])
    idx = idx[rng.permutation(len(idx))]
    if not plan.config.duplicate:
        idx = np.array_split(idx, len(holders))[holders.index(client)]
    if plan.config.max_per_class:
        idx = idx[: plan.config.max_per_class]
    return np.sort(idx).astype(np.int64)


def client_task_indices(plan: StreamPlan, labels: np.ndarray, client: int, task: int) -> np.ndarray:
    """All of ``client``'s training indices for its current classes at ``task``."""
    parts = [shard_indices(plan, labels, client, c) for c in plan.client_classes(client, task)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# the streams: their specs in the one registry, and their image pools


# MNIST digits are stream classes 0-9, Fashion-MNIST items 10-19; statistics of the 120k union.
MNIST_FMNIST_FORMAT = ImageFormat(1, 28, (0.2084,), (0.3403,))


def _register(name: str, description: str, num_classes: int, fmt: ImageFormat, augment: bool = False,
              needs_data_root: bool = True) -> None:
    """A stream's spec: no build function (its clients read the stream plan), ResNet-18 by default."""
    register_task(TaskSpec(name=name, description=description, num_classes=num_classes, fmt=fmt,
                           default_model="resnet18", needs_data_root=needs_data_root, build=None,
                           kind="class-incremental", stream=StreamFacts(augment=augment)))


_register("mnist-fmnist-cil", "Class-incremental MNIST (classes 0-9) + Fashion-MNIST (10-19), for the GLFC family "
                              "(needs data-root)", 20, MNIST_FMNIST_FORMAT)
_register("uci-digits-cil", "Class-incremental UCI digits (embedded in scikit-learn, 8x8 upsampled to 28x28), for "
                            "the GLFC family; needs no files (tests, demos)", 10, UCI_FORMAT, needs_data_root=False)
_register("cifar100-cil", "Class-incremental CIFAR-100 (GLFC's setting), for the GLFC family (needs data-root)",
          100, CIFAR100_FORMAT, augment=True)


def load_stream_images(name: str, root: str | None, split: str, download: bool = False) -> ImageSet:
    """The whole pool of one split with stream labels (cached by :func:`load_source` per part)."""
    import torch
    if name == "mnist-fmnist-cil":
        a = load_source("mnist", root, split, download=download)
        b = load_source("fashion_mnist", root, split, download=download)
        return ImageSet(torch.cat([a.images, b.images]), torch.cat([a.labels, b.labels + 10]), 20, name)
    if name == "cifar100-cil":
        s = load_source("cifar100", root, split, download=download)
        return ImageSet(s.images, s.labels, 100, name)
    if name == "uci-digits-cil":
        s = load_source("uci_digits", None, split)
        return ImageSet(s.images, s.labels, 10, name)
    get_task(name, "class-incremental")  # another task: refused, naming the streams
    raise TaskError(f"class-incremental task {name!r} has no image pool in load_stream_images")


def class_permutation(num_classes: int, order: str, seed: int) -> np.ndarray:
    """``perm[k]`` = the source label that stream class k stands for (``label`` order or seeded ``shuffled``)."""
    if order == CLASS_ORDERS[0]:
        return np.arange(num_classes)
    if order == CLASS_ORDERS[1]:
        return np.random.default_rng([seed, 0x0DE7]).permutation(num_classes)
    raise StreamError(f"class order must be 'label' or 'shuffled', got {order!r}")


@dataclass(frozen=True, eq=False)
class StreamData:
    """One split: uint8 images (N×C×H×W, shared, read-only), stream labels (N), the model input format.

    Pixels stay uint8 until selected, so a client process holds its own few images as float, not the pool.
    """

    images: torch.Tensor
    y: torch.Tensor
    fmt: ImageFormat

    def select(self, idx: np.ndarray | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised model input and labels of the samples at ``idx``."""
        import torch
        t = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return to_model_input(self.images[t], self.fmt), self.y[t]


@functools.lru_cache(maxsize=4)
def stream_data(name: str, root: str | None, split: str, order: str = "label", seed: int = 0,
                download: bool = False) -> StreamData:
    """A split with labels remapped to the stream order (cached per process)."""
    import torch
    src = get_task(name, "class-incremental")
    pool = load_stream_images(name, root, split, download)
    perm = class_permutation(src.num_classes, order, seed)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    labels = torch.as_tensor(inverse)[pool.labels]
    return StreamData(pool.images, labels, src.fmt)


def client_task_data(name: str, plan: StreamPlan, root: str | None, client: int, task: int,
                     order: str = "label", download: bool = False) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(x, y, indices into the train split) of ``client``'s current classes at ``task``."""
    train = stream_data(name, root, "train", order, plan.config.seed, download)
    idx = client_task_indices(plan, train.y.numpy(), client, task)
    x, y = train.select(idx)
    return x, y, idx

