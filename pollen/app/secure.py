"""``secure-aggregation = true``: the ServerApp's grid becomes a :class:`~pollen.secagg.grid.SecureGrid`, so the
method's own strategy aggregates each train round through SecAgg+ (docs/secure-aggregation.md). The
run keys become one :class:`~pollen.secagg.SecAggConfig`: the payload kind is the method's family, the
weighting the strategy's, the largest weight the strategy's ``max_examples``."""

from __future__ import annotations

from typing import Any

from flwr.serverapp import Grid

from pollen.privacy.distributed import calibrate
from pollen.secagg import SecAggConfig
from pollen.secagg.grid import SecureGrid
from pollen.settings import RunConfig


def dp_shape(strategy: Any) -> tuple[int, ...]:
    """The two sizes of a prototype (C, d) or logit (N0, C) contribution, from the strategy; () for weights."""
    if strategy.family == "prototypes":
        return int(strategy.num_classes), int(strategy.embed_dim)
    if strategy.family == "logits":
        return int(strategy.num_public), int(strategy.num_classes)
    return ()


def secagg_config(cfg: RunConfig, strategy: Any) -> SecAggConfig:
    weighting = getattr(strategy, "weighting", "uniform") if strategy.family != "logits" else "uniform"
    dp: dict[str, Any] = {}
    if cfg.dp_mode == "distributed":  # the clients check these against their own run config, and refuse less
        q = cfg.fraction_fit  # each client draws its own participation (pollen.privacy.distributed)
        z = cfg.dp_noise_multiplier or calibrate(cfg.dp_target_epsilon, cfg.dp_delta, q, cfg.num_server_rounds)
        dp = {"clip_dp": cfg.dp_clip, "noise_multiplier_dp": z, "min_honest_dp": cfg.dp_min_honest,
              "sampling_dp": q, "dp_shape": dp_shape(strategy)}
    return SecAggConfig(neighbours=cfg.secagg_neighbours, threshold=cfg.secagg_threshold,
                        clipping_range=cfg.secagg_clipping_range, levels=cfg.secagg_quantization,
                        modulus_bits=cfg.secagg_modulus_bits, max_weight=int(strategy.max_examples),
                        kind=strategy.family, weighting=weighting, **dp)


def secure_grid(grid: Grid, cfg: RunConfig, strategy: Any) -> Grid:
    """The grid the strategy runs on: ``grid`` itself, or under secure aggregation a SecureGrid around it."""
    if not cfg.secure_aggregation:
        return grid
    return SecureGrid(grid, secagg_config(cfg, strategy))  # type: ignore[return-value]
