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
  ``‖v + noise‖ ≤ √((clip + k·s)² + (s·(√d + t))²)`` (:func:`clipped_noisy_norm`);
* every coordinate of v is at most clip, so each coordinate of ``v + noise`` is within ``clip + k·s``
  (what catches a large value on a few coordinates that the norm lets through);
* the noise across v alone has norm at least ``s·((d−1)/√d − t)`` (:func:`noise_floor`): a reply whose
  norm is below it carries less noise than the mechanism adds, so it is not a release and is refused.

Each reply's failure probability is split, never spent twice: equally between its kinds of check, and
within a kind over every vector or coordinate it covers (GLFC: the model update and K gradient sets).

Replies travel in float32: every limit gets the rounding of the values it is checked on (a relative
:data:`ROUNDING` of the largest magnitude involved). ``dp-mode = sample`` trains with DP-SGD, whose
model replies carry no noise of their own: only its prototype release is bounded (with a target ε each
client's σ depends on its record count, unknown to the server: the bound is sized by the count noise
std a reply declares, which must be at least the floor the keys give).
"""

from __future__ import annotations

import functools
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


def noise_floor(std: float, dims: int, count: int, failure: float) -> float:
    """The L2 norm every one of ``count`` vectors ``v + N(0, std²·I_dims)`` exceeds, whatever v, except with
    probability ≤ ``failure`` (0 where no such floor exists). The noise across v is N(0, std²·I_m), m =
    dims − 1, whose norm has mean ≥ std·m/√(m + 1) and falls t·std below it with probability ≤
    exp(−t²/2) (Gaussian concentration, lower tail); ``‖v + n‖ ≥ ‖n_⊥‖``."""
    m = max(dims - 1, 0)
    t = math.sqrt(2.0 * math.log(max(count, 1) / failure))
    return max(0.0, std * (m / math.sqrt(m + 1) - t))


def clipped_noisy_norm(clip: float, std: float, dims: int, count: int, failure: float) -> float:
    """The L2 norm none of ``count`` vectors ``v + N(0, std²·I_dims)`` with ``‖v‖ ≤ clip`` exceeds, except
    with probability ≤ ``failure``. The noise splits into its coordinate along v and the rest, independent
    Gaussians (rotation invariance): ``‖v + n‖² = (‖v‖ + n₁)² + ‖n_⊥‖²``; half of ``failure`` bounds each
    (tighter than ``clip + ‖n‖``, which adds lengths that are nearly orthogonal)."""
    along = clip + coordinate_bound(std, count, failure / 2.0)
    return math.hypot(along, norm_bound(std, dims, count, failure / 2.0))


def _max_abs(arrays: Iterable[np.ndarray]) -> float:
    top = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            if np.size(a):
                top = max(top, float(np.max(np.abs(np.asarray(a, dtype=np.float64)))))
    return top if math.isfinite(top) else math.inf


def _norm(arrays: Iterable[np.ndarray]) -> float:
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            total += float(np.square(np.asarray(a, dtype=np.float64)).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


COUNT_GRID = 2.0 ** 0.125  # record counts the count-noise cap rounds to (a calibration per grid step)


def _grid_down(n: float) -> int:
    """The largest grid point (``COUNT_GRID``'s powers, whole numbers, at least 1) at or below ``n``."""
    point = math.floor(COUNT_GRID ** math.floor(math.log(max(n, 1.0), COUNT_GRID) + 1e-9))
    return max(1, min(point, math.floor(n)))


def _grid_up(n: float) -> int:
    """The smallest grid point at or above ``n``."""
    return max(math.ceil(COUNT_GRID ** math.ceil(math.log(max(n, 1.0), COUNT_GRID) - 1e-9)), math.ceil(n))


@functools.lru_cache(maxsize=256)
def _calibrated_cap(target_epsilon: float, delta: float, rounds: int, rate: float, steps: int,
                    full_per_round: int) -> float | None:
    """σ of the DP-SGD plan a client would calibrate (:func:`pollen.privacy.accounting.calibrate_noise_multiplier`);
    a pure function of its arguments, kept because each costs seconds and replies repeat it."""
    from pollen.privacy.accounting import calibrate_noise_multiplier

    try:
        return calibrate_noise_multiplier(target_epsilon, delta, rounds, rate, steps, full_per_round)
    except ValueError:
        return None


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
    # ``sample`` with a target ε: what the server needs to cap a declared count noise std from above
    # (:meth:`count_std_cap`): the planned rounds, the DP-SGD epochs and batch size, the full releases a round.
    target_epsilon: float = 0.0
    delta: float = 0.0
    rounds: int = 0
    sgd_epochs: int = 0
    sgd_batch: int = 0
    full_per_round: int = 1

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

    def check_vector(self, what: str, delta: list[np.ndarray], base: list[np.ndarray], clip: float, std: float,
                     count: int, failure: float, how: str, coordinate_clip: float | None = None) -> str | None:
        """One clipped-plus-noise vector (``delta``, the release minus what the server knows, ``base``), one
        of ``count`` checked together at ``failure`` in all: its norm (:func:`clipped_noisy_norm`), its
        largest coordinate (``coordinate_clip``, by default ``clip``, + k·std, k over every coordinate of the
        ``count`` vectors) and its noise floor (:func:`noise_floor`), a third of ``failure`` each; float32
        rounding on top."""
        entries = sum(int(np.size(d)) for d in delta)
        size, base_norm = _norm(delta), _norm(base)
        limit = clipped_noisy_norm(clip, std, entries, count, failure / 3.0)
        reason = self._refuse(f"{what} norm", size, limit + ROUNDING * (base_norm + limit),
                              f"{how} with the noise bound of {entries} entries at std {std:.4g}")
        if reason is not None:
            return reason
        most = clip if coordinate_clip is None else coordinate_clip
        top = most + coordinate_bound(std, entries * count, failure / 3.0)
        reason = self._refuse(f"{what} coordinate", _max_abs(delta), top + ROUNDING * (_max_abs(base) + top),
                              f"{most:g} + {(top - most) / std if std else 0:.3g} stds of {std:.4g} ({how})")
        if reason is not None:
            return reason
        floor = noise_floor(std, entries, count, failure / 3.0) - ROUNDING * (base_norm + limit)
        if size < floor:
            return (f"{what} norm {size:.6g} below the DP noise floor {floor:.6g} of {entries} entries at std "
                    f"{std:.4g}: a reply without its noise is not a release ({self.source})")
        return None

    def check_update(self, reply: Mapping[str, np.ndarray], broadcast: Mapping[str, np.ndarray],
                     std_units: float = 1.0, checks: int = 1, what: str = "update",
                     failure: float | None = None) -> str | None:
        """Weights (``std_units`` = 1) and GLFC's model: the float entries' update as one clipped-plus-noise
        vector (:meth:`check_vector`), noise std σ·clip·``std_units``, one of ``checks`` vectors."""
        keys = [k for k in broadcast if np.asarray(broadcast[k]).dtype.kind == "f"]
        with np.errstate(over="ignore", invalid="ignore"):
            delta = [np.asarray(reply[k], dtype=np.float64) - np.asarray(broadcast[k], dtype=np.float64)
                     for k in keys]
        std = self.noise_multiplier * self.clip * std_units
        return self.check_vector(what, delta, [np.asarray(broadcast[k]) for k in keys], self.clip, std, checks,
                                 self.failure if failure is None else failure, f"dp-clip {self.clip:g}")

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
        # the matrix: its norm, each entry (a clipped row's entries are at most clip) and its noise floor
        reason = self.check_vector("logit matrix", [values], [], self.clip * math.sqrt(rows), std, 1,
                                   self.failure / 2.0, f"dp-clip {self.clip:g}·√N0, N0 = {rows}, noise σ·clip·√N0",
                                   coordinate_clip=self.clip)
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
        on every entry (K = ``max_sets``): 1 + K vectors checked together (:meth:`check_vector`), the
        reply's failure probability shared among them once."""
        units = math.sqrt(1 + max_sets)
        reason = self.check_update(reply, broadcast, units, 1 + max_sets)
        if reason is not None:
            return reason
        std = self.noise_multiplier * self.clip * units
        for i, grads in enumerate(gradient_sets):
            reason = self.check_vector(f"gradient set g{i}", [np.asarray(g) for g in grads.values()], [], self.clip,
                                       std, 1 + max_sets, self.failure,
                                       f"dp-clip {self.clip:g}, noise σ·clip·√(1 + K), K = {max_sets}")
            if reason is not None:
                return reason
        return None

    @property
    def count_std(self) -> float:
        """The count noise std of a prototype release: σ·√2 (one row moves a sum by clip and a count by 1)."""
        return self.noise_multiplier * PROTOTYPE_SENSITIVITY_UNITS

    def count_std_cap(self, counts: np.ndarray, count_std: float, max_count: int, failure: float) -> float | None:
        """The most count noise std an honest client can declare under ``sample`` with a target ε (``None``
        where σ is not a floor). A client calibrates σ for its record count n: ``epochs·⌈n / batch⌉`` DP-SGD
        steps a round at rate q = min(1, batch / n), plus the full releases. The server does not know n, but
        the released counts bound it: their sum is n plus N(0, C·std²), so n lies in
        [Σ counts − k, Σ counts + k] (k = std·√C·√(2·ln(1/failure))), and in [1, ``max_count``]. A plan
        with a higher rate and more steps than any n of that range costs more ε at every σ, so its σ (the
        same calibration the clients run) is at least every honest client's: rate at the range's low end,
        steps at its high end, each widened to a grid of 2^(1/8) so that replies of similar sizes share
        one calibration (:func:`_calibrated_cap`). 1 % on top for the calibrations' precision (1e-3)."""
        if not self.sigma_is_floor or self.rounds < 1 or self.sgd_epochs < 1 or self.sgd_batch < 1:
            return None
        c = np.asarray(counts, dtype=np.float64)
        total, k = float(c.sum()), count_std * math.sqrt(c.size) * math.sqrt(2.0 * math.log(1.0 / failure))
        if not (math.isfinite(total) and math.isfinite(k)):
            return None
        n_low = _grid_down(max(1.0, min(float(max_count), total - k)))
        n_high = _grid_up(max(1.0, min(float(max_count), total + k)))
        rate = min(1.0, self.sgd_batch / n_low)
        steps = self.sgd_epochs * math.ceil(n_high / self.sgd_batch)
        sigma = _calibrated_cap(self.target_epsilon, self.delta, self.rounds, rate, steps, self.full_per_round)
        return None if sigma is None else sigma * PROTOTYPE_SENSITIVITY_UNITS * 1.01

    def check_prototypes(self, sums: np.ndarray, counts: np.ndarray, count_std: float, max_count: int) -> str | None:
        """Noisy per-class sums (C×d) and counts (C), tied together: a class's true count is at most its
        noisy count + k stds (and ``max_count``), so its sum row, n_c clipped rows plus noise, is bounded
        in norm (:func:`clipped_noisy_norm` of clip·n_c) and per coordinate (clip·n_c + k·std·clip); every
        count lies in [−k·std, ``max_count`` + k·std]; the sums carry at least their noise
        (:func:`noise_floor`). The declared count std must be the one the keys give; where σ is only a
        floor (:attr:`sigma_is_floor`) at least that and at most :meth:`count_std_cap`, and the bounds are
        sized by the declared one. The failure probability is shared equally by the six checks."""
        failure = self.failure / 6.0  # count range, count tail, sum coordinates, row norms, floor, std cap
        std = self.count_std
        if self.sigma_is_floor:
            if not count_std >= std * (1.0 - 1e-6):
                return (f"'count-noise-std' {count_std:.6g} is below the DP floor σ·√2 = {std:.6g} ({self.source})")
            cap = self.count_std_cap(counts, count_std, max_count, failure)
            if cap is not None and count_std > cap:
                return (f"'count-noise-std' {count_std:.6g} is above {cap:.6g}, the most a client's σ·√2 can be for "
                        f"the records its counts show ({self.sgd_epochs} epoch(s) in batches of {self.sgd_batch} a "
                        f"round, {self.source})")
            std = float(count_std)
        elif not abs(count_std - std) <= 1e-6 * std:
            return f"'count-noise-std' {count_std:.6g} is not the DP count noise std σ·√2 = {std:.6g} ({self.source})"
        c = np.asarray(counts, dtype=np.float64).ravel()
        rows = np.asarray(sums, dtype=np.float64)
        if not c.size:
            return None
        k_count = coordinate_bound(std, c.size, failure)
        low, high = -k_count * (1.0 + ROUNDING), (max_count + k_count) * (1.0 + ROUNDING)
        if not (c.min() >= low and c.max() <= high):
            bad = c.min() if not c.min() >= low else c.max()
            return (f"noisy count {bad:.6g} outside the DP bound [{low:.6g}, {high:.6g}] = max count {max_count} "
                    f"± {k_count / std:.3g} stds of {std:.4g} ({self.source})")
        held = np.clip(c + coordinate_bound(std, c.size, failure), 0.0, float(max_count))  # n_c at most
        sum_std, dims = std * self.clip, int(rows.shape[1]) if rows.ndim == 2 else 0
        k_sum = coordinate_bound(sum_std, int(rows.size), failure)
        with np.errstate(over="ignore", invalid="ignore"):
            tops = np.max(np.abs(rows), axis=1) if dims else np.zeros(c.size)
            norms = np.linalg.norm(rows, axis=1) if dims else np.zeros(c.size)
        for cls in range(c.size):
            limit = (self.clip * held[cls] + k_sum) * (1.0 + ROUNDING)
            if not tops[cls] <= limit:
                return (f"prototype sum magnitude {tops[cls]:.6g} of class {cls} above the DP bound {limit:.6g} = "
                        f"dp-clip {self.clip:g} × its count bound {held[cls]:.4g} (noisy count + k stds, at most max "
                        f"count {max_count}) + {k_sum / sum_std:.3g} stds of {sum_std:.4g} ({self.source})")
            limit = clipped_noisy_norm(self.clip * held[cls], sum_std, dims, c.size, failure) * (1.0 + ROUNDING)
            if not norms[cls] <= limit:
                return (f"prototype sum norm {norms[cls]:.6g} of class {cls} above the DP bound {limit:.6g} = "
                        f"dp-clip {self.clip:g} × its count bound {held[cls]:.4g} with the noise bound of {dims} "
                        f"entries at std {sum_std:.4g} ({self.source})")
        total, limit = _norm([rows]), float(np.sqrt(np.sum(np.square(self.clip * held))))
        floor = noise_floor(sum_std, int(rows.size), 1, failure) - ROUNDING * (total + limit)
        if total < floor:
            return (f"prototype sums norm {total:.6g} below the DP noise floor {floor:.6g} of {rows.size} entries at "
                    f"std {sum_std:.4g}: a reply without its noise is not a release ({self.source})")
        return None


def dp_bounds(config: PrivacyConfig, planned_releases: int, failure: float = FALSE_REFUSAL,
              unit: str = "record", sgd_epochs: int = 0, sgd_batch: int = 0) -> DpBounds | None:
    """The run's DP keys as screening bounds (``None`` with ``dp-mode = off`` or ``distributed``, whose
    server reads only noisy sums). σ is the clients' own: given, or
    :meth:`~pollen.privacy.config.PrivacyConfig.payload_noise_multiplier` for
    ``planned_releases`` (computed once, here). Under ``sample`` with a target ε a client's σ also pays
    for its DP-SGD steps, which depend on its record count; composing more releases only raises ε, so
    the σ of the prototype releases alone is a floor every client's σ is at or above. ``unit``: what the
    releases protect (:func:`~pollen.privacy.config.release_unit`; a target ε is met under its neighbour
    relation). ``sgd_epochs`` and ``sgd_batch`` (DP-SGD's epochs and batch size, ``sample``) let the server
    cap the count noise a client declares (:meth:`DpBounds.count_std_cap`)."""
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
    return DpBounds(config.mode, float(config.clip), float(sigma), source, failure, floor,
                    target_epsilon=config.target_epsilon, delta=config.delta, rounds=planned_releases,
                    sgd_epochs=sgd_epochs, sgd_batch=sgd_batch, full_per_round=1 + config.evaluations)
