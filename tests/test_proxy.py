"""GLFC's proxy: label inference, per-sample gradients, batched L-BFGS vs torch's, slots."""

import numpy as np
import pytest
import torch

from pollen.models import LeNet
from pollen.strategies.proxy import (
    BatchedLBFGS,
    LBFGSSettings,
    ProxyState,
    infer_labels,
    matching_losses,
    monitor_accuracy,
    per_sample_gradients,
    reconstruct_batched,
    reconstruct_one_by_one,
    single_matching_loss,
)

torch.set_num_threads(1)


def _lenet(dtype=torch.float32, classes=20, size=28):
    return LeNet(classes, in_channels=1, image_size=size, seed=7).to(dtype)


def test_label_inference_is_correct_for_every_class():
    lenet = _lenet()
    gen = torch.Generator().manual_seed(0)
    grads = []
    for c in range(20):
        x = torch.randn(1, 28, 28, generator=gen)
        g = lenet.gradient(x, c)
        assert int(infer_labels(g[-2])) == c  # FC weight gradient, C×d
        grads.append(g[-2])
    assert infer_labels(torch.stack(grads)).tolist() == list(range(20))  # batched, B×C×d
    assert infer_labels(torch.stack(grads).numpy()).tolist() == list(range(20))
    with pytest.raises(ValueError, match="C×d"):
        infer_labels(torch.zeros(5))


def test_per_sample_gradients_match_autograd_one_at_a_time():
    lenet = _lenet(torch.float64)
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    y = torch.tensor([4, 0, 19])
    batched = per_sample_gradients(lenet, x, y)
    for b in range(3):
        single = lenet.gradient(x[b], int(y[b]))
        for gb, gs in zip(batched, single):
            assert torch.allclose(gb[b], gs, atol=1e-12)
    targets = [torch.randn_like(g) for g in batched]
    per = matching_losses(lenet, x, y, targets)
    for b in range(3):
        one = single_matching_loss(lenet, x[b:b + 1], y[b], [t[b] for t in targets])
        assert float(per[b].detach()) == pytest.approx(float(one.detach()), rel=1e-10)


def test_batched_lbfgs_equals_torch_lbfgs_row_by_row():
    # separable objective with a different curvature per row: f_b(x) = sum_i a_bi (x_i - c_bi)^2 + (x_0 x_1)^2
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(5, 6, generator=gen, dtype=torch.float64) * 5 + 0.1
    c = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    x0 = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    # row 4 starts at its optimum: it never moves while the others fill and wrap their histories, so
    # the rows' history rings are out of step (the general, gathered path of the two-loop recursion)
    c[4, 0] = 0.0
    x0[4] = c[4]

    def f(x, a_, c_):
        return (a_ * (x - c_) ** 2).sum(-1) + (x[..., 0] * x[..., 1]) ** 2

    def objective(x):
        xx = x.detach().requires_grad_(True)
        loss = f(xx, a, c)
        (g,) = torch.autograd.grad(loss.sum(), xx)
        return loss.detach(), g

    settings = LBFGSSettings(lr=0.3, max_iter=7, history_size=3)
    opt = BatchedLBFGS(x0, settings)
    for _ in range(4):
        opt.step(objective)
    for b in range(5):
        xb = x0[b].clone().requires_grad_(True)
        ref = torch.optim.LBFGS([xb], lr=0.3, max_iter=7, history_size=3)

        def closure(ref=ref, xb=xb, b=b):  # bound now: the optimiser calls it within this iteration
            ref.zero_grad()
            loss = f(xb, a[b], c[b])
            loss.backward()
            return loss

        for _ in range(4):
            ref.step(closure)
        assert torch.allclose(opt.x[b], xb.detach(), atol=1e-10), b
    assert int(opt.hist_len[4]) == 0 and bool((opt.hist_len[:4] == 3).all())


def test_batched_reconstruction_lowers_the_loss_and_equals_one_by_one():
    lenet = _lenet(torch.float64, classes=10, size=12)
    gen = torch.Generator().manual_seed(1)
    labels = [3, 7, 1]
    grads = [lenet.gradient(torch.randn(1, 12, 12, generator=gen, dtype=torch.float64), c) for c in labels]
    seeds = [11, 12, 13]
    settings = LBFGSSettings(max_iter=5)
    batched = reconstruct_batched(lenet, grads, (1, 12, 12), seeds, iterations=3, keep_last=2, settings=settings)
    single = reconstruct_one_by_one(lenet, grads, (1, 12, 12), seeds, iterations=3, keep_last=2, settings=settings)
    assert batched.labels.tolist() == single.labels.tolist() == labels
    assert batched.images.shape == (3, 2, 1, 12, 12)
    assert (batched.losses < batched.initial_losses).all()
    assert torch.allclose(batched.initial_losses, single.initial_losses, rtol=1e-10)
    assert torch.allclose(batched.images, single.images, atol=1e-8)
    assert torch.allclose(batched.losses, single.losses, rtol=1e-6)
    x, y = batched.samples()
    assert x.shape == (6, 1, 12, 12) and y.tolist() == [3, 3, 7, 7, 1, 1]
    # chunking does not change the result
    chunked = reconstruct_batched(lenet, grads, (1, 12, 12), seeds, iterations=3, keep_last=2, settings=settings,
                                  chunk=2)
    assert torch.allclose(chunked.images, batched.images, atol=1e-10)


