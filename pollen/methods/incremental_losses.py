"""Local objectives of federated class-incremental learning (GLFC, iCaRL, Finetune) as pure functions.

GLFC (Dong et al., CVPR 2022) trains with per-class sigmoid + binary cross-entropy, not softmax:

* **L_GC** (class-aware gradient compensation) re-weights each sample by ``g_i = |p_{i,y_i} - 1|``
  normalised within its group (old classes vs new classes) so that the old classes' gradient does not
  drown in the new classes' (or the reverse).
* **L_RD** (class-semantic relation distillation) replaces the first ``C_old`` columns of the one-hot
  target by the old model's sigmoid outputs, so the new model keeps the old model's class relations.
* ``L = L_GC`` without an old model, else ``0.5 L_GC + 0.5 L_RD``.

The task-transition test (mean softmax entropy jumping by more than ``tau``) and the two learning-rate
schedules live here too, so the client adapter only wires them together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from pollen.methods.glfc_settings import LR_SCHEDULES  # declared with the keys, without torch

OBJECTIVES = ("glfc", "icarl", "ce")


def one_hot(labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {labels.min()}..{labels.max()}")
    return F.one_hot(labels, num_classes).to(dtype)


def gc_weights(logits: torch.Tensor, labels: torch.Tensor, learned_classes: Iterable[int]) -> torch.Tensor:
    """Per-sample L_GC weights ``w_i`` (N), detached.

    ``g_i = |sigmoid(o_{i,y_i}) - 1| = sigmoid(-o_{i,y_i})``; samples of learned (old) classes get
    ``g_i / mean_old(g)``, the others ``g_i / mean_new(g)``. An empty group contributes nothing; without
    learned classes every weight is 1 (plain BCE), as in the official code.

    Computed as ``exp(log g_i - log mean_group(g))`` with ``log g = logsigmoid(-o)``: no ``1 - sigmoid``
    cancellation (which made ``g`` exactly 0 in float32 once a group's true-class logits were all
    >= ~17, and the weights 0/0 = NaN) and no underflow for any finite logit.
    """
    learned = sorted({int(c) for c in learned_classes})
    n = logits.shape[0]
    if not learned:
        return torch.ones(n, dtype=logits.dtype, device=logits.device)
    with torch.no_grad():
        log_g = F.logsigmoid(-logits.gather(1, labels.view(-1, 1)).squeeze(1))
        is_old = torch.isin(labels, torch.tensor(learned, device=labels.device))
        w = torch.zeros_like(log_g)
        for mask in (is_old, ~is_old):
            count = int(mask.sum())
            if count:
                group = log_g[mask]
                w[mask] = torch.exp(group - (torch.logsumexp(group, 0) - math.log(count)))
    return w


def gc_loss(logits: torch.Tensor, labels: torch.Tensor, learned_classes: Iterable[int]) -> torch.Tensor:
    """``mean_{i,c} w_i · BCEwithLogits(o_ic, Y_ic)``."""
    w = gc_weights(logits, labels, learned_classes)
    bce = F.binary_cross_entropy_with_logits(logits, one_hot(labels, logits.shape[1], logits.dtype),
                                             reduction="none")
    return (w[:, None] * bce).mean()


def rd_targets(labels: torch.Tensor, num_classes: int, old_logits: torch.Tensor) -> torch.Tensor:
    """One-hot targets whose first ``C_old`` columns are ``sigmoid(old_logits)`` (N×C, detached)."""
    c_old = old_logits.shape[1]
    if c_old > num_classes:
        raise ValueError(f"old model has {c_old} outputs, more than the current {num_classes}")
    target = one_hot(labels, num_classes, old_logits.dtype).to(old_logits.device)
    target[:, :c_old] = torch.sigmoid(old_logits.detach())
    return target


def rd_loss(logits: torch.Tensor, labels: torch.Tensor, old_logits: torch.Tensor) -> torch.Tensor:
    """``mean_{i,c} BCEwithLogits(o_ic, T_ic)`` with T from :func:`rd_targets`."""
    target = rd_targets(labels, logits.shape[1], old_logits).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, target)


def incremental_loss(logits: torch.Tensor, labels: torch.Tensor, *, objective: str = "glfc",
                     learned_classes: Iterable[int] = (), old_logits: torch.Tensor | None = None,
                     use_gc: bool = True, use_rd: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The local loss of one batch and its parts.

    ``objective``: ``glfc`` — L_GC (plain BCE when ``use_gc`` is off), plus the 0.5/0.5 mix with L_RD
    when an old model's logits are given and ``use_rd``; ``icarl`` — BCE towards the distillation
    targets (old sigmoid outputs on old columns, one-hot elsewhere), plain BCE without an old model;
    ``ce`` — softmax cross-entropy (Finetune).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "ce":
        loss = F.cross_entropy(logits, labels)
        parts = {"ce": float(loss.detach())}
        _check_term("CE (cross-entropy)", parts["ce"], logits)
        return loss, parts
    if objective == "icarl":
        if old_logits is None:
            loss = F.binary_cross_entropy_with_logits(logits, one_hot(labels, logits.shape[1], logits.dtype))
        else:
            loss = rd_loss(logits, labels, old_logits)
        parts = {"bce": float(loss.detach())}
        _check_term("BCE (iCaRL distillation)" if old_logits is not None else "BCE", parts["bce"], logits,
                    old_logits)
        return loss, parts
    learned = list(learned_classes)
    cur = gc_loss(logits, labels, learned if use_gc else [])
    parts = {"gc": float(cur.detach())}
    _check_term("L_GC (class-aware gradient compensation)" if use_gc and learned else "L_GC (plain BCE)",
                parts["gc"], logits)
    if old_logits is None or not use_rd:
        return cur, parts
    rd = rd_loss(logits, labels, old_logits)
    parts["rd"] = float(rd.detach())
    _check_term("L_RD (relation distillation)", parts["rd"], logits, old_logits)
    return 0.5 * cur + 0.5 * rd, parts


def _check_term(name: str, value: float, logits: torch.Tensor, old_logits: torch.Tensor | None = None) -> None:
    """Raise ``FloatingPointError`` naming the loss term that is not finite, and what fed it."""
    if math.isfinite(value):
        return
    inputs = []
    if not bool(torch.isfinite(logits.detach()).all()):
        inputs.append("the model's logits are not finite (the local model diverged)")
    if old_logits is not None and not bool(torch.isfinite(old_logits).all()):
        inputs.append("the old model's logits are not finite (a corrupt old model)")
    raise FloatingPointError(f"GLFC loss term {name} became {value}"
                             + (f": {'; '.join(inputs)}" if inputs else " with finite logits"))


def mean_entropy(logits: torch.Tensor) -> float:
    """Mean softmax entropy (nats) over the rows of ``logits``; 0 for no rows."""
    if logits.shape[0] == 0:
        return 0.0
    logp = F.log_softmax(logits.float(), dim=1)
    return float(-(logp.exp() * logp).sum(1).mean())


def is_transition(entropy: float, last_entropy: float, tau: float) -> bool:
    """GLFC's task-transition test: the entropy rose by more than ``tau`` since the last check."""
    return entropy - last_entropy > tau


def learning_rate(schedule: str, base_lr: float, *, round_in_task: int, rounds_per_task: int, epoch: int,
                  epochs: int, global_round: int, first_task: bool) -> float:
    """Learning rate of local epoch ``epoch`` (0-based) of one round.

    ``cosine`` — cosine decay over the task's ``rounds_per_task · epochs`` local epochs (ours);
    ``code`` — the official step schedule: the within-task epoch counter
    ``(epoch + global_round · epochs) mod 200`` divides the rate by 5 / 25 / 125 when it *hits*
    100 / 150 / 180, for the rest of that round only, because the optimiser is rebuilt every round
    (so the rate jumps back up next round); ``first_task`` is accepted for parity with the code,
    where both branches set the same value. ``constant`` — ``base_lr``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if schedule == "constant":
        return base_lr
    if schedule == "cosine":
        total = max(1, rounds_per_task * epochs)
        pos = min(total - 1, round_in_task * epochs + epoch)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * pos / total))
    lr = base_lr
    for e in range(epoch + 1):
        p = (e + global_round * epochs) % 200
        if p == 100:
            lr = base_lr / 5
        elif p == 150:
            lr = base_lr / 25
        elif p == 180:
            lr = base_lr / 125
    return lr
