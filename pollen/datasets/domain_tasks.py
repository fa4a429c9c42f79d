"""Domain-shift tasks for FCCL-style methods: one client per domain, same labels, different P(X|Y).

=================  ===========================================  =====================  =============
task               domains (one per client, in partition order)  public set (default)   needs files
=================  ===========================================  =====================  =============
``digits-offline``  mnist, uci, mnistm, syn                      fashion_mnist          MNIST (+ FMNIST)
``digits``          mnist, usps, svhn, syndigits (the paper's)   cifar100               all four + CIFAR-100
``office-home``     Art, Clipart, Product, Real_World            cifar100               Office-Home + CIFAR-100
``image-domains``   your folders, one per node                   your folder            your images
=================  ===========================================  =====================  =============

Private training sets are seeded random subsets of the paper's sizes (Digits: 150 / 80 / 5000 /
1800; Office-Home: 1400 / 2000 / 2500 / 2000); ``digits-offline`` uses the Digits sizes for its
four stand-in domains. Callers (the FCCL clients) may ask for smaller sizes for CPU runs. All images
become 3×32×32 with ImageNet statistics (:data:`DIGITS_FORMAT`), with no augmentation on private data
[FCCL code]. Each client's :attr:`ClientData.extra_tests` holds every *other* domain's test set, for
inter-domain accuracy.

Each is a :class:`~pollen.datasets.spec.TaskSpec` of kind ``domains`` whose
:class:`~pollen.datasets.spec.DomainFacts` name its domains, sizes, public set and loader.
``image-domains`` (registered with the other user-data tasks in :mod:`pollen.datasets.user_tasks`)
has no fixed domains: its facts' empty ``names`` and ``train_sizes`` mean "whatever the folders hold".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pollen.datasets.domains import load_domain, seeded_subset
from pollen.datasets.public import load_public, public_digest
from pollen.datasets.sources import ImageSet, load_source
from pollen.datasets.spec import (
    DOMAIN_MODELS,
    ClientData,
    DomainFacts,
    TaskError,
    TaskOptions,
    TaskSpec,
    get_task,
    register_task,
)
from pollen.datasets.transforms import DIGITS_FORMAT, ImageFormat, to_model_input

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=32)
def _domain_split(kind: str, domain: str, root: str | None, split: str, seed: int, size: int | None) -> ImageSet:
    """One domain's split, at most ``size`` samples (seeded subset; generated domains render ``size``)."""
    if kind == "officehome":
        data = load_source("officehome", root, split, domain=domain)
        return seeded_subset(data, size, seed, "domain", domain, split) if size and size < len(data) else data
    if domain in ("syn", "mnistm") and size is not None:  # generated: render only what is needed
        try:
            return load_domain(domain, root, split, seed, size)
        except ValueError:  # more than the domain's digits allow: take all of them
            return load_domain(domain, root, split, seed)
    data = load_domain(domain, root, split, seed)
    return seeded_subset(data, size, seed, "cap", domain, split) if size and size < len(data) else data