def test_float32_reconstruction_lowers_the_matching_loss():
    lenet = _lenet()
    gen = torch.Generator().manual_seed(2)
    grads = [lenet.gradient(torch.randn(1, 28, 28, generator=gen), c) for c in (0, 5)]
    rec = reconstruct_batched(lenet, grads, (1, 28, 28), [1, 2], iterations=2, keep_last=1,
                              settings=LBFGSSettings(max_iter=10))
    assert (rec.losses < 0.5 * rec.initial_losses).all()


def test_proxy_slots_rotate_and_keep_the_best():
    st = ProxyState()
    a = [np.zeros(2, np.float32)]
    b = [np.ones(2, np.float32)]
    # task 0 without reconstructions: any score >= -inf makes the model best_model_2
    assert st.consider(0.0, a, 5) and st.slot2.version == 1 and st.slot1.version == 0
    x, y = torch.zeros(4, 1, 2, 2), torch.tensor([0, 0, 1, 1])
    assert st.receive(0, x, y)  # first gradients of task 0: slot1 <- slot2 (model a), monitor replaced
    assert st.slot1.version == 2 and np.array_equal(st.slot1.arrays[0], a[0])
    assert st.consider(0.5, b, 5) and st.slot2.version == 3
    assert not st.consider(0.4, a, 5) and np.array_equal(st.slot2.arrays[0], b[0])
    assert not st.receive(0, x[:2], y[:2])  # more gradients of the same task: appended, no rotation
    assert len(st.monitor_x) == 6
    assert st.receive(1, x[:1], y[:1]) and np.array_equal(st.slot1.arrays[0], b[0]) and len(st.monitor_x) == 1
    assert st.best_score == float("-inf")  # reset per task (ours)
    keep = ProxyState()
    keep.consider(0.9, a, 5)
    keep.receive(1, x, y, reset_per_task=False)
    assert not keep.consider(0.5, b, 10)  # the code's behaviour: the stale best score survives the task change
    assert not st.receive(2, None, None)


def test_monitor_accuracy():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    x = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 2.0, 0, 0]]).view(3, 1, 2, 2)
    assert monitor_accuracy(model, x, torch.tensor([0, 0, 1]), torch.device("cpu")) == pytest.approx(2 / 3)
    assert monitor_accuracy(model, None, None, torch.device("cpu")) == 0.0


def test_closed_form_per_sample_gradients_equal_vmap_and_autograd():
    from pollen.strategies.proxy import per_sample_gradients_vmap

    for size in (28, 32, 13):
        lenet = LeNet(7, in_channels=3 if size == 32 else 1, image_size=size, seed=2).double()
        x = torch.randn(4, 3 if size == 32 else 1, size, size, dtype=torch.float64, requires_grad=True)
        y = torch.tensor([0, 6, 3, 3])
        fast = per_sample_gradients(lenet, x, y)
        ref = per_sample_gradients_vmap(lenet, x, y)
        assert [tuple(g.shape) for g in fast] == [(4, *p.shape) for p in lenet.parameters()]
        for a, b in zip(fast, ref):
            assert torch.allclose(a, b, atol=1e-12)
        # and its derivative w.r.t. the input (what DLG optimises) matches too
        ga = torch.autograd.grad(sum((g ** 2).sum() for g in fast), x)[0]
        gb = torch.autograd.grad(sum((g ** 2).sum() for g in ref), x)[0]
        assert torch.allclose(ga, gb, atol=1e-10)


def test_fused_matching_loss_and_its_input_gradient_equal_the_official_autograd_form():
    # The fused LeNet objective (expanded head term, transposed conv comparison) against the official
    # loop's loss, one image at a time with create_graph autograd — value and d loss / d image.
    from pollen.strategies.proxy import MatchingObjective

    for size, channels in ((28, 1), (32, 3)):
        lenet = LeNet(10, in_channels=channels, image_size=size, seed=3).double()
        gen = torch.Generator().manual_seed(size)
        x = torch.randn(3, channels, size, size, generator=gen, dtype=torch.float64, requires_grad=True)
        y = torch.tensor([2, 9, 2])
        targets = [torch.randn(3, *p.shape, generator=gen, dtype=torch.float64) for p in lenet.parameters()]
        fused = MatchingObjective(lenet, y, targets)(x)
        (g_fused,) = torch.autograd.grad(fused.sum(), x)
        for b in range(3):
            xb = x[b:b + 1].detach().clone().requires_grad_(True)
            one = single_matching_loss(lenet, xb, y[b], [t[b] for t in targets])
            (g_one,) = torch.autograd.grad(one, xb)
            assert float(fused[b].detach()) == pytest.approx(float(one.detach()), rel=1e-10)
            assert torch.allclose(g_fused[b], g_one[0], rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="target arrays"):
        MatchingObjective(lenet, y, targets[:-1])
