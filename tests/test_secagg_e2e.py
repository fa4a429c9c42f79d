"""SecAgg+ through a real ``flwr run`` (Ray simulation, 3 SuperNodes, 2 rounds): an external project
(tests/external/secagg_project) whose ServerApp drives Pollen's ``SecAggPlus`` and whose ClientApp
carries ``secagg_mod``. Its FedAvg must equal an independent FedAvg of the same seeded clients within
quantization, and no per-client number but the allowed scalars may reach the server."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_external_projects import NODES, _app_config, _load, launch


def _fedavg(task, cfg: dict, rounds: int) -> list[dict[str, np.ndarray]]:
    state = task.initial_state(int(cfg["num-features"]))
    out = []
    for _ in range(rounds):
        news, sizes = [], []
        for pid in range(NODES):
            x, y = task.partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
            new, _ = task.local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
            news.append(new), sizes.append(len(y))
        state = {k: sum(n * new[k].astype(np.float64) for n, new in zip(sizes, news)) / sum(sizes) for k in state}
        state = {k: (np.rint(v) if k == task.STEPS else v) for k, v in state.items()}
        out.append(state)
    return out


@pytest.mark.e2e
def test_an_external_project_aggregates_securely_through_flwr_run(tmp_path):
    outcome, report, _ = launch("secagg_project", tmp_path)
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("secagg_project")
    task = _load("secagg_project", "task")
    expected = _fedavg(task, cfg, 2)
    for rnd, want in zip(("1", "2"), expected):
        got = report["rounds"][rnd]
        assert (got["survivors"], got["dropped"], got["refused"]) == (NODES, 0, [])
        assert got["weight"] == sum(task.train_size(p) for p in range(NODES))
        assert got["metrics"] == ["partition-id", "train-loss"]  # num-examples is inside the sum only
        for key, value in want.items():
            np.testing.assert_allclose(np.asarray(got["arrays"][key], dtype=np.float64), value, atol=2e-5, rtol=0)
