"""Run-level regressions: whole tiny runs through Pollen's real ServerApp and ClientApp.

One method of each family — ``fedavg`` (weights, ``uci-dirichlet``), ``fedproto`` (prototypes,
``mnist-shot``) and ``fccl`` (logits, ``digits-offline``) — runs end to end in this process: the
ServerApp (``pollen.app.server_app.app``: ``METHODS[method].make_strategy`` / ``initial_arrays``, the
run recorder) drives the strategy through an in-process grid whose nodes are Pollen's real ClientApp
with a real ``Context`` each (``pollen.testing``). Each run is a few seconds: 2 rounds, a handful
of clients and samples, CPU, one torch thread.

Two checks per family:

* **Same seed, same run**: the run is done twice (separate output folders, so no client state is
  shared through disk); every value of every ``metrics.jsonl`` record must be identical, timings
  (``wall-time-s``, ``elapsed-s``, any key ending in ``-s`` or naming a time) excluded.
* **Stored expectation**: per-round aggregates (``fit``/``evaluate`` metrics, accepted, sampled,
  bytes each way) and ``summary.json``'s status and final accuracy must match
  ``tests/expected/<method>.json``. Floats are compared with an absolute tolerance (``ABS_TOL``,
  also written into each file): 1e-4 for ``fedavg`` and ``fedproto``, 1e-3 for ``fccl`` — room for
  other CPU kernels (measured: running with 2 torch threads instead of 1 moves ``fedavg``'s values
  by <= 1e-7, ``fedproto``'s by 0 and FCCL's round-2 losses by <= 1.8e-4), far below what a
  behaviour change moves (accuracies on these test sets move in steps of >= 1/120). Everything
  else (ints, strings, keys, lengths) must match exactly.

A behaviour change that moves these numbers must update the files **on purpose**::

    POLLEN_UPDATE_EXPECTED=1 .venv/bin/python -m pytest tests/test_run_regression.py

rewrites ``tests/expected/*.json`` from the current code (the tests then pass and say so in a
warning); review the diff and commit it with the change that caused it.

Another kind of CPU computes other last bits (``tests/numerics.py``), and one test image may then flip.
A platform whose runs differ keeps its own files in ``tests/expected/<platform>/`` (written with
``POLLEN_UPDATE_EXPECTED=platform``, from the same commit as the shared files); any other platform is
held to the shared ones.

``fedproto`` and ``fccl`` need the MNIST files (``POLLEN_DATA_ROOT``) and skip without them, by the
suite's one rule (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from pollen.testing import InProcessGrid, clientapp_node
from tests.numerics import numeric_platform

EXPECTED_DIR = Path(__file__).resolve().parent / "expected"
UPDATE_ENV = "POLLEN_UPDATE_EXPECTED"
ABS_TOL = {"fedavg": 1e-4, "fedproto": 1e-4, "fccl": 1e-3}  # see the module docstring
RUN_ID = 1  # the run id clientapp_node gives its nodes' Contexts

# Common to every run: CPU, one thread, 2 rounds, every node every round.
COMMON = {"num-server-rounds": 2, "seed": 3, "device": "cpu", "torch-threads": 1, "fraction-fit": 1.0,
          "fraction-evaluate": 1.0}

# method -> (run config, number of clients, needs the MNIST files)
RUNS: dict[str, tuple[dict[str, Any], int, bool]] = {
    "fedavg": ({"method": "fedavg", "task": "uci-dirichlet", "max-train-samples": 96, "batch-size": 16,
                "min-available-clients": 3}, 3, False),
    "fedproto": ({"method": "fedproto", "task": "mnist-shot", "shot-ways": 2, "shot-shots": 12, "shot-stdev": 0,
                  "shot-test-per-class": 4, "batch-size": 4, "lr": 0.05, "min-available-clients": 3}, 3, True),
    # tests/test_fccl_client.py's TINY sizes; one small backbone for all four domains keeps it fast
    "fccl": ({"method": "fccl", "task": "digits-offline", "model": "cnn_mnist", "fccl-public": "photo_patches",
              "fccl-public-size": 40, "fccl-public-batch-size": 20, "fccl-train-sizes": "24,24,24,24",
              "fccl-solo-epochs": 1, "fccl-local-epochs": "1", "fccl-test-size": 20, "fccl-batch-size": 12,
              "min-available-clients": 4}, 4, True),
}

_TIMING = re.compile(r"(time|elapsed|seconds|duration)|-s$")


def _run_config(method: str, out_dir: Path, data_root: str | None) -> dict[str, Any]:
    config, _, _ = RUNS[method]
    rc = {**COMMON, **config, "out-dir": str(out_dir)}
    if data_root:
        rc["data-root"] = data_root
    return rc


def run_once(method: str, out_dir: Path, data_root: str | None) -> tuple[list[dict], dict]:
    """One whole run; returns (``metrics.jsonl`` records, ``summary.json``)."""
    from pollen.app import client_app, server_app

    rc = _run_config(method, out_dir, data_root)
    _, num_clients, _ = RUNS[method]
    grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, num_clients)
                          for p in range(num_clients)})
    context = Context(run_id=RUN_ID, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc))
    server_app.app(grid, context)
    run_dir = out_dir / str(RUN_ID)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return records, summary


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not _TIMING.search(str(k))}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def expectation(records: list[dict], summary: dict) -> dict[str, Any]:
    """The small, stable part of a run that the stored files keep."""
    rounds = [{key: rec.get(key) for key in ("round", "sampled", "accepted", "bytes-down", "bytes-up",
                                            "failures", "fit", "evaluate")} for rec in records]
    for rec, src in zip(rounds, records, strict=True):
        rec["rejected"] = len(src.get("rejected", []))
    return without_timings({"status": summary.get("status"), "rounds": rounds,
                            "final-accuracy": summary.get("final-accuracy")})


def assert_close(got: Any, want: Any, tol: float, path: str = "") -> None:
    """Floats within ``tol``; ints, strings, None, keys and lengths exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (
            f"{path}: keys differ: missing {sorted(set(want) - set(got or {}))}, "
            f"new {sorted(set(got or {}) - set(want))}")
        for key in want:
            assert_close(got[key], want[key], tol, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, tol, f"{path}[{i}]")
    elif isinstance(want, float) or (isinstance(got, float) and isinstance(want, int) and not isinstance(want, bool)):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}: {got!r} != {want!r}"
        assert math.isclose(got, want, rel_tol=0.0, abs_tol=tol), (
            f"{path}: {got!r} differs from the stored {want!r} by more than {tol}")
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != stored {want!r}"


