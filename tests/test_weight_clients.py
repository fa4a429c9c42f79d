"""FedAvg / FedProx / local clients driven through real Flower Contexts (no Flower server)."""

import numpy as np
import pytest
import torch

from pollen.app.config import parse_node_config, parse_run_config
from pollen.app.methods_weights import initial_model_arrays
from pollen.app.registry import METHODS
from tests.conftest import make_context


def _client(method, context, **overrides):
    cfg = parse_run_config({"method": method, "local-epochs": 1, "batch-size": 16, **overrides})
    return METHODS[method].make_client(cfg, parse_node_config(context.node_config), context), cfg


def test_fedavg_client_trains_and_reports():
    ctx = make_context(partition_id=1, num_partitions=3)
    client, cfg = _client("fedavg", ctx)
    init = initial_model_arrays(cfg).to_numpy_ndarrays()
    assert [a.shape for a in client.get_parameters({})] == [a.shape for a in init]
    loss0, n_test, m0 = client.evaluate(init, {})
    new, n, metrics = client.fit(init, {"server-round": 1, "proximal-mu": 0.0})
    assert n == client.data.num_train and metrics["partition-id"] == 1 and np.isfinite(metrics["train-loss"])
    assert any(not np.array_equal(a, b) for a, b in zip(new, init))
    assert [a.dtype for a in new] == [a.dtype for a in init]
    loss1, _, m1 = client.evaluate(new, {})
    assert n_test == len(client.data.y_test) and loss1 < loss0  # one epoch helps on its own data split


def test_fedprox_term_keeps_weights_closer_to_the_global_model():
    ctx = make_context(partition_id=0, num_partitions=3)
    client, cfg = _client("fedprox", ctx, **{"lr": 0.2})
    init = initial_model_arrays(cfg).to_numpy_ndarrays()

    def dist(arrays):
        return sum(float(((a.astype(np.float64) - b) ** 2).sum()) for a, b in zip(arrays, init)
                   if a.dtype.kind == "f")

    free, _, _ = client.fit(init, {"server-round": 1, "proximal-mu": 0.0})
    prox, _, _ = client.fit(init, {"server-round": 1, "proximal-mu": 10.0})
    assert dist(prox) < dist(free)


def test_fedprox_term_matches_a_hand_computation():
    """FedProx's objective is CE + mu/2·||w - w_global||² over the trainable parameters.

    With one full batch per epoch (batch-size >= samples), momentum 0 and no weight decay, each
    epoch is one plain SGD step, and the same round seed gives the same batch order and dropout masks
    whatever mu is. Step 1 starts at w_global, where the proximal gradient is exactly 0, so w1 is the
    same for every mu. Step 2 then differs only by the proximal gradient mu·(w1 - w_global):
        w2(mu) = w2(0) - lr·mu·(w1 - w_global),
    and its loss, the reported train-loss, only by the term's value:
        train-loss(mu) - train-loss(0) = mu/2·||w1 - w_global||².
    """
    lr, mu = 0.1, 2.0
    ctx = make_context(partition_id=0, num_partitions=3)
    opts = {"lr": lr, "momentum": 0.0, "weight-decay": 0.0, "batch-size": 1_000_000}
    one, cfg = _client("fedprox", ctx, **opts, **{"local-epochs": 1})
    two, _ = _client("fedprox", ctx, **opts, **{"local-epochs": 2})
    assert one.data.num_train <= 1_000_000  # one batch per epoch: an epoch is one SGD step
    init = initial_model_arrays(cfg).to_numpy_ndarrays()
    model = one.new_model()
    keys = list(model.state_dict())
    params = {name for name, _ in model.named_parameters()}
    assert params and all(a.dtype == np.float32 for k, a in zip(keys, init) if k in params)

    def fit(client, proximal_mu):
        arrays, n, metrics = client.fit(init, {"server-round": 1, "proximal-mu": proximal_mu})
        assert n == client.data.num_train
        return [a.astype(np.float64) for a in arrays], metrics

    w1, _ = fit(one, 0.0)
    w1_prox, _ = fit(one, mu)
    w2, m2 = fit(two, 0.0)
    w2_prox, m2_prox = fit(two, mu)

    # step 1: no proximal pull at the anchor — bit for bit
    for k, a, b in zip(keys, w1, w1_prox):
        np.testing.assert_array_equal(a, b, err_msg=k)
    # step 2: exactly the proximal gradient's extra step, on every parameter
    moved = [w - g for k, w, g in zip(keys, w1, init) if k in params]
    assert max(float(np.abs(lr * mu * d).max()) for d in moved) > 1e-4  # far above float32 rounding
    for k, a, b, w, g in zip(keys, w2_prox, w2, w1, init):
        want = b - lr * mu * (w - g) if k in params else b
        np.testing.assert_allclose(a, want, rtol=0, atol=1e-6, err_msg=k)
    # the reported loss of step 2 carries the term's value, mu/2·||w1 - w_global||²
    term = 0.5 * mu * sum(float((d ** 2).sum()) for d in moved)
    assert term > 1e-4
    assert m2_prox["train-loss"] - m2["train-loss"] == pytest.approx(term, rel=1e-4, abs=1e-6)


