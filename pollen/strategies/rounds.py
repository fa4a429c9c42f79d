"""The round loop of every Pollen strategy: Flower's ``Strategy.start``, able to continue a resumed run.

Same order, ``Result`` and INFO lines as Flower's: ``evaluate_fn(0, initial_arrays)`` (fresh runs only),
then per round train → aggregate → evaluate → aggregate → ``evaluate_fn(round, arrays)``, each round's
aggregated metrics logged as Flower's strategies log them. Flower's closing dump of every round's
metrics is left out: ``Result`` holds them. Messages travel through the strategy's ``exchange`` (the
one seam between a round and the wire).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from pollen.log import LOGGER


class RoundStrategy(Protocol):
    """What the loop calls: Flower's four strategy steps, the exchange seam and the start-up summary."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]: ...

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]: ...

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None: ...

    def exchange(self, server_round: int, stage: str, messages: Iterable[Message], grid: Grid,
                 timeout: float) -> Iterable[Message]: ...

    def summary(self) -> None: ...


def run_rounds(strategy: RoundStrategy, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
               train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
               first_round: int = 1) -> Result:
    """Rounds ``first_round``..``num_rounds`` of ``strategy`` on ``grid`` (module docstring)."""
    if not 1 <= first_round <= num_rounds:
        raise ValueError(f"first_round must be in 1..{num_rounds}, got {first_round}")
    LOGGER.info("Starting %s strategy:", type(strategy).__name__)
    log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
    strategy.summary()
    LOGGER.info("")
    started = time.time()
    result = Result()
    arrays = initial_arrays
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    if evaluate_fn is not None and first_round == 1:
        res = evaluate_fn(0, arrays)
        LOGGER.info("Initial global evaluation results: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    for server_round in range(first_round, num_rounds + 1):
        LOGGER.info("")
        LOGGER.info("[ROUND %d/%d]", server_round, num_rounds)
        messages = strategy.configure_train(server_round, arrays, train_config, grid)
        new_arrays, train_metrics = strategy.aggregate_train(
            server_round, strategy.exchange(server_round, "train", messages, grid, timeout))
        if new_arrays is not None:
            result.arrays = arrays = new_arrays
        if train_metrics is not None:
            LOGGER.info("\t└──> Aggregated MetricRecord: %s", train_metrics)
            result.train_metrics_clientapp[server_round] = train_metrics
        messages = strategy.configure_evaluate(server_round, arrays, evaluate_config, grid)
        eval_metrics = strategy.aggregate_evaluate(
            server_round, strategy.exchange(server_round, "evaluate", messages, grid, timeout))
        if eval_metrics is not None:
            LOGGER.info("\t└──> Aggregated MetricRecord: %s", eval_metrics)
            result.evaluate_metrics_clientapp[server_round] = eval_metrics
        if evaluate_fn is not None:
            LOGGER.info("Global evaluation")
            res = evaluate_fn(server_round, arrays)
            LOGGER.info("\t└──> MetricRecord: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
    LOGGER.info("")
    LOGGER.info("Strategy execution finished in %.2fs", time.time() - started)
    return result
