"""The optimisers the methods train with, without ``torch.optim``.

``torch.optim``'s ``step`` imports ``torch._dynamo`` on its first call (to mark a graph break for
``torch.compile``, which Pollen never uses): about 2.9 CPU-seconds in every process that trains, i.e. in
every Ray actor of a simulation and every SuperNode, before its first batch. :class:`SGD` and :class:`Adam`
are ``torch.optim``'s single-tensor updates (the ones torch uses for CPU tensors) with the same operations in
the same order, so on the CPU they give the same bits (``tests/test_optim.py``); they are also what runs on a
GPU, where ``torch.optim`` would pick its multi-tensor variants (equal up to float rounding).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pollen.privacy.dpsgd import Optimizer

__all__ = ["SGD", "Adam", "Optimizer"]


def _zero_grad(param_groups: list[dict[str, Any]], set_to_none: bool) -> None:
    for group in param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.requires_grad_(False)
                p.grad.zero_()


class SGD:
    """Stochastic gradient descent with momentum and weight decay (no dampening, no Nesterov).

    ``param_groups`` is a one-group list as in ``torch.optim`` (a schedule sets ``group["lr"]``); parameters
    without a gradient are skipped, and the momentum buffer starts as a copy of the first gradient.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        if not lr >= 0 or not momentum >= 0 or not weight_decay >= 0:
            raise ValueError(f"SGD needs lr, momentum and weight decay >= 0, got {lr}, {momentum}, {weight_decay}")
        group: dict[str, Any] = {"params": list(params), "lr": lr, "momentum": momentum,
                                 "weight_decay": weight_decay}
        self.param_groups = [group]
        self._momentum: dict[int, torch.Tensor] = {}  # id(param) -> momentum buffer

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad(self.param_groups, set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if weight_decay != 0:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum != 0:
                    buf = self._momentum.get(id(p))
                    if buf is None:
                        buf = self._momentum[id(p)] = grad.detach().clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1)
                    grad = buf
                p.add_(grad, alpha=-lr)


class Adam:
    """Adam without weight decay or AMSGrad (``torch.optim.Adam``'s defaults: betas (0.9, 0.999), eps 1e-8).

    Each parameter's step count, first and second moments start at its first step with a gradient.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        if not lr >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Adam needs lr >= 0, eps >= 0 and betas in [0, 1), got {lr}, {eps}, {betas}")
        self.param_groups: list[dict[str, Any]] = [{"params": list(params), "lr": lr, "betas": betas, "eps": eps}]
        self._state: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}  # id -> ([step], m, v)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad(self.param_groups, set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if id(p) not in self._state:
                    self._state[id(p)] = ([0], torch.zeros_like(p, memory_format=torch.preserve_format),
                                          torch.zeros_like(p, memory_format=torch.preserve_format))
                count, exp_avg, exp_avg_sq = self._state[id(p)]
                count[0] += 1
                step = float(count[0])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
