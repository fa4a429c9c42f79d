"""Leak measures on hand-worked cases, and the measured effect of the prototype mechanism's noise."""

import numpy as np
import pytest

from pollen.privacy.leakage import (
    class_mean_images,
    histogram_leak,
    presence_f1,
    presence_leak,
    psnr,
    reconstruction_audit,
    record_label_leak,
    ssim,
    surrogate_labels,
    total_variation,
)
from pollen.privacy.mechanisms import release_prototypes
from pollen.protocol.prototypes import DP_HELD_STDS


def test_hand_worked_values():
    assert total_variation([2, 2, 0, 0], [0, 0, 1, 1]) == 1.0
    assert total_variation([3, 1], [1, 1]) == pytest.approx(0.25)
    assert total_variation([3, 1], [-5, 0]) == pytest.approx(0.25)  # all-negative estimate: uniform
    assert histogram_leak([6, 2, 0, 0], [6, 2, 0, 0]) == (0.0, pytest.approx(0.5))
    assert presence_f1([5, 0, 3, 0], [True, True, False, False]) == pytest.approx(0.5)
    assert presence_leak([5, 0, 3, 0], [9.0, -1.0, 4.0, 0.5], threshold=2.0) == (1.0, pytest.approx(2 * 2 / 6))
    with pytest.raises(ValueError, match="differ in length"):
        total_variation([1, 2], [1, 2, 3])


@pytest.mark.parametrize(("sigma", "leaks"), [(0.05, True), (500.0, False)])
def test_noise_takes_the_label_histogram_away(sigma, leaks):
    """A client with 3 of 10 classes: with little noise the server reads its histogram and classes off
    the counts; with σ = 500 it does no better than its random guess (averaged over 200 releases)."""
    rng = np.random.default_rng(0)
    labels = np.repeat([1, 4, 7], [60, 30, 10])
    truth = np.bincount(labels, minlength=10)
    z = rng.normal(size=(100, 8))
    tvs, f1s = [], []
    for _ in range(200):
        r = release_prototypes(z, labels, 10, 1.0, sigma, rng)
        tv, tv_floor = histogram_leak(truth, r.counts)
        f1, f1_floor = presence_leak(truth, r.counts, max(1.0, DP_HELD_STDS * r.count_std))
        tvs.append(tv)
        f1s.append(f1)
    if leaks:
        assert np.mean(tvs) < 0.01 and np.mean(f1s) == 1.0
    else:  # no better than guessing: TV at least the uniform guess's minus a margin, F1 no better
        assert np.mean(tvs) > tv_floor - 0.05 and np.mean(f1s) <= f1_floor + 0.05


def test_psnr_and_ssim_on_hand_computed_images():
    rng = np.random.default_rng(1)
    img = rng.uniform(0.2, 0.8, size=(3, 16, 16))
    assert psnr(img, img) == float("inf") and ssim(img, img) == pytest.approx(1.0, abs=1e-12)
    assert psnr(img, img + 0.1) == pytest.approx(20.0)  # MSE 0.01: 10·log10(1 / 0.01)
    assert psnr(img[0], img[0] + 0.01) == pytest.approx(40.0)
    # two flat images: σ terms vanish, SSIM = (2ab + C1) / (a² + b² + C1)
    c1 = 0.01 ** 2
    assert ssim(np.full((12, 12), 0.3), np.full((12, 12), 0.6)) == pytest.approx((2 * 0.18 + c1) / (0.45 + c1))
    assert ssim(img, 1.0 - img) < 0  # anti-correlated structure
    with pytest.raises(ValueError, match="at least 11"):
        ssim(np.zeros((3, 10, 10)), np.zeros((3, 10, 10)))
    with pytest.raises(ValueError, match="one shape"):
        psnr(np.zeros((4, 4)), np.zeros((4, 5)))


@pytest.mark.parametrize("shape", [(28, 28), (3, 32, 24)])
def test_ssim_equals_an_independent_gaussian_filter_implementation(shape):
    """The same definition through scipy's Gaussian filter (σ 1.5 truncated at radius 5, reflect-padded,
    then cropped to the windows that fit): the construction scikit-image uses."""
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(2)
    a = rng.uniform(size=shape)
    b = np.clip(a + rng.normal(scale=0.2, size=shape), 0, 1)

    def f(t):
        return gaussian_filter(t, sigma=1.5, truncate=3.5, mode="reflect")[5:-5, 5:-5]

    def reference(x, y):
        mx, my = f(x), f(y)
        vx, vy, cxy = f(x * x) - mx ** 2, f(y * y) - my ** 2, f(x * y) - mx * my
        c1, c2 = 0.01 ** 2, 0.03 ** 2
        return ((2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))).mean()

    channels = [a] if a.ndim == 2 else list(a)
    expected = np.mean([reference(x, y) for x, y in zip(channels, [b] if b.ndim == 2 else list(b))])
    assert ssim(a, b) == pytest.approx(expected, rel=1e-9)
    assert 0.05 < ssim(a, b) < 0.95


