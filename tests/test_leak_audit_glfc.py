"""leak-audit for GLFC: clients also send the true perturbed sample behind each gradient set, and the
server scores its proxy's reconstructions against them. Off, a reply and a run are what they were
before the audit existed; on, the round's ``leak-*`` fit metrics are ``reconstruction_audit`` of the
proxy's final reconstructions and the true samples, paired through the proxy's shuffle; a malformed
audit record is refused with a reason."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from pollen.app.client_app import app as client_app
from pollen.app.config import ConfigError, parse_run_config
from pollen.app.methods_glfc import _test_set, initial_arrays
from pollen.app.server_app import main as server_main
from pollen.datasets.spec import UCI_FORMAT
from pollen.methods.glfc import build_lenet
from pollen.privacy.leakage import class_mean_images, reconstruction_audit
from pollen.protocol import glfc as protocol
from pollen.protocol.records import array_record
from pollen.testing import InProcessGrid, clientapp_node, set_task_identity
from tests.numerics import REFERENCE, on_this_platform
from tests.test_glfc_strategy import _configure, _grad_set, _reply, _strategy, identity_grid

torch.set_num_threads(1)

LEAK_KEYS = {"leak-psnr", "leak-psnr-floor", "leak-ssim", "leak-ssim-floor", "leak-label-acc",
             "leak-label-acc-floor"}
TIMINGS = {"proxy-seconds", "proxy-images-per-s"}
# 2 tasks × 1 round: the proxy inverts gradients in both rounds (oracle boundaries: every client detects)
RC = {"method": "glfc", "task": "uci-digits-cil", "seed": 3, "num-server-rounds": 2, "glfc-tasks": 2,
      "glfc-rounds-per-task": 1, "glfc-initial-clients": 3, "glfc-new-clients": 0, "glfc-clients-per-round": 3,
      "glfc-old-fraction": 0.0, "model": "cnn_mnist", "glfc-max-per-class": 8, "glfc-memory-size": 8,
      "glfc-oracle-boundary": True, "glfc-perturb-steps": 2, "glfc-proxy-iterations": 3, "glfc-proxy-keep": 2,
      "glfc-eval-per-class": 5, "local-epochs": 1, "lr": 0.1, "momentum": 0.0, "fraction-evaluate": 0.0}
# sha256 of partition 1's round-1 reply (every record, metrics included) to RC, computed before the audit
# existed (at commit b1d17ce, on each numeric platform: tests/numerics.py): with the key off, not one byte differs
REPLY_BEFORE_AUDIT = on_this_platform({
    REFERENCE: "ed06690b66d69fa9d12ce5dea41a319b0db717f6dcbb28a15ffea96a8cd03b92",
    "AuthenticAMD-AVX2": "4c2c1ad70c4d45b35323989bbc29d6397a45c4e83743d0b54452069f5cc5ee4d"})


def reply_digest(reply: Message) -> str:
    h = hashlib.sha256()
    for name, record in sorted(reply.content.items()):
        h.update(name.encode())
        if isinstance(record, ArrayRecord):
            for key, array in sorted(record.items()):
                h.update(f"{key}:{array.dtype}:{array.shape}".encode())
                h.update(bytes(array.data))
        else:
            h.update(json.dumps(sorted((k, repr(v)) for k, v in record.items())).encode())
    return h.hexdigest()


def first_train_message(rc: dict) -> Message:
    set_task_identity()
    cfg = {"server-round": 1, "task": 0, "round-in-task": 0, "num-classes": 5, "old1-sent": False,
           "old2-sent": False, "old1-version": 0, "old2-version": 0, "transition-slot": 2, "num-tasks": 2,
           "classes-per-task": 5, "rounds-per-task": 1}
    content = protocol.encode_train_content(initial_arrays(parse_run_config(rc)), ConfigRecord(cfg))
    return Message(content, dst_node_id=101, message_type=MessageType.TRAIN)


def lenet_gradient(x: np.ndarray, label: int) -> dict[str, np.ndarray]:
    lenet = build_lenet("uci-digits-cil", RC["seed"])
    return {n: g.numpy() for n, g in zip((n for n, _ in lenet.named_parameters()),
                                         lenet.gradient(torch.from_numpy(x), label))}


def test_off_the_reply_is_byte_identical_to_before_and_on_only_adds_the_samples_behind_the_gradients(tmp_path):
    off = clientapp_node(client_app, RC, 1, 3, state_dir=str(tmp_path / "off"))(first_train_message(RC))
    on = clientapp_node(client_app, {**RC, "leak-audit": True}, 1, 3, state_dir=str(tmp_path / "on"))(
        first_train_message(RC))
    assert not off.has_error() and not on.has_error(), (off.error, on.error)
    assert protocol.AUDIT_SAMPLES not in off.content
    assert reply_digest(off) == REPLY_BEFORE_AUDIT
    samples = on.content[protocol.AUDIT_SAMPLES]
    del on.content[protocol.AUDIT_SAMPLES]
    assert reply_digest(on) == REPLY_BEFORE_AUDIT  # the audit changes nothing else
    grads = on.content[protocol.PROTO_GRADS]
    num_sets = len({k.split(".")[0] for k in grads.keys()})
    assert num_sets >= 1 and sorted(samples.keys()) == sorted(k for i in range(num_sets)
                                                              for k in protocol.sample_key(i))
    for i in range(num_sets):  # sample i is the perturbed image and class whose LeNet gradient is set i
        x, y = samples[f"x{i}"].numpy(), samples[f"y{i}"].numpy()
        assert x.shape == (1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64 and y.shape == (1,)
        for name, g in lenet_gradient(x, int(y[0])).items():
            np.testing.assert_allclose(grads[protocol.grad_key(i, name)].numpy(), g, rtol=1e-5, atol=1e-7)


def _run(rc: dict, tmp_path, name: str, monkeypatch=None):
    """Server and three ClientApps in this process; metrics.jsonl, each round's train replies and, with
    ``monkeypatch``, each proxy round's (gradients, reconstruction)."""
    import pollen.strategies.proxy as proxy

    inverted: list = []
    if monkeypatch is not None:
        real = proxy.reconstruct_batched

        def spy(lenet, grads, *args, **kwargs):
            rec = real(lenet, grads, *args, **kwargs)
            inverted.append((grads, rec))
            return rec
        monkeypatch.setattr(proxy, "reconstruct_batched", spy)
    replies: list[Message] = []

    def recording(handler):
        def handle(msg):
            out = handler(msg)
            if msg.metadata.message_type == MessageType.TRAIN:
                replies.append(out)
            return out
        return handle

    nodes = {100 + p: recording(clientapp_node(client_app, rc, p, 3, state_dir=str(tmp_path / name / f"p{p}")))
             for p in range(3)}
    run_config = {**rc, "out-dir": str(tmp_path / name / "runs")}
    server_main(InProcessGrid(nodes), Context(run_id=4, node_id=0, node_config={}, state=RecordDict(),
                                              run_config=run_config))
    lines = (tmp_path / name / "runs" / "4" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], replies, inverted


