"""Local objectives and monitors of FedProto and BD-FedProto, as pure torch / float functions.

Notation (``docs/methods/fedproto.md`` describes the method): ``z`` is a B×d batch of embeddings, ``protos`` the
C×d global prototypes, ``present`` a boolean C-vector saying which classes have a global prototype
(absent rows are never read), ``d(a, b)`` the element-wise MSE ``mean((a - b)²)`` FedProto uses as its
distance.

* :func:`prototype_loss` — FedProto's L_P (faithful to the official code).
* :func:`negative_hinge_loss`, :func:`negative_infonce_loss` — CPA's L_N (reconstructed).
* :func:`annealing_temperature`, :func:`dynamic_lambda` — DA's λ_D (reconstructed).
* :func:`mutual_information`, :func:`prototype_probabilities` — the MI monitor (reconstructed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _check_protos(z: torch.Tensor, protos: torch.Tensor, present: torch.Tensor) -> None:
    if z.dim() != 2:
        raise ValueError(f"z must be B×d, got shape {tuple(z.shape)}")
    if protos.dim() != 2 or protos.shape[1] != z.shape[1]:
        raise ValueError(f"protos must be C×{z.shape[1]} (same d as z), got shape {tuple(protos.shape)}")
    if present.shape != (protos.shape[0],) or present.dtype != torch.bool:
        raise ValueError(f"present must be a bool vector of length {protos.shape[0]}, "
                         f"got {present.dtype} of shape {tuple(present.shape)}")


def squared_distances(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """B×C matrix of ``d(z_b, protos_c) = mean_k (z_bk - protos_ck)²`` (FedProto's MSE distance)."""
    return ((z.unsqueeze(1) - protos.unsqueeze(0)) ** 2).mean(dim=2)


def prototype_loss(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """L_P: MSE between each embedding and its class's global prototype, averaged over B×d.

    Samples whose class has no global prototype contribute 0 but still count in the average — the
    official code replaces their target by the embedding itself before one ``MSELoss`` over the batch.
    """
    _check_protos(z, protos, present)
    if z.shape[0] == 0:
        return z.sum() * 0.0
    has = present[y]
    target = torch.where(has.unsqueeze(1), protos[y].to(z.dtype), z.detach())
    return F.mse_loss(z, target)


def negative_mask(present: torch.Tensor, own_classes: Sequence[int]) -> torch.Tensor:
    """M_i: the classes that have a global prototype but that this client does not hold."""
    mask = present.clone()
    if len(own_classes):
        mask[torch.as_tensor(list(own_classes), dtype=torch.long, device=present.device)] = False
    return mask


def negative_hinge_loss(z: torch.Tensor, protos: torch.Tensor, negatives: torch.Tensor,
                        margin: float) -> torch.Tensor:
    """CPA's L_N: ``mean_b mean_{k∈M} max(0, m − d(z_b, C̄^k))``; 0 when M is empty.

    Pushes embeddings at least ``margin`` away (in FedProto's MSE distance) from the prototypes of
    classes the client never sees; the server sets ``margin`` to the median inter-prototype distance,
    so the scale follows the embedding space.
    """
    _check_protos(z, protos, negatives)
    if margin < 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    if z.shape[0] == 0 or not bool(negatives.any()):
        return z.sum() * 0.0
    dist = squared_distances(z, protos[negatives].to(z.dtype))
    return torch.clamp(margin - dist, min=0.0).mean()


def negative_infonce_loss(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, present: torch.Tensor,
                          negatives: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """InfoNCE option for L_N: ``−log softmax`` of the positive among {positive} ∪ M_i, logits −d/τ.

    Averaged over the samples whose class has a global prototype; 0 when there are none.
    """
    _check_protos(z, protos, present)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    has = present[y]
    if z.shape[0] == 0 or not bool(has.any()):
        return z.sum() * 0.0
    zp, yp = z[has], y[has]
    pos = -((zp - protos[yp].to(z.dtype)) ** 2).mean(dim=1, keepdim=True) / tau
    if bool(negatives.any()):
        neg = -squared_distances(zp, protos[negatives].to(z.dtype)) / tau
        logits = torch.cat([pos, neg], dim=1)
    else:
        logits = pos
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def annealing_temperature(round_number: int, t0: float = 2.0, kappa: float = 0.95, t_min: float = 0.05) -> float:
    """DA's simulated-annealing temperature ``T_t = max(T_min, T_0 · κ^t)``."""
    if t0 <= 0 or t_min <= 0 or not 0 < kappa <= 1:
        raise ValueError(f"need t0 > 0, t_min > 0 and 0 < kappa <= 1; got t0={t0}, t_min={t_min}, kappa={kappa}")
    return max(t_min, t0 * kappa ** round_number)


def dynamic_lambda(history: Sequence[tuple[float, float]], lambda_prev: float, lambda0: float,
                   round_number: int, *, alpha: float = 0.5, t0: float = 2.0, kappa: float = 0.95,
                   t_min: float = 0.05, low: float = 0.1, high: float = 2.0) -> float:
    """DA's global-loss weight for the coming round, from the client's (L_S, L_P) history.

    ``history`` holds one (epoch-mean L_S, epoch-mean L_P) pair per past round in which the client had
    global prototypes. With fewer than two pairs the weight is ``lambda0``. Otherwise the latest
    ratios ``r = L^t / L^{t-1}`` are compared through a temperature-``T_t`` softmax:
    ``λ̃ = 2·exp(r_P/T)/(exp(r_S/T)+exp(r_P/T))`` — above 1 when the prototype loss falls more slowly
    than the supervised loss (the local model drifts from the global knowledge, so pull harder), 1 when
    both fall alike — then smoothed ``λ = α·λ_prev + (1−α)·λ̃·λ_0`` and clamped to ``[low, high]·λ_0``.
    A zero previous loss (nothing left to decrease) gives ratio 1.
    """
    if lambda0 <= 0:
        raise ValueError(f"lambda0 must be > 0, got {lambda0}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    if len(history) < 2:
        return float(lambda0)
    (s_prev, p_prev), (s_now, p_now) = history[-2], history[-1]
    r_s = s_now / s_prev if s_prev > 0 else 1.0
    r_p = p_now / p_prev if p_prev > 0 else 1.0
    temp = annealing_temperature(round_number, t0, kappa, t_min)
    # 2·σ((r_P − r_S)/T): the same value as the two-exponential form, without overflow at small T.
    target = 2.0 / (1.0 + math.exp(-(r_p - r_s) / temp)) if (r_p - r_s) / temp > -700 else 0.0
    updated = alpha * lambda_prev + (1.0 - alpha) * target * lambda0
    return float(min(max(updated, low * lambda0), high * lambda0))


def prototype_probabilities(z: torch.Tensor, protos: torch.Tensor, present: torch.Tensor,
                            tau: float = 0.5) -> torch.Tensor:
    """``softmax(−d(z, C̄)/τ)`` over all C classes; classes without a prototype get probability 0."""
    _check_protos(z, protos, present)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if not bool(present.any()):
        raise ValueError("prototype_probabilities needs at least one present prototype")
    logits = -squared_distances(z, protos.to(z.dtype)) / tau
    logits = logits.masked_fill(~present.unsqueeze(0), float("-inf"))
    return torch.softmax(logits, dim=1)


def mutual_information(probs: torch.Tensor) -> float:
    """``(H(p̂) − mean_i H(p_i)) / log C`` with p̂ the mean of the rows of ``probs`` (N×C).

    The mutual information between input and predicted label under the model, normalised to [0, 1]:
    high when predictions are confident for each sample yet diverse across samples.
    """
    if probs.dim() != 2 or probs.shape[1] < 2:
        raise ValueError(f"probs must be N×C with C >= 2, got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0:
        return 0.0
    p = probs.double()

    def entropy(q: torch.Tensor) -> torch.Tensor:
        return -(q * torch.log(q.clamp_min(1e-300))).where(q > 0, torch.zeros_like(q)).sum(dim=-1)

    mi = entropy(p.mean(dim=0)) - entropy(p).mean()
    return float(mi / math.log(probs.shape[1]))
