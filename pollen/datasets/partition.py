"""Splitting a dataset across clients: IID, Dirichlet label skew, N-way K-shot, domains.

Pure numpy functions: the same arguments and seed always give the same split, and every
index array returned is a sorted ``int64`` array. Impossible requests raise
:class:`PartitionError` with the numbers that do not fit, before any training starts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PartitionError(ValueError):
    """The requested split cannot be made from the data given."""


def _sorted_int64(a: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(a, dtype=np.int64))


def _check_positive(name: str, value: int) -> None:
    if int(value) != value or value < 1:
        raise PartitionError(f"{name} must be a positive integer, got {value}")


def iid(num_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A random permutation of ``range(num_samples)`` cut into near-equal parts (sizes differ ≤ 1)."""
    _check_positive("num_clients", num_clients)
    if num_samples < num_clients:
        raise PartitionError(
            f"iid: num_samples ({num_samples}) must be >= num_clients ({num_clients}) so every "
            f"client gets at least one sample"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_samples)
    return [_sorted_int64(part) for part in np.array_split(perm, num_clients)]


HOPELESS_AFTER = 10  # draws; then a draw leaving this many clients short means sampling will not succeed


def _hopeless_shortfall(num_clients: int) -> int:
    return max(10, num_clients // 100)


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_per_client: int = 2,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients by proportions ~ Dir(alpha·1).

    Small ``alpha`` concentrates a class on few clients. The whole draw is repeated until every
    client holds at least ``min_per_client`` samples. When no draw gets there — ``max_retries``
    draws, or already the first ``HOPELESS_AFTER`` when each left many clients short (thousands of
    clients on a dataset that gives each only a handful) — the last draw is **topped up**: each
    short client receives random samples of the client holding the most, until it has the minimum
    (:func:`_top_up`). The label skew of everyone else is untouched. A minimum the data cannot meet
    at all raises :class:`PartitionError`.
    """
    labels = np.asarray(labels).reshape(-1)
    _check_positive("num_clients", num_clients)
    if not alpha > 0:
        raise PartitionError(f"dirichlet: alpha must be > 0, got {alpha}")
    if min_per_client < 0:
        raise PartitionError(f"dirichlet: min_per_client must be >= 0, got {min_per_client}")
    _check_positive("max_retries", max_retries)
    if num_clients * min_per_client > labels.size:
        raise PartitionError(
            f"dirichlet: {num_clients} clients × min_per_client {min_per_client} = "
            f"{num_clients * min_per_client} samples needed, only {labels.size} available"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    fewest_short = num_clients
    result: list[np.ndarray] = []
    for attempt in range(max_retries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            props = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(props)[:-1] * idx.size).astype(np.int64)
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].append(piece)
        result = [
            _sorted_int64(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts
        ]
        short = sum(r.size < min_per_client for r in result)
        if short == 0:
            return result
        fewest_short = min(fewest_short, short)
        if attempt + 1 >= HOPELESS_AFTER and fewest_short >= _hopeless_shortfall(num_clients):
            break
    return _top_up(result, min_per_client, rng)


def _top_up(parts: list[np.ndarray], minimum: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Give every client at least ``minimum`` samples, each taken at random from the client that holds
    the most at that moment (ties: the lowest index); the caller checked the total suffices."""
    import heapq

    parts = [p.copy() for p in parts]
    heap = [(-p.size, i) for i, p in enumerate(parts)]
    heapq.heapify(heap)
    for client in range(len(parts)):
        while parts[client].size < minimum:
            neg, donor = heapq.heappop(heap)
            if -neg != parts[donor].size:  # stale entry: push the current size back
                heapq.heappush(heap, (-parts[donor].size, donor))
                continue
            if donor == client or parts[donor].size <= minimum:
                raise PartitionError(f"dirichlet: cannot top up client {client} to {minimum} samples")
            k = int(rng.integers(parts[donor].size))
            sample = parts[donor][k]
            parts[donor] = np.delete(parts[donor], k)
            heapq.heappush(heap, (-parts[donor].size, donor))
            parts[client] = np.append(parts[client], sample)
            heapq.heappush(heap, (-parts[client].size, client))
    return [_sorted_int64(p) for p in parts]


@dataclass(frozen=True, eq=False)
class ShotSplit:
    """One client's N-way K-shot data: its classes, train/test indices, shots per class."""

    classes: tuple[int, ...]
    train: np.ndarray
    test: np.ndarray
    shots: tuple[int, ...]


def n_way_k_shot(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    ways: int,
    shots: int,
    stdev: int,
    test_per_class: int,
    num_classes: int,
    seed: int,
    official_k_high: int | None = None,
) -> list[ShotSplit]:
    """FedProto's non-IID split, with clean errors where the official code crashes.

    With ``official_k_high`` the split is instead drawn exactly as the official code draws it
    (:func:`_official_draw`; ``official_k_high`` is its exclusive upper bound of k).

    Client ``i`` draws ``n_i ~ U{max(2, ways−stdev) … min(num_classes, ways+stdev)}`` distinct
    classes and, for each class ``j``, ``k_ij ~ U{shots−stdev … shots+stdev}`` training samples.
    Each class's training indices are shuffled once and handed out as **disjoint** consecutive
    slices, client by client. Test data: ``test_per_class`` samples of each of the client's
    classes, as disjoint slices of the shuffled test indices when the class has enough test
    samples for all its clients; otherwise each client samples its own ``test_per_class``
    without replacement (clients may then share test samples of that class).
    """
    train_labels = np.asarray(train_labels).reshape(-1).astype(np.int64)
    test_labels = np.asarray(test_labels).reshape(-1).astype(np.int64)
    _check_positive("num_clients", num_clients)
    _check_positive("num_classes", num_classes)
    if int(ways) != ways or ways < 1 or ways > num_classes:
        raise PartitionError(f"n_way_k_shot: ways must be in 1..num_classes ({num_classes}), got {ways}")
    if int(stdev) != stdev or stdev < 0:
        raise PartitionError(f"n_way_k_shot: stdev must be a non-negative integer, got {stdev}")
    if int(shots) != shots or shots - stdev < 1:
        raise PartitionError(
            f"n_way_k_shot: shots − stdev must be >= 1 (every class needs a training sample), "
            f"got shots={shots}, stdev={stdev}"
        )
    if int(test_per_class) != test_per_class or test_per_class < 0:
        raise PartitionError(f"n_way_k_shot: test_per_class must be >= 0, got {test_per_class}")
    n_lo, n_hi = max(2, ways - stdev), min(num_classes, ways + stdev)
    if n_lo > n_hi:
        raise PartitionError(
            f"n_way_k_shot: the number of classes per client ranges over max(2, ways−stdev)={n_lo} … "
            f"min(num_classes, ways+stdev)={n_hi}, which is empty (ways={ways}, stdev={stdev}, "
            f"num_classes={num_classes})"
        )
    for what, lab in (("train_labels", train_labels), ("test_labels", test_labels)):
        if lab.size and (lab.min() < 0 or lab.max() >= num_classes):
            raise PartitionError(
                f"n_way_k_shot: {what} must lie in 0..{num_classes - 1}, found {lab.min()}..{lab.max()}"
            )

    if official_k_high is not None:
        return _official_draw(train_labels, test_labels, num_clients, ways, shots, stdev, test_per_class,
                              num_classes, seed, official_k_high)
    rng = np.random.default_rng(seed)
    client_classes: list[np.ndarray] = []
    client_shots: list[np.ndarray] = []
    for _ in range(num_clients):
        n_i = int(rng.integers(n_lo, n_hi + 1))
        client_classes.append(np.sort(rng.choice(num_classes, size=n_i, replace=False)).astype(np.int64))
        client_shots.append(rng.integers(shots - stdev, shots + stdev + 1, size=n_i).astype(np.int64))

    # Training: disjoint consecutive slices of each class's shuffled indices.
    needed = np.zeros(num_classes, dtype=np.int64)
    for cls, k in zip(client_classes, client_shots):
        np.add.at(needed, cls, k)
    train_pool = [rng.permutation(np.flatnonzero(train_labels == c)) for c in range(num_classes)]
    for c in range(num_classes):
        if needed[c] > train_pool[c].size:
            holders = sum(int(c in cls) for cls in client_classes)
            raise PartitionError(
                f"n_way_k_shot: class {c} needs {int(needed[c])} training samples "
                f"({holders} clients × {shots}±{stdev} shots) but only {train_pool[c].size} are available; "
                f"lower shots/num_clients or use a larger dataset"
            )
    train_next = np.zeros(num_classes, dtype=np.int64)
    train_parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for i, (cls, k) in enumerate(zip(client_classes, client_shots)):
        for c, kc in zip(cls, k):
            start = train_next[c]
            train_parts[i].append(train_pool[c][start : start + kc])
            train_next[c] = start + kc

    # Test: disjoint slices when the class has enough, else per-client sampling.
    test_pool = [rng.permutation(np.flatnonzero(test_labels == c)) for c in range(num_classes)]
    holders_per_class = np.zeros(num_classes, dtype=np.int64)
    for cls in client_classes:
        holders_per_class[cls] += 1
    for c in range(num_classes):
        if holders_per_class[c] and test_per_class > test_pool[c].size:
            raise PartitionError(
                f"n_way_k_shot: class {c} needs {test_per_class} test samples per client but only "
                f"{test_pool[c].size} are available; lower test_per_class"
            )
    test_next = np.zeros(num_classes, dtype=np.int64)
    test_parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for i, cls in enumerate(client_classes):
        for c in cls:
            pool = test_pool[c]
            if holders_per_class[c] * test_per_class <= pool.size:
                start = test_next[c]
                test_parts[i].append(pool[start : start + test_per_class])
                test_next[c] = start + test_per_class
            else:
                test_parts[i].append(rng.choice(pool, size=test_per_class, replace=False))

    return [
        ShotSplit(
            classes=tuple(int(c) for c in cls),
            train=_sorted_int64(np.concatenate(train_parts[i])),
            test=_sorted_int64(np.concatenate(test_parts[i])) if test_parts[i] else np.empty(0, np.int64),
            shots=tuple(int(k) for k in client_shots[i]),
        )
        for i, cls in enumerate(client_classes)
    ]


def _official_draw(train_labels: np.ndarray, test_labels: np.ndarray, num_clients: int, ways: int, shots: int,
                   stdev: int, test_per_class: int, num_classes: int, seed: int, k_high: int,
                   slice_stride: int = 110) -> list[ShotSplit]:
    """FedProto's split exactly as its official code draws it, for like-for-like comparisons.

    ``RandomState(seed).randint`` draws n_i ∈ [max(2, ways−stdev), min(C, ways+stdev+1)) for all
    clients, then one k_i ∈ [shots−stdev+1, k_high) per client (the official MNIST rule is
    ``k_high = shots+stdev−1``, i.e. k ∈ {99, 100}; CIFAR-10's is ``shots+stdev+1``); each client's
    classes are ``random.Random(seed).sample`` draws, in client order. Both sets are sorted by label
    (``np.argsort``) and client i takes k_i training images of each class starting at position
    ``i·slice_stride`` of that class (110: the code's ``train_shots_max``) and ``test_per_class`` test
    images starting at ``i·test_per_class``. The class sets and sizes equal the official run's for the
    same seed; which images fill them follows NumPy's unstable sort, so may differ between versions.
    """
    n_lo, n_hi = max(2, ways - stdev), min(num_classes, ways + stdev + 1)
    if n_lo >= n_hi or shots - stdev + 1 >= k_high:
        raise PartitionError(f"n_way_k_shot (official draw): empty draw range (ways={ways}, shots={shots}, "
                             f"stdev={stdev}, k_high={k_high})")
    state = np.random.RandomState(seed % (2**32))
    n_list = state.randint(n_lo, n_hi, num_clients)
    k_list = state.randint(shots - stdev + 1, k_high, num_clients)
    py_rng = random.Random(seed)
    train_order = np.argsort(train_labels, kind="quicksort")
    test_order = np.argsort(test_labels, kind="quicksort")
    train_begin = {c: int(np.searchsorted(train_labels[train_order], c)) for c in range(num_classes)}
    test_begin = {c: int(np.searchsorted(test_labels[test_order], c)) for c in range(num_classes)}
    train_count = np.bincount(train_labels, minlength=num_classes)
    test_count = np.bincount(test_labels, minlength=num_classes)
    splits = []
    for i in range(num_clients):
        classes = sorted(py_rng.sample(range(num_classes), int(n_list[i])))
        k = int(k_list[i])
        train_parts, test_parts = [], []
        for c in classes:
            lo, lo_test = i * slice_stride, i * test_per_class
            if lo + k > train_count[c] or lo_test + test_per_class > test_count[c]:
                raise PartitionError(f"n_way_k_shot (official draw): client {i} needs class {c} images beyond the "
                                     f"{train_count[c]} training / {test_count[c]} test images there are; "
                                     "use fewer clients")
            train_parts.append(train_order[train_begin[c] + lo: train_begin[c] + lo + k])
            test_parts.append(test_order[test_begin[c] + lo_test: test_begin[c] + lo_test + test_per_class])
        splits.append(ShotSplit(classes=tuple(int(c) for c in classes),
                                train=_sorted_int64(np.concatenate(train_parts)),
                                test=_sorted_int64(np.concatenate(test_parts)),
                                shots=tuple(k for _ in classes)))
    return splits


def one_domain_per_client(num_clients: int, domains: Sequence[str]) -> list[str]:
    """Client ``i`` gets ``domains[i % len(domains)]``: each domain once, then round-robin.

    Fewer clients than domains is refused, since a domain nobody holds would silently
    disappear from the federation.
    """
    domains = list(domains)
    _check_positive("num_clients", num_clients)
    if not domains:
        raise PartitionError("one_domain_per_client: domains must not be empty")
    if len(set(domains)) != len(domains):
        raise PartitionError(f"one_domain_per_client: domains must be distinct, got {domains}")
    if num_clients < len(domains):
        raise PartitionError(
            f"one_domain_per_client: num_clients ({num_clients}) must be >= the number of domains "
            f"({len(domains)}: {', '.join(domains)}) so every domain has a client"
        )
    return [domains[i % len(domains)] for i in range(num_clients)]
