"""Pollen's SGD and Adam against ``torch.optim``'s: the same update, bit for bit on the CPU (the same operations in
the same order as torch's single-tensor path, which torch uses for CPU tensors), and no ``torch._dynamo``
import in a process that trains (the reason it exists: 2.9 CPU-s per training process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pollen.methods.optim import SGD, Adam


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(3 * 6 * 6, 4), torch.nn.Linear(4, 4))
    net[4].weight.requires_grad_(False)  # a frozen layer: no gradient, never stepped
    return net


def _train(make, momentum: float, weight_decay: float, set_to_none: bool) -> list[torch.Tensor]:
    net = _net(0)
    opt = make([p for p in net.parameters() if p.requires_grad] + [net[4].weight], lr=0.1, momentum=momentum,
               weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for step in range(7):
        if step == 4:  # a schedule changes the rate between steps
            for group in opt.param_groups:
                group["lr"] = 0.03
        x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_update_is_torchs_bit_for_bit(momentum, weight_decay, set_to_none):
    ours = _train(SGD, momentum, weight_decay, set_to_none)
    torchs = _train(torch.optim.SGD, momentum, weight_decay, set_to_none)
    start = [p.detach() for p in _net(0).parameters()]
    for a, b in zip(ours, torchs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], start[0]) and torch.equal(ours[-2], start[-2])  # trained; the frozen weight kept


def _train_adam(make) -> list[torch.Tensor]:
    net = _net(0)
    opt = make(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(2)
    for _ in range(9):
        x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_adam_is_torchs_bit_for_bit():
    ours, torchs = _train_adam(Adam), _train_adam(torch.optim.Adam)
    start = [p.detach() for p in _net(0).parameters()]
    for a, b in zip(ours, torchs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], start[0]) and torch.equal(ours[-2], start[-2])


def test_negative_settings_are_refused():
    with pytest.raises(ValueError, match="lr, momentum and weight decay >= 0"):
        SGD([torch.zeros(1, requires_grad=True)], lr=-0.1)
    with pytest.raises(ValueError, match="betas in"):
        Adam([torch.zeros(1, requires_grad=True)], betas=(0.9, 1.0))


def test_training_imports_no_dynamo():
    code = textwrap.dedent("""
        import sys, torch
        from pollen.methods.training import make_sgd, train_epochs
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
        x, y = torch.randn(20, 1, 4, 4), torch.randint(0, 3, (20,))
        train_epochs(net, x, y, epochs=2, batch_size=8, optimizer=make_sgd(net, 0.1, 0.9, 1e-4),
                     generator=torch.Generator().manual_seed(0), device=torch.device("cpu"))
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
