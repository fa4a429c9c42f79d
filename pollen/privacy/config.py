"""The run's differential-privacy settings as one typed value, and the rules that tie its keys together.

The keys' defaults and ranges are declared once with the other common run keys
(``pollen.settings.common.PrivacyKeys``); this module only checks what a single range cannot: that a
private mode has a noise multiplier or an ε target (not both), and that the keys mean something in the
mode chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from pollen.privacy.accounting import DEFAULT_NEIGHBOUR, HEADLINE_UNITS, calibrate_noise_multiplier
from pollen.settings import DP_MODES as MODES
from pollen.settings import RunConfig

# What one release protects, per payload kind (pollen.privacy.mechanisms): under ``payload`` a client's
# whole dataset, but for prototypes only one embedding row given the model (trained without DP);
# under ``sample`` (DP-SGD) one record, whatever the kind.
PAYLOAD_UNITS = {"prototypes": "row-given-model", "weights": "client", "logits": "client", "glfc": "client"}


def release_unit(kind: str, mode: str) -> str:
    """The unit a release of payload ``kind`` protects in ``mode`` (``record``, ``client`` or
    ``row-given-model``): what its ε is about."""
    if mode == "sample":
        return "record"
    if mode == "distributed":
        return "client"
    if mode != "payload" or kind not in PAYLOAD_UNITS:
        raise ValueError(f"no DP release of kind {kind!r} in dp-mode {mode!r}")
    return PAYLOAD_UNITS[kind]


def release_terms(kind: str, mode: str) -> dict[str, str]:
    """``dp-unit`` and ``dp-neighbour`` of the ε a release of payload ``kind`` reports in ``mode``: what
    the run's metrics and ``summary.json`` say the figure protects."""
    unit = release_unit(kind, mode)
    return {"dp-unit": unit, "dp-neighbour": DEFAULT_NEIGHBOUR[unit]}


def no_headline_warning(kind: str, mode: str) -> str | None:
    """Why the ε of this run is not a guarantee to quote, said before round 1; ``None`` when it is."""
    unit = release_unit(kind, mode)
    if unit in HEADLINE_UNITS:
        return None
    return (f"differential privacy: dp-mode = {mode!r} on {kind} protects one embedding row given the model, "
            "and the model is trained on those rows without DP: its ε is no guarantee for a record or for a "
            "client's data (the class counts give a client's label histogram back, docs/privacy.md); "
            "summary.json reports it as dp-epsilon-row-given-model, never as the run's dp-epsilon; "
            "dp-mode = 'sample' protects each record")


@dataclass(frozen=True)
class PrivacyConfig:
    """``dp-mode``, ``dp-clip``, ``dp-noise-multiplier``, ``dp-target-epsilon``, ``dp-delta``,
    ``dp-max-epsilon``; 0 means "not set" for the last three numbers but δ. ``evaluate``
    (``dp-evaluate``): whether evaluate replies are releases too (``noised``)."""

    mode: str
    clip: float
    noise_multiplier: float
    target_epsilon: float
    delta: float
    max_epsilon: float
    evaluate: str = "refuse"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"run config key 'dp-mode' = {self.mode!r} is invalid: expected one of {', '.join(MODES)}")
        if self.mode == "off":
            return
        if (self.noise_multiplier > 0) == (self.target_epsilon > 0):
            raise ValueError(
                f"dp-mode = {self.mode!r} needs exactly one of 'dp-noise-multiplier' (σ, > 0) or "
                f"'dp-target-epsilon' (ε for the planned rounds, > 0); got {self.noise_multiplier} and "
                f"{self.target_epsilon}")
        if 0 < self.max_epsilon < self.target_epsilon:
            raise ValueError(f"run config key 'dp-max-epsilon' = {self.max_epsilon} is below 'dp-target-epsilon' = "
                             f"{self.target_epsilon}: the clients would stop before the planned rounds")

    @classmethod
    def of(cls, cfg: RunConfig) -> PrivacyConfig:
        """The DP keys of run ``cfg`` as one value (mode, clip, σ or target ε, δ, cap)."""
        return cls(cfg.dp_mode, cfg.dp_clip, cfg.dp_noise_multiplier, cfg.dp_target_epsilon, cfg.dp_delta,
                   cfg.dp_max_epsilon, cfg.dp_evaluate)

    @property
    def private(self) -> bool:
        return self.mode != "off"

    @property
    def cap(self) -> float:
        """The ε no client passes (0: none): ``dp-max-epsilon``, by default the target ε. The ledger
        counts every release ever made, so the cap holds across resumes, which repeat rounds."""
        return self.max_epsilon if self.max_epsilon > 0 else self.target_epsilon

    @property
    def evaluations(self) -> int:
        """Releases an evaluation adds to a round: 1 when evaluate replies are noised and accounted."""
        return int(self.evaluate == "noised")

    def payload_noise_multiplier(self, planned_releases: int, unit: str = "record") -> float:
        """σ of each payload release: given, or calibrated so ``planned_releases`` rounds (each one release,
        plus one evaluation when noised) stay within the target ε (stated under ``unit``'s neighbour
        relation)."""
        if self.noise_multiplier > 0:
            return self.noise_multiplier
        return calibrate_noise_multiplier(self.target_epsilon, self.delta, planned_releases * (1 + self.evaluations),
                                          neighbour=DEFAULT_NEIGHBOUR[unit])


def cross_sample_refusal(model_name: str, layer: str, kind: str) -> str:
    """Why DP-SGD refuses model ``model_name``, naming its first layer ``layer`` (class ``kind``) that mixes
    the samples of a batch, and the fix: one message for the run-config check (which reads the layer from
    :mod:`pollen.models.catalog`, without torch) and for DP-SGD's own check of the module it trains."""
    return (f"model {model_name!r} has layer '{layer}' ({kind}), which mixes the samples of a batch, so "
            "per-sample gradients (dp-mode = 'sample') are undefined: use a model without BatchNorm (its "
            "BatchNorm layers replaced by GroupNorm), or dp-mode = 'payload'")
