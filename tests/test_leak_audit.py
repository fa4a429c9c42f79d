"""leak-audit through real ClientApps in this process: off adds nothing to a reply; on, each client's
``leak-*`` metrics are the leakage measures applied to exactly what it released, against its true labels,
and they reach metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from pollen.app.client_app import app as client_app
from pollen.app.config import ConfigError, parse_run_config
from pollen.app.registry import METHODS
from pollen.app.server_app import main as server_main
from pollen.datasets.spec import TaskOptions
from pollen.datasets.tasks import build_client_data
from pollen.privacy.leakage import logit_audit, prototype_audit
from pollen.testing import InProcessGrid, clientapp_node
from tests.test_privacy_clients import PAYLOAD, REPLY_BEFORE_DP, TINY_FCCL, UCI, digest, train_message

torch.set_num_threads(1)

PROTO_KEYS = {"leak-hist-tv", "leak-hist-tv-floor", "leak-presence-f1", "leak-presence-f1-floor"}


def true_counts(rc: dict, partition: int, num_partitions: int) -> np.ndarray:
    cfg = parse_run_config(rc)
    data = build_client_data(cfg.task, TaskOptions.of(cfg), partition, num_partitions)
    return np.bincount(data.y_train.numpy(), minlength=10)


def uniform_tv(counts: np.ndarray) -> float:
    """The floor by hand: ½·Σ|p − 1/C|."""
    return 0.5 * float(np.abs(counts / counts.sum() - 1 / counts.size).sum())


def test_off_adds_nothing_and_on_changes_no_payload_byte():
    rc = {"method": "fedproto", **UCI}
    arrays = METHODS["fedproto"].initial_arrays(parse_run_config(rc))
    off = clientapp_node(client_app, rc, 1, 3)(train_message(1, arrays))
    on = clientapp_node(client_app, {**rc, "leak-audit": True}, 1, 3)(train_message(1, arrays))
    assert digest(off) == digest(on) == REPLY_BEFORE_DP["fedproto"]
    off_metrics, on_metrics = dict(off.content["metrics"]), dict(on.content["metrics"])
    assert not [k for k in off_metrics if k.startswith("leak-")]
    assert set(on_metrics) - set(off_metrics) == PROTO_KEYS
    assert {k: v for k, v in on_metrics.items() if k not in PROTO_KEYS} == off_metrics
    # exact counts: the server reads the histogram and the classes perfectly
    truth = true_counts(rc, 1, 3)
    np.testing.assert_array_equal(on.content["arrays"]["class-counts"].numpy(), truth)
    assert on_metrics["leak-hist-tv"] == 0.0 and on_metrics["leak-presence-f1"] == 1.0
    assert on_metrics["leak-hist-tv-floor"] == pytest.approx(uniform_tv(truth))
    held = int((truth > 0).sum())  # guessing all 10 classes: F1 = 2·held / (held + 10)
    assert on_metrics["leak-presence-f1-floor"] == pytest.approx(2 * held / (held + 10))


def test_payload_prototypes_audit_the_noisy_counts_they_release():
    rc = {**PAYLOAD, "leak-audit": True}
    reply = clientapp_node(client_app, rc, 1, 3)(train_message(1))
    assert not reply.has_error(), reply.error
    arrays, metrics = reply.content["arrays"], reply.content["metrics"]
    noisy, std = arrays["noisy-counts"].numpy(), float(arrays["count-noise-std"].numpy()[0])
    truth = true_counts(rc, 1, 3)
    assert std == pytest.approx(2.0 * np.sqrt(2))
    expected = prototype_audit(truth, noisy, max(1.0, 3 * std))  # the server's held rule: 3 stds, at least 1
    assert {k: metrics[k] for k in PROTO_KEYS} == pytest.approx(expected)
    assert 0 < metrics["leak-hist-tv"] and "dp-epsilon" in metrics


def test_logits_audit_the_labels_a_surrogate_of_the_released_logits_gives_the_clients_records(data_root, tmp_path):
    rc = {**TINY_FCCL, "method": "fedmd", "data-root": data_root, "leak-audit": True}
    reply = clientapp_node(client_app, rc, 1, 4, state_dir=str(tmp_path))(train_message(1))
    assert not reply.has_error(), reply.error
    logits, metrics = reply.content["arrays"]["logits"].numpy(), reply.content["metrics"]
    from pollen.app.config import NodeConfig
    from pollen.clients.logits import LogitClient
    from tests.conftest import make_context

    client = LogitClient(parse_run_config(rc), NodeConfig(1, 4), make_context(rc, 1, 4))
    labels = client.data.y_train.numpy()
    expected = logit_audit(client.public.inputs.numpy(), logits, client.data.x_train.numpy(), labels)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert metrics["leak-record-label-acc-floor"] == pytest.approx(np.bincount(labels).max() / len(labels))
    off = clientapp_node(client_app, {**rc, "leak-audit": False}, 1, 4, state_dir=str(tmp_path / "off"))(
        train_message(1))
    assert not [k for k in off.content["metrics"] if k.startswith("leak-")]


def test_leak_audit_is_refused_where_nothing_is_measured():
    with pytest.raises(ConfigError, match="'leak-audit' = true has no measure for method 'fedavg'"):
        parse_run_config({"method": "fedavg", **UCI, "leak-audit": True})


def test_a_run_records_each_clients_leakage_and_the_round_mean(tmp_path):
    """Server and three ClientApps in this process, two private rounds: metrics.jsonl carries every
    client's leak-* figures and their mean (what docs/privacy.md reads)."""
    rc = {**PAYLOAD, "leak-audit": True, "num-server-rounds": 2, "out-dir": str(tmp_path / "runs"),
          "fraction-evaluate": 0.0}
    nodes = {100 + p: clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / f"p{p}")) for p in range(3)}
    server_main(InProcessGrid(nodes), Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    records = [json.loads(line) for line in (tmp_path / "runs" / "9" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        clients = record["fit-clients"].values()
        assert all(PROTO_KEYS <= set(c) for c in clients)
        for key in PROTO_KEYS:
            assert record["fit"][f"{key}-client-mean"] == pytest.approx(np.mean([c[key] for c in clients]))