@pytest.mark.parametrize("method", list(RUNS))
def test_same_seed_same_run_and_stored_expectation(method, tmp_path, monkeypatch):
    monkeypatch.setattr("pollen.app.results.plot_curves", lambda *args, **kwargs: None)  # seconds, untested here
    _, _, needs_data = RUNS[method]
    data_root = None
    if needs_data:
        from tests.conftest import require_real_data

        data_root = require_real_data()

    first, summary = run_once(method, tmp_path / "a", data_root)
    second, summary2 = run_once(method, tmp_path / "b", data_root)

    # the run completed, every round trained and evaluated every client
    _, num_clients, _ = RUNS[method]
    assert summary["status"] == "completed", summary.get("failure-reason")
    assert [r["round"] for r in first] == [1, 2]
    for rec in first:
        assert rec["accepted"] == num_clients and not rec["rejected"] and rec["failures"] == 0, rec
        assert rec["evaluate"], f"round {rec['round']} has no evaluate metrics"

    # same seed -> identical metrics.jsonl (timings excluded), bit for bit
    assert without_timings(first) == without_timings(second)
    assert without_timings(summary["final-accuracy"]) == without_timings(summary2["final-accuracy"])

    # stored expectation, changed only on purpose
    got = expectation(first, summary)
    update = os.environ.get(UPDATE_ENV)
    own = EXPECTED_DIR / numeric_platform() / f"{method}.json"
    path = own if update == "platform" or (update != "1" and own.exists()) else EXPECTED_DIR / f"{method}.json"
    if update in ("1", "platform"):
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = {"method": method, "run-config": {k: v for k, v in _run_config(method, Path("<tmp>"), None).items()
                                                   if k != "out-dir"},
                  "num-clients": num_clients, "abs-tolerance": ABS_TOL[method], **got}
        path.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        warnings.warn(f"{UPDATE_ENV}=1: rewrote {path}", stacklevel=1)
        return
    assert path.exists(), f"{path} is missing: create it with {UPDATE_ENV}=1 (see this module's docstring)"
    stored = json.loads(path.read_text())
    want = {k: stored[k] for k in got}
    assert_close(got, want, ABS_TOL[method], method)
