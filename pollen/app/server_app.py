"""Flower ServerApp: validate the run config, build the method's strategy, record the run."""

from __future__ import annotations

import os
from pathlib import Path

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager

from pollen.app.config import RunConfig, parse_run_config
from pollen.app.registry import METHODS
from pollen.app.results import PollenServer, RecordingStrategy, RunRecorder


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``out-dir/<run-id>``; an empty ``out-dir`` means ``$POLLEN_OUT_DIR`` or ``./pollen-runs``.

    Pass an absolute ``out-dir``: relative paths resolve against the SuperLink's working directory.
    """
    base = cfg.out_dir or os.environ.get("POLLEN_OUT_DIR") or "pollen-runs"
    return Path(base).expanduser().resolve() / str(run_id)


def server_fn(context: Context) -> ServerAppComponents:
    cfg = parse_run_config(context.run_config)
    strategy = METHODS[cfg.method].make_strategy(cfg)
    recorder = RunRecorder(run_directory(cfg, context.run_id), cfg.to_dict(), cfg.num_server_rounds)
    server = PollenServer(client_manager=SimpleClientManager(),
                          strategy=RecordingStrategy(strategy, recorder))
    return ServerAppComponents(server=server, config=ServerConfig(num_rounds=cfg.num_server_rounds))


app = ServerApp(server_fn=server_fn)
