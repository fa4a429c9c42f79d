"""GLFC's local objectives against hand-worked batches, the entropy detector, the LR schedules."""

import math

import pytest
import torch

from pollen.methods.incremental_losses import (
    gc_loss,
    gc_weights,
    incremental_loss,
    is_transition,
    learning_rate,
    mean_entropy,
    rd_loss,
    rd_targets,
)

torch.set_num_threads(1)
L3 = math.log(3.0)


def _bce(o: float, y: float) -> float:
    p = 1.0 / (1.0 + math.exp(-o))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def _batch():
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75, sigmoid(-ln 3) = 0.25 on the true-class logits.
    logits = torch.tensor([[0.0, 1.0, -1.0],
                           [0.5, L3, 0.0],
                           [-2.0, 0.3, -L3],
                           [1.0, -0.5, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 2])
    return logits, labels


def test_gc_weights_hand_worked():
    logits, labels = _batch()
    # g = |p_true - 1| = [0.5 | 0.25, 0.75, 0.5]; old group {sample 0} mean 0.5, new group mean 0.5.
    w = gc_weights(logits, labels, learned_classes=[0])
    assert torch.allclose(w, torch.tensor([1.0, 0.5, 1.5, 1.0], dtype=torch.float64))
    # old = {0, 1}: g_old = [0.5, 0.25] (mean 0.375), g_new = [0.75, 0.5] (mean 0.625)
    w = gc_weights(logits, labels, learned_classes=[0, 1])
    assert torch.allclose(w, torch.tensor([0.5 / 0.375, 0.25 / 0.375, 0.75 / 0.625, 0.5 / 0.625], dtype=torch.float64))
    assert torch.equal(gc_weights(logits, labels, []), torch.ones(4, dtype=torch.float64))
    # learned classes absent from the batch: only the new group, normalised by its own mean
    w = gc_weights(logits, labels, learned_classes=[7])
    assert torch.allclose(w, torch.tensor([0.5, 0.25, 0.75, 0.5], dtype=torch.float64) / 0.5)


def test_gc_loss_equals_weighted_mean_of_elementwise_bce():
    logits, labels = _batch()
    w = [1.0, 0.5, 1.5, 1.0]
    expected = sum(w[i] * _bce(float(logits[i, c]), 1.0 if c == int(labels[i]) else 0.0)
                   for i in range(4) for c in range(3)) / 12
    assert float(gc_loss(logits, labels, [0])) == pytest.approx(expected, rel=1e-12)


def test_gc_weights_carry_no_gradient():
    logits, labels = _batch()
    logits = logits.clone().requires_grad_(True)
    assert not gc_weights(logits, labels, [0]).requires_grad


def test_rd_targets_hand_worked():
    labels = torch.tensor([2, 0, 3])
    old = torch.tensor([[0.0, L3], [-L3, 0.0], [0.0, 0.0]])
    target = rd_targets(labels, 4, old)
    expected = torch.tensor([[0.5, 0.75, 1.0, 0.0],
                             [0.25, 0.5, 0.0, 0.0],  # the one-hot of old class 0 is overwritten, as in the code
                             [0.5, 0.5, 0.0, 1.0]])
    assert torch.allclose(target, expected)
    with pytest.raises(ValueError, match="more than"):
        rd_targets(labels, 1, old)


def test_rd_loss_and_combined_loss_hand_worked():
    logits, labels = _batch()
    old = torch.tensor([[0.0], [L3], [-L3], [0.0]], dtype=torch.float64)
    t = rd_targets(labels, 3, old)
    rd_expected = sum(_bce(float(logits[i, c]), float(t[i, c])) for i in range(4) for c in range(3)) / 12
    assert float(rd_loss(logits, labels, old)) == pytest.approx(rd_expected, rel=1e-12)
    gc = float(gc_loss(logits, labels, [0]))
    loss, parts = incremental_loss(logits, labels, learned_classes=[0], old_logits=old)
    assert float(loss) == pytest.approx(0.5 * gc + 0.5 * rd_expected, rel=1e-12)
    assert set(parts) == {"gc", "rd"}
    # no old model: L = L_GC; ablations
    assert float(incremental_loss(logits, labels, learned_classes=[0])[0]) == pytest.approx(gc)
    no_rd, _ = incremental_loss(logits, labels, learned_classes=[0], old_logits=old, use_rd=False)
    assert float(no_rd) == pytest.approx(gc)
    no_gc, _ = incremental_loss(logits, labels, learned_classes=[0], old_logits=old, use_gc=False)
    plain = float(gc_loss(logits, labels, []))
    assert float(no_gc) == pytest.approx(0.5 * plain + 0.5 * rd_expected)
    icarl, _ = incremental_loss(logits, labels, objective="icarl", old_logits=old)
    assert float(icarl) == pytest.approx(rd_expected)
    ce, _ = incremental_loss(logits, labels, objective="ce")
    assert float(ce) == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    with pytest.raises(ValueError, match="objective"):
        incremental_loss(logits, labels, objective="kl")


def test_mean_entropy_and_transition_detection():
    assert mean_entropy(torch.zeros(7, 5)) == pytest.approx(math.log(5))
    peaked = torch.tensor([[20.0, 0, 0, 0, 0]])
    assert mean_entropy(peaked) < 1e-6
    assert mean_entropy(torch.zeros(0, 3)) == 0.0
    tau = 1.2
    last = 0.3
    assert is_transition(last + 1.3, last, tau)
    assert not is_transition(last + 1.1, last, tau)
    assert not is_transition(last - 1.0, last, tau)
    # a trained model (peaked) meeting new-class data (uniform over 10) jumps by ln 10 > tau
    assert is_transition(mean_entropy(torch.zeros(4, 10)), mean_entropy(peaked), tau)


def test_learning_rate_schedules():
    kw = dict(rounds_per_task=10, epochs=20, first_task=False)
    assert learning_rate("constant", 2.0, round_in_task=3, epoch=5, global_round=3, **kw) == 2.0
    assert learning_rate("cosine", 2.0, round_in_task=0, epoch=0, global_round=0, **kw) == pytest.approx(2.0)
    assert learning_rate("cosine", 2.0, round_in_task=5, epoch=0, global_round=5, **kw) == pytest.approx(1.0)
    # official: (epoch + round·20) mod 200 hits 100 at round 5 epoch 0 -> lr/5 for that whole round
    assert learning_rate("code", 2.0, round_in_task=5, epoch=7, global_round=5, **kw) == pytest.approx(0.4)
    # round 7 starts again at 2.0 (optimizer rebuilt), drops to /25 at epoch 10 (counter 150)
    assert learning_rate("code", 2.0, round_in_task=7, epoch=9, global_round=7, **kw) == pytest.approx(2.0)
    assert learning_rate("code", 2.0, round_in_task=7, epoch=10, global_round=7, **kw) == pytest.approx(0.08)
    assert learning_rate("code", 2.0, round_in_task=9, epoch=0, global_round=9, **kw) == pytest.approx(0.016)
    assert learning_rate("code", 2.0, round_in_task=0, epoch=3, global_round=10, **kw) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate("step", 1.0, round_in_task=0, epoch=0, global_round=0, **kw)


def test_gc_weights_are_finite_and_exact_for_confident_logits():
    """Issue 19: true-class logits >= ~17 made 1 - sigmoid(o) exactly 0 in float32, so a group's weights were
    0/0 = NaN. With sigmoid(-o) (in log space) they are finite and equal the math, even past underflow."""
    true = [20.0, 25.0, 30.0, 33.0, 40.0, 120.0]  # sigmoid(-120) underflows float32 to 0
    labels = torch.tensor([0, 0, 1, 2, 3, 3])
    logits = torch.zeros(6, 4, dtype=torch.float32)
    logits[torch.arange(6), labels] = torch.tensor(true)
    assert float((torch.sigmoid(logits[torch.arange(6), labels]) - 1).abs().max()) == 0.0  # the old cancellation
    w = gc_weights(logits, labels, learned_classes=[0, 1])
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    # the math in float64 log space: g_i = sigmoid(-o_i); w_i = g_i / mean of its group (old: labels 0, 1)
    log_g = [-math.log1p(math.exp(o)) if o < 30 else -o - math.log1p(math.exp(-o)) for o in true]

    def group(idx):
        top = max(log_g[i] for i in idx)
        log_mean = top + math.log(sum(math.exp(log_g[i] - top) for i in idx) / len(idx))
        return [math.exp(log_g[i] - log_mean) for i in idx]

    expected = torch.tensor(group([0, 1, 2]) + group([3, 4, 5]), dtype=torch.float64)
    assert torch.allclose(w.double(), expected, rtol=1e-5, atol=1e-30)
    assert w[:3].double().mean() == pytest.approx(1.0, rel=1e-5) and w[3:].double().mean() == pytest.approx(1.0, rel=1e-5)
    loss, parts = incremental_loss(logits, labels, learned_classes=[0, 1], old_logits=torch.zeros(6, 2))
    assert math.isfinite(float(loss)) and set(parts) == {"gc", "rd"}


def test_nan_guard_names_the_loss_term():
    logits, labels = _batch()
    old = torch.zeros(4, 1, dtype=torch.float64)
    bad = logits.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(FloatingPointError, match=r"L_GC .*model's logits are not finite") as err:
        incremental_loss(bad, labels, learned_classes=[0], old_logits=old)
    assert "learning rate" not in str(err.value)
    bad_old = old.clone()
    bad_old[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"L_RD .*old model's logits are not finite"):
        incremental_loss(logits, labels, learned_classes=[0], old_logits=bad_old)
    with pytest.raises(FloatingPointError, match=r"BCE \(iCaRL distillation\)"):
        incremental_loss(logits, labels, objective="icarl", old_logits=bad_old)
    with pytest.raises(FloatingPointError, match=r"CE \(cross-entropy\)"):
        incremental_loss(bad, labels, objective="ce")