def test_fit_is_deterministic_for_a_round_seed():
    ctx = make_context(partition_id=2, num_partitions=3)
    client, cfg = _client("fedavg", ctx)
    init = initial_model_arrays(cfg).to_numpy_ndarrays()
    a, _, _ = client.fit(init, {"server-round": 3})
    b, _, _ = client.fit(init, {"server-round": 3})
    c, _, _ = client.fit(init, {"server-round": 4})
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_local_client_keeps_its_model_in_context_state():
    ctx = make_context(partition_id=0, num_partitions=3)
    client, _ = _client("local", ctx)
    assert "local-model" not in ctx.state
    arrays, n, _ = client.fit([], {"server-round": 1})
    assert arrays == [] and n > 0 and "local-model" in ctx.state
    after_round1 = {k: ctx.state["local-model"][k].numpy().copy() for k in ctx.state["local-model"]}
    # A brand-new client object (as Flower builds per message) continues from the stored model.
    fresh, _ = _client("local", ctx)
    model = fresh._load()
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.cpu().numpy(), after_round1[k])
    fresh.fit([], {"server-round": 2})
    changed = any(not np.array_equal(ctx.state["local-model"][k].numpy(), after_round1[k]) for k in after_round1)
    assert changed


def test_wrong_number_of_arrays_is_a_clear_error():
    ctx = make_context(partition_id=0, num_partitions=3)
    client, cfg = _client("fedavg", ctx)
    with pytest.raises(ValueError, match="same model and width"):
        client.fit(initial_model_arrays(cfg).to_numpy_ndarrays()[:-1], {"server-round": 1})


def test_cuda_request_without_gpu_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    ctx = make_context()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        _client("fedavg", ctx, device="cuda")


@pytest.fixture
def count_validations(monkeypatch):
    """Counts every full check of a run config (whatever entry point: each reads it against the
    declarations once, ``read_run_config``), with the once-per-process cache empty before and after."""
    from pollen.app import config

    calls = []
    check = config.read_run_config
    monkeypatch.setattr(config, "read_run_config", lambda *args: calls.append(args) or check(*args))
    config._validated.cache_clear()
    yield calls
    config._validated.cache_clear()


TINY_RUN = {"method": "fedavg", "task": "uci-dirichlet", "max-train-samples": 48, "batch-size": 16,
            "num-server-rounds": 2, "fraction-evaluate": 1.0}


def test_an_inprocess_run_validates_its_run_config_once(count_validations, tmp_path):
    """The in-process runner is one process holding the server side and every ClientApp: 2 rounds of 3
    nodes (12 train/evaluate messages) check the run config once (before: the runner once and the
    ClientApps once more)."""
    from pollen.testing import run_inprocess

    records = run_inprocess({**TINY_RUN, "out-dir": str(tmp_path / "runs")}, 3, echo=False)
    assert len(records) == 2 and len(count_validations) == 1


def test_the_serverapp_and_its_clientapps_in_one_process_validate_once(count_validations, tmp_path):
    """``server_app.main`` with ClientApps answering in the same process (InProcessGrid): one check for
    the ServerApp and every message (before: the ServerApp once and the ClientApps once more)."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    rc = {**TINY_RUN, "out-dir": str(tmp_path / "runs")}
    grid = InProcessGrid({100 + p: clientapp_node(client_app, rc, p, 3) for p in range(3)})
    server_main(grid, Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    assert sum(m.metadata.message_type in ("train", "evaluate") for m in grid.sent) == 12
    assert len(count_validations) == 1
