"""dp-mode through real ClientApps in this process: off changes nothing, payload releases what the
mechanism says and reports the ε an independent dp-accounting computation gives, the ledger survives a
restart, the cap stops a client, and the server turns noisy sums and counts back into prototypes."""

from __future__ import annotations

import hashlib
import json

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from pollen.app.checkpoints import load_records
from pollen.app.client_app import app as client_app
from pollen.app.config import ConfigError, parse_run_config
from pollen.app.registry import METHODS
from pollen.app.server_app import main as server_main
from pollen.clients.state import ClientState
from pollen.datasets.spec import TaskOptions
from pollen.privacy import calibrate_noise_multiplier
from pollen.protocol import prototypes as proto_protocol
from pollen.strategies import NoTrainingError
from pollen.testing import InProcessGrid, clientapp_node, set_task_identity
from tests.conftest import pollen_command
from tests.numerics import REFERENCE, on_this_platform

torch.set_num_threads(1)

UCI = {"task": "uci-dirichlet", "max-train-samples": 48, "batch-size": 8, "fraction-evaluate": 0.0}
PAYLOAD = {"method": "fedproto", **UCI, "dp-mode": "payload", "dp-noise-multiplier": 2.0, "dp-clip": 1.0}
# SHA-256 of the round-1 train reply of partition 1 of 3 (UCI, 48 samples, batch 8) before dp-mode existed
# (commit 545f108), per numeric platform (tests/numerics.py): each computed by that commit on the platform
REPLY_BEFORE_DP_BY_PLATFORM = {
    REFERENCE: {"fedproto": "20fc070f19806c1ea36b6778b6fb217bab60e7c629f9b15c73327cd61fa76a54",
                "fedavg": "e63429f52ce658a799e8da317168c30f01eb423037e255dd9d54e29a71916cc4"},
    "AuthenticAMD-AVX2": {"fedproto": "e3278aa1cbd7d2146bdbc27215a853430722565a7ccf53461ff8f4707d18303e",
                          "fedavg": "03c20f4eb6f88754e5de4e535b234cfd10d01f46da6b30adc0a2280789e58e48"},
}
REPLY_BEFORE_DP = on_this_platform(REPLY_BEFORE_DP_BY_PLATFORM)


def train_message(server_round: int, arrays: ArrayRecord | None = None, node_id: int = 101) -> Message:
    set_task_identity()
    content = RecordDict({"arrays": arrays or ArrayRecord(), "config": ConfigRecord({"server-round": server_round})})
    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)


def digest(reply: Message) -> str:
    h = hashlib.sha256()
    for key, array in sorted(reply.content["arrays"].items()):
        h.update(key.encode())
        h.update(array.dtype.encode())
        h.update(bytes(array.data))
    return h.hexdigest()


def independent_epsilon(sigma: float, releases: int, delta: float = 1e-5, replace_one: bool = False) -> float:
    """dp-accounting's PLD accountant, add/remove or (a client's dataset: the default) replace-one."""
    relation = dp_accounting.NeighboringRelation
    accountant = pld_privacy_accountant.PLDAccountant(
        relation.REPLACE_ONE if replace_one else relation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), releases)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
@pytest.mark.parametrize("explicit", [False, True])
def test_dp_off_leaves_the_encoded_reply_bit_identical(method, explicit):
    rc = {"method": method, **UCI, **({"dp-mode": "off"} if explicit else {})}
    arrays = METHODS[method].initial_arrays(parse_run_config(rc))
    reply = clientapp_node(client_app, rc, 1, 3)(train_message(1, arrays))
    assert not reply.has_error(), reply.error
    assert digest(reply) == REPLY_BEFORE_DP[method]
    assert "dp-epsilon" not in reply.content["metrics"]


