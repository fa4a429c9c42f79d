"""Streaming a run to the tracker people already use: TensorBoard or MLflow, fed by the ServerApp alone.

The nodes need no access to the tracker: everything it shows is what the ServerApp already records in the
run folder. ``tracking = "tensorboard"`` writes an event file under ``<tracking-uri>/<run folder name>/``
(empty: the run folder's ``tensorboard/``); ``tracking = "mlflow"`` logs to the MLflow tracking server or store at
``tracking-uri`` (empty: ``$MLFLOW_TRACKING_URI``, else a file store ``<out-dir>/mlruns`` beside the runs).

What a tracker receives (:func:`round_scalars` names every value):

* at the start, the run config as parameters (MLflow params; TensorBoard: one text summary);
* per round, at step = the round: the aggregated train and evaluate metrics and the server's evaluation,
  every client's metrics under ``clients/<partition>/``, each client's ε under ``privacy/epsilon/``,
  bytes each way, the round's wall time and counts, and the simulated network's figures when it is on;
* at the end (MLflow), ``summary.json``, ``metrics.jsonl``, ``config.json``, ``curves.png`` and the final
  model (``final/``) as artifacts, and the run's status.

A tracker is optional: its packages are the ``pollen-fl[tracking]`` extra, imported only when the key asks
for them (a ServerApp without tracking pays nothing). Everything a run writes is on disk before a tracker
sees it, and a tracker that is missing, unreachable or fails is a WARNING naming what failed: from then on
it is left alone and the run goes on.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pollen.log import LOGGER
from pollen.settings import TRACKERS

INSTALL_HINT = "pip install 'pollen-fl[tracking]'"
# The files of a run folder an MLflow run keeps as artifacts (the final model: the whole ``final/`` folder).
ARTIFACT_FILES = ("summary.json", "metrics.jsonl", "config.json", "curves.png", "task.json")
# An unreachable MLflow server must cost seconds, not MLflow's default minutes of retries (these are MLflow's
# own environment variables; a value the user set wins).
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
MLFLOW_BATCH = 100  # MLflow's log_batch takes at most 100 params and 1000 metrics per call


def _slug(label: str) -> str:
    """A client label as one path part of a metric name: ``partition 3`` -> ``partition-3``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(label)).strip("-") or "client"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def round_scalars(rec: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one ``metrics.jsonl`` record, by the names a tracker shows them under.

    ``train/<key>``, ``evaluate/<key>``, ``server-evaluate/<key>`` (the round's aggregated metrics),
    ``clients/<client>/train/<key>`` and ``clients/<client>/evaluate/<key>`` (each client's),
    ``privacy/epsilon/<client>`` (each client's ε so far), ``bytes/down``, ``bytes/up``, ``round/wall-time-s``,
    ``round/sampled``, ``round/accepted``, ``round/rejected``, ``round/failures`` and, with the simulated
    network on, ``network/...`` (its clock and the clients that dropped out or came late). Lists and
    anything not a finite number are left out: they stay in ``metrics.jsonl``.
    """
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        number = _number(value)
        if number is not None:
            out[name] = number

    for source, prefix in (("fit", "train"), ("evaluate", "evaluate"), ("server-evaluate", "server-evaluate")):
        for key, value in (rec.get(source) or {}).items():
            put(f"{prefix}/{key}", value)
    for source, stage in (("fit-clients", "train"), ("evaluate-clients", "evaluate")):
        for client, metrics in (rec.get(source) or {}).items():
            for key, value in (metrics or {}).items():
                put(f"clients/{_slug(client)}/{stage}/{key}", value)
            if stage == "train" and "dp-epsilon" in (metrics or {}):
                put(f"privacy/epsilon/{_slug(client)}", metrics["dp-epsilon"])
    put("bytes/down", rec.get("bytes-down"))
    put("bytes/up", rec.get("bytes-up"))
    put("round/wall-time-s", rec.get("wall-time-s"))
    put("round/sampled", rec.get("sampled"))
    put("round/accepted", rec.get("accepted"))
    put("round/rejected", len(rec.get("rejected") or []))
    put("round/failures", rec.get("failures"))
    network = rec.get("network") or {}
    for key in ("sim-round-s", "sim-clock-s", "deadline-s"):
        put(f"network/{key}", network.get(key))
    if network:
        missing = network.get("missing") or []
        put("network/dropped", sum(1 for m in missing if m.get("why") == "dropped"))
        put("network/late", sum(1 for m in missing if m.get("why") == "late"))
    return out


class Tracker:
    """The interface, and ``tracking = "none"``: nothing is sent anywhere."""

    name = "none"

    def start(self, params: Mapping[str, Any]) -> None:
        """The run config, once, before round 1 (a resumed run: again, unchanged)."""

    def log_round(self, step: int, scalars: Mapping[str, float]) -> None:
        """One round's scalars (:func:`round_scalars`) at ``step`` = the round."""

    def finish(self, summary: Mapping[str, Any], run_dir: Path) -> None:
        """The end of the run: its summary, and what the run folder holds as artifacts."""


class TensorBoardTracker(Tracker):
    """Scalars into a TensorBoard event file, written with TensorBoard's own writer (no torch, no TensorFlow)."""

    name = "tensorboard"

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._proto = (Event, Summary, SummaryMetadata, TensorProto)
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.logdir))

    def _text(self, tag: str, text: str, step: int) -> None:
        """A text summary (TensorBoard's text plugin shows it under ``tag``)."""
        import time

        event, summary, metadata, tensor = self._proto
        meta = metadata(plugin_data=metadata.PluginData(plugin_name="text"))
        value = tensor(dtype=7, string_val=[text.encode()], tensor_shape={})  # dtype 7: DT_STRING
        self.writer.add_event(event(wall_time=time.time(), step=step,
                                    summary=summary(value=[summary.Value(tag=tag, metadata=meta, tensor=value)])))
        self.writer.flush()

    def start(self, params: Mapping[str, Any]) -> None:
        self._text("run-config", "```\n" + json.dumps(dict(params), indent=1, sort_keys=True, default=str) + "\n```", 0)

    def log_round(self, step: int, scalars: Mapping[str, float]) -> None:
        import time

        event, summary, _, _ = self._proto
        values = [summary.Value(tag=tag, simple_value=value) for tag, value in sorted(scalars.items())]
        self.writer.add_event(event(wall_time=time.time(), step=step, summary=summary(value=values)))
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any], run_dir: Path) -> None:
        text = "```\n" + json.dumps(dict(summary), indent=1, sort_keys=True, default=str) + "\n```"
        self._text("summary", text, int(summary.get("last-round") or 0))
        self.writer.close()


