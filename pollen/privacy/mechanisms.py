"""Gaussian mechanisms per payload kind: clip what a release depends on, add noise scaled to the
release's L2 sensitivity. Pure numpy.

``noise_multiplier`` σ is always relative to the sensitivity Δ of the *whole* release (noise std = σ·Δ
on every coordinate), so one release is one ``Release(σ)`` in the ledger, whatever its shape. The
neighbouring relation is add/remove of one *unit* of what the release is computed from; the unit and
Δ of each kind:

* prototypes — per-class sums of embeddings each clipped to ``clip``, and class counts, for all C
  classes; unit: one embedding row (not the dataset: per dataset the same release is only as private
  as σ/‖counts‖₂, docs/privacy.md); Δ = √2 in units where sums are divided by ``clip`` (one row moves
  one sum by <= clip and one count by 1), i.e. noise std σ·√2·clip on sums and σ·√2 on counts.
* weights — the update reply − broadcast, clipped to ``clip`` as one vector; unit: the client's whole
  update (its dataset); Δ = ``clip``.
* logits — every public-sample row of the N0×C matrix clipped to ``clip``; every row depends on all the
  client's data, so the unit is its dataset and Δ = ``clip·√N0`` (the matrix's largest Frobenius norm).

* GLFC — the model update (as weights) and each prototype-gradient set (all LeNet arrays of one set as
  one vector), each clipped to ``clip``; with at most K sets a round, the unit is the client's dataset
  and Δ = ``clip·√(1 + K)``.

For weights, logits and GLFC Δ is the norm bound of the release: the distance to the release of no data
(add/remove the client's dataset). Against replacing the dataset by another one, the distance doubles:
the same noise then gives the guarantee of σ/2.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pollen.privacy.clipping import clip_rows, clip_update


def secure_rng() -> np.random.Generator:
    """A generator seeded from the OS's entropy, never from the run seed: the server knows the run seed
    and could regenerate (and subtract) noise drawn from it. DP runs are therefore not bit-reproducible."""
    return np.random.default_rng(secrets.randbits(128))


def gaussian_noise(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """i.i.d. N(0, std²) in float64; ``std`` must be finite and > 0 (a zero std is no mechanism)."""
    if not (np.isfinite(std) and std > 0):
        raise ValueError(f"noise std must be a finite number > 0, got {std!r}")
    return rng.normal(0.0, std, size=shape)


@dataclass(frozen=True)
class PrototypeRelease:
    """What a client releases for prototypes: noisy per-class sums (C×d) and noisy counts (C), and the
    std of the count noise (the server needs it to tell held classes from noise)."""

    sums: np.ndarray
    counts: np.ndarray
    count_std: float
    clipped_fraction: float  # share of embeddings whose norm exceeded the clip


# One embedding row moves its class's sum by <= clip (after clipping) and its count by 1: with sums
# released in units of clip, the joint L2 sensitivity is sqrt(1 + 1).
PROTOTYPE_SENSITIVITY_UNITS = float(np.sqrt(2.0))


def release_prototypes(embeddings: np.ndarray, labels: np.ndarray, num_classes: int, clip: float,
                       noise_multiplier: float, rng: np.random.Generator) -> PrototypeRelease:
    """Noisy per-class sums of embeddings clipped to ``clip`` and noisy counts, for **all** classes
    (noise on every row, so which classes a client holds is hidden too). The server divides
    (``pollen.protocol.prototypes.divide_release``)."""
    z = np.asarray(embeddings)
    y = np.asarray(labels)
    if z.ndim != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"embeddings must be n×d with n labels, got {z.shape} and {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes or not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"labels must be integers in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    clipped, norms = clip_rows(z, clip)
    sums = np.zeros((num_classes, z.shape[1]), dtype=np.float64)
    np.add.at(sums, y, clipped)
    counts = np.bincount(y, minlength=num_classes).astype(np.float64)
    std_units = noise_multiplier * PROTOTYPE_SENSITIVITY_UNITS
    sums = sums + gaussian_noise(sums.shape, std_units * clip, rng)
    counts = counts + gaussian_noise(counts.shape, std_units, rng)
    fraction = float((norms > clip).mean()) if norms.size else 0.0
    return PrototypeRelease(sums, counts, std_units, fraction)


def release_update(reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray], clip: float,
                   noise_multiplier: float, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``broadcast + clip(reply − broadcast) + N(0, (σ·clip)²)`` by name, float64, and the update's
    norm before clipping."""
    update, norm = clip_update(reply, broadcast, clip)
    std = noise_multiplier * clip
    out = {name: np.asarray(broadcast[name], dtype=np.float64) + u + gaussian_noise(u.shape, std, rng)
           for name, u in update.items()}
    return out, norm


def release_logits(logits: np.ndarray, clip: float, noise_multiplier: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Rows clipped to ``clip`` plus N(0, (σ·clip·√N0)²) on every entry (float64), and the share of rows
    the clip cut."""
    clipped, norms = clip_rows(logits, clip)
    std = noise_multiplier * clip * np.sqrt(clipped.shape[0])
    return clipped + gaussian_noise(clipped.shape, std, rng), float((norms > clip).mean()) if norms.size else 0.0


def release_glfc(reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                 gradient_sets: list[Mapping[str, np.ndarray]], max_sets: int, clip: float, noise_multiplier: float,
                 rng: np.random.Generator) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """GLFC's reply: ``broadcast`` + the clipped update, and each gradient set clipped, all with
    N(0, (σ·clip·√(1 + max_sets))²) per entry (float64). The noise is sized for ``max_sets`` whatever the
    round's count, so the bound holds in every round."""
    if not 0 <= len(gradient_sets) <= max_sets:
        raise ValueError(f"{len(gradient_sets)} gradient sets, but the noise is sized for at most {max_sets}")
    update, _ = clip_update(reply, broadcast, clip)
    std = noise_multiplier * clip * float(np.sqrt(1 + max_sets))
    model = {name: np.asarray(broadcast[name], dtype=np.float64) + u + gaussian_noise(u.shape, std, rng)
             for name, u in update.items()}
    sets = []
    for grads in gradient_sets:
        clipped, _ = clip_update(grads, {k: np.zeros(np.shape(v)) for k, v in grads.items()}, clip)
        sets.append({k: g + gaussian_noise(g.shape, std, rng) for k, g in clipped.items()})
    return model, sets
