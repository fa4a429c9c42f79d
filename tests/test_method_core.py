"""The method core apart from Flower: typed settings, composable loss terms, a prototype round.

The terms are checked against hand computations; the round runs with a plain dict as its state store
(no Flower object anywhere), and ``fedproto-prox`` — the worked example of docs/development.md, a new
method made of FedProto's terms plus :class:`~pollen.methods.terms.Proximal` — also runs whole through
Pollen's ServerApp and ClientApp.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from pollen.app.config import parse_run_config
from pollen.datasets.tasks import TaskOptions, build_client_data, resolve_task
from pollen.methods.prototype_settings import ProtoSettings
from pollen.methods.prototypes import (
    BD_FEDPROTO,
    FEDPROTO,
    FEDPROTO_PROX,
    PrototypeRound,
)
from pollen.methods.terms import CrossEntropy, LossTerm, Proximal, objective
from pollen.methods.training import LocalTraining
from pollen.models import build_model
from pollen.models.spec import choose_model
from pollen.protocol.prototypes import GlobalPrototypes, PrototypeReply
from pollen.settings import declared_keys, from_values, setting
from pollen.testing import InProcessGrid, clientapp_node

torch.set_num_threads(1)


# settings -------------------------------------------------------------------------------------------
def test_settings_fields_are_the_run_keys_with_their_defaults():
    keys = declared_keys(ProtoSettings)
    assert keys["proto-lambda"][:2] == (1.0, "float > 0") and keys["proto-negative"].default == "hinge"
    values = {key: default for key, (default, *_) in keys.items()}
    values["proto-beta"] = 0.25
    s = from_values(ProtoSettings, values)
    assert s.beta == 0.25 and s.lam == 1.0 and s.cpa is True and s.local_protos == "post-pass"
    del values["proto-tau"]
    with pytest.raises(KeyError, match="proto-tau"):
        from_values(ProtoSettings, values)


def test_a_settings_field_without_a_run_key_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Broken:
        ok: int = setting("x-ok", 1, "int >= 1", "fine")
        bare: int = 2

    with pytest.raises(TypeError, match="Broken.bare"):
        declared_keys(Broken)


def test_a_choice_key_names_its_values_where_it_is_declared():
    assert declared_keys(ProtoSettings)["proto-negative"][3] == ("hinge", "infonce")
    with pytest.raises(TypeError, match="'x-form': a 'choice' range needs choices="):
        setting("x-form", "a", "choice", "no values named")
    with pytest.raises(TypeError, match="only a choice key takes them"):
        setting("x-n", 1, "int >= 1", "a number", choices=("1",))


# loss terms -----------------------------------------------------------------------------------------
class TinySplit(torch.nn.Module):
    """features = linear 3 -> 2, classify = linear 2 -> 3: small enough to compute by hand."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(2, 3)

    def features(self, x):
        return self.body(x)

    def classify(self, z):
        return self.head(z)


class Constant(LossTerm):
    name = "const"

    def __init__(self, value: float, weight: float):
        self.c, self.weight = value, weight

    def value(self, batch):
        return batch.z.sum() * 0 + self.c


def test_objective_is_the_weighted_sum_and_reports_each_unweighted_part():
    torch.manual_seed(0)
    model, x, y = TinySplit(), torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    loss, parts = objective([CrossEntropy(), Constant(2.0, weight=0.5)])(model, x, y)
    ce = torch.nn.functional.cross_entropy(model.head(model.body(x)), y)
    torch.testing.assert_close(loss, ce + 1.0)
    assert parts == pytest.approx({"ce": float(ce.detach()), "const": 2.0})
    with pytest.raises(ValueError, match="distinct"):
        objective([CrossEntropy(), CrossEntropy()])
    with pytest.raises(ValueError, match="at least one"):
        objective([])


def test_proximal_term_is_half_mu_times_the_squared_distance_to_the_start():
    torch.manual_seed(0)
    model, x, y = TinySplit(), torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    term = Proximal(mu=0.3)
    with pytest.raises(RuntimeError, match="start"):
        objective([term])(model, x, y)
    term.start(model)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.body.weight[0, 1] += 0.5
        model.head.bias[2] -= 2.0
    loss, parts = objective([term])(model, x, y)
    assert parts["prox"] == pytest.approx(0.5**2 + 2.0**2)  # ||w - w_start||²
    assert float(loss.detach()) == pytest.approx(0.15 * (0.25 + 4.0))  # mu/2 · that
    loss.backward()  # gradient mu·(w - w_start)
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.grad, 0.3 * (p.detach() - s))
    with pytest.raises(ValueError, match="mu"):
        Proximal(mu=-1.0)


