"""Flower ServerApp (Message API): validate the run config, run the method's strategy, record the run.

The strategy does the federated work (:mod:`pollen.strategies`); this app adds what a Pollen run
promises: one results folder per run (:mod:`pollen.app.results`), a closed record after every round,
and a run that trained nobody ends **failed** — ``summary.json`` says why and the ServerApp raises,
so Flower reports ``finished:failed`` and the launcher exits non-zero.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from pollen.app.config import RunConfig, parse_run_config
from pollen.app.registry import METHODS
from pollen.app.results import RunRecorder

LOGGER = logging.getLogger("pollen")

app = ServerApp()


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``out-dir/<run-id>``; an empty ``out-dir`` means ``$POLLEN_OUT_DIR`` or ``./pollen-runs``.

    Pass an absolute ``out-dir``: relative paths resolve against the SuperLink's working directory.
    """
    base = cfg.out_dir or os.environ.get("POLLEN_OUT_DIR") or "pollen-runs"
    return Path(base).expanduser().resolve() / str(run_id)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    spec = METHODS[cfg.method]
    strategy = spec.make_strategy(cfg)
    recorder = RunRecorder(run_directory(cfg, context.run_id), cfg.to_dict(), cfg.num_server_rounds)
    server_evaluate = getattr(strategy, "evaluate_global", None)  # GLFC evaluates on the server

    def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        metrics = server_evaluate(server_round, arrays) if server_evaluate is not None else None
        if server_round == 0:
            if metrics is not None:
                recorder.record_initial(dict(metrics))
            return metrics
        recorder.record_report(strategy.take_round_report(server_round),
                               dict(metrics) if metrics is not None else None)
        return metrics

    try:
        strategy.start(grid=grid, initial_arrays=spec.initial_arrays(cfg), num_rounds=cfg.num_server_rounds,
                       evaluate_fn=end_of_round)
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        LOGGER.error("run failed: %s", reason)
        recorder.finish(status="failed", reason=reason)
        raise
    recorder.finish()