class MlflowTracker(Tracker):
    """An MLflow run: params, per-round metrics, the run folder's files as artifacts, the final status.

    A resumed run continues the MLflow run it started (its id is kept in the run folder's ``tracking.json``).
    """

    name = "mlflow"

    def __init__(self, uri: str, run_dir: Path, run_name: str, experiment: str = "pollen"):
        for key, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if uri.startswith("file:") or "://" not in uri:  # a local file store: MLflow 3 asks for the opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.run_dir = Path(run_dir)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        kept = _read_json(self.run_dir / "tracking.json")
        if kept.get("tracking") == "mlflow" and kept.get("uri") == uri and kept.get("run-id"):
            self.run_id = str(kept["run-id"])
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            _write_json(self.run_dir / "tracking.json", {"tracking": "mlflow", "uri": uri, "run-id": self.run_id,
                                                         "experiment": experiment})

    def start(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        if self.client.get_run(self.run_id).data.params:  # a resumed run: its params are there, unchanged
            return
        items = [Param(str(k), json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(params.items())]
        for i in range(0, len(items), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_BATCH])

    def log_round(self, step: int, scalars: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, value, now, step) for key, value in sorted(scalars.items())]
        for i in range(0, len(items), 10 * MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + 10 * MLFLOW_BATCH])

    def finish(self, summary: Mapping[str, Any], run_dir: Path) -> None:
        for name in ARTIFACT_FILES:
            if (run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(run_dir / name))
        if (run_dir / "final").is_dir():
            self.client.log_artifacts(self.run_id, str(run_dir / "final"), artifact_path="final")
        status = "FINISHED" if summary.get("status") == "completed" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)


