"""Named federated tasks: which data, split how, into what input format, with which default model.

A task maps ``(partition id, number of partitions)`` to the :class:`ClientData` that client holds.
Everything is derived from the run seed, so every process (Ray actor, SuperNode, test) that asks
for the same partition gets the same samples without any coordination. Results are cached per
process: a client serving many rounds converts its data to model input once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from pollen.datasets.partition import PartitionError, dirichlet, iid, n_way_k_shot
from pollen.datasets.sources import ImageSet, load_source
from pollen.datasets.spec import (  # the task abstraction, also offered from here, the catalog's face
    TASK_KINDS,
    TASKS,  # noqa: F401  (the registry, offered here with every task registered)
    UCI_FORMAT,
    ClientData,
    TaskError,
    TaskOptions,
    TaskSpec,
    cap_indices,
    get_task,
    register_task,
)
from pollen.datasets.transforms import CIFAR10_FORMAT, MNIST_FORMAT, ImageFormat, to_model_input


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
        mine = cap_indices(parts[partition_id], opts.max_train_samples, opts.seed + partition_id)
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


def partition_data(task: str, opts: TaskOptions, partition_id: int, num_partitions: int,
                   train_sizes: tuple[int, ...] | None = None, test_size: int = 0) -> ClientData:
    """How one partition's data are built, for every task that has partitions (not the class-incremental
    streams): the one answer that a client and ``pollen predict`` both ask, so a saved model is judged on
    the very tensors its client trained and evaluated on.

    ``train_sizes`` (one per domain) and ``test_size`` (0 = the whole test split) are the built-in domain
    tasks' sizes, as a method that runs on them settles (the logit family's ``fccl-train-sizes``,
    ``fccl-test-size`` and profile); ``None`` / 0 keep the task's own. Tasks without built-in domains have
    no such sizes: ``test_size`` is then not read (a caller that resolved it for every task may pass it
    regardless), and ``train_sizes`` must be ``None`` or empty, or :class:`TaskError` says so.
    """
    domains = get_task(task).domains
    if domains is not None and domains.names:  # built-in domains (not image-domains: the run's folders)
        if train_sizes is None and not test_size:
            return build_client_data(task, opts, partition_id, num_partitions)
        return domain_tasks.domain_client_data(task, opts, partition_id, num_partitions,
                                               None if train_sizes is None else tuple(train_sizes), test_size)
    if train_sizes:
        raise TaskError(f"task {task!r} has no built-in domains, so no per-domain training sizes; got {train_sizes}")
    return build_client_data(task, opts, partition_id, num_partitions)


from pollen.datasets import (
    domain_tasks,  # noqa: E402,F401  (registers digits-offline, digits, office-home)
    incremental,  # noqa: E402,F401  (registers mnist-fmnist-cil, uci-digits-cil, cifar100-cil)
    user_tasks,  # noqa: E402,F401  (registers image-folder, array, image-domains)
)