def test_reconstruction_audit_against_hand_values():
    rng = np.random.default_rng(3)
    truth = rng.uniform(0.0, 0.8, size=(3, 1, 12, 12))
    means = rng.uniform(0.0, 1.0, size=(10, 1, 12, 12))
    labels = np.array([4, 7, 1])
    audit = reconstruction_audit(truth, truth + 0.1, labels, np.array([4, 7, 2]), means, candidate_labels=5)
    assert audit["leak-psnr"] == pytest.approx(20.0) and audit["leak-label-acc"] == pytest.approx(2 / 3)
    assert audit["leak-label-acc-floor"] == pytest.approx(1 / 5)  # a guess among the task's 5 classes
    # the floor: each sample against its own class's mean image
    floor = np.mean([10 * np.log10(1 / np.mean((t - means[c]) ** 2)) for t, c in zip(truth, labels)])
    assert audit["leak-psnr-floor"] == pytest.approx(floor, rel=1e-12)
    assert audit["leak-ssim-floor"] == pytest.approx(np.mean([ssim(t, means[c]) for t, c in zip(truth, labels)]))
    assert audit["leak-ssim"] == pytest.approx(np.mean([ssim(t, t + 0.1) for t in truth]))
    # a reconstruction that is its class mean scores exactly the floor
    same = reconstruction_audit(truth, means[labels], labels, labels, means, 5)
    assert same["leak-psnr"] == same["leak-psnr-floor"] and same["leak-ssim"] == same["leak-ssim-floor"]
    with pytest.raises(ValueError, match="B labels"):
        reconstruction_audit(truth, truth, np.array([1, 2]), np.array([1, 2, 3]), means, 5)
    with pytest.raises(ValueError, match="class_means"):
        reconstruction_audit(truth, truth, np.array([1, 2, 10]), np.array([1, 2, 3]), means, 5)
    with pytest.raises(ValueError, match="candidate_labels"):
        reconstruction_audit(truth, truth, labels, labels, means, 0)


def test_class_mean_images_by_hand_and_the_class_mean_is_the_best_fixed_guess():
    x = np.array([np.full((1, 2, 2), v) for v in (0.0, 0.2, 1.0, 0.6)])
    means = class_mean_images(x, np.array([0, 0, 2, 2]), 4)
    np.testing.assert_allclose(means[:, 0, 0, 0], [0.1, 0.45, 0.8, 0.45])  # classes 1 and 3: the overall mean
    # within a class the mean image minimises the mean squared error of a fixed guess, so no other fixed
    # image beats the floor's PSNR on average (checked against perturbed guesses)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, size=(200, 1, 12, 12))
    m = class_mean_images(images, np.zeros(200, int), 1)[0]
    best = np.mean([np.mean((a - m) ** 2) for a in images])
    for _ in range(20):
        other = np.clip(m + rng.normal(0, 0.05, m.shape), 0, 1)
        assert np.mean([np.mean((a - other) ** 2) for a in images]) > best
    with pytest.raises(ValueError, match="labels must lie"):
        class_mean_images(x, np.array([0, 0, 2, 4]), 4)


def test_the_surrogate_is_ridge_regression_in_its_kernel_form():
    """Fewer input dimensions than public rows: the kernel form equals the primal ridge solution
    (X0ᵀX0 + λI)⁻¹X0ᵀ(Z − mean Z), solved independently, in its scores' argmax."""
    rng = np.random.default_rng(5)
    x0, z, x = rng.normal(size=(60, 8)), rng.normal(size=(60, 4)), rng.normal(size=(300, 8))
    lam = 0.7 * np.mean(np.sum(x0 ** 2, axis=1))
    w = np.linalg.solve(x0.T @ x0 + lam * np.eye(8), x0.T @ (z - z.mean(axis=0)))
    np.testing.assert_array_equal(surrogate_labels(x0, z, x, ridge=0.7), (x @ w).argmax(axis=1))
    # images are flattened: N×1×2×4 is the same as N×8
    np.testing.assert_array_equal(surrogate_labels(x0.reshape(60, 1, 2, 4), z, x.reshape(300, 1, 2, 4), 0.7),
                                  (x @ w).argmax(axis=1))


def test_a_release_that_is_the_clients_labelling_gives_its_labels_and_noise_gives_the_floor():
    """A client whose model is linear: its labels are argmax(x·W) and its release is X0·W. The surrogate
    reads almost every label; a release independent of the client (pure noise) reads chance, within 4
    binomial standard deviations of 1/C, below the floor (the most frequent label's share)."""
    rng = np.random.default_rng(11)
    d, classes, n0, n = 30, 5, 400, 2000
    w = rng.normal(size=(d, classes))
    x0, x = rng.normal(size=(n0, d)), rng.normal(size=(n, d))
    labels = (x @ w).argmax(axis=1)
    acc, floor = record_label_leak(x0, x0 @ w, x, labels)
    assert floor == pytest.approx(np.bincount(labels).max() / n) and floor >= 1 / classes
    assert acc > 0.95 > floor + 0.5
    noise_acc, _ = record_label_leak(x0, rng.normal(size=(n0, classes)), x, labels)
    assert abs(noise_acc - 1 / classes) < 4 * np.sqrt(0.2 * 0.8 / n) and noise_acc < floor
    with pytest.raises(ValueError, match="one logit row per public input"):
        record_label_leak(x0[:10], x0 @ w, x, labels)
    with pytest.raises(ValueError, match="one label"):
        record_label_leak(x0, x0 @ w, x, labels[:5])
