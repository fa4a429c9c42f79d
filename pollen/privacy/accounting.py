"""The per-client ε ledger and noise calibration, on Google's ``dp-accounting``.

How ε is computed: releases on all of a client's data (``dp-mode = payload``) are Gaussian mechanisms,
and Gaussians compose into one Gaussian, whose ε at δ ``dp-accounting`` computes exactly (the analytic
Gaussian mechanism) in a millisecond. Once a release is Poisson-subsampled (DP-SGD), the
privacy-loss-distribution (PLD) accountant gives the tightest ε ``dp-accounting`` can certify. RDP is
a looser but independent bound, the cross-check: an ε above RDP's signals a bug. Flower's
``RdpAccountant`` would give only that looser bound.

A ledger stores its releases, not an accountant object: run-length ``(noise multiplier, sampling
probability, count)`` triples, a few numbers per client. ε is recomputed from them, so a ledger
serialised to JSON, persisted with the node's state and read back after a restart reaches exactly the
ε of one that never stopped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dp_accounting

# dp-accounting (scipy) is imported where ε is computed: importing it costs ~1 s, which the launcher
# and the config check, which only read the DP keys, should not pay.

# PLD grid step of the privacy loss. 1e-3 is ~10x faster than the library's 1e-4 and changes ε by
# less than 1e-6 relative for the Gaussian mechanisms Pollen composes (tests/test_privacy.py checks).
PLD_INTERVAL = 1e-3


@dataclass(frozen=True)
class Release:
    """``count`` invocations of a Gaussian mechanism with noise std = ``noise_multiplier`` × its L2
    sensitivity, each on a Poisson sample of the records with ``sampling_probability`` (1 = all)."""

    noise_multiplier: float
    sampling_probability: float = 1.0
    count: int = 1

    def __post_init__(self):
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"noise multiplier must be a finite number > 0, got {self.noise_multiplier!r}")
        if not 0 < self.sampling_probability <= 1:
            raise ValueError(f"sampling probability must be in (0, 1], got {self.sampling_probability!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"release count must be an integer >= 1, got {self.count!r}")

    def event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_probability == 1.0:
            return dp_accounting.SelfComposedDpEvent(gaussian, self.count)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(self.sampling_probability, gaussian), self.count)


def _full_gaussian_sigma(releases: Iterable[Release]) -> float | None:
    """The one Gaussian equivalent to all unsampled releases: composing Gaussians with multipliers σ_i
    is exactly a Gaussian with σ = (Σ 1/σ_i²)^(-1/2). One PLD instead of many keeps ε cheap."""
    inverse = sum(r.count / r.noise_multiplier ** 2 for r in releases if r.sampling_probability == 1.0)
    return 1.0 / math.sqrt(inverse) if inverse > 0 else None


def _same_mechanisms_together(releases: Iterable[Release]) -> list[Release]:
    """The releases with every mechanism's invocations summed into one release, in first-seen order.
    Composition does not depend on order, so this is the same composition; but the PLD accountant
    self-composes n invocations of one mechanism at once, while composing them release by release costs
    one convolution each. A DP-SGD client alternates its training release with its prototype release,
    so its ledger holds one training release per round: composed one by one, ε cost more with every
    round (minutes per round after 70 rounds of the privacy study), together it costs the same at
    round 100 as at round 1, and the same ε to 1e-8 relative."""
    counts: dict[tuple[float, float], int] = {}
    for r in releases:
        key = (r.noise_multiplier, r.sampling_probability)
        counts[key] = counts.get(key, 0) + r.count
    return [Release(sigma, q, n) for (sigma, q), n in counts.items()]


def composed_epsilon(releases: Iterable[Release], delta: float) -> float:
    """ε at ``delta`` of all ``releases`` composed (0 for none): exact for Gaussians on all the data,
    by the PLD accountant once any release is subsampled."""
    from dp_accounting import GaussianDpEvent, gaussian_mechanism
    from dp_accounting.pld import pld_privacy_accountant

    releases = list(releases)
    sigma = _full_gaussian_sigma(releases)
    sampled = _same_mechanisms_together(r for r in releases if r.sampling_probability < 1.0)
    if not sampled:
        return 0.0 if sigma is None else float(gaussian_mechanism.get_epsilon_gaussian(sigma, delta))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    if sigma is not None:
        accountant.compose(GaussianDpEvent(sigma))
    for r in sampled:
        accountant.compose(r.event())
    try:
        return max(0.0, float(accountant.get_epsilon(delta)))
    except ValueError as err:  # the loss distribution outgrew the accountant's grid: ε in the hundreds
        raise ValueError(f"epsilon of these releases is too large to account ({err}): raise the noise "
                         "multiplier") from err


def rdp_epsilon(releases: Iterable[Release], delta: float) -> float:
    """ε at ``delta`` by the RDP accountant: an independent, looser bound (the cross-check)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    for r in _same_mechanisms_together(releases):
        accountant.compose(r.event())
    return float(accountant.get_epsilon(delta))


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return delta