class SafeTracker(Tracker):
    """A tracker whose every failure is a WARNING, after which it is left alone: the run never waits on it
    again and never fails because of it."""

    def __init__(self, inner: Tracker | None, where: str):
        self.inner = inner
        self.where = where
        self.name = inner.name if inner is not None else "none"

    def _call(self, what: str, fn, *args: Any) -> None:
        if self.inner is None:
            return
        try:
            fn(*args)
        except Exception as err:  # a tracker is optional: whatever it raises, the run goes on
            LOGGER.warning("tracking = %s: %s failed (%s: %s); the tracker is left alone for the rest of the run, "
                           "everything is on disk in %s", self.name, what, type(err).__name__,
                           str(err).strip().splitlines()[0][:300] if str(err).strip() else "", self.where)
            self.inner = None

    def start(self, params: Mapping[str, Any]) -> None:
        self._call("logging the run config", self.inner.start if self.inner else None, params)

    def log_round(self, step: int, scalars: Mapping[str, float]) -> None:
        self._call(f"logging round {step}", self.inner.log_round if self.inner else None, step, scalars)

    def finish(self, summary: Mapping[str, Any], run_dir: Path) -> None:
        self._call("logging the run's end", self.inner.finish if self.inner else None, summary, run_dir)


def default_uri(kind: str, run_dir: Path) -> str:
    """Where a tracker writes when ``tracking-uri`` is empty (module docstring)."""
    if kind == "tensorboard":
        return str(run_dir / "tensorboard")
    return os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.parent / "mlruns").resolve().as_uri()


def open_tracker(kind: str, uri: str, run_dir: Path, params: Mapping[str, Any]) -> SafeTracker:
    """The run's tracker, started with ``params`` (the run config); a tracker that cannot be opened (its
    package missing, its server unreachable) is a WARNING and the run goes on without it."""
    run_dir = Path(run_dir)
    if kind == "none":
        return SafeTracker(None, str(run_dir))
    if kind not in TRACKERS:
        raise ValueError(f"tracking must be one of {TRACKERS}, got {kind!r}")
    target = uri or default_uri(kind, run_dir)
    inner: Tracker | None = None
    try:
        # TensorBoard: one folder per run under a given tracking-uri, so runs sit side by side in its view
        inner = TensorBoardTracker(Path(target) / run_dir.name if uri else Path(target)) if kind == "tensorboard" \
            else MlflowTracker(target, run_dir, run_name=run_dir.name)
    except ImportError as err:
        LOGGER.warning("tracking = %s needs the package %r (%s); the run goes on without a tracker, everything is "
                       "on disk in %s", kind, err.name, INSTALL_HINT, run_dir)
    except Exception as err:  # unreachable server, refused store: the run goes on
        LOGGER.warning("tracking = %s: cannot open %s (%s: %s); the run goes on without a tracker, everything is on "
                       "disk in %s", kind, target, type(err).__name__,
                       str(err).strip().splitlines()[0][:300] if str(err).strip() else "", run_dir)
    tracker = SafeTracker(inner, str(run_dir))
    if inner is not None:
        LOGGER.info("tracking = %s: %s", kind, target)
    tracker.start(params)
    return tracker


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    from pollen.app.checkpoints import atomic_write

    atomic_write(path, (json.dumps(dict(data), indent=2, sort_keys=True) + "\n").encode())
