"""Objectives of the public-logit methods (FCCL, FedMD, FedDF), as pure torch functions.

FCCL (Huang, Ye, Du; CVPR 2022) aligns every model's *raw* logits on unlabeled public data with a
consensus through the cross-correlation of class columns (Eq. 1–2), and keeps private knowledge
with two distillation terms (Eq. 3–6). FedMD pulls logits to the consensus with an L1 loss, FedDF
with a KL divergence between softmaxes. See ``specs/fccl.md`` for the exact definitions.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pollen.methods.logit_settings import LogitOptions

# Weight of the off-diagonal terms in FCCL's cross-correlation loss (paper and code): run key fccl-lambda-col.
LAMBDA_OFF_DIAGONAL = LogitOptions.lambda_col
# Added to the column standard deviation so a constant column (std 0) standardises to zeros
# instead of NaN; the official code has no such guard: run key fccl-eps.
DEFAULT_EPS = LogitOptions.eps


def standardize_columns(z: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Centre each class column along the batch and divide by its unbiased std plus ``eps``."""
    if z.dim() != 2:
        raise ValueError(f"standardize_columns expects a batch×classes matrix, got shape {tuple(z.shape)}")
    if z.shape[0] < 2:
        raise ValueError(f"standardize_columns needs at least 2 rows for an unbiased std, got {z.shape[0]}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return (z - z.mean(dim=0, keepdim=True)) / (z.std(dim=0, unbiased=True, keepdim=True) + eps)


def cross_correlation_matrix(z: torch.Tensor, z_target: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """FCCL's C×C matrix ``M = zᵀ z̄ / N`` between standardised logit columns (Eq. 1)."""
    if z.shape != z_target.shape:
        raise ValueError(f"logits {tuple(z.shape)} and target logits {tuple(z_target.shape)} differ in shape")
    n = z.shape[0]
    return standardize_columns(z, eps).T @ standardize_columns(z_target, eps) / n


def correlation_target_loss(m: torch.Tensor, off_diagonal_weight: float = LAMBDA_OFF_DIAGONAL) -> torch.Tensor:
    """``Σ_u (M_uu − 1)² + λ Σ_{u≠v} (M_uv + 1)²``: zero exactly at the target ``2·I − 1`` (Eq. 2).

    The off-diagonal target is −1, as in the paper's Fig. 2 and the official code.
    """
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"correlation_target_loss expects a square matrix, got shape {tuple(m.shape)}")
    diag = torch.diagonal(m)
    on = ((diag - 1.0) ** 2).sum()
    off = ((m + 1.0) ** 2).sum() - ((diag + 1.0) ** 2).sum()
    return on + off_diagonal_weight * off


def cross_correlation_loss(z: torch.Tensor, z_target: torch.Tensor,
                           off_diagonal_weight: float = LAMBDA_OFF_DIAGONAL,
                           eps: float = DEFAULT_EPS) -> torch.Tensor:
    """FCCL's collaborative loss ``L_col`` on raw logits; gradients flow into ``z`` only."""
    return correlation_target_loss(cross_correlation_matrix(z, z_target.detach(), eps), off_diagonal_weight)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """``KL(σ(teacher) ‖ σ(student))`` averaged over the batch (temperature 1, no T² factor)."""
    return F.kl_div(F.log_softmax(student_logits, dim=1), F.softmax(teacher_logits.detach(), dim=1),
                    reduction="batchmean")


def fccl_local_loss(logits: torch.Tensor, labels: torch.Tensor, prev_logits: torch.Tensor | None,
                    solo_logits: torch.Tensor | None, lambda_loc: float = 1.0
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """FCCL's local objective (Eq. 6): CE plus λ·(inter-domain KL + intra-domain KL).

    ``prev_logits`` come from last round's model (inter-domain knowledge), ``solo_logits`` from the
    frozen SOLO model (intra-domain knowledge); ``None`` drops a term (CE-only baselines).
    """
    ce = F.cross_entropy(logits, labels)
    loss = ce
    parts = {"ce": float(ce.detach())}
    if prev_logits is not None:
        inter = kl_to_teacher(logits, prev_logits)
        loss = loss + lambda_loc * inter
        parts["kl-inter"] = float(inter.detach())
    if solo_logits is not None:
        intra = kl_to_teacher(logits, solo_logits)
        loss = loss + lambda_loc * intra
        parts["kl-intra"] = float(intra.detach())
    return loss, parts


def fedmd_l1_loss(logits: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """FedMD's digest step: mean absolute difference to the consensus logits."""
    return F.l1_loss(logits, consensus.detach())


def feddf_kl_loss(logits: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """FedDF's distillation: ``KL(σ(consensus) ‖ σ(logits))``, batch mean."""
    return kl_to_teacher(logits, consensus)


def leave_one_out_target(mean: np.ndarray, count: int, own: np.ndarray | None) -> np.ndarray | None:
    """The mean of the *other* contributors, from the mean over ``count`` and one's own share.

    ``(count · mean − own) / (count − 1)``; ``None`` when nobody else contributed. ``own = None``
    (this client's reply was not in the mean) returns ``mean`` unchanged.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if own is None:
        return mean
    if own.shape != mean.shape:
        raise ValueError(f"own logits {own.shape} and mean logits {mean.shape} differ in shape")
    if count == 1:
        return None
    out = (count * mean.astype(np.float64) - own.astype(np.float64)) / (count - 1)
    return out.astype(np.float32)
