"""Local training and evaluation loops over in-memory tensors.

Data is held as one normalised float tensor per client (see ``pollen.datasets.tasks``), so a batch is
an index lookup — no DataLoader workers, no per-sample Python. Methods plug their objective in as a
``loss_fn(model, x, y) -> (loss, parts)`` callable; the loop owns batching, device moves and the
optimiser step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pollen.datasets.transforms import batches
from pollen.methods.optim import SGD, Optimizer
from pollen.settings import RunConfig

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class LocalTraining:
    """The local optimisation every method shares (run keys ``local-epochs``, ``batch-size``, ``lr``,
    ``momentum``, ``weight-decay``; ``proximal_mu`` is ``fedprox-mu``, read by methods with a
    proximal term)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    proximal_mu: float = 0.0

    @classmethod
    def of(cls, cfg: RunConfig) -> LocalTraining:
        """The local training keys of run ``cfg``."""
        return cls(epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
                   weight_decay=cfg.weight_decay, proximal_mu=cfg.fedprox_mu)

    def sgd(self, model: torch.nn.Module) -> SGD:
        return make_sgd(model, self.lr, self.momentum, self.weight_decay)


def pick_device(choice: str) -> torch.device:
    """``auto`` → cuda when present, else cpu; ``cuda`` without a GPU is an error, not a fallback."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run config 'device' = 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU generator for data order."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A stable seed from (run seed, partition, round, purpose...) — same in every process."""
    acc = 0x9E3779B1
    for p in parts:
        acc = (acc * 1_000_003 + int(p) + 0x7F4A7C15) % (2**31 - 1)
    return acc


def cross_entropy_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    loss = F.cross_entropy(model(x), y)
    return loss, {"ce": float(loss.detach())}


def proximal_term(model: torch.nn.Module, anchor: Iterable[torch.Tensor]) -> torch.Tensor:
    """FedProx's ``||w - w_global||^2`` over trainable parameters (times mu/2 by the caller)."""
    total = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
    if not isinstance(total, torch.Tensor):
        raise ValueError("proximal_term of a model without parameters")
    return total


@dataclass
class EpochStats:
    loss: float
    parts: dict[str, float]
    samples: int


def train_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int,
                 batch_size: int, optimizer: Optimizer, generator: torch.Generator,
                 device: torch.device, loss_fn: LossFn = cross_entropy_loss,
                 drop_last: bool = False) -> list[EpochStats]:
    """Run ``epochs`` passes of minibatch training; returns per-epoch mean losses."""
    model.train()
    history: list[EpochStats] = []
    for _ in range(epochs):
        total, count = 0.0, 0
        parts_sum: dict[str, float] = {}
        for idx in batches(len(y), batch_size, generator, drop_last=drop_last):
            xb = x[idx].to(device, non_blocking=True)
            yb = y[idx].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss, parts = loss_fn(model, xb, yb)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training loss became {float(loss.detach())}; lower the learning rate")
            loss.backward()
            optimizer.step()
            n = len(idx)
            total += float(loss.detach()) * n
            count += n
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v * n
        if count:
            history.append(EpochStats(total / count, {k: v / count for k, v in parts_sum.items()}, count))
    return history


def model_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The full state (parameters and buffers) by name, in ``state_dict`` order, as sent to the server."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def load_state(model: torch.nn.Module, state: Mapping[str, np.ndarray], model_name: str = "") -> None:
    """Load a state by name; the names must be exactly the model's (a clear error otherwise, naming the
    model when ``model_name`` is given)."""
    keys = list(model.state_dict().keys())
    if set(keys) != set(state):
        missing = sorted(set(keys) - set(state))[:5]
        extra = sorted(set(state) - set(keys))[:5]
        named = f" {model_name!r}" if model_name else ""
        raise ValueError(f"server model state does not match this client's model{named}: missing {missing}, "
                         f"unexpected {extra}; do server and client use the same model and width?")
    device = next(model.parameters()).device
    model.load_state_dict({k: torch.from_numpy(np.array(state[k], copy=True)).to(device) for k in keys})


@torch.no_grad()
def predict_logits(model: torch.nn.Module, x: torch.Tensor, device: torch.device,
                   batch_size: int = 512) -> torch.Tensor:
    """Logits for every row of ``x`` in eval mode, on CPU."""
    model.eval()
    out = [model(x[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(out) if out else torch.zeros(0)


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                        batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, top-1 accuracy) of ``model`` on (x, y)."""
    if len(y) == 0:
        return 0.0, 0.0
    logits = predict_logits(model, x, device, batch_size)
    loss = float(F.cross_entropy(logits, y.cpu()))
    acc = float((logits.argmax(1) == y.cpu()).float().mean())
    return loss, acc


def make_sgd(model: torch.nn.Module, lr: float, momentum: float, weight_decay: float) -> SGD:
    return SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
