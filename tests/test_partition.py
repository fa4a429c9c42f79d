"""Partitioners, checked against naive independent computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pollen.datasets.partition import (
    PartitionError,
    ShotSplit,
    dirichlet,
    iid,
    n_way_k_shot,
    one_domain_per_client,
)
from tests.conftest import needs_real_data, real_data_root

torch.set_num_threads(1)

DATA_ROOT = real_data_root()  # the one skip rule (tests/conftest.py)


def assert_sorted_int64(a: np.ndarray) -> None:
    assert a.dtype == np.int64
    assert all(a[i] <= a[i + 1] for i in range(len(a) - 1))


def assert_exact_cover(parts, n) -> None:
    seen = [0] * n
    for p in parts:
        assert_sorted_int64(p)
        for i in p.tolist():
            seen[i] += 1
    assert seen == [1] * n


# ------------------------------------------------------------------------------------------ iid


def test_iid_sizes_and_cover():
    parts = iid(103, 10, seed=0)
    assert len(parts) == 10
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 103
    assert_exact_cover(parts, 103)
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid(103, 10, seed=0)))
    assert any(not np.array_equal(a, b) for a, b in zip(parts, iid(103, 10, seed=1)))
    with pytest.raises(PartitionError, match="num_samples"):
        iid(3, 5, seed=0)
    with pytest.raises(PartitionError, match="num_clients"):
        iid(3, 0, seed=0)


# ------------------------------------------------------------------------------------ dirichlet


def _labels(n_per_class=60, num_classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(num_classes), n_per_class))


def test_dirichlet_cover_disjoint_deterministic():
    labels = _labels()
    parts = dirichlet(labels, 8, alpha=0.5, seed=3)
    assert len(parts) == 8
    assert_exact_cover(parts, labels.size)
    assert min(len(p) for p in parts) >= 2
    again = dirichlet(labels, 8, alpha=0.5, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = dirichlet(labels, 8, alpha=0.5, seed=4)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def _mean_label_entropy(labels, parts, num_classes=10):
    """Mean over clients of the entropy of the client's label histogram (lower = more skewed)."""
    ents = []
    for p in parts:
        counts = np.bincount(labels[p], minlength=num_classes).astype(float)
        q = counts[counts > 0] / counts.sum()
        ents.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(ents))


def test_dirichlet_small_alpha_is_more_skewed():
    labels = _labels()
    skewed = np.mean([_mean_label_entropy(labels, dirichlet(labels, 6, 0.1, seed=s)) for s in range(3)])
    mild = np.mean([_mean_label_entropy(labels, dirichlet(labels, 6, 100.0, seed=s)) for s in range(3)])
    assert mild > np.log(10) - 0.1  # near-uniform label mix
    assert skewed < mild - 0.5


def test_dirichlet_impossible_minimum():
    labels = _labels(n_per_class=2, num_classes=3)  # 6 samples
    with pytest.raises(PartitionError, match="only 6 available"):
        dirichlet(labels, 4, alpha=1.0, seed=0, min_per_client=2)
    with pytest.raises(PartitionError, match="alpha"):
        dirichlet(labels, 2, alpha=0.0, seed=0)


def _check_cover(parts, n, minimum):
    joined = np.concatenate(parts)
    assert joined.size == n and np.array_equal(np.sort(joined), np.arange(n))  # disjoint, covers all
    assert min(p.size for p in parts) >= minimum


def test_dirichlet_tops_up_when_no_draw_meets_the_minimum():
    # Possible in principle but essentially never drawn with a tiny alpha: after the retries, the
    # short clients get samples of the largest one.
    labels = _labels(n_per_class=3, num_classes=2)
    parts = dirichlet(labels, 3, alpha=0.001, seed=0, min_per_client=2, max_retries=20)
    _check_cover(parts, labels.size, 2)
    assert [p.size for p in parts] == [2, 2, 2]


