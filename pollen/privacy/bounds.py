"""Screening bounds that follow the DP mechanism: from the run's DP keys, how far an honest private
reply can lie from what it was clipped to, so a strategy can refuse anything further.

The server knows ``dp-clip`` and σ (``dp-noise-multiplier``, or the σ a client calibrates for
``dp-target-epsilon`` over ``num-server-rounds`` releases, recomputed here with the same function), so
it knows each mechanism's noise std. An honest reply is the clipped value plus Gaussian noise; two
tail bounds turn that into limits an honest reply exceeds with probability at most
:data:`FALSE_REFUSAL`, union-bounded over everything one reply is checked on:

* one coordinate: ``P(|N(0, s²)| > k·s) ≤ 2·exp(−k²/2)``; over n coordinates ``k = √(2·ln(2n/p))``;
* a vector of d coordinates: ``‖N(0, s²·I_d)‖`` is an s-Lipschitz function of a standard Gaussian with
  mean ≤ s·√d, so ``P(‖noise‖ ≥ s·(√d + t)) ≤ exp(−t²/2)``; ``t = √(2·ln(m/p))`` for m such norms;
* a clipped value v (‖v‖ ≤ clip) plus noise: the noise along v and across it are independent, so
  ``‖v + noise‖ ≤ √((clip + k·s)² + (s·(√d + t))²)`` (:func:`clipped_noisy_norm`).

Replies travel in float32: every limit gets the rounding of the values it is checked on (a relative
:data:`ROUNDING` of the largest magnitude involved). ``dp-mode = sample`` trains with DP-SGD, whose
model replies carry no noise of their own: only its prototype release is bounded (with a target ε each
client's σ depends on its record count, unknown to the server: the bound is sized by the count noise
std a reply declares, which must be at least the floor the keys give).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pollen.privacy.accounting import DEFAULT_NEIGHBOUR
from pollen.privacy.config import PrivacyConfig
from pollen.privacy.mechanisms import PROTOTYPE_SENSITIVITY_UNITS

# The most an honest private reply may be refused with, all of its checks together.
FALSE_REFUSAL = 1e-9
# Relative rounding allowed on top of a limit: float32's unit roundoff is 2^-24; twice that covers the
# rounding of the reply and of the difference taken from it.
ROUNDING = 2.0**-23


def coordinate_bound(std: float, count: int, failure: float) -> float:
    """``k·std`` that none of ``count`` i.i.d. N(0, std²) coordinates exceeds in magnitude, except with
    probability ≤ ``failure``: ``count · 2·exp(−k²/2) = failure``."""
    return std * math.sqrt(2.0 * math.log(2.0 * max(count, 1) / failure))


def norm_bound(std: float, dims: int, count: int, failure: float) -> float:
    """``std·(√dims + t)`` that none of ``count`` N(0, std²·I_dims) vectors exceeds in L2 norm, except with
    probability ≤ ``failure``: ``count · exp(−t²/2) = failure`` (Gaussian concentration of the norm)."""
    return std * (math.sqrt(dims) + math.sqrt(2.0 * math.log(max(count, 1) / failure)))


def clipped_noisy_norm(clip: float, std: float, dims: int, count: int, failure: float) -> float:
    """The L2 norm none of ``count`` vectors ``v + N(0, std²·I_dims)`` with ``‖v‖ ≤ clip`` exceeds, except
    with probability ≤ ``failure``. The noise splits into its coordinate along v and the rest, independent
    Gaussians (rotation invariance): ``‖v + n‖² = (‖v‖ + n₁)² + ‖n_⊥‖²``; half of ``failure`` bounds each
    (tighter than ``clip + ‖n‖``, which adds lengths that are nearly orthogonal)."""
    along = clip + coordinate_bound(std, count, failure / 2.0)
    return math.hypot(along, norm_bound(std, dims, count, failure / 2.0))


def _norm(arrays: Iterable[np.ndarray]) -> float:
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            total += float(np.square(np.asarray(a, dtype=np.float64)).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


@dataclass(frozen=True)
class DpBounds:
    """The noise of the run's mechanisms, as the server derives it from the DP keys, and the limit of
    each payload kind. ``source`` names the keys, so every refusal says where its bound came from."""

    mode: str
    clip: float
    noise_multiplier: float
    source: str
    failure: float = FALSE_REFUSAL
    # ``sample`` with a target ε: each client calibrates σ with its own record count, which the server
    # does not know; ``noise_multiplier`` is then the least σ any client can have (below).
    sigma_is_floor: bool = False

    @property
    def bounds_models(self) -> bool:
        """Model, logit and GLFC replies carry the mechanism's noise only under ``payload``."""
        return self.mode == "payload"

    def _refuse(self, what: str, value: float, limit: float, how: str) -> str | None:
        if value <= limit:
            return None
        return f"{what} {value:.6g} above the DP bound {limit:.6g} = {how} ({self.source})"

    def update_limit(self, entries: int, base_norm: float, std: float, checks: int = 1) -> float:
        """``‖reply − broadcast‖`` of an update clipped to ``dp-clip`` plus N(0, std²) on ``entries``
        coordinates, one of ``checks`` norms bounded together; plus the rounding of the float32 reply."""
        limit = clipped_noisy_norm(self.clip, std, entries, checks, self.failure)
        return limit + ROUNDING * (base_norm + limit)

    def check_update(self, reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                     std_units: float = 1.0, checks: int = 1, what: str = "update norm") -> str | None:
        """Weights (``std_units`` = 1) and GLFC's model: the float entries' update against
        :meth:`update_limit`, noise std σ·clip·``std_units``."""
        keys = [k for k in broadcast if np.asarray(broadcast[k]).dtype.kind == "f"]
        entries = sum(int(np.size(broadcast[k])) for k in keys)
        with np.errstate(over="ignore", invalid="ignore"):
            delta = _norm(np.asarray(reply[k], dtype=np.float64) - np.asarray(broadcast[k], dtype=np.float64)
                          for k in keys)
        std = self.noise_multiplier * self.clip * std_units
        limit = self.update_limit(entries, _norm(broadcast[k] for k in keys), std, checks)
        return self._refuse(what, delta, limit,
                            f"dp-clip {self.clip:g} with the noise bound of {entries} entries at std {std:.4g}")

    def model_noise_warning(self, model: Mapping[str, np.ndarray], clients: int, std_units: float = 1.0) -> str | None:
        """Why a private model run may diverge, said before round 1, or ``None``. Each round's average of
        ``clients`` releases carries noise of expected norm σ·clip·``std_units``·√(d / clients) over the
        model's d float entries (uniform weights; the noise of independent releases averages down by
        √clients). When that is larger than the whole model, the next round trains on a model that is
        mostly noise, and its loss tends to overflow to NaN a round or two later."""
        if not self.bounds_models or clients < 1:
            return None
        keys = [k for k in model if np.asarray(model[k]).dtype.kind == "f"]
        entries = sum(int(np.size(model[k])) for k in keys)
        noise = self.noise_multiplier * self.clip * std_units * math.sqrt(entries / clients)
        size = _norm(model[k] for k in keys)
        if noise <= size:
            return None
        scale = "" if std_units == 1.0 else f"·{std_units:.3g}"
        return (f"differential privacy: each round's averaged model gets noise of norm ≈ {noise:.3g} "
                f"(σ·clip{scale}·√(d / k): σ {self.noise_multiplier:.4g}, dp-clip {self.clip:g}, d = {entries} float "
                f"entries, k = {clients} clients a round), more than the model's own norm {size:.3g}: training "
                f"is likely to diverge (NaN loss) within a few rounds; lower dp-noise-multiplier (or raise "
                f"dp-target-epsilon) or dp-clip, or sample more clients per round ({self.source})")

    def check_logits(self, logits: np.ndarray) -> str | None:
        """Each of the N0 public-sample rows was clipped to ``dp-clip``, then N(0, (σ·clip·√N0)²) on every
        entry: the whole matrix within :func:`clipped_noisy_norm` of clip·√N0 (its sensitivity) over N0·C
        entries (what catches a scaled matrix), and each row within that of clip over C entries, N0 rows
        (what catches one inflated row); half of the failure probability each."""
        rows, cols = logits.shape
        std = self.noise_multiplier * self.clip * math.sqrt(rows)
        values = np.asarray(logits, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            row_norms = np.linalg.norm(values, axis=1) if rows else np.zeros(1)
        total = _norm([values])
        limit = clipped_noisy_norm(self.clip * math.sqrt(rows), std, rows * cols, 1, self.failure / 2.0)
        reason = self._refuse("logit matrix norm", total, limit * (1.0 + ROUNDING),
                              f"dp-clip {self.clip:g}·√N0 with the noise bound of {rows * cols} entries at std "
                              f"{std:.4g} (σ·clip·√N0, N0 = {rows})")
        if reason is not None:
            return reason
        worst = float(np.max(row_norms))
        limit = clipped_noisy_norm(self.clip, std, cols, rows, self.failure / 2.0)
        return self._refuse("logit row norm", worst if math.isfinite(worst) else math.inf, limit * (1.0 + ROUNDING),
                            f"dp-clip {self.clip:g} with the noise bound of {cols} entries at std {std:.4g} "
                            f"(σ·clip·√N0, N0 = {rows})")

    def check_glfc(self, reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                   gradient_sets: Sequence[Mapping[str, np.ndarray]], max_sets: int) -> str | None:
        """GLFC: the model update and each gradient set clipped to ``dp-clip``, noise std σ·clip·√(1 + K)
        on every entry (K = ``max_sets``); 1 + K norms bounded together."""
        units = math.sqrt(1 + max_sets)
        reason = self.check_update(reply, broadcast, units, 1 + max_sets)
        if reason is not None:
            return reason
        std = self.noise_multiplier * self.clip * units
        for i, grads in enumerate(gradient_sets):
            entries = sum(int(np.size(g)) for g in grads.values())
            limit = clipped_noisy_norm(self.clip, std, entries, 1 + max_sets, self.failure) * (1.0 + ROUNDING)
            reason = self._refuse(f"gradient set g{i} norm", _norm(grads.values()), limit,
                                  f"dp-clip {self.clip:g} with the noise bound of {entries} entries at std {std:.4g} "
                                  f"(σ·clip·√(1 + K), K = {max_sets})")
            if reason is not None:
                return reason
        return None

    @property
    def count_std(self) -> float:
        """The count noise std of a prototype release: σ·√2 (one row moves a sum by clip and a count by 1)."""
        return self.noise_multiplier * PROTOTYPE_SENSITIVITY_UNITS

    def check_prototypes(self, sums: np.ndarray, counts: np.ndarray, count_std: float, max_count: int) -> str | None:
        """Noisy per-class sums (C×d) and counts (C): every sum coordinate within clip·``max_count`` +
        k·σ·√2·clip, every count in [−k·σ·√2, ``max_count`` + k·σ·√2], k over all C·d + C entries. The
        declared count std must be the one the keys give; where σ is only a floor (:attr:`sigma_is_floor`)
        at least that, and the bound is sized by the declared one."""
        std = self.count_std
        if self.sigma_is_floor:
            if not count_std >= std * (1.0 - 1e-6):
                return (f"'count-noise-std' {count_std:.6g} is below the DP floor σ·√2 = {std:.6g} ({self.source})")
            std = float(count_std)
        elif not abs(count_std - std) <= 1e-6 * std:
            return f"'count-noise-std' {count_std:.6g} is not the DP count noise std σ·√2 = {std:.6g} ({self.source})"
        k_std = coordinate_bound(std, int(np.size(sums)) + int(np.size(counts)), self.failure)
        top = float(np.max(np.abs(sums))) if np.size(sums) else 0.0
        limit = (self.clip * max_count + k_std * self.clip) * (1.0 + ROUNDING)
        reason = self._refuse("prototype sum magnitude", top, limit,
                              f"dp-clip {self.clip:g} × max count {max_count} + {k_std / std:.3g} stds of "
                              f"{std * self.clip:.4g}")
        if reason is not None or not np.size(counts):
            return reason
        low, high = -k_std * (1.0 + ROUNDING), (max_count + k_std) * (1.0 + ROUNDING)
        c = np.asarray(counts, dtype=np.float64)
        if c.min() < low or c.max() > high:
            bad = c.min() if c.min() < low else c.max()
            return (f"noisy count {bad:.6g} outside the DP bound [{low:.6g}, {high:.6g}] = max count {max_count} "
                    f"± {k_std / std:.3g} stds of {std:.4g} ({self.source})")
        return None


def dp_bounds(config: PrivacyConfig, planned_releases: int, failure: float = FALSE_REFUSAL,
              unit: str = "record") -> DpBounds | None:
    """The run's DP keys as screening bounds (``None`` with ``dp-mode = off`` or ``distributed``, whose
    server reads only noisy sums). σ is the clients' own: given, or
    :meth:`~pollen.privacy.config.PrivacyConfig.payload_noise_multiplier` for
    ``planned_releases`` (computed once, here). Under ``sample`` with a target ε a client's σ also pays
    for its DP-SGD steps, which depend on its record count; composing more releases only raises ε, so
    the σ of the prototype releases alone is a floor every client's σ is at or above. ``unit``: what the
    releases protect (:func:`~pollen.privacy.config.release_unit`; a target ε is met under its neighbour
    relation)."""
    if not config.private or config.mode == "distributed":  # distributed: the server reads only noisy sums
        return None
    sigma = config.payload_noise_multiplier(planned_releases, unit)
    if config.noise_multiplier > 0:
        how = "dp-noise-multiplier"
    else:
        how = (f"calibrated for dp-target-epsilon {config.target_epsilon:g} over {planned_releases} releases at "
               f"dp-delta {config.delta:g}, {DEFAULT_NEIGHBOUR[unit]} {unit}")
    floor = config.mode == "sample" and config.noise_multiplier <= 0
    source = f"dp-mode {config.mode}, dp-clip {config.clip:g}, σ {'>= ' if floor else ''}{sigma:.6g} from {how}"
    return DpBounds(config.mode, float(config.clip), float(sigma), source, failure, floor)
