"""``secure-aggregation = true``: the ServerApp's grid becomes a :class:`~pollen.secagg.grid.SecureGrid`, so the
method's own strategy aggregates each train round through SecAgg+ (docs/secure-aggregation.md). The
run keys become one :class:`~pollen.secagg.SecAggConfig`: the payload kind is the method's family, the
weighting the strategy's, the largest weight the strategy's ``max_examples``."""

from __future__ import annotations

from typing import Any

from flwr.serverapp import Grid

from pollen.secagg import SecAggConfig
from pollen.secagg.grid import SecureGrid
from pollen.settings import RunConfig


def secagg_config(cfg: RunConfig, strategy: Any) -> SecAggConfig:
    weighting = getattr(strategy, "weighting", "uniform") if strategy.family != "logits" else "uniform"
    return SecAggConfig(neighbours=cfg.secagg_neighbours, threshold=cfg.secagg_threshold,
                        clipping_range=cfg.secagg_clipping_range, levels=cfg.secagg_quantization,
                        modulus_bits=cfg.secagg_modulus_bits, max_weight=int(strategy.max_examples),
                        kind=strategy.family, weighting=weighting)


def secure_grid(grid: Grid, cfg: RunConfig, strategy: Any) -> Grid:
    """The grid the strategy runs on: ``grid`` itself, or under secure aggregation a SecureGrid around it."""
    if not cfg.secure_aggregation:
        return grid
    return SecureGrid(grid, secagg_config(cfg, strategy))  # type: ignore[return-value]