@functools.lru_cache(maxsize=8)
def domain_client_data(task: str, opts: TaskOptions, partition_id: int, num_partitions: int,
                       train_sizes: tuple[int, ...] | None = None, test_size: int = 0) -> ClientData:
    """Client ``partition_id``'s domain: private train set, own test set, other domains' test sets.

    ``train_sizes`` (one per domain) defaults to the paper's; ``opts.max_train_samples`` caps them
    further; ``test_size`` (0 = the whole test split) caps every test set. Raises
    :class:`TaskError` for a wrong client count or sizes larger than a domain holds.
    """
    spec = get_task(task, "domains")
    facts = spec.domain_facts()
    k = len(facts.names)
    if num_partitions != k:
        raise TaskError(f"task {task!r} has one client per domain: num-partitions must be {k}, got {num_partitions}")
    if not 0 <= partition_id < k:
        raise TaskError(f"partition id {partition_id} outside 0..{k - 1}")
    sizes = facts.train_sizes if train_sizes is None else tuple(train_sizes)
    if len(sizes) != k or any(s < 1 for s in sizes):
        raise TaskError(f"task {task!r} needs {k} positive training sizes (one per domain), got {sizes}")
    domain = facts.names[partition_id]
    size = sizes[partition_id]
    if opts.max_train_samples > 0:
        size = min(size, opts.max_train_samples)
    try:
        train = _domain_split(facts.loader, domain, opts.data_root, "train", opts.seed, size)
        tests = {d: _domain_split(facts.loader, d, opts.data_root, "test", opts.seed, test_size or None)
                 for d in facts.names}
    except ValueError as err:
        raise TaskError(f"task {task!r}, domain {domain!r}: {err}") from err
    if len(train) < size:
        raise TaskError(f"task {task!r}: domain {domain!r} has only {len(train)} training samples, {size} requested")
    own = tests[domain]
    return ClientData(
        x_train=to_model_input(train.images, spec.fmt), y_train=train.labels.clone(),
        x_test=to_model_input(own.images, spec.fmt), y_test=own.labels.clone(),
        num_classes=spec.num_classes, classes=tuple(range(spec.num_classes)), domain=domain, fmt=spec.fmt,
        extra_tests={d: (to_model_input(t.images, spec.fmt), t.labels.clone())
                     for d, t in tests.items() if d != domain})


@dataclass(frozen=True)
class PublicSet:
    """The public set X0 as normalised model input (N0×C×H×W float32) and the digest of its images."""

    inputs: torch.Tensor
    digest: int


@functools.lru_cache(maxsize=4)
def public_set(name: str, root: str | None, size: int, seed: int, fmt: ImageFormat = DIGITS_FORMAT,
               folder: str | None = None) -> PublicSet:
    """X0 as this client feeds it to its model; the digest is of the images before normalisation, so it
    is equal on every node holding the same images, whatever each node's own normalisation."""
    images = load_public(name, root, size, seed, folder).images
    return PublicSet(to_model_input(images, fmt), public_digest(images))


def _register(name: str, description: str, facts: DomainFacts, num_classes: int, models: tuple[str, ...],
              top_k: int = 1) -> None:
    """One client per domain, each domain's model by partition, images as :data:`DIGITS_FORMAT`."""
    def build(opts: TaskOptions, partition_id: int, num_partitions: int) -> ClientData:
        return domain_client_data(name, opts, partition_id, num_partitions)

    register_task(TaskSpec(name=name, description=description, num_classes=num_classes, fmt=DIGITS_FORMAT,
                           default_model=models[0], needs_data_root=True, build=build, kind="domains",
                           fixed_partitions=len(facts.names), partition_models=models, top_k=top_k, domains=facts))


_register("digits-offline", "FCCL offline Digits: MNIST / UCI / MNIST-M / SYN domains, one per client, 3x32x32 "
                            "(needs data-root with MNIST)",
          DomainFacts(("mnist", "uci", "mnistm", "syn"), (150, 80, 5000, 1800), "fashion_mnist"), 10, DOMAIN_MODELS)
_register("digits", "FCCL Digits: MNIST / USPS / SVHN / SynDigits, one per client (needs all four under data-root)",
          DomainFacts(("mnist", "usps", "svhn", "syndigits"), (150, 80, 5000, 1800), "cifar100"), 10, DOMAIN_MODELS)
_register("office-home", "FCCL Office-Home: Art / Clipart / Product / Real World, 65 classes, top-5 "
                         "(needs Office-Home under data-root)",
          DomainFacts(("Art", "Clipart", "Product", "Real_World"), (1400, 2000, 2500, 2000), "cifar100",
                      loader="officehome"),
          65, ("resnet10", "resnet12", "resnet18", "resnet34"), top_k=5)