def _unit(images: np.ndarray) -> np.ndarray:
    """Model input back to [0, 1] by hand: UCI digits are normalised with mean 0.305, std 0.32."""
    assert UCI_FORMAT.mean == (0.305,) and UCI_FORMAT.std == (0.32,)
    return np.clip(np.asarray(images, np.float64) * 0.32 + 0.305, 0, 1)


def test_a_run_reports_the_proxys_reconstructions_against_the_true_samples_and_off_changes_nothing(
        tmp_path, monkeypatch):
    off, off_replies, _ = _run(RC, tmp_path, "off")
    on, on_replies, inverted = _run({**RC, "leak-audit": True}, tmp_path, "on", monkeypatch)
    assert len(on) == len(off) == 2 and len(inverted) == 2
    for a, b in zip(off, on):  # the audit changes no model, no other metric, no client's figures
        assert not LEAK_KEYS & set(a["fit"])
        assert {k: v for k, v in b["fit"].items() if k not in LEAK_KEYS | TIMINGS} == \
            {k: v for k, v in a["fit"].items() if k not in TIMINGS}
        assert a["server-evaluate"] == b["server-evaluate"] and a["fit-clients"] == b["fit-clients"]
    assert all(protocol.AUDIT_SAMPLES not in r.content for r in off_replies)
    # pair every inverted gradient with the sample sent behind it, by looking the gradient up in the replies
    lenet_names = [n for n, _ in build_lenet("uci-digits-cil", RC["seed"]).named_parameters()]
    behind: list[tuple[list[np.ndarray], np.ndarray, int]] = []
    for r in on_replies:
        grads, samples = r.content.get(protocol.PROTO_GRADS), r.content.get(protocol.AUDIT_SAMPLES)
        num_sets = 0 if grads is None else len(grads) // len(lenet_names)
        assert (samples is None) == (num_sets == 0)
        for i in range(num_sets):
            behind.append(([grads[protocol.grad_key(i, n)].numpy() for n in lenet_names],
                           samples[f"x{i}"].numpy(), int(samples[f"y{i}"].numpy()[0])))
    for record, (grads, rec) in zip(on, inverted):
        truth = []
        for g in grads:
            (match,) = [(x, y) for gs, x, y in behind if all(np.array_equal(a, b) for a, b in zip(gs, g))]
            truth.append(match)
        labels = np.array([y for _, y in truth])
        task = record["round"] - 1  # one round per task: the samples are of that task's 5 classes
        assert set(labels) <= set(range(5 * task, 5 * task + 5))
        test_x, test_y = _test_set(parse_run_config(RC))(5 * (task + 1))  # the server's test set, seen classes
        means = class_mean_images(_unit(test_x.numpy()), test_y.numpy(), 10)
        expected = reconstruction_audit(_unit(np.stack([x for x, _ in truth])), _unit(rec.images[:, -1].numpy()),
                                        labels, rec.labels.numpy(), means, candidate_labels=5)
        fit = record["fit"]
        assert fit["proxy-gradients"] == len(grads) >= 2
        assert {k: fit[k] for k in LEAK_KEYS} == pytest.approx(expected, rel=1e-9)
        assert fit["leak-label-acc-floor"] == pytest.approx(1 / 5) and fit["leak-label-acc"] == 1.0
        assert fit["leak-psnr"] > 0 and -1 <= fit["leak-ssim"] <= 1 and fit["leak-psnr-floor"] > 0


