"""What the server could learn from a client's release, measured against the truth. Pure numpy.

Each measure comes with its *random-guess floor*: the score of a server that ignores the release and
guesses (the uniform histogram; every class present). A release leaks what a measure gains over its
floor; with ``dp-mode = payload`` the gain should shrink as σ grows. The ``*_audit`` functions name
the measures as the ``leak-*`` train metrics of ``leak-audit = true``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _histogram(counts: np.ndarray, name: str) -> np.ndarray:
    """Non-negative counts as a distribution; all-zero (an estimate with nothing left) is uniform."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not np.isfinite(c).all():
        raise ValueError(f"{name} must be a non-empty finite vector, got shape {c.shape}")
    c = np.clip(c, 0.0, None)
    total = c.sum()
    return c / total if total > 0 else np.full(c.size, 1.0 / c.size)


def total_variation(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """TV distance ½·Σ|p − q| of the two histograms (negative entries, e.g. noisy counts, count as 0)."""
    p, q = _histogram(p_counts, "p_counts"), _histogram(q_counts, "q_counts")
    if p.shape != q.shape:
        raise ValueError(f"histograms differ in length: {p.size} and {q.size}")
    return 0.5 * float(np.abs(p - q).sum())


def histogram_leak(true_counts: np.ndarray, released_counts: np.ndarray) -> tuple[float, float]:
    """(TV of the label histogram read off the released counts, TV of the uniform guess: the floor)."""
    uniform = np.ones(np.shape(true_counts))
    return total_variation(true_counts, released_counts), total_variation(true_counts, uniform)


def presence_f1(true_counts: np.ndarray, predicted_present: np.ndarray) -> float:
    """F1 of the predicted set of held classes against the classes with a positive true count."""
    truth = np.asarray(true_counts) > 0
    pred = np.asarray(predicted_present, dtype=bool)
    if truth.shape != pred.shape:
        raise ValueError(f"presence vectors differ in shape: {truth.shape} and {pred.shape}")
    hits = int((truth & pred).sum())
    denominator = int(truth.sum() + pred.sum())
    return 2.0 * hits / denominator if denominator else 1.0


def presence_leak(true_counts: np.ndarray, released_counts: np.ndarray,
                  threshold: float) -> tuple[float, float]:
    """(F1 of "held = released count >= threshold", F1 of guessing every class held: the floor)."""
    released = np.asarray(released_counts, dtype=np.float64)
    return presence_f1(true_counts, released >= threshold), presence_f1(true_counts, np.ones(released.shape, bool))


def softmax_histogram_leak(public_logits: np.ndarray, true_counts: np.ndarray) -> tuple[float, float]:
    """(TV between the mean softmax of the public-set logits and the client's label histogram, TV of
    the uniform guess: the floor). A model trained on skewed labels predicts them more often."""
    z = np.asarray(public_logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] != np.size(true_counts) or not np.isfinite(z).all():
        raise ValueError(f"public logits must be finite N0×{np.size(true_counts)}, got shape {z.shape}")
    e = np.exp(z - z.max(axis=1, keepdims=True))
    mean_softmax = (e / e.sum(axis=1, keepdims=True)).mean(axis=0)
    return histogram_leak(true_counts, mean_softmax)


def prototype_audit(true_counts: np.ndarray, released_counts: np.ndarray, held_at: float) -> dict[str, float]:
    """The ``leak-*`` metrics of a prototype release: the histogram and the held classes (count >=
    ``held_at``, the server's rule) read off its counts, each with its floor."""
    tv, tv_floor = histogram_leak(true_counts, released_counts)
    f1, f1_floor = presence_leak(true_counts, released_counts, held_at)
    return {"leak-hist-tv": tv, "leak-hist-tv-floor": tv_floor,
            "leak-presence-f1": f1, "leak-presence-f1-floor": f1_floor}


def logit_audit(public_logits: np.ndarray, true_counts: np.ndarray) -> dict[str, float]:
    """The ``leak-*`` metrics of a public-logit release: the histogram read off its mean softmax, and its floor."""
    tv, floor = softmax_histogram_leak(public_logits, true_counts)
    return {"leak-softmax-tv": tv, "leak-softmax-tv-floor": floor}


# --- image reconstructions (GLFC's proxy inverts gradients into images) ------------------------------

SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03  # the usual SSIM constants, peak 1


def _images(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError(f"images must be finite, of one shape, H×W or C×H×W: got {x.shape} and {y.shape}")
    return x, y


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two images in [0, 1]: 10·log10(1 / MSE); inf when equal."""
    x, y = _images(a, b)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)


def _gaussian_filter(x: np.ndarray) -> np.ndarray:
    """Weighted mean over every full 11×11 window of the last two axes (a 'valid' Gaussian filter)."""
    t = np.arange(SSIM_WINDOW) - (SSIM_WINDOW - 1) / 2
    g = np.exp(-t ** 2 / (2 * SSIM_SIGMA ** 2))
    g /= g.sum()
    rows = sliding_window_view(x, SSIM_WINDOW, axis=-2) @ g  # (..., H-10, W)
    return sliding_window_view(rows, SSIM_WINDOW, axis=-1) @ g  # (..., H-10, W-10)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean structural similarity of two images in [0, 1] (H×W, or C×H×W: the mean over the channels'
    maps): Gaussian window 11, σ 1.5, K1 0.01, K2 0.03, over the windows that fit inside the image."""
    x, y = _images(a, b)
    if min(x.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW}×{SSIM_WINDOW}, got {x.shape}")
    c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2
    mx, my = _gaussian_filter(x), _gaussian_filter(y)
    vx, vy = _gaussian_filter(x * x) - mx ** 2, _gaussian_filter(y * y) - my ** 2
    cxy = _gaussian_filter(x * y) - mx * my
    s = (2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return float(s.mean())


def class_mean_images(images: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """The mean image of each class (C×image); a class without an image gets the mean of all images.

    What a server that holds labelled images of the task (its test set) can always output for a class
    without looking at any release: the PSNR/SSIM floor of a reconstruction."""
    x = np.asarray(images, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64).ravel()
    if x.ndim < 3 or len(x) != len(y) or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError(f"need N >= 1 finite images and N labels, got {x.shape} and {np.shape(labels)}")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes - 1}], got [{y.min()}, {y.max()}]")
    overall = x.mean(axis=0)
    return np.stack([x[y == c].mean(axis=0) if (y == c).any() else overall for c in range(num_classes)])


def reconstruction_audit(true_images: np.ndarray, reconstructions: np.ndarray, true_labels: np.ndarray,
                         inferred_labels: np.ndarray, class_means: np.ndarray,
                         candidate_labels: int) -> dict[str, float]:
    """The ``leak-*`` metrics of gradient inversion (GLFC's proxy), images B×H×W or B×C×H×W in [0, 1]:
    mean PSNR and SSIM of each reconstruction against its true image, and the share of labels inferred
    right. Floors, what the server has without the gradients: the mean image of the sample's own class
    (``class_means[label]``, :func:`class_mean_images`; crediting the server with the label makes the
    floor higher than any label-free guess) and 1 / ``candidate_labels`` (the server knows the
    current task's K classes, so a label guess is one of K, not of every class)."""
    x, r = _images(true_images, reconstructions)
    labels = np.asarray(true_labels).astype(np.int64).ravel()
    if x.ndim < 3 or len(x) != len(labels) or len(x) != len(np.asarray(inferred_labels)):
        raise ValueError(f"need B images and B labels of each kind, got {x.shape}, {np.shape(true_labels)}, "
                         f"{np.shape(inferred_labels)}")
    means = np.asarray(class_means, dtype=np.float64)
    if means.shape[1:] != x.shape[1:] or labels.min() < 0 or labels.max() >= len(means):
        raise ValueError(f"class_means must be C×{x.shape[1:]} with every true label below C, got {means.shape} "
                         f"and labels up to {labels.max()}")
    if int(candidate_labels) != candidate_labels or candidate_labels < 1:
        raise ValueError(f"candidate_labels must be an integer >= 1, got {candidate_labels!r}")
    floor = means[labels]
    return {"leak-psnr": float(np.mean([psnr(a, b) for a, b in zip(x, r)])),
            "leak-psnr-floor": float(np.mean([psnr(a, m) for a, m in zip(x, floor)])),
            "leak-ssim": float(np.mean([ssim(a, b) for a, b in zip(x, r)])),
            "leak-ssim-floor": float(np.mean([ssim(a, m) for a, m in zip(x, floor)])),
            "leak-label-acc": float(np.mean(labels == np.asarray(inferred_labels).ravel())),
            "leak-label-acc-floor": 1.0 / int(candidate_labels)}
