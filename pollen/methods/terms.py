"""Composable local objectives: a loss is a weighted sum of named terms over one batch.

A method lists its terms for the round (cross-entropy, FedProto's prototype distance, CPA's negatives,
a proximal pull, ...); :func:`objective` turns the list into the ``loss_fn`` that
:func:`pollen.methods.training.train_epochs` calls. Each term's unweighted value is reported per epoch
under its name (``loss-<name>`` in the client's metrics), so a new method is a new list, and a new
idea is one new :class:`LossTerm`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pollen.methods.training import EpochStats, LocalTraining, LossFn, proximal_term, train_epochs
from pollen.privacy.accounting import Release
from pollen.privacy.sample import SamplePrivacy


@dataclass
class Batch:
    """One training batch and the model's outputs on it, computed once for every term."""

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor  # embeddings: model.features(x)
    logits: torch.Tensor  # model.classify(z)


class LossTerm(ABC):
    """One part of a local objective: ``weight · value(batch)``; ``start`` runs before the round's
    first batch (e.g. to remember the starting weights)."""

    name = "term"
    weight = 1.0
    # What the term reads off the client's whole dataset (e.g. the classes its labels hold). DP-SGD
    # refuses any: a per-sample loss may depend on its own sample and public inputs only.
    data_statistics: tuple[str, ...] = ()

    def start(self, model: torch.nn.Module) -> None:
        """Called once per round, before training; most terms need nothing."""
        return None

    @abstractmethod
    def value(self, batch: Batch) -> torch.Tensor:
        """This term's unweighted loss on ``batch`` (a scalar tensor)."""


class CrossEntropy(LossTerm):
    """The supervised loss L_S on the client's own labels."""

    name = "ce"

    def value(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(batch.logits, batch.y)


class Proximal(LossTerm):
    """FedProx's pull ``mu/2 · ||w - w_start||²`` towards the weights the round started from."""

    name = "prox"

    def __init__(self, mu: float):
        if mu < 0:
            raise ValueError(f"proximal mu must be >= 0, got {mu}")
        self.weight = 0.5 * mu
        self.anchor: list[torch.Tensor] = []

    def start(self, model: torch.nn.Module) -> None:
        self.anchor = [p.detach().clone() for p in model.parameters()]

    def value(self, batch: Batch) -> torch.Tensor:
        if not self.anchor:
            raise RuntimeError("Proximal.value before start(model): the term has no anchor")
        return proximal_term(batch.model, self.anchor)


Observer = Callable[[Batch], None]


def objective(terms: Sequence[LossTerm], observers: Sequence[Observer] = ()) -> LossFn:
    """``loss_fn(model, x, y) -> (Σ weight·value, {name: value})`` over ``terms``; each observer also
    sees every batch (e.g. to average training-time embeddings). Call each term's ``start`` first."""
    if not terms:
        raise ValueError("an objective needs at least one loss term")
    names = [t.name for t in terms]
    if len(set(names)) != len(names):
        raise ValueError(f"loss term names must be distinct (they name the metrics), got {names}")

    def loss_fn(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        z = model.features(x)
        batch = Batch(model, x, y, z, model.classify(z))
        loss: torch.Tensor | None = None
        parts: dict[str, float] = {}
        for term in terms:
            value = term.value(batch)
            parts[term.name] = float(value.detach())
            weighted = value if term.weight == 1.0 else term.weight * value
            loss = weighted if loss is None else loss + weighted
        for observe in observers:
            observe(batch)
        assert loss is not None
        return loss, parts

    return loss_fn


def scalar_objective(terms: Sequence[LossTerm]) -> Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(model, x, y) -> Σ weight·value`` as one tensor, without the per-term floats of
    :func:`objective`: what DP-SGD differentiates one sample at a time (under ``vmap``, where a tensor
    cannot become a Python float). Call each term's ``start`` first."""
    if not terms:
        raise ValueError("an objective needs at least one loss term")

    def loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.features(x)
        batch = Batch(model, x, y, z, model.classify(z))
        total = terms[0].weight * terms[0].value(batch)
        for term in terms[1:]:
            total = total + term.weight * term.value(batch)
        return total

    return loss


def train_terms(model: Any, x: torch.Tensor, y: torch.Tensor, terms: Sequence[LossTerm], training: LocalTraining, *,
                generator: torch.Generator, device: torch.device, sample: SamplePrivacy | None = None,
                drop_last: bool = False, observers: Sequence[Observer] = ()) -> tuple[list[EpochStats], Release | None]:
    """A round of local training on ``terms``: minibatch SGD (per-epoch losses), or under ``sample``
    (``dp-mode = sample``) DP-SGD, which reports no losses but the :class:`Release` it ran."""
    if sample is None:
        return train_epochs(model, x, y, epochs=training.epochs, batch_size=training.batch_size, generator=generator,
                            device=device, drop_last=drop_last, optimizer=training.sgd(model),
                            loss_fn=objective(terms, observers)), None
    if observers:
        raise ValueError("DP-SGD cannot feed training-time observers: each batch is a secret Poisson sample")
    from pollen.privacy.dpsgd import dp_sgd  # torch.func: only when DP-SGD runs

    release = dp_sgd(model, x, y, loss=scalar_objective(terms), epochs=training.epochs,
                     batch_size=training.batch_size, optimizer=training.sgd(model), clip=sample.config.clip,
                     noise_multiplier=sample.noise_multiplier, device=device,
                     statistics=tuple(f"{t.name}: {s}" for t in terms for s in t.data_statistics))
    return [], release