def _audit(n: int, image=None, label=2, **extra) -> ArrayRecord:
    arrays = {}
    for i in range(n):
        arrays[f"x{i}"] = np.zeros((1, 28, 28), np.float32) if image is None else image
        arrays[f"y{i}"] = np.array([label], np.int64)
    return array_record({**arrays, **extra})


def test_malformed_audit_records_are_refused_with_a_reason():
    schedule = protocol.TaskSchedule(num_tasks=2, classes_per_task=2, rounds_per_task=2, population=(10, 10))
    strat = _strategy(clients_per_round=10, schedule=schedule, leak_audit=True, image_mean=(0.1307,),
                      image_std=(0.3081,))
    msgs = _configure(strat, 1, identity_grid(10))

    def reply(pid, grads=1, audit=None):
        r = _reply(msgs[pid], pid, [_grad_set(strat)] * grads)
        if audit is not None:
            r.content[protocol.AUDIT_SAMPLES] = audit
        return r

    nan = np.zeros((1, 28, 28), np.float32)
    nan[0, 3, 3] = np.nan
    replies = [reply(0, audit=_audit(1)),
               reply(1),  # gradients without their samples
               reply(2, audit=_audit(1, image=nan)),
               reply(3, audit=_audit(1, image=np.zeros((1, 28, 27), np.float32))),
               reply(4, audit=_audit(1, image=np.zeros((1, 28, 28), np.float64))),
               reply(5, audit=_audit(1, label=20)),  # the mnist-fmnist LeNet has 20 outputs
               reply(6, audit=_audit(1, label=-1)),
               reply(7, audit=_audit(2)),  # two samples for one gradient set
               reply(8, grads=0, audit=_audit(1)),
               reply(9, audit=_audit(1, label=2.0))]
    replies[9].content[protocol.AUDIT_SAMPLES] = array_record({"x0": np.zeros((1, 28, 28), np.float32),
                                                               "y0": np.array([2.0])})
    _, metrics = strat.aggregate_train(1, replies)
    reasons = {int(r["client"].split()[-1]): r["reason"] for r in strat.take_round_report(1).rejected}
    assert metrics["accepted"] == 1 and sorted(reasons) == list(range(1, 10))
    assert "'audit-samples': leak-audit is on, but the 1 gradient set(s) come without their samples" == reasons[1]
    assert "'audit-samples'" in reasons[2] and "'x0'" in reasons[2] and "NaN" in reasons[2]
    assert "'x0'" in reasons[3] and "shape" in reasons[3]
    assert "'x0'" in reasons[4] and "dtype float64" in reasons[4]
    assert "'y0'" in reasons[5] and "above the plausible maximum 19" in reasons[5]
    assert "'y0'" in reasons[6] and "negative" in reasons[6]
    assert "unexpected key(s) ['x1', 'y1']" in reasons[7]
    assert "samples sent without gradient sets" in reasons[8]
    assert "'y0'" in reasons[9] and "dtype float64" in reasons[9]
    # the accepted reply: a zero image (mid-grey-ish after unnormalising) behind a class-2 gradient
    assert metrics["proxy-gradients"] == 1 and metrics["leak-label-acc"] == 1.0
    assert metrics["leak-label-acc-floor"] == pytest.approx(1 / 2)  # the task's 2 classes, not the LeNet's 20


def test_without_leak_audit_a_sample_record_is_refused_and_methods_without_a_proxy_refuse_the_key():
    strat = _strategy(clients_per_round=3)
    msgs = _configure(strat, 1, identity_grid(5))
    r = _reply(msgs[0], 0, [_grad_set(strat)])
    r.content[protocol.AUDIT_SAMPLES] = _audit(1)
    _, metrics = strat.aggregate_train(1, [r, _reply(msgs[1], 1, [_grad_set(strat)])])
    (rejected,) = strat.take_round_report(1).rejected
    assert metrics["accepted"] == 1 and not LEAK_KEYS & set(metrics)
    assert rejected["reason"] == "'audit-samples': sent, but this run does not set leak-audit"
    assert parse_run_config({**RC, "method": "glfc-wo-gc", "leak-audit": True}).leak_audit
    for method in ("glfc-wo-rd", "glfc-wo-proxy", "fedavg-icarl", "finetune"):
        with pytest.raises(ConfigError, match=f"'leak-audit' = true has no measure for method '{method}'.*"
                                              "of family 'glfc' only glfc, glfc-wo-gc"):
            parse_run_config({**RC, "method": method, "leak-audit": True})
