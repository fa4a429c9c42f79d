"""The ε of composed releases and noise calibration, on Google's ``dp-accounting``.

How ε is computed: releases on all of a client's data (``dp-mode = payload``) are Gaussian mechanisms,
and Gaussians compose into one Gaussian, whose ε at δ ``dp-accounting`` computes exactly (the analytic
Gaussian mechanism) in a millisecond. Once a release is Poisson-subsampled (DP-SGD), the
privacy-loss-distribution (PLD) accountant gives the tightest ε ``dp-accounting`` can certify. RDP is
a looser but independent bound, the cross-check: an ε above RDP's signals a bug. Flower's
``RdpAccountant`` would give only that looser bound.

Every ε states what it protects: the *unit* (one ``record``; a ``client``'s whole dataset; one
embedding ``row-given-model``, i.e. given a model trained on the same rows without DP) and the
*neighbour* relation (``add-remove`` one unit, or ``replace-one`` unit by another). A release's noise
multiplier is its noise std over the L2 distance one unit added or removed moves it by (for a whole
dataset: the distance to the release of no data), ``dp-accounting``'s convention; replacing a unit
moves it by at most twice that (triangle inequality), which is how ``dp-accounting``'s replace-one
relation accounts a Gaussian. A ledger composes releases of one unit and one neighbour only.

The ledger here is in memory; :mod:`pollen.privacy.ledger` keeps a node's releases on disk, append-only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dp_accounting

# dp-accounting (scipy) is imported where ε is computed: importing it costs ~1 s, which the launcher
# and the config check, which only read the DP keys, should not pay.

# PLD grid step of the privacy loss. 1e-3 is ~10x faster than the library's 1e-4; it is pessimistic (ε
# never below a 1e-5 grid's) and measured at most 2.5e-4 relative above it on DP-SGD plans (a 750-step
# plan at q 0.013; 1e-6 on shorter ones): tests/test_privacy.py measures it.
PLD_INTERVAL = 1e-3

UNITS = ("record", "client", "row-given-model")
NEIGHBOURS = ("replace-one", "add-remove")
# The relation each unit's ε is stated under unless a release names another. A client's releases are
# seen one by one by the server, so the dataset it could be confused with is any other dataset
# (replace-one); DP-SGD's Poisson sampling is analysed, as usual, by adding or removing one record.
DEFAULT_NEIGHBOUR = {"record": "add-remove", "client": "replace-one", "row-given-model": "add-remove"}
# The units whose ε a run may quote as its guarantee (summary.json's headline, README, docs).
HEADLINE_UNITS = ("record", "client")
MECHANISMS = ("gaussian",)


@dataclass(frozen=True)
class Release:
    """``count`` invocations of a Gaussian mechanism with noise std = ``noise_multiplier`` × its L2
    sensitivity to adding or removing one ``unit``, each on a Poisson sample of the records with
    ``sampling_probability`` (1 = all), its ε stated under ``neighbour`` (default: the unit's,
    :data:`DEFAULT_NEIGHBOUR`)."""

    noise_multiplier: float
    sampling_probability: float = 1.0
    count: int = 1
    unit: str = "record"
    neighbour: str = field(default="")
    mechanism: str = "gaussian"

    def __post_init__(self):
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"noise multiplier must be a finite number > 0, got {self.noise_multiplier!r}")
        if not 0 < self.sampling_probability <= 1:
            raise ValueError(f"sampling probability must be in (0, 1], got {self.sampling_probability!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"release count must be an integer >= 1, got {self.count!r}")
        if self.unit not in UNITS:
            raise ValueError(f"release unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if not self.neighbour:
            object.__setattr__(self, "neighbour", DEFAULT_NEIGHBOUR[self.unit])
        if self.neighbour not in NEIGHBOURS:
            raise ValueError(f"release neighbour must be one of {', '.join(NEIGHBOURS)}, got {self.neighbour!r}")
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"release mechanism must be one of {', '.join(MECHANISMS)}, got {self.mechanism!r}")

    @property
    def kind(self) -> tuple[str, str]:
        """(unit, neighbour): what the release's ε protects; a ledger composes one kind only."""
        return self.unit, self.neighbour

    def times(self, count: int) -> Release:
        """The same mechanism, ``count`` invocations."""
        return Release(self.noise_multiplier, self.sampling_probability, count, self.unit, self.neighbour,
                       self.mechanism)

    def event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_probability == 1.0:
            return dp_accounting.SelfComposedDpEvent(gaussian, self.count)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(self.sampling_probability, gaussian), self.count)

    def to_json(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "noise-multiplier": self.noise_multiplier,
                "sampling-probability": self.sampling_probability, "count": self.count, "unit": self.unit,
                "neighbour": self.neighbour}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Release:
        """Inverse of :meth:`to_json`; a malformed entry is refused naming what is wrong."""
        keys = ("mechanism", "noise-multiplier", "sampling-probability", "count", "unit", "neighbour")
        if not isinstance(data, Mapping) or any(k not in data for k in keys):
            raise ValueError(f"a release must be a dict with {', '.join(keys)}, got {data!r}")
        count = data["count"]
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"release count must be an integer, got {count!r}")
        return cls(float(data["noise-multiplier"]), float(data["sampling-probability"]), count, str(data["unit"]),
                   str(data["neighbour"]), str(data["mechanism"]))


