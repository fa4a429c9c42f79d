"""Exemplar memory for class-incremental learning: iCaRL herding, per-class quota, shrinking.

Exemplars are kept as *indices* into the client's own training images (one int64 array per class),
so the memory fits in ``context.state`` and never duplicates pixels. Herding picks, one at a time,
the sample that brings the running mean of the chosen L2-normalised features closest to the
(normalised) class mean; a prefix of a herded list is itself a good exemplar set, which is why
shrinking keeps the first ``m``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from pollen.models import SplitModel


@torch.no_grad()
def normalised_features(model: SplitModel, x: torch.Tensor, device: torch.device,
                        batch_size: int = 512) -> torch.Tensor:
    """L2-normalised ``model.features(x)`` in eval mode (N×d, CPU float32)."""
    model.eval()
    out = [F.normalize(model.features(x[i:i + batch_size].to(device)).float(), dim=1).cpu()
           for i in range(0, len(x), batch_size)]
    return torch.cat(out) if out else torch.zeros(0, getattr(model, "feature_dim", 0))


def class_mean(features: torch.Tensor) -> torch.Tensor:
    """Mean of the (already L2-normalised) features: the point herding's running mean approaches."""
    if features.shape[0] == 0:
        raise ValueError("class_mean needs at least one feature row")
    return features.mean(0)


def herding(features: torch.Tensor, m: int, distinct: bool = True) -> np.ndarray:
    """Indices of ``m`` exemplars in herding order.

    Step k picks ``argmin_i ||mu - (s + f_i) / k||`` where ``mu`` is :func:`class_mean` and ``s`` the
    sum of the features already picked. ``distinct=True`` (ours) never picks a sample twice and caps
    ``m`` at the number of samples; ``distinct=False`` is the official code, which may repeat one.
    """
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    n = features.shape[0]
    if n == 0 or m == 0:
        return np.zeros(0, dtype=np.int64)
    feats = features.double()
    mu = class_mean(feats)
    total = torch.zeros_like(mu)
    available = torch.ones(n, dtype=torch.bool)
    picked: list[int] = []
    for k in range(1, (min(m, n) if distinct else m) + 1):
        dist = (mu[None, :] - (total[None, :] + feats) / k).norm(dim=1)
        if distinct:
            dist = dist.masked_fill(~available, float("inf"))
        i = int(torch.argmin(dist))
        picked.append(i)
        total += feats[i]
        available[i] = False
    return np.asarray(picked, dtype=np.int64)


def per_class_quota(memory_size: int, num_learned: int) -> int:
    """``m = memory_size // #learned classes`` (0 while nothing is learned)."""
    if memory_size < 0:
        raise ValueError(f"memory_size must be >= 0, got {memory_size}")
    return memory_size // num_learned if num_learned > 0 else 0


def shrink(exemplars: Mapping[int, np.ndarray], m: int) -> dict[int, np.ndarray]:
    """Keep the first ``m`` (herding order) exemplars of every class."""
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    return {int(c): np.asarray(idx, dtype=np.int64)[:m] for c, idx in exemplars.items()}


def update_memory(exemplars: Mapping[int, np.ndarray], new_classes: Mapping[int, tuple[np.ndarray, torch.Tensor]],
                  memory_size: int, distinct: bool = True) -> dict[int, np.ndarray]:
    """Shrink the old sets to the new quota, then herd the quota for each newly learned class.

    ``new_classes`` maps class -> (candidate sample indices, their normalised features).
    """
    learned = set(int(c) for c in exemplars) | set(int(c) for c in new_classes)
    m = per_class_quota(memory_size, len(learned))
    out = shrink({c: v for c, v in exemplars.items() if int(c) not in new_classes}, m)
    for c, (candidates, feats) in new_classes.items():
        candidates = np.asarray(candidates, dtype=np.int64)
        if len(candidates) != feats.shape[0]:
            raise ValueError(f"class {c}: {len(candidates)} candidate indices but {feats.shape[0]} feature rows")
        out[int(c)] = candidates[herding(feats, m, distinct)]
    return out


def nearest_to_mean(features: torch.Tensor) -> int:
    """Index of the sample whose normalised feature is closest to the class mean (GLFC's prototype)."""
    mu = class_mean(features)
    return int(torch.argmin((features - mu[None, :]).norm(dim=1)))


def memory_to_arrays(exemplars: Mapping[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Flatten for ``ClientState.save_arrays`` (keys are class ids as strings)."""
    return {str(int(c)): np.asarray(v, dtype=np.int64) for c, v in exemplars.items()}


def memory_from_arrays(arrays: Mapping[str, np.ndarray] | None) -> dict[int, np.ndarray]:
    return {int(k): np.asarray(v, dtype=np.int64) for k, v in (arrays or {}).items()}
