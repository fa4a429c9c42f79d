"""What the server could learn from a client's release, measured against the truth. Pure numpy.

Each measure comes with its *floor*: the score of a server that ignores the release and guesses as
well as it can without it (the uniform histogram; every class present; the client's most frequent
label; the class-mean image; one of the task's K classes). A release leaks what a measure gains over
its floor; with ``dp-mode = payload`` the gain should shrink as σ grows. The ``*_audit`` functions name
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


def prototype_audit(true_counts: np.ndarray, released_counts: np.ndarray, held_at: float) -> dict[str, float]:
    """The ``leak-*`` metrics of a prototype release: the histogram and the held classes (count >=
    ``held_at``, the server's rule) read off its counts, each with its floor."""
    tv, tv_floor = histogram_leak(true_counts, released_counts)
    f1, f1_floor = presence_leak(true_counts, released_counts, held_at)
    return {"leak-hist-tv": tv, "leak-hist-tv-floor": tv_floor,
            "leak-presence-f1": f1, "leak-presence-f1-floor": f1_floor}


# --- public-set logits (FCCL, FedMD, FedDF): the labels of the client's records, read through a surrogate ---

SURROGATE_RIDGE = 1.0  # the surrogate's ridge, in units of the public inputs' mean squared norm (scale-free)


def _rows(a: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(a, dtype=np.float64)
    if x.ndim < 2 or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError(f"{name} must be N ≥ 1 finite rows (N×d or N×image), got shape {x.shape}")
    return x.reshape(len(x), -1)


def surrogate_labels(public_inputs: np.ndarray, released_logits: np.ndarray, inputs: np.ndarray,
                     ridge: float = SURROGATE_RIDGE) -> np.ndarray:
    """The labels a server gives ``inputs`` with a linear surrogate of the client's model calibrated on the
    public set it holds: ridge regression from the public inputs (flattened) to the released logits
    (centred per class), in its kernel form ``scores = X·X0ᵀ·(X0·X0ᵀ + λI)⁻¹·(Z − mean Z)`` so that inputs
    larger than the public set cost N0×N0; ``λ = ridge × mean ‖x0‖²``; the label is the highest score."""
    x0, x = _rows(public_inputs, "public_inputs"), _rows(inputs, "inputs")
    z = _rows(released_logits, "released_logits")
    if len(z) != len(x0) or x.shape[1] != x0.shape[1]:
        raise ValueError(f"need one logit row per public input and inputs of the public inputs' size, got "
                         f"{z.shape} logits, {x0.shape} public inputs and {x.shape} inputs")
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0, got {ridge}")
    k = x0 @ x0.T
    lam = ridge * float(np.trace(k)) / len(k)
    alpha = np.linalg.solve(k + lam * np.eye(len(k)), z - z.mean(axis=0))
    return np.asarray((x @ x0.T @ alpha).argmax(axis=1))


def record_label_leak(public_inputs: np.ndarray, released_logits: np.ndarray, inputs: np.ndarray,
                      labels: np.ndarray) -> tuple[float, float]:
    """(share of the client's records whose label the surrogate (:func:`surrogate_labels`) gets right, the
    floor: the share of the client's most frequent label, what a server holding nothing from this client
    gets by giving every record one label, the best one, at least 1/C).

    Why this attack: a public-logit release is the client's model read on inputs the server holds, so the
    server can rebuild the model's labelling and read the labels of the client's records (images it
    might hold, e.g. a leaked or shared copy). The label histogram read off the mean softmax (the
    attack this replaces) cannot beat its uniform floor when clients hold near-balanced labels: the
    public set's own composition dominates the mean. The floor credits the server with the client's
    best single label; a server holding other models of the task could do better without the release,
    so the gain over the floor is what the release carries, not what the task itself gives away."""
    y = np.asarray(labels).astype(np.int64).ravel()
    if len(y) != len(np.asarray(inputs)) or y.min(initial=0) < 0:
        raise ValueError(f"need one label >= 0 per input, got {np.shape(labels)} for {np.shape(inputs)}")
    predicted = surrogate_labels(public_inputs, released_logits, inputs)
    return float(np.mean(predicted == y)), float(np.bincount(y).max() / len(y))


def logit_audit(public_inputs: np.ndarray, released_logits: np.ndarray, inputs: np.ndarray,
                labels: np.ndarray) -> dict[str, float]:
    """The ``leak-*`` metrics of a public-logit release: the client's record labels read through a
    surrogate calibrated on the public set (:func:`record_label_leak`), and its floor."""
    acc, floor = record_label_leak(public_inputs, released_logits, inputs, labels)
    return {"leak-record-label-acc": acc, "leak-record-label-acc-floor": floor}


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
