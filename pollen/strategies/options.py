"""The options every Pollen strategy takes, checked once: a bad value is refused naming the option."""

from __future__ import annotations

from collections.abc import Mapping

from pollen.protocol.records import ARRAYS, CONFIG
from pollen.strategies.aggregation import check_aggregation
from pollen.strategies.replies import MetricsAggrFn

# Flower's FedAvg options whose only meaningful value is the one Pollen's wire contract fixes.
FLOWER_FIXED_OPTIONS = {"weighted_by_key": "num-examples", "arrayrecord_key": ARRAYS, "configrecord_key": CONFIG}


def check_options(*, fraction_train: float, fraction_evaluate: float, min_train_nodes: int, min_evaluate_nodes: int,
                  min_available_nodes: int, evaluate_every: int, max_examples: int, max_empty_rounds: int,
                  node_wait_s: float, aggregation: str, trim_fraction: float,
                  fixed: Mapping[str, str], aggr_fns: Mapping[str, MetricsAggrFn | None]) -> None:
    """Refuse a bad value of :class:`PollenStrategy`'s options, naming the option and the value."""
    for option, chosen in fixed.items():
        if chosen != FLOWER_FIXED_OPTIONS[option]:
            raise ValueError(f"{option} must be {FLOWER_FIXED_OPTIONS[option]!r}, got {chosen!r}: Pollen's "
                             "wire contract fixes it (docs/strategies.md)")
    for option, fn in aggr_fns.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{option} must be a callable (contents, weighted_by_key) -> MetricRecord")
    if not 0.0 < fraction_train <= 1.0:
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
    if not 0.0 <= fraction_evaluate <= 1.0:
        raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
    for name, value in (("min_train_nodes", min_train_nodes), ("min_available_nodes", min_available_nodes),
                        ("evaluate_every", evaluate_every), ("max_examples", max_examples)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")
    if min_evaluate_nodes < 0 or max_empty_rounds < 0 or node_wait_s < 0:
        raise ValueError("min_evaluate_nodes, max_empty_rounds and node_wait_s must be >= 0")
    check_aggregation(aggregation, trim_fraction)