def test_payload_prototypes_release_noisy_sums_and_counts_and_report_epsilon(tmp_path):
    node = clientapp_node(client_app, PAYLOAD, 1, 3, state_dir=str(tmp_path))
    for server_round in (1, 2, 3):
        reply = node(train_message(server_round))
        assert not reply.has_error(), reply.error
        arrays, metrics = reply.content["arrays"], reply.content["metrics"]
        assert sorted(arrays) == ["count-noise-std", "noisy-counts", "proto-sums"]
        assert arrays["proto-sums"].shape == (10, 50) and arrays["noisy-counts"].dtype == "float32"
        assert metrics["dp-epsilon"] == pytest.approx(independent_epsilon(2.0, server_round), rel=1e-3)
        assert metrics["dp-delta"] == 1e-5
        assert not {"train-loss", "loss-ce", "lambda", "mi"} & set(metrics)  # nothing computed from the data
    counts = arrays["noisy-counts"].numpy()
    assert float(arrays["count-noise-std"].numpy()[0]) == pytest.approx(2.0 * np.sqrt(2))
    assert (counts != np.round(counts)).all()  # every class noisy, held or not
    assert metrics["num-examples"] == max(1, round(float(counts.astype(np.float64).sum())))


def test_the_ledger_outlives_a_restart_and_is_never_rolled_back(tmp_path):
    """A restarted node (empty context.state, the same state folder) continues its ledger; asked for a
    round it already trained (a resume from an older checkpoint rolls its state back), it trains it
    again, and that release is counted on top of the first: the server may have seen both."""
    first = clientapp_node(client_app, PAYLOAD, 0, 3, node_id=100, state_dir=str(tmp_path))
    eps = [first(train_message(r, node_id=100)).content["metrics"]["dp-epsilon"] for r in (1, 2)]
    again = clientapp_node(client_app, PAYLOAD, 0, 3, node_id=100, state_dir=str(tmp_path))  # a new process
    eps += [again(train_message(r, node_id=100)).content["metrics"]["dp-epsilon"] for r in (2, 3)]
    assert eps == pytest.approx([independent_epsilon(2.0, n) for n in (1, 2, 3, 4)], rel=1e-3)
    state = RecordDict()
    assert load_records(tmp_path, state) and "dp-ledger" not in state  # the ledger is not in the state
    assert len(json.loads((tmp_path / "dp-ledger.json").read_text())["releases"]) == 4


def test_a_client_stops_releasing_before_passing_dp_max_epsilon(tmp_path):
    cap = independent_epsilon(2.0, 2) * 1.001
    node = clientapp_node(client_app, {**PAYLOAD, "dp-max-epsilon": cap}, 2, 3, node_id=102, state_dir=str(tmp_path))
    assert not node(train_message(1, node_id=102)).has_error()
    assert not node(train_message(2, node_id=102)).has_error()
    third = node(train_message(3, node_id=102))
    assert third.has_error()
    assert "partition 2 stops releasing: after 2 release(s)" in third.error.reason
    assert "dp-max-epsilon" in third.error.reason


def test_target_epsilon_calibrates_sigma_for_the_planned_rounds(tmp_path):
    rc = {**PAYLOAD, "dp-noise-multiplier": 0.0, "dp-target-epsilon": 3.0, "num-server-rounds": 4}
    node = clientapp_node(client_app, rc, 1, 3, state_dir=str(tmp_path))
    eps = [node(train_message(r)).content["metrics"]["dp-epsilon"] for r in (1, 2, 3, 4)]
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 4)
    assert eps[-1] == pytest.approx(independent_epsilon(sigma, 4), rel=1e-3)
    assert 3.0 * 0.99 < eps[-1] <= 3.0 * (1 + 1e-6)


def test_the_server_divides_noisy_sums_by_noisy_counts():
    rng = np.random.default_rng(0)
    sums, counts = rng.normal(size=(4, 3)).astype(np.float32), np.array([40.0, 2.5, -3.0, 9.0], np.float32)
    record = proto_protocol.encode_dp_prototype_reply(sums, counts, 2.0, {}, 48)["arrays"]
    (protos, weights), reason = proto_protocol.decode_prototype_reply(record, 4, 3, max_count=1000)
    assert reason is None
    held = np.array([True, False, False, True])  # noisy count >= 3 stds = 6
    np.testing.assert_allclose(protos[held], sums[held] / counts[held, None], rtol=1e-6)
    assert (protos[~held] == 0).all() and weights.tolist() == [40.0, 0.0, 0.0, 9.0]
    bad = proto_protocol.encode_dp_prototype_reply(sums, counts, 0.0, {}, 48)["arrays"]
    assert "'count-noise-std': 0.0 is not > 0" in proto_protocol.decode_prototype_reply(bad, 4, 3, 1000)[1]
    nan = proto_protocol.encode_dp_prototype_reply(sums * np.nan, counts, 2.0, {}, 48)["arrays"]
    assert "'proto-sums'" in proto_protocol.decode_prototype_reply(nan, 4, 3, 1000)[1]
    huge = proto_protocol.encode_dp_prototype_reply(sums, counts * 1e6, 2.0, {}, 48)["arrays"]
    assert "'noisy-counts'" in proto_protocol.decode_prototype_reply(huge, 4, 3, 1000)[1]