# a prototype round without Flower -------------------------------------------------------------------
class DictStore:
    """The four methods a core needs from client state, on a plain dict."""

    def __init__(self):
        self.items: dict[str, Any] = {}

    def save_module(self, key: str, module: torch.nn.Module) -> None:
        self.items[key] = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def load_module(self, key: str, module: torch.nn.Module) -> bool:
        if key not in self.items:
            return False
        module.load_state_dict(self.items[key])
        return True

    def save_values(self, key: str, values: Mapping[str, Any]) -> None:
        self.items[key] = json.loads(json.dumps(dict(values)))

    def load_values(self, key: str, default: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return dict(self.items.get(key, default or {}))


RC = {"task": "uci-dirichlet", "max-train-samples": 64, "batch-size": 8, "lr": 0.05, "seed": 1}


def _round(method, mu: float = 0.0, **proto) -> tuple[PrototypeRound, DictStore]:
    cfg = parse_run_config({**RC, "method": method.name, **proto})
    task = resolve_task(cfg.task, TaskOptions.of(cfg))
    data = build_client_data(cfg.task, TaskOptions.of(cfg), 0, 3)

    def new_model():
        torch.manual_seed(7)
        return build_model(task.default_model, task.num_classes, in_channels=task.fmt.channels,
                           image_size=task.fmt.size, width=choose_model(cfg, task).width)

    store = DictStore()
    training = LocalTraining(epochs=1, batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=0.0, proximal_mu=mu)
    core = PrototypeRound(method, from_values(ProtoSettings, cfg.extra), training, store, data,
                          task.num_classes, torch.device("cpu"), new_model)
    return core, store


def _global(reply: PrototypeReply) -> GlobalPrototypes:
    return GlobalPrototypes(reply.prototypes, (reply.class_counts > 0).astype(np.float32), 1.0)


def _distance_moved(core: PrototypeRound, before: dict[str, torch.Tensor]) -> float:
    after = core.load_model()
    return sum(float(((p.detach() - before[k]) ** 2).sum()) for k, p in after.named_parameters())


def test_fedproto_prox_pulls_the_private_model_towards_where_the_round_started():
    moved = {}
    for mu in (0.0, 50.0):
        core, _ = _round(FEDPROTO_PROX, mu=mu)
        reply = core.fit(None, 1, round_seed=11, monitor=False)
        start = {k: v.detach().clone() for k, v in core.load_model().named_parameters()}
        reply2 = core.fit(_global(reply), 2, round_seed=12, monitor=False)
        moved[mu] = _distance_moved(core, start)
        assert {"loss-ce", "loss-proto", "loss-prox"} <= set(reply2.metrics)
        assert reply.num_examples == core.data.num_train
        assert np.isfinite(reply2.prototypes).all()
    assert moved[50.0] < 0.5 * moved[0.0]  # a strong pull keeps round 2 close to its start


def test_fedproto_prox_with_mu_zero_trains_exactly_as_fedproto():
    replies = {}
    for method in (FEDPROTO, FEDPROTO_PROX):
        core, _ = _round(method, mu=0.0)
        first = core.fit(None, 1, round_seed=11, monitor=False)
        replies[method.name] = core.fit(_global(first), 2, round_seed=12, monitor=True)
    (p1, c1, m1), (p2, c2, m2) = ((r.prototypes, r.class_counts, r.metrics) for r in replies.values())
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(c2, c1)
    assert m2["loss-proto"] == pytest.approx(m1["loss-proto"], abs=1e-6) and "loss-prox" not in m1


def test_bd_fedproto_round_uses_negatives_and_keeps_its_da_history_in_the_store():
    core, store = _round(BD_FEDPROTO)
    first = core.fit(None, 1, round_seed=11, monitor=False)
    metrics = core.fit(_global(first), 2, round_seed=12, monitor=True).metrics
    assert {"loss-neg", "mi", "mi-classifier"} <= set(metrics)
    assert len(store.items[PrototypeRound.DA_KEY]["history"]) == 1


# the example method, whole ---------------------------------------------------------------------------
def test_fedproto_prox_runs_whole_through_pollens_server_and_client_apps(tmp_path, monkeypatch):
    from pollen.app import client_app, server_app

    monkeypatch.setattr("pollen.app.results.plot_curves", lambda *args, **kwargs: None)
    rc = {**RC, "method": "fedproto-prox", "fedprox-mu": 0.5, "num-server-rounds": 2, "device": "cpu",
          "torch-threads": 1, "min-available-clients": 3, "out-dir": str(tmp_path)}
    grid = InProcessGrid({100 + p: clientapp_node(client_app.app, rc, p, 3) for p in range(3)})
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(rc)))
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed", summary
    assert [r["accepted"] for r in records] == [3, 3]
    assert records[-1]["fit"]["loss-prox"] > 0
