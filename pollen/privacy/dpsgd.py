"""``dp-mode = sample``: DP-SGD for local training, the one torch module of :mod:`pollen.privacy` (used
only by training; nothing else here imports torch).

Per-sample gradients come from ``torch.func`` (``functional_call`` + ``vmap`` + ``grad``) rather than
Opacus: no new dependency and no version lock on torch, any model without cross-sample layers works
as it is (Opacus needs a hook per supported layer type), and the loss is the method's own function of
one sample. Each step: a Poisson sample of the records (rate q = batch-size / n,
drawn from the OS's entropy — amplification by subsampling needs the server not to know the batches),
each sample's gradient clipped to ``clip`` (global L2 over all parameters), summed, plus
N(0, (σ·clip)²) per coordinate, divided by the expected batch size q·n, then the usual optimizer step
(momentum and weight decay are post-processing). One record is the unit: ``Release(σ, q, steps)``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.func import functional_call, grad, vmap

from pollen.privacy.accounting import Release
from pollen.privacy.config import cross_sample_refusal
from pollen.privacy.sample import steps_and_rate

SampleLoss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Optimizer(Protocol):
    """What a training loop calls on its optimiser (Pollen's ``pollen.methods.optim`` or ``torch.optim``)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> Any: ...

# Layers that mix the samples of a batch: a sample's gradient through them depends on the others.
_CROSS_SAMPLE = (torch.nn.modules.batchnorm._BatchNorm,)


def first_cross_sample_layer(model: torch.nn.Module) -> tuple[str, str] | None:
    """(path, class name) of the first layer of ``model`` that mixes the samples of a batch; None if none
    (what :data:`pollen.models.catalog.FIRST_BATCHNORM` records for the built-in models)."""
    for name, module in model.named_modules():
        if isinstance(module, _CROSS_SAMPLE):
            return name, type(module).__name__
    return None


def refuse_cross_sample_layers(model: torch.nn.Module, model_name: str) -> None:
    """Refuse a model DP-SGD cannot train, naming the first such layer and the fix (DP-SGD's own check of
    the module it trains, whatever model it is; the run config was checked against the catalog before)."""
    layer = first_cross_sample_layer(model)
    if layer is not None:
        raise ValueError(cross_sample_refusal(model_name, *layer))


class _Loss(torch.nn.Module):
    """``loss(model, x, y)`` as a module, so ``functional_call`` can swap the model's parameters."""

    def __init__(self, model: torch.nn.Module, loss: SampleLoss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, x, y)


def dp_sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss: SampleLoss, epochs: int,
           batch_size: int, optimizer: Optimizer, clip: float, noise_multiplier: float,
           device: torch.device, generator: torch.Generator | None = None,
           statistics: Sequence[str] = ()) -> Release:
    """Train ``model`` in place with DP-SGD; returns the :class:`Release` to compose in the ledger.

    ``loss(model, xb, yb)`` is the mean loss of a batch (called here on batches of one sample).
    ``generator`` (tests only) replaces the secure source of the sampling and the noise. ``statistics``
    names what ``loss`` reads off the whole dataset: any is refused, since removing one record could then
    change every sample's gradient, which the per-sample clip does not bound.
    """
    if statistics:
        raise ValueError(f"DP-SGD refuses a per-sample loss built from a statistic of the dataset "
                         f"({'; '.join(statistics)}): removing one record could change every gradient of a step")
    if not (math.isfinite(clip) and clip > 0 and math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"DP-SGD needs clip > 0 and noise multiplier > 0, got {clip} and {noise_multiplier}")
    refuse_cross_sample_layers(model, type(model).__name__)
    n = len(y)
    steps, q = steps_and_rate(n, batch_size, epochs)
    if generator is None:
        generator = torch.Generator().manual_seed(secrets.randbits(63))
    wrapper = _Loss(model, loss)
    params = {k: p for k, p in wrapper.named_parameters() if p.requires_grad}
    buffers = dict(wrapper.named_buffers())

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, (p, buffers), (xi.unsqueeze(0), yi.unsqueeze(0)))

    per_sample = vmap(grad(one), in_dims=(None, 0, 0), randomness="different")
    model.train()
    for _ in range(steps):
        idx = torch.nonzero(torch.rand(n, generator=generator) < q).squeeze(1)
        total = {k: torch.zeros_like(p) for k, p in params.items()}
        if len(idx):
            detached = {k: p.detach() for k, p in params.items()}
            grads = per_sample(detached, x[idx].to(device), y[idx].to(device))
            norms = torch.sqrt(sum((g.reshape(len(idx), -1) ** 2).sum(1) for g in grads.values()))
            scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0)
            for k, g in grads.items():
                total[k] = torch.einsum("b,b...->...", scale, g)
        optimizer.zero_grad(set_to_none=True)
        for k, p in params.items():
            noise = torch.normal(0.0, noise_multiplier * clip, size=p.shape, generator=generator).to(p.device)
            p.grad = (total[k] + noise) / (q * n)
        optimizer.step()
    return Release(noise_multiplier, q, steps)