class Ledger:
    """One client's composed releases and the ε they cost at a fixed δ."""

    def __init__(self, delta: float, releases: Iterable[Release] = ()):
        self.delta = _check_delta(delta)
        self.releases: list[Release] = []
        for r in releases:
            self.add(r)

    def add(self, release: Release) -> None:
        """Compose one more release (merged with the last one when it is the same mechanism)."""
        last = self.releases[-1] if self.releases else None
        if last is not None and (last.noise_multiplier, last.sampling_probability) == (
                release.noise_multiplier, release.sampling_probability):
            self.releases[-1] = Release(last.noise_multiplier, last.sampling_probability, last.count + release.count)
        else:
            self.releases.append(release)

    @property
    def count(self) -> int:
        return sum(r.count for r in self.releases)

    def epsilon(self) -> float:
        return composed_epsilon(self.releases, self.delta)

    def epsilon_rdp(self) -> float:
        return rdp_epsilon(self.releases, self.delta)

    def epsilon_after(self, *releases: Release) -> float:
        """ε if ``releases`` were composed next; the ledger is unchanged."""
        return composed_epsilon([*self.releases, *releases], self.delta)

    def to_dict(self) -> dict[str, Any]:
        """A small JSON-able dict (the node's persisted state keeps it)."""
        return {"delta": self.delta,
                "releases": [[r.noise_multiplier, r.sampling_probability, r.count] for r in self.releases]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Ledger:
        """Inverse of :meth:`to_dict`; a malformed dict is refused naming what is wrong."""
        if not isinstance(data, Mapping) or "delta" not in data or "releases" not in data:
            raise ValueError(f"privacy ledger must be a dict with 'delta' and 'releases', got {data!r}")
        rows = data["releases"]
        if not isinstance(rows, list) or not all(isinstance(row, (list, tuple)) and len(row) == 3 for row in rows):
            raise ValueError(f"privacy ledger 'releases' must be [noise multiplier, sampling probability, count] "
                             f"triples, got {rows!r}")
        return cls(float(data["delta"]), [Release(float(s), float(q), int(c)) for s, q, c in rows])


@functools.lru_cache(maxsize=64)
def calibrate_noise_multiplier(target_epsilon: float, delta: float, releases: int,
                               sampling_probability: float = 1.0, steps_per_release: int = 1,
                               full_per_release: int = 0, rtol: float = 1e-3) -> float:
    """The smallest noise multiplier (to ``rtol``) whose ``releases`` × (``steps_per_release``
    mechanisms at ``sampling_probability`` + ``full_per_release`` on all the data) stay within
    ``target_epsilon`` at ``delta``: bisection on log σ over :func:`composed_epsilon`.

    ε falls as σ grows, so the bracket [lo, hi] keeps ε(lo) > target >= ε(hi) and the answer is hi:
    never above the target.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    _check_delta(delta)
    if releases < 1 or steps_per_release < 1:
        raise ValueError(f"releases and steps per release must be >= 1, got {releases} and {steps_per_release}")

    def eps(sigma: float) -> float:
        plan = [Release(sigma, sampling_probability, releases * steps_per_release)]
        if full_per_release:
            plan.append(Release(sigma, 1.0, releases * full_per_release))
        return composed_epsilon(plan, delta)

    lo, hi = 0.05, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon {target_epsilon} at delta {delta}")
    if eps(lo) <= target_epsilon:
        raise ValueError(f"target epsilon {target_epsilon} at delta {delta} needs a noise multiplier below {lo}: "
                         "the target is too loose to calibrate; give the noise multiplier instead")
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