def test_dirichlet_scales_to_ten_thousand_clients_on_mnist_sized_labels():
    """60,000 labels over 10,000 clients (6 each on average): no draw leaves every client 2 samples, so the
    split gives up sampling after a few draws and tops up; the label skew of the others stays."""
    labels = np.repeat(np.arange(10), 6000)
    parts = dirichlet(labels, 10_000, alpha=0.5, seed=0)
    _check_cover(parts, labels.size, 2)
    again = dirichlet(labels, 10_000, alpha=0.5, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    classes_held = np.mean([np.unique(labels[p]).size for p in parts])
    iid_classes = np.mean([np.unique(labels[p]).size for p in iid(labels.size, 10_000, seed=0)])
    assert classes_held < iid_classes - 0.3  # still label-skewed (IID: about 4.7 of 10 classes per client)


# --------------------------------------------------------------------------------- n-way k-shot


def _shot_labels(train_per_class=400, test_per_class=100, num_classes=10, seed=0):
    rng = np.random.default_rng(seed)
    tr = rng.permutation(np.repeat(np.arange(num_classes), train_per_class))
    te = rng.permutation(np.repeat(np.arange(num_classes), test_per_class))
    return tr, te


def test_n_way_k_shot_ranges_disjoint_and_labels():
    tr, te = _shot_labels()
    ways, shots, stdev = 4, 20, 2
    splits = n_way_k_shot(tr, te, num_clients=12, ways=ways, shots=shots, stdev=stdev,
                          test_per_class=5, num_classes=10, seed=1)
    assert len(splits) == 12
    all_train = []
    for s in splits:
        assert isinstance(s, ShotSplit)
        assert max(2, ways - stdev) <= len(s.classes) <= min(10, ways + stdev)
        assert list(s.classes) == sorted(set(s.classes))
        assert len(s.shots) == len(s.classes)
        assert all(shots - stdev <= k <= shots + stdev for k in s.shots)
        assert_sorted_int64(s.train)
        assert_sorted_int64(s.test)
        # Exactly k_ij training samples of each of its classes, and nothing else.
        for c, k in zip(s.classes, s.shots):
            assert int((tr[s.train] == c).sum()) == k
        assert set(tr[s.train].tolist()) == set(s.classes)
        assert len(s.train) == sum(s.shots)
        # test_per_class test samples of each of its classes.
        assert len(s.test) == 5 * len(s.classes)
        assert set(te[s.test].tolist()) == set(s.classes)
        for c in s.classes:
            assert int((te[s.test] == c).sum()) == 5
        all_train.extend(s.train.tolist())
    assert len(all_train) == len(set(all_train))  # disjoint across clients
    all_test = [i for s in splits for i in s.test.tolist()]
    assert len(all_test) == len(set(all_test))  # enough test data here → disjoint too


def test_n_way_k_shot_class_count_range_is_used():
    tr, te = _shot_labels()
    splits = n_way_k_shot(tr, te, 60, ways=4, shots=5, stdev=2, test_per_class=1, num_classes=10, seed=0)
    counts = {len(s.classes) for s in splits}
    assert counts == {2, 3, 4, 5, 6}
    shots = {k for s in splits for k in s.shots}
    assert shots == {3, 4, 5, 6, 7}


def test_n_way_k_shot_deterministic_and_seed_dependent():
    tr, te = _shot_labels()
    kw = dict(num_clients=6, ways=3, shots=10, stdev=1, test_per_class=4, num_classes=10)
    a = n_way_k_shot(tr, te, seed=5, **kw)
    b = n_way_k_shot(tr, te, seed=5, **kw)
    c = n_way_k_shot(tr, te, seed=6, **kw)
    for x, y in zip(a, b):
        assert x.classes == y.classes and x.shots == y.shots
        assert np.array_equal(x.train, y.train) and np.array_equal(x.test, y.test)
    assert any(x.classes != y.classes or not np.array_equal(x.train, y.train) for x, y in zip(a, c))


def test_n_way_k_shot_test_overlap_fallback_when_test_is_scarce():
    tr, te = _shot_labels(test_per_class=6)
    splits = n_way_k_shot(tr, te, 10, ways=5, shots=10, stdev=0, test_per_class=4, num_classes=10, seed=2)
    for s in splits:
        for c in s.classes:
            idx = s.test[te[s.test] == c]
            assert idx.size == 4 and len(set(idx.tolist())) == 4  # no repeats within a client
    all_test = [i for s in splits for i in s.test.tolist()]
    assert len(all_test) > len(set(all_test))  # clients share some test samples


def test_n_way_k_shot_errors_name_the_problem():
    tr, te = _shot_labels(train_per_class=30)
    kw = dict(test_per_class=2, num_classes=10, seed=0)
    with pytest.raises(PartitionError, match="ways must be in 1..num_classes"):
        n_way_k_shot(tr, te, 3, ways=11, shots=5, stdev=1, **kw)
    with pytest.raises(PartitionError, match="ways"):
        n_way_k_shot(tr, te, 3, ways=0, shots=5, stdev=1, **kw)
    with pytest.raises(PartitionError, match="shots − stdev must be >= 1"):
        n_way_k_shot(tr, te, 3, ways=3, shots=2, stdev=2, **kw)
    # 20 clients × ~100 shots cannot come out of 30 samples per class.
    with pytest.raises(PartitionError) as info:
        n_way_k_shot(tr, te, 20, ways=3, shots=100, stdev=2, **kw)
    msg = str(info.value)
    assert "class" in msg and "training samples" in msg and "only 30 are available" in msg
    needed = int(msg.split("needs ")[1].split()[0])
    assert needed > 30
    with pytest.raises(PartitionError, match="test samples per client but only 1"):
        n_way_k_shot(tr, np.arange(10), 2, ways=3, shots=2, stdev=1, test_per_class=2, num_classes=10, seed=0)
    with pytest.raises(PartitionError, match="which is empty"):
        n_way_k_shot(tr, te, 2, ways=1, shots=2, stdev=0, **kw)
    with pytest.raises(PartitionError, match="train_labels must lie in 0..9"):
        n_way_k_shot(np.array([0, 12]), te, 2, ways=2, shots=1, stdev=0, **kw)


@needs_real_data
def test_fedproto_mnist_split_on_real_labels():
    from pollen.datasets.sources import load_source

    tr = load_source("mnist", DATA_ROOT, "train").labels.numpy()
    te = load_source("mnist", DATA_ROOT, "test").labels.numpy()
    splits = n_way_k_shot(tr, te, 20, ways=3, shots=100, stdev=2, test_per_class=40, num_classes=10, seed=0)
    seen = set()
    for s in splits:
        assert 2 <= len(s.classes) <= 5
        assert 98 * len(s.classes) <= len(s.train) <= 102 * len(s.classes)
        assert set(tr[s.train].tolist()) == set(s.classes)
        assert len(s.test) == 40 * len(s.classes) and set(te[s.test].tolist()) == set(s.classes)
        assert seen.isdisjoint(s.train.tolist())
        seen.update(s.train.tolist())


def test_official_split_follows_the_official_draw_order_and_slices():
    # Independent re-derivation in the official code's own style: the *global* legacy NumPy RNG and
    # Python's `random`, both seeded, then per-client label-sorted slices at i·110 (train) / i·40 (test).
    import random as pyrandom

    rng = np.random.default_rng(5)
    tr = np.repeat(np.arange(10), 2300)[rng.permutation(23000)]
    te = np.repeat(np.arange(10), 820)[rng.permutation(8200)]
    splits = n_way_k_shot(tr, te, 20, ways=3, shots=100, stdev=2, test_per_class=40, num_classes=10,
                          seed=1234, official_k_high=101)
    np_state, py_state = np.random.get_state(), pyrandom.getstate()
    try:
        np.random.seed(1234)
        pyrandom.seed(1234)
        n_list = np.random.randint(2, 6, 20)
        k_list = np.random.randint(99, 101, 20)
        tr_sorted, te_sorted = np.argsort(tr), np.argsort(te)
        for i in range(20):
            classes = np.sort(pyrandom.sample(range(10), int(n_list[i])))
            assert splits[i].classes == tuple(int(c) for c in classes)
            assert splits[i].shots == (int(k_list[i]),) * len(classes)
            want_train = np.concatenate([tr_sorted[2300 * c + 110 * i: 2300 * c + 110 * i + k_list[i]] for c in classes])
            want_test = np.concatenate([te_sorted[820 * c + 40 * i: 820 * c + 40 * i + 40] for c in classes])
            np.testing.assert_array_equal(splits[i].train, np.sort(want_train))
            np.testing.assert_array_equal(splits[i].test, np.sort(want_test))
    finally:
        np.random.set_state(np_state)
        pyrandom.setstate(py_state)
    assert {k for s in splits for k in s.shots} <= {99, 100}  # the official MNIST range quirk
    with pytest.raises(PartitionError, match="beyond"):
        n_way_k_shot(tr, te, 30, ways=3, shots=100, stdev=2, test_per_class=40, num_classes=10,
                     seed=1234, official_k_high=101)


# ------------------------------------------------------------------------------------- domains


def test_one_domain_per_client():
    doms = ["mnist", "usps", "svhn", "syn"]
    assert one_domain_per_client(4, doms) == doms
    assert one_domain_per_client(6, doms) == doms + ["mnist", "usps"]
    with pytest.raises(PartitionError, match="every domain has a client"):
        one_domain_per_client(3, doms)
    with pytest.raises(PartitionError, match="distinct"):
        one_domain_per_client(2, ["a", "a"])
    with pytest.raises(PartitionError, match="empty"):
        one_domain_per_client(2, [])