def _relation(neighbour: str):
    from dp_accounting import NeighboringRelation

    if neighbour not in NEIGHBOURS:
        raise ValueError(f"neighbour must be one of {', '.join(NEIGHBOURS)}, got {neighbour!r}")
    return NeighboringRelation.REPLACE_ONE if neighbour == "replace-one" else NeighboringRelation.ADD_OR_REMOVE_ONE


def _neighbour_of(releases: Iterable[Release], neighbour: str | None) -> str:
    if neighbour is not None:
        return neighbour
    kinds = {r.neighbour for r in releases}
    if len(kinds) > 1:
        raise ValueError(f"releases under different neighbour relations ({', '.join(sorted(kinds))}) do not "
                         "compose into one ε: name the relation")
    return kinds.pop() if kinds else "add-remove"


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
    counts: dict[Release, int] = {}
    for r in releases:
        key = r.times(1)
        counts[key] = counts.get(key, 0) + r.count
    return [r.times(n) for r, n in counts.items()]


def composed_epsilon(releases: Iterable[Release], delta: float, neighbour: str | None = None) -> float:
    """ε at ``delta`` of all ``releases`` composed (0 for none), under ``neighbour`` (default: the
    releases' own): exact for Gaussians on all the data, by the PLD accountant once any release is
    subsampled."""
    return _composed_epsilon(tuple(releases), delta, neighbour)


@functools.lru_cache(maxsize=256)
def _composed_epsilon(releases: tuple[Release, ...], delta: float, neighbour: str | None) -> float:
    """Cached per process: a pure function of its (hashable) releases, and the clients of one simulation
    compose the same releases every round (one PLD per round instead of one per client; a PLD takes ~1 s)."""
    from dp_accounting import GaussianDpEvent, gaussian_mechanism
    from dp_accounting.pld import pld_privacy_accountant

    relation = _neighbour_of(releases, neighbour)
    sigma = _full_gaussian_sigma(releases)
    sampled = _same_mechanisms_together(r for r in releases if r.sampling_probability < 1.0)
    if not sampled:
        if sigma is None:
            return 0.0
        # replacing a unit moves a Gaussian release by up to twice its add/remove sensitivity: σ/2
        effective = sigma / 2.0 if relation == "replace-one" else sigma
        return float(gaussian_mechanism.get_epsilon_gaussian(effective, delta))
    accountant = pld_privacy_accountant.PLDAccountant(_relation(relation), value_discretization_interval=PLD_INTERVAL)
    if sigma is not None:
        accountant.compose(GaussianDpEvent(sigma))
    for r in sampled:
        accountant.compose(r.event())
    try:
        return max(0.0, float(accountant.get_epsilon(delta)))
    except ValueError as err:  # the loss distribution outgrew the accountant's grid: ε in the hundreds
        raise ValueError(f"epsilon of these releases is too large to account ({err}): raise the noise "
                         "multiplier") from err


