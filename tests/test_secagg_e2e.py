"""SecAgg+ through a real ``flwr run`` (Ray simulation, 3 SuperNodes, 2 rounds): an external project
(tests/external/secagg_project, its own pyproject and numpy clients) runs Pollen's ``WeightAveraging`` and
``PrototypeStrategy``, unchanged, on a ``SecureGrid``, its ClientApp carrying ``secagg_mod``. The results
must equal what the same clients give in clear, computed here independently, within quantization; no
per-client count reaches the server."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_external_projects import NODES, _app_config, _load, launch


def _fedavg(task, cfg: dict, rounds: int) -> dict[str, np.ndarray]:
    state = task.initial_state(int(cfg["num-features"]))
    for _ in range(rounds):
        news, sizes = [], []
        for pid in range(NODES):
            x, y = task.partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
            new, _ = task.local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
            news.append(new), sizes.append(len(y))
        state = {k: sum(n * new[k].astype(np.float64) for n, new in zip(sizes, news)) / sum(sizes) for k in state}
        state = {k: (np.rint(v) if k == task.STEPS else v) for k, v in state.items()}
    return state


def _pooled_prototypes(task, cfg: dict) -> np.ndarray:
    args = (int(cfg["proto-train-size"]), int(cfg["num-classes"]), int(cfg["proto-features"]), int(cfg["embed-dim"]))
    means, counts = zip(*(task.class_means(int(cfg["data-seed"]), pid, *args) for pid in range(NODES)))
    total = sum(c[:, None] * m for m, c in zip(means, counts))
    return total / sum(counts)[:, None]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["weights", "prototypes"])
def test_pollens_strategies_aggregate_securely_in_an_external_project_through_flwr_run(mode, tmp_path):
    outcome, report, _ = launch("secagg_project", tmp_path, mode=mode)
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("secagg_project")
    task = _load("secagg_project", "task")
    assert report["survivors"] == NODES
    for rnd in ("1", "2"):
        assert (report["train"][rnd]["accepted"], report["train"][rnd]["failures"]) == (NODES, 0)
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in report["arrays"].items()}
    if mode == "weights":
        assert report["clear-metrics"] == ["partition-id", "train-loss"]  # num-examples is inside the sum only
        for key, value in _fedavg(task, cfg, 2).items():
            np.testing.assert_allclose(arrays[key], value, atol=2e-5, rtol=0, err_msg=key)
    else:
        assert report["clear-metrics"] == ["partition-id"]  # the class counts are inside the sum only
        np.testing.assert_allclose(arrays["prototypes"], _pooled_prototypes(task, cfg), atol=2e-6, rtol=0)
        assert arrays["present"].tolist() == [1] * int(cfg["num-classes"])