def test_a_payload_run_aggregates_and_records_epsilon_per_client(tmp_path):
    """The whole ServerApp and three real ClientApps in this process, two rounds: the strategy accepts
    the noisy replies, builds global prototypes, and metrics.jsonl carries each client's ε."""
    rc = {**PAYLOAD, "dp-noise-multiplier": 0.5, "num-server-rounds": 2, "out-dir": str(tmp_path / "runs"),
          "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / f"p{p}")) for p in range(3)}
    server_main(InProcessGrid(nodes), Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    run = tmp_path / "runs" / "9"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        clients = record["fit-clients"]
        assert sorted(clients) == ["partition 0", "partition 1", "partition 2"] and record["accepted"] == 3
        expected = independent_epsilon(0.5, record["round"])
        assert all(c["dp-epsilon"] == pytest.approx(expected, rel=1e-3) for c in clients.values()), clients
        assert record["fit"]["classes-present"] >= 1
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_payload_mode_is_refused_where_it_is_not_wired():
    with pytest.raises(ConfigError, match="'dp-mode' = 'payload' is not available for method 'local'"):
        parse_run_config({"method": "local", **UCI, "dp-mode": "payload", "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="method 'solo' sends nothing to the server"):
        parse_run_config({**TINY_FCCL, "method": "solo", "dp-mode": "payload", "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="'dp-mode' = 'sample' is not available for method 'fedmd'"):
        parse_run_config({**TINY_FCCL, "method": "fedmd", "dp-mode": "sample", "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="proto-local-protos"):
        parse_run_config({**PAYLOAD, "proto-local-protos": "training"})


WEIGHTS = {"method": "fedavg", **UCI, "dp-mode": "payload", "avg-weighting": "uniform", "dp-noise-multiplier": 1.0}


def weights_reply(rc: dict, tmp_path, name: str) -> tuple[Message, ArrayRecord]:
    broadcast = METHODS["fedavg"].initial_arrays(parse_run_config(rc))
    reply = clientapp_node(client_app, rc, 1, 3, state_dir=str(tmp_path / name))(train_message(1, broadcast))
    assert not reply.has_error(), reply.error
    return reply, broadcast


class NoNoise:
    """Stands in for the secure generator so the clipping can be checked exactly (the ledger still
    composes the configured σ)."""

    def normal(self, loc, scale, size):
        return np.zeros(size)


def test_payload_weights_release_the_broadcast_plus_a_clipped_noisy_update(tmp_path, monkeypatch):
    off, broadcast = weights_reply({"method": "fedavg", **UCI}, tmp_path, "off")
    with monkeypatch.context() as patch:
        patch.setattr("pollen.privacy.payload.secure_rng", NoNoise)
        # a clip above the update's norm: the release is the trained model
        loose, _ = weights_reply({**WEIGHTS, "dp-clip": 1e4}, tmp_path, "loose")
        for key, array in off.content["arrays"].items():
            np.testing.assert_allclose(loose.content["arrays"][key].numpy(), array.numpy(), atol=1e-6)
        # a small clip: the float update is cut to norm clip, in the trained direction
        tight, _ = weights_reply({**WEIGHTS, "dp-clip": 0.05}, tmp_path, "tight")
    floats = [k for k, b in broadcast.items() if b.numpy().dtype.kind == "f"]
    cut = np.concatenate([tight.content["arrays"][k].numpy().astype(np.float64).ravel()
                          - broadcast[k].numpy().ravel() for k in floats])
    full = np.concatenate([off.content["arrays"][k].numpy().astype(np.float64).ravel()
                           - broadcast[k].numpy().ravel() for k in floats])
    assert np.linalg.norm(full) > 0.05 and np.linalg.norm(cut) == pytest.approx(0.05, rel=1e-4)
    np.testing.assert_allclose(cut, full * 0.05 / np.linalg.norm(full), atol=1e-6)
    # the noise: std σ·clip on every float entry; integer entries come back as broadcast
    noisy, _ = weights_reply({**WEIGHTS, "dp-clip": 0.01, "dp-noise-multiplier": 1.0}, tmp_path, "noisy")
    noise = np.concatenate([(noisy.content["arrays"][k].numpy().astype(np.float64) - b.numpy()).ravel()
                            for k, b in broadcast.items() if b.numpy().dtype.kind == "f"])
    assert noise.size > 5000 and noise.std() == pytest.approx(0.01, rel=0.05)
    for key, b in broadcast.items():
        if b.numpy().dtype.kind != "f":
            np.testing.assert_array_equal(noisy.content["arrays"][key].numpy(), b.numpy())
    metrics = noisy.content["metrics"]
    assert metrics["num-examples"] == 1 and "train-loss" not in metrics
    assert metrics["dp-epsilon"] == pytest.approx(independent_epsilon(1.0, 1, replace_one=True), rel=1e-3)
    assert metrics["dp-epsilon-add-remove"] == pytest.approx(independent_epsilon(1.0, 1), rel=1e-3)


def test_payload_weights_need_uniform_averaging():
    with pytest.raises(ConfigError, match="'avg-weighting' = 'samples'.*set avg-weighting = 'uniform'"):
        parse_run_config({**WEIGHTS, "avg-weighting": "samples"})


TINY_FCCL = {"task": "digits-offline", "model-width": 0.125, "fccl-public": "photo_patches", "fccl-public-size": 40,
             "fccl-public-batch-size": 20, "fccl-train-sizes": "24,24,24,24", "fccl-solo-epochs": 1,
             "fccl-local-epochs": "1", "fccl-test-size": 20, "fccl-batch-size": 12, "fraction-evaluate": 0.0}


def test_payload_logits_clip_every_row_and_add_noise_over_the_matrix(data_root, tmp_path, monkeypatch):
    base = {**TINY_FCCL, "method": "fedmd", "data-root": data_root, "fccl-target": "leave-one-out"}
    private = {**base, "dp-mode": "payload", "dp-noise-multiplier": 1.5, "dp-clip": 0.1}
    off = clientapp_node(client_app, base, 1, 4, state_dir=str(tmp_path / "off"))(train_message(1))
    raw = off.content["arrays"]["logits"].numpy().astype(np.float64)
    assert (np.linalg.norm(raw, axis=1) > 0.1).all()
    with monkeypatch.context() as patch:
        patch.setattr("pollen.privacy.payload.secure_rng", NoNoise)
        cut = clientapp_node(client_app, private, 1, 4, state_dir=str(tmp_path / "cut"))(train_message(1))
    clipped = cut.content["arrays"]["logits"].numpy()
    np.testing.assert_allclose(clipped, raw * (0.1 / np.linalg.norm(raw, axis=1))[:, None], rtol=1e-5, atol=1e-6)
    node = clientapp_node(client_app, private, 1, 4, state_dir=str(tmp_path / "noisy"))
    noisy = node(train_message(1))
    noise = noisy.content["arrays"]["logits"].numpy().astype(np.float64) - clipped
    assert noise.std() == pytest.approx(1.5 * 0.1 * np.sqrt(40), rel=0.1)  # 400 entries: ~4% s.e.
    metrics = noisy.content["metrics"]
    assert metrics["num-examples"] == 1
    assert metrics["dp-epsilon"] == pytest.approx(independent_epsilon(1.5, 1, replace_one=True))
    assert metrics["dp-epsilon-add-remove"] == pytest.approx(independent_epsilon(1.5, 1))
    assert not [k for k in metrics if k.startswith(("solo-", "train-"))]
    # the client's own logits for the leave-one-out target are what it released, not the clean ones
    state = RecordDict()
    assert load_records(tmp_path / "noisy", state)  # the node's persisted context.state
    stored = ClientState(state).load_arrays("fccl-last-logits")
    assert stored is not None
    np.testing.assert_array_equal(stored["logits"], noisy.content["arrays"]["logits"].numpy())


def test_payload_refuses_homogeneous_logit_mode():
    with pytest.raises(ConfigError, match="'fccl-average-weights' = true"):
        parse_run_config({**TINY_FCCL, "method": "fccl", "dp-mode": "payload", "dp-noise-multiplier": 1.0,
                          "fccl-average-weights": True})


def test_payload_glfc_run_in_process_releases_noisy_models_and_gradients(tmp_path):
    """GLFC's model update and prototype gradients (which its proxy inverts into images) are clipped and
    noisy; the run goes on (the proxy and the bounds accept them) and every client reports its ε."""
    from pollen.app.methods_glfc import initial_arrays, make_strategy
    from tests.test_glfc_strategy import UCI_RC, client_app_grid

    # clip 0.05: noise std 0.05·√6 per weight; at clip 1 (std 2.4) the averaged model is mostly noise
    rc = {**UCI_RC, "dp-mode": "payload", "dp-noise-multiplier": 1.0, "dp-clip": 0.05,
          "glfc-detect-all-clients": True, "out-dir": str(tmp_path / "runs")}
    cfg = parse_run_config(rc)
    strategy = make_strategy(cfg)
    grid = client_app_grid(rc, 5, tmp_path)
    strategy.start(grid=grid, initial_arrays=initial_arrays(cfg), num_rounds=4, evaluate_fn=strategy.evaluate_global)
    reports = [strategy.take_round_report(r) for r in range(1, 5)]
    # the unsampled clients ran task detection on the new model; under DP their replies say nothing of their
    # data (no transition, entropy, class or exemplar count, training-set size)
    detected = [m for rep in reports for m in rep.evaluate_clients.values()]
    assert detected and all(set(m) <= {"partition-id", "loss", "num-examples"} for m in detected), detected
    assert all(m.get("num-examples", 1) == 1 and m.get("loss", 0.0) == 0.0 for m in detected)
    assert all(rep.accepted == 3 and not rep.rejected and not rep.failures for rep in reports), \
        [(rep.rejected, rep.failures) for rep in reports]
    rounds_of: dict[str, int] = {}
    for rep in reports:
        for name, metrics in rep.fit_clients.items():
            rounds_of[name] = rounds_of.get(name, 0) + 1
            assert metrics["dp-epsilon"] == pytest.approx(independent_epsilon(1.0, rounds_of[name], replace_one=True),
                                                          rel=1e-3)
            assert "train-loss" not in metrics and "entropy" not in metrics
    assert sum(rounds_of.values()) == 12 and len(rounds_of) == 5  # 3 a round; task 2 brings two newcomers


def test_a_glfc_run_whose_noise_would_bury_the_model_is_warned_before_round_1(tmp_path, caplog):
    """At clip 1 and σ 1 every GLFC release carries noise of std √(1 + K) = 2.4 per weight (the privacy
    study's σ ≥ 0.5 runs ended at chance accuracy): the ServerApp says so once. At clip 0.05 and σ 0.25 the
    averaged noise (norm ≈ 2.6) stays below the model's (≈ 5.3): no warning."""
    from pollen.app.methods_glfc import initial_arrays, make_strategy
    from tests.test_glfc_strategy import UCI_RC, client_app_grid

    def warnings_of(clip: float, sigma: float = 1.0) -> list[str]:
        caplog.clear()
        rc = {**UCI_RC, "dp-mode": "payload", "dp-noise-multiplier": sigma, "dp-clip": clip,
              "out-dir": str(tmp_path / f"runs-{clip}")}
        cfg = parse_run_config(rc)
        strategy = make_strategy(cfg)
        strategy.start(grid=client_app_grid(rc, 5, tmp_path / str(clip)), initial_arrays=initial_arrays(cfg),
                       num_rounds=1)
        return [r.getMessage() for r in caplog.records if "averaged model gets noise" in r.getMessage()]

    (warning,) = warnings_of(1.0)
    assert "σ·clip·2.45·√(d / k)" in warning and "k = 3 clients a round" in warning and "dp-clip 1," in warning
    assert warnings_of(0.05, sigma=0.25) == []


def sampled_epsilon(sigma: float, q: float, steps: int, rounds: int, prototypes: bool) -> float:
    """dp-accounting's own PLD of ``rounds`` × (DP-SGD steps [+ one prototype release])."""
    accountant = pld_privacy_accountant.PLDAccountant()
    for _ in range(rounds):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        if prototypes:
            accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    return accountant.get_epsilon(1e-5)


SAMPLE = {**UCI, "dp-mode": "sample", "dp-noise-multiplier": 1.2, "dp-clip": 1.0, "local-epochs": 2}


def test_sample_mode_fedavg_trains_with_dp_sgd_and_reports_the_sampled_epsilon(tmp_path):
    rc = {**SAMPLE, "method": "fedavg", "avg-weighting": "uniform"}
    n = weights_reply({"method": "fedavg", **UCI}, tmp_path, "off")[0].content["metrics"]["num-examples"]
    reply, broadcast = weights_reply(rc, tmp_path, "sample")
    metrics = reply.content["metrics"]
    steps = 2 * -(-n // 8)
    assert metrics["num-examples"] == 1 and "train-loss" not in metrics
    assert metrics["dp-epsilon"] == pytest.approx(sampled_epsilon(1.2, 8 / n, steps, 1, False), rel=2e-3)
    moved = sum(float(np.abs(reply.content["arrays"][k].numpy() - b.numpy()).sum()) for k, b in broadcast.items())
    assert moved > 0  # it trained


def test_sample_mode_fedproto_composes_dp_sgd_and_the_prototype_release(tmp_path):
    rc = {**SAMPLE, "method": "fedproto", "num-server-rounds": 2, "out-dir": str(tmp_path / "runs"),
          "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / f"p{p}")) for p in range(3)}
    server_main(InProcessGrid(nodes), Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    run = tmp_path / "runs" / "5"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    sizes = {p: len(clientapp_partition_labels(rc, p)) for p in range(3)}
    for record in records:
        assert record["accepted"] == 3 and record["fit"]["classes-present"] >= 1
        for name, metrics in record["fit-clients"].items():
            n = sizes[int(name.split()[-1])]
            expected = sampled_epsilon(1.2, 8 / n, 2 * -(-n // 8), record["round"], True)
            assert metrics["dp-epsilon"] == pytest.approx(expected, rel=2e-3), (name, record["round"])


def clientapp_partition_labels(rc: dict, partition: int) -> np.ndarray:
    """The training labels a partition holds (independently of the client under test)."""
    from pollen.datasets.tasks import build_client_data

    cfg = parse_run_config(rc)
    return build_client_data(cfg.task, TaskOptions.of(cfg), partition, 3).y_train.numpy()


def test_pollen_run_refuses_a_batchnorm_model_in_sample_mode_before_start(tmp_path):
    """As a user meets it: `pollen run` exits 2 naming the layer and the fix; no run folder appears."""
    out = tmp_path / "runs"
    done = pollen_command("run", "--out-dir", str(out), "--run-config",
                          "method='fedavg' avg-weighting='uniform' dp-mode='sample' dp-noise-multiplier=1.0 "
                          "model='resnet10'")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model 'resnet10' has layer 'bn1' (BatchNorm2d)" in done.stderr
    assert "replaced by GroupNorm), or dp-mode = 'payload'" in done.stderr and "cnn_mnist, lenet" in done.stderr
    assert not out.exists()


def test_a_run_whose_clients_all_stop_releasing_fails_with_that_reason(tmp_path):
    cap = independent_epsilon(2.0, 1) * 1.001  # room for one release each
    rc = {**PAYLOAD, "dp-max-epsilon": cap, "num-server-rounds": 3, "out-dir": str(tmp_path / "runs"),
          "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / f"p{p}")) for p in range(3)}
    with pytest.raises(NoTrainingError, match="stops releasing"):
        server_main(InProcessGrid(nodes), Context(run_id=3, node_id=0, node_config={}, state=RecordDict(),
                                                  run_config=rc))
    summary = json.loads((tmp_path / "runs" / "3" / "summary.json").read_text())
    assert summary["status"] == "failed" and "stops releasing" in summary["failure-reason"], summary
    records = [json.loads(line) for line in (tmp_path / "runs" / "3" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["accepted"] == 3
