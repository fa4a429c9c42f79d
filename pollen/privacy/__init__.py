"""Differential privacy on what leaves a node: clipping, Gaussian mechanisms per payload kind, the
per-client ε ledger, noise calibration, and the server's bounds that follow them (``docs/privacy.md``).

Noise is added on the client, before a release leaves the node: the adversary is the server.
Everything here is numpy (and ``dp-accounting``); no torch, so the strategies and the protocol can
use it without a training stack.
"""

from pollen.privacy.accounting import (
    NEIGHBOURS,
    UNITS,
    Ledger,
    Release,
    calibrate_noise_multiplier,
    composed_epsilon,
    rdp_epsilon,
)
from pollen.privacy.bounds import DpBounds, dp_bounds
from pollen.privacy.budget import DELTA, EPSILON, Budget, BudgetExhausted
from pollen.privacy.clipping import clip_rows, clip_update
from pollen.privacy.config import MODES, PrivacyConfig, release_unit
from pollen.privacy.ledger import LedgerError, LedgerFile
from pollen.privacy.mechanisms import (
    PrototypeRelease,
    gaussian_noise,
    release_glfc,
    release_logits,
    release_prototypes,
    release_update,
    secure_rng,
)
from pollen.privacy.payload import PayloadPrivacy

__all__ = ["DELTA", "EPSILON", "MODES", "NEIGHBOURS", "UNITS", "Budget", "BudgetExhausted", "DpBounds", "Ledger",
           "LedgerError", "LedgerFile", "PayloadPrivacy", "PrivacyConfig", "PrototypeRelease", "Release",
           "calibrate_noise_multiplier", "clip_rows", "clip_update", "composed_epsilon", "dp_bounds", "gaussian_noise",
           "rdp_epsilon", "release_glfc", "release_logits", "release_prototypes", "release_unit", "release_update",
           "secure_rng"]