def rdp_epsilon(releases: Iterable[Release], delta: float, neighbour: str | None = None) -> float | None:
    """ε at ``delta`` by the RDP accountant: an independent, looser bound (the cross-check). ``None``
    where ``dp-accounting``'s RDP has no analysis (Poisson-sampled releases under replace-one)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    releases = _same_mechanisms_together(releases)
    if _neighbour_of(releases, neighbour) == "replace-one":
        if any(r.sampling_probability < 1.0 for r in releases):
            return None
        # dp-accounting's RDP takes a Gaussian's sensitivity as 1 under either relation: replacing a unit
        # moves a release by up to twice what removing it does, i.e. the Gaussian of σ/2 (as its PLD has it)
        releases = [Release(r.noise_multiplier / 2.0, 1.0, r.count, r.unit, "add-remove") for r in releases]
    accountant = rdp_privacy_accountant.RdpAccountant()
    for r in releases:
        accountant.compose(r.event())
    return float(accountant.get_epsilon(delta))


def check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return delta


class Ledger:
    """Composed releases of one unit and neighbour, and the ε they cost at a fixed δ (in memory; a
    node's releases on disk: :class:`pollen.privacy.ledger.LedgerFile`)."""

    def __init__(self, delta: float, releases: Iterable[Release] = ()):
        self.delta = check_delta(delta)
        self.releases: list[Release] = []
        for r in releases:
            self.add(r)

    def add(self, release: Release) -> None:
        """Compose one more release (merged with the last one when it is the same mechanism). A release of
        another unit or neighbour is refused: ε of one record and ε of one client do not add up."""
        if self.releases and release.kind != self.releases[0].kind:
            raise ValueError(f"a ledger of {self.describe()} cannot compose a release of unit "
                             f"{release.unit!r} under {release.neighbour!r}")
        last = self.releases[-1] if self.releases else None
        if last is not None and last.times(1) == release.times(1):
            self.releases[-1] = last.times(last.count + release.count)
        else:
            self.releases.append(release)

    @property
    def count(self) -> int:
        return sum(r.count for r in self.releases)

    @property
    def unit(self) -> str | None:
        return self.releases[0].unit if self.releases else None

    @property
    def neighbour(self) -> str | None:
        return self.releases[0].neighbour if self.releases else None

    def describe(self) -> str:
        return f"unit {self.unit!r} under {self.neighbour!r}" if self.releases else "no release"

    def epsilon(self, neighbour: str | None = None) -> float:
        """ε under the releases' neighbour relation, or under ``neighbour`` (the other one, beside it)."""
        return composed_epsilon(self.releases, self.delta, neighbour)

    def epsilon_rdp(self, neighbour: str | None = None) -> float | None:
        return rdp_epsilon(self.releases, self.delta, neighbour)

    def epsilon_after(self, *releases: Release) -> float:
        """ε if ``releases`` were composed next; the ledger is unchanged."""
        return composed_epsilon([*self.releases, *releases], self.delta)


@functools.lru_cache(maxsize=64)
def calibrate_noise_multiplier(target_epsilon: float, delta: float, releases: int,
                               sampling_probability: float = 1.0, steps_per_release: int = 1,
                               full_per_release: int = 0, rtol: float = 1e-3,
                               neighbour: str = "add-remove") -> float:
    """The smallest noise multiplier (to ``rtol``) whose ``releases`` × (``steps_per_release``
    mechanisms at ``sampling_probability`` + ``full_per_release`` on all the data) stay within
    ``target_epsilon`` at ``delta`` under ``neighbour``: bisection on log σ over :func:`composed_epsilon`.

    ε falls as σ grows, so the bracket [lo, hi] keeps ε(lo) > target >= ε(hi) and the answer is hi:
    never above the target.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    check_delta(delta)
    if releases < 1 or steps_per_release < 1:
        raise ValueError(f"releases and steps per release must be >= 1, got {releases} and {steps_per_release}")

    def eps(sigma: float) -> float:
        plan = [Release(sigma, sampling_probability, releases * steps_per_release)]
        if full_per_release:
            plan.append(Release(sigma, 1.0, releases * full_per_release))
        return composed_epsilon(plan, delta, neighbour)

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
