"""Flower ServerApp (Message API): validate the run config, run the method's strategy, keep what it made.

The strategy does the federated work (:mod:`pollen.strategies`); this app adds what a Pollen run
promises: one results folder per run (:mod:`pollen.app.results`), a closed record after every round,
a checkpoint every ``checkpoint-every`` rounds and the final global state under ``final/``
(:mod:`pollen.app.checkpoints`), ``resume-from`` to continue an interrupted run, and a run that trained
nobody ends **failed** — ``summary.json`` says why and the ServerApp raises, so Flower reports
``finished:failed`` and the launcher exits non-zero.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from pollen.app.checkpoints import CheckpointError, latest_checkpoint, save_arrays, write_checkpoint, write_json
from pollen.app.config import RunConfig, evaluates_on_clients, validated_run_config
from pollen.app.grid_poll import prompt_replies
from pollen.app.registry import METHODS, all_defaults
from pollen.app.results import RunRecorder, run_directory
from pollen.app.secure import secure_grid
from pollen.app.tracking import open_tracker
from pollen.log import LOGGER
from pollen.privacy.config import no_headline_warning, release_terms
from pollen.settings import RESUMABLE_CHANGES

app = ServerApp()


def config_differences(saved: dict, now: dict) -> list[str]:
    """Keys whose value changed since the checkpoint. A key the saved config lacks was added to Pollen
    after the run started: it counts as its declared default (a new key's default keeps the old behaviour),
    so a run from an older version resumes unless the key is set to something else."""
    defaults = all_defaults()
    return sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES
                  and saved.get(k, defaults.get(k)) != now.get(k))


def _initial_arrays(strategy, arrays: dict) -> ArrayRecord:
    """What ``start`` continues from after a restore: the strategy's global record, if it has one."""
    model = {k[len("model."):]: v for k, v in arrays.items() if k.startswith("model.")}
    if getattr(strategy, "family", "") == "weights" and model:
        return ArrayRecord({k: Array(v) for k, v in model.items()})
    return ArrayRecord()


def write_final(run_dir: Path, cfg: RunConfig, strategy, last_round: int) -> dict[str, str]:
    """``final/global.safetensors`` (+ JSON): the strategy's global state at the end of the run."""
    arrays, values = strategy.state()
    values = {k: v for k, v in values.items() if k != "rng"}
    if not arrays:
        return {}
    folder = run_dir / "final"
    digest = save_arrays(folder / "global.safetensors", arrays)
    meta = {"method": cfg.method, "task": cfg.task, "family": strategy.family, "round": last_round,
            "model": cfg.model or "", "values": values, "sha256": digest}  # the arrays' digest travels with them
    if strategy.family == "weights":  # a global model: what rebuilds it travels with it (pollen predict)
        from pollen.datasets.tasks import TaskOptions, resolve_task
        from pollen.models.spec import choose_model

        meta["model-spec"] = choose_model(cfg, resolve_task(cfg.task, TaskOptions.of(cfg))).to_json()
    write_json(folder / "global.json", meta)
    return {"global": str(folder / "global.safetensors")}


def record_task(run_dir: Path, cfg: RunConfig) -> None:
    """``task.json`` for user-data tasks: the classes and input format the run agreed on (given or
    detected from ``data-dir``), so a result says what it was trained on."""
    from pollen.datasets.tasks import TaskOptions, resolve_task

    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    if not task.class_names:
        return
    detected = "each data folder's training images"
    write_json(run_dir / "task.json", {
        "task": cfg.task, "classes": list(task.class_names), "image-size": task.fmt.size,
        "image-channels": task.fmt.channels, "data-dir": cfg.data_dir,
        "image-mean": list(task.fmt.mean) if cfg.image_mean else detected,
        "image-std": list(task.fmt.std) if cfg.image_std else detected})


@app.main()
def main(grid: Grid, context: Context) -> None:
    grid = prompt_replies(grid)  # a fleet's replies as they arrive, not at Flower's 3 s pull ticks
    cfg = validated_run_config(context.run_config)  # once per process: in-process ClientApps reuse it
    spec = METHODS[cfg.method]
    strategy = spec.make_strategy(cfg)
    run_dir = run_directory(cfg, context.run_id)
    initial = spec.initial_arrays(cfg)
    first_round = 1
    if cfg.resume_from:
        ckpt = latest_checkpoint(run_dir)
        changed = config_differences(ckpt.config, cfg.to_dict())
        if changed:
            raise CheckpointError(f"cannot resume {run_dir}: run config differs in {changed}")
        strategy.restore(ckpt.arrays, ckpt.values)
        initial = _initial_arrays(strategy, ckpt.arrays) or initial
        first_round = ckpt.round + 1
        LOGGER.info("resuming %s after round %d (%s)", run_dir, ckpt.round, ckpt.path.name)
    dp_terms = None
    if cfg.dp_mode != "off":  # what every ε protects, and what became of the clients' evaluation
        dp_terms = {**release_terms(spec.family, cfg.dp_mode),
                    "dp-evaluate": cfg.dp_evaluate if evaluates_on_clients(cfg) else "none"}
    if cfg.dp_mode != "off" and (caveat := no_headline_warning(spec.family, cfg.dp_mode)):
        LOGGER.warning(caveat)
    recorder = RunRecorder(run_dir, cfg.to_dict(), cfg.num_server_rounds, resume_after=first_round - 1,
                           flower_run_id=context.run_id, dp_terms=dp_terms,
                           tracker=open_tracker(cfg.tracking, cfg.tracking_uri, run_dir, cfg.to_dict()))
    record_task(run_dir, cfg)
    server_evaluate = getattr(strategy, "evaluate_global", None)  # GLFC evaluates on the server
    written: dict[str, str] = {}

    def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        metrics = server_evaluate(server_round, arrays) if server_evaluate is not None else None
        if server_round == 0:
            if metrics is not None:
                recorder.record_initial(dict(metrics))
            return metrics
        recorder.record_report(strategy.take_round_report(server_round),
                               dict(metrics) if metrics is not None else None)
        every = cfg.checkpoint_every
        if every and (server_round % every == 0 or server_round == cfg.num_server_rounds):
            state_arrays, values = strategy.state()
            written["checkpoint"] = str(write_checkpoint(run_dir, server_round, state_arrays, values,
                                                         cfg.to_dict(), cfg.checkpoint_keep))
        return metrics

    if first_round > cfg.num_server_rounds:
        LOGGER.info("nothing to resume: %s already finished round %d", run_dir, first_round - 1)
        # a run stopped between its last checkpoint and its final files gets them now, from that checkpoint
        written.update(write_final(run_dir, cfg, strategy, cfg.num_server_rounds))
    else:
        try:
            strategy.start(grid=secure_grid(grid, cfg, strategy), initial_arrays=initial,
                           num_rounds=cfg.num_server_rounds, evaluate_fn=end_of_round, first_round=first_round)
            written.update(write_final(run_dir, cfg, strategy, cfg.num_server_rounds))
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"
            LOGGER.error("run failed: %s", reason)
            recorder.finish(status="failed", reason=reason, files=written)
            raise
    recorder.finish(files=written)
