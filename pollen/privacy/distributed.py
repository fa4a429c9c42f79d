"""Distributed DP at the client level (``dp-mode = distributed``): noise once for the sum, shared by the clients.

Under secure aggregation the server reads only the sum of the clients' contributions, so the noise must
hide one client in the *sum*, not in its own release. In every round each client of the secure round

1. draws, in secret, whether it is sampled: with probability ``q = fraction-fit`` (Poisson sampling; 1:
   always). A sampled client trains and contributes its update; the others contribute zeros, which the
   masks make indistinguishable, so nobody — the server included — learns who was sampled;
2. clips its contribution (one vector: a model update, its class-weighted prototypes and weights, its
   logits) to L2 norm ``clip``, so its influence does not grow with its record count;
3. rounds it to the secure sum's integer grid (step ``step``): the rounded vector's L2 norm is at most
   ``Δ = clip / step + sqrt(d) / 2`` steps (nearest rounding moves each coordinate by at most 1/2);
4. adds its share of the noise, sampled or not, a discrete Gaussian ``N_Z(0, σ_c²)`` per coordinate
   (integers, so the noise survives the modular ring: wrapping around is a function of the sum, i.e.
   post-processing).

Accounting. Assume at least ``h = dp-min-honest`` of each round's summed clients are honest (add their noise,
keep it and their draw secret). The sum then carries noise of variance at least ``h σ_c²`` whoever was
sampled; a round is the Gaussian mechanism of noise multiplier ``z = sqrt(h) σ_c / Δ`` on a Poisson sample
(probability ``q``) of the clients, on client-level neighbours that differ by *replacing* one client's data
(sensitivity 2Δ, handled by the accountant). :func:`round_release` is that mechanism as the ledger's
:class:`~pollen.privacy.accounting.Release` (unit ``client``, neighbour ``replace-one``), which the ledger
composes with dp-accounting's PLD accountant (amplification by sampling for ``q < 1``). Each client appends
one release per round it takes part in, sampled or not: what the sum reveals about it depends on its draw,
which it never reveals. The draw is what makes amplification hold against the server itself: a server that
drew the sample would know it, and the noise of a sum of the sampled clients alone would depend on who they
were. What remains for the server to see: how long each client took to answer (a sampled client trains; a
deployment that needs amplification against a server timing its replies must make them take equally long),
and, in a simulation with a simulated network, the example counts it times the round by.

Stated approximation: the sum of ``h`` discrete Gaussians is accounted as a Gaussian of the same
variance. A sum of discrete Gaussians is within max-divergence ``τ·d`` of one discrete Gaussian of the
summed variance, ``τ = 10 Σ_{k=1}^{h-1} exp(−2π² σ_c² k / (k + 1))`` (Kairouz, Liu & Steinke, 2021), and a
discrete Gaussian's Rényi divergences are at most the continuous one's; :func:`sum_gap` gives ``τ·d``,
which :func:`check_plan` requires to be below ``MAX_SUM_GAP`` (at σ_c of a few steps it is below 1e-30).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pollen.privacy.accounting import Release, calibrate_noise_multiplier, composed_epsilon
from pollen.privacy.budget import Budget
from pollen.privacy.config import PrivacyConfig
from pollen.privacy.ledger import LedgerFile

MAX_SUM_GAP = 1e-9  # largest max-divergence per round the sum-of-discrete-Gaussians approximation may cost
NEIGHBOUR = "replace-one"
UNIT = "client"
SAMPLING, MIN_HONEST = "dp-sampling", "dp-min-honest"  # reply metrics: the assumptions every ε of the run is under


def discrete_gaussian(rng: np.random.Generator, sigma: float, size: int) -> np.ndarray:
    """``size`` draws of the discrete Gaussian ``N_Z(0, sigma²)`` (int64), by rejection from a discrete
    Laplace of scale ``t = floor(sigma) + 1`` (a difference of two geometric draws): a candidate ``y`` is
    kept with probability ``exp(−(|y| − sigma²/t)² / (2 sigma²))``. The randomness is ``rng``'s; the
    acceptance test is in floating point."""
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"the discrete Gaussian's sigma must be a finite number > 0, got {sigma!r}")
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # success probability of the geometric draws: P(y) ∝ exp(−|y| / t)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        want = max(64, int(1.5 * (size - filled)))
        y = rng.geometric(p, want).astype(np.int64) - rng.geometric(p, want).astype(np.int64)
        keep = rng.random(want) < np.exp(-((np.abs(y) - sigma ** 2 / t) ** 2) / (2 * sigma ** 2))
        kept = y[keep][: size - filled]
        out[filled:filled + kept.size] = kept
        filled += kept.size
    return out


@dataclass(frozen=True)
class DistributedPlan:
    """One round's distributed-DP parameters, the same on every client.

    clip: L2 bound of a client's whole contribution (value units).
    noise_multiplier: z, the sum's noise std over the contribution's L2 bound Δ (both in steps).
    min_honest: h, the honest clients whose noise the guarantee counts on.
    step: the value of one integer step of the secure sum.
    """

    clip: float
    noise_multiplier: float
    min_honest: int
    step: float

    def __post_init__(self):
        for name in ("clip", "noise_multiplier", "step"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if isinstance(self.min_honest, bool) or not isinstance(self.min_honest, int) or self.min_honest < 1:
            raise ValueError(f"dp-min-honest must be a whole number >= 1, got {self.min_honest!r}")

    def sensitivity(self, dim: int) -> float:
        """Δ: the L2 bound, in steps, of one client's clipped and rounded contribution of ``dim`` values."""
        return self.clip / self.step + math.sqrt(dim) / 2

    def client_sigma(self, dim: int) -> float:
        """σ_c, in steps: each client's share, so that h of them make the sum's σ = z Δ."""
        return self.noise_multiplier * self.sensitivity(dim) / math.sqrt(self.min_honest)

    def privatize(self, vector: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Clip (L2) → round to the step grid → add this client's discrete Gaussian noise: int64 steps."""
        v = np.asarray(vector, dtype=np.float64).ravel()
        if not np.isfinite(v).all():
            raise ValueError("a contribution to privatize is NaN or infinite")
        rounded = np.rint(clip_l2(v, self.clip) / self.step).astype(np.int64)
        return rounded + discrete_gaussian(rng, self.client_sigma(v.size), v.size)


def clip_l2(vector: np.ndarray, clip: float) -> np.ndarray:
    """``vector`` scaled down to L2 norm ``clip`` when it is longer."""
    norm = float(np.linalg.norm(vector))
    return vector * (clip / norm) if norm > clip else vector


def sum_gap(client_sigma: float, min_honest: int, dim: int) -> float:
    """τ·d: how far (max-divergence, per round) the sum of ``min_honest`` discrete Gaussians of std
    ``client_sigma`` can be from one discrete Gaussian of the summed variance, over ``dim`` coordinates."""
    tau = 10.0 * sum(math.exp(-2 * math.pi ** 2 * client_sigma ** 2 * k / (k + 1)) for k in range(1, min_honest))
    return tau * dim


def check_plan(plan: DistributedPlan, dim: int) -> None:
    """Refuse a plan whose approximation (module docstring) would cost more than ``MAX_SUM_GAP``."""
    gap = sum_gap(plan.client_sigma(dim), plan.min_honest, dim)
    if gap > MAX_SUM_GAP:
        raise ValueError(f"each client's noise ({plan.client_sigma(dim):.3g} steps) is too small for the sum of "
                         f"{plan.min_honest} discrete Gaussians to be accounted as one Gaussian (gap {gap:.3g} > "
                         f"{MAX_SUM_GAP}): raise the noise multiplier or the quantization")


def round_release(noise_multiplier: float, sampling_probability: float = 1.0, rounds: int = 1) -> Release:
    """``rounds`` rounds of distributed DP as the ledger's release: client-level, replace-one (module docstring)."""
    return Release(noise_multiplier, sampling_probability, rounds, unit=UNIT, neighbour=NEIGHBOUR)


def epsilon(noise_multiplier: float, sampling_probability: float, rounds: int, delta: float) -> float:
    """Client-level, replace-one ε at ``delta`` after ``rounds`` rounds: the ledger's composition."""
    return composed_epsilon([round_release(noise_multiplier, sampling_probability, rounds)], delta)


def calibrate(target_epsilon: float, delta: float, sampling_probability: float, rounds: int) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds stay within ``target_epsilon`` at ``delta``."""
    return calibrate_noise_multiplier(target_epsilon, delta, rounds, sampling_probability, neighbour=NEIGHBOUR)


class DistributedPrivacy:
    """A client's side of ``dp-mode = distributed``: its plan from the run config (z given, or calibrated so
    ``planned_rounds`` rounds at sampling probability ``sampling`` stay within the target ε), its ledger, its
    secret draw, and the check that the server asks for no less noise than the client's own run config says.
    ``rng``: where the draw comes from (default: the operating system's randomness, never the run's seed)."""

    def __init__(self, config: PrivacyConfig, planned_rounds: int, min_honest: int, ledger: LedgerFile, who: str,
                 sampling: float = 1.0, rng: random.Random | None = None):
        if config.mode != "distributed":
            raise ValueError(f"DistributedPrivacy needs dp-mode = 'distributed', got {config.mode!r}")
        if min_honest < 1:
            raise ValueError("dp-mode = 'distributed' needs dp-min-honest >= 1: the honest clients the guarantee "
                             "counts on")
        if not 0 < sampling <= 1:
            raise ValueError(f"the sampling probability must be in (0, 1], got {sampling!r}")
        self.config, self.planned_rounds, self.min_honest = config, planned_rounds, min_honest
        self.ledger, self.who, self.sampling = ledger, who, float(sampling)
        self.rng = rng if rng is not None else random.SystemRandom()

    @functools.cached_property
    def noise_multiplier(self) -> float:
        if self.config.noise_multiplier > 0:
            return self.config.noise_multiplier
        return calibrate(self.config.target_epsilon, self.config.delta, self.sampling, self.planned_rounds)

    def refusal(self, clip: float, noise_multiplier: float, min_honest: int, sampling: float = 1.0) -> str | None:
        """Why this client refuses a round whose server states these parameters (``None``: it does not)."""
        if clip > self.config.clip * (1 + 1e-9) or noise_multiplier < self.noise_multiplier * (1 - 1e-9) \
                or min_honest > self.min_honest or abs(sampling - self.sampling) > 1e-12:
            return (f"{self.who} refuses: the server asks for clip {clip:g}, noise multiplier {noise_multiplier:g}, "
                    f"{min_honest} honest clients, sampling {sampling:g}; this node's run config says clip "
                    f"{self.config.clip:g}, noise multiplier {self.noise_multiplier:g}, {self.min_honest} honest "
                    f"clients, sampling {self.sampling:g}")
        return None

    def plan_sigma(self, step: float, dim: int) -> float:
        """σ_c in steps this client adds to a contribution of ``dim`` values."""
        return DistributedPlan(self.config.clip, self.noise_multiplier, self.min_honest, step).client_sigma(dim)

    def take_part(self, step: float, dim: int) -> tuple[bool, Callable[[np.ndarray], np.ndarray], dict[str, float]]:
        """``(sampled, privatize, metrics)`` for this round's contribution of ``dim`` values: this client's secret
        draw, the function that clips, rounds and noises the contribution (zeros when not sampled), and the
        round's ε metrics. The release is appended to the ledger *now*, before the reply that carries it leaves."""
        from pollen.privacy.mechanisms import secure_rng

        plan = DistributedPlan(self.config.clip, self.noise_multiplier, self.min_honest, step)
        check_plan(plan, dim)
        sampled = self.sampling >= 1.0 or self.rng.random() < self.sampling
        metrics = Budget(self.ledger, self.config.delta, self.config.cap, self.who).spend(
            round_release(self.noise_multiplier, self.sampling))
        metrics.update({SAMPLING: self.sampling, MIN_HONEST: float(self.min_honest)})
        rng = secure_rng()
        return sampled, (lambda vector: plan.privatize(vector, rng)), metrics
