"""Clients of the public-logit methods: FCCL, its w/o-CON ablation, FedMD, FedDF and SOLO.

All of them share one round (``specs/fccl.md``), differing only in two switches (:class:`Recipe`):

1. **Collaborative update** on the public set X0 towards the server's consensus logits ``Z̄``
   (skipped in round 1, when no consensus exists yet): FCCL's cross-correlation loss, FedMD's L1,
   FedDF's KL, or nothing (SOLO). Every client walks X0 in the same batch order (drawn from the run
   seed and the round, not the partition), a fresh Adam per batch [FCCL code], ``drop_last``.
2. **Local update** on private data with a fresh Adam: CE + λ·(KL to last round's model + KL to the
   frozen SOLO model) for FCCL, CE only for the others.

Then ``prev ← net`` and the client replies with its logits on the whole public set (N0×C float32,
eval mode), computed on the view of X0 that *next* round's collaborative step uses (the same seeded
augmentation on every client), so reply rows and next round's targets align per sample.

State in ``context.state`` (never sent): ``fccl-net`` (the trained model), ``fccl-solo`` (the frozen
intra-domain teacher, pretrained CE-only the first time the client runs), ``fccl-prev`` (the
inter-domain teacher, ``net`` at the end of the previous round), ``fccl-last-logits`` (this client's
last reply, for the leave-one-out target). Round 0: ``net = prev = solo``.

Staleness: the official code syncs logits per public batch; Pollen exchanges once per round, so the
consensus a client distils from in round t was computed from the models at the end of round t−1.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import NDArrays, Scalar

from pollen.clients.base import PollenClient
from pollen.clients.logit_losses import (
    cross_correlation_loss,
    fccl_local_loss,
    feddf_kl_loss,
    fedmd_l1_loss,
    leave_one_out_target,
)
from pollen.clients.weights import load_model_arrays, model_arrays
from pollen.datasets.domain_tasks import DomainTask, domain_client_data, get_domain_task, public_inputs
from pollen.datasets.tasks import ClientData, TaskOptions
from pollen.datasets.transforms import augment, batches
from pollen.methods.training import derive_seed, predict_logits, train_epochs
from pollen.models import SplitModel

COLLABORATIVE = ("col", "l1", "kl")

# Profile defaults for the keys whose value 0 / "" means "let the profile decide".
Profile = TypedDict("Profile", {"public-size": int, "public-batch-size": int, "solo-epochs": int, "train-cap": int,
                                "test-size": int, "local-epochs": NotRequired[tuple[int, ...]]})
QUICK: Profile = {"public-size": 1000, "public-batch-size": 250, "solo-epochs": 30, "train-cap": 500, "test-size": 300,
         "local-epochs": (10, 10, 2, 2)}
PAPER: Profile = {"public-size": 5000, "public-batch-size": 512, "solo-epochs": 40, "train-cap": 0, "test-size": 0}
# Per-domain local epochs of the paper profile: Digits [FCCL code]; Office-Home [ours] (not in the spec).
PAPER_LOCAL_EPOCHS = {"digits": (40, 35, 3, 4), "digits-offline": (40, 35, 3, 4), "office-home": (20, 20, 20, 20)}
PAPER_PUBLIC_EPOCHS = {"digits": 1, "digits-offline": 1, "office-home": 2}

# Purposes for derive_seed, so each random stream is independent of the others.
_PUBLIC_ORDER, _PUBLIC_VIEW, _LOCAL, _SOLO = 11, 12, 13, 14


@dataclass(frozen=True)
class Recipe:
    """What a method does in the two phases of a round."""

    collaborative: str | None  # "col" (FCCL), "l1" (FedMD), "kl" (FedDF) or None (SOLO)
    distill_local: bool  # CE + KL(prev) + KL(SOLO) (FCCL) or CE only

    def __post_init__(self):
        if self.collaborative not in (None, *COLLABORATIVE):
            raise ValueError(f"collaborative must be None or one of {COLLABORATIVE}, got {self.collaborative!r}")


@dataclass(frozen=True)
class LogitSettings:
    """The ``fccl-…`` run keys resolved against the profile and the task."""

    public: str
    public_size: int
    public_batch_size: int
    public_epochs: int
    public_augment: bool
    lr: float
    batch_size: int
    local_epochs: tuple[int, ...]
    solo_epochs: int
    train_sizes: tuple[int, ...]
    test_size: int
    lambda_col: float
    lambda_loc: float
    eps: float
    target: str
    average_weights: bool
    solo_cache: str


def _int_list(text: str, key: str, length: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError as err:
        raise ValueError(f"run config key '{key}' = {text!r}: expected {length} comma-separated integers") from err
    if len(values) == 1:
        values = values * length
    if len(values) != length or any(v < 0 for v in values):
        raise ValueError(f"run config key '{key}' = {text!r}: expected 1 or {length} non-negative integers")
    return values


def resolve_settings(cfg, task: DomainTask) -> LogitSettings:
    """Read the method keys from ``cfg.extra``; 0 / "" take the profile's (quick or paper) value."""
    x = cfg.extra
    k = len(task.domains)
    prof = QUICK if cfg.profile == "quick" else PAPER
    if x["fccl-local-epochs"]:
        local = _int_list(x["fccl-local-epochs"], "fccl-local-epochs", k)
    elif cfg.profile == "quick":
        local = QUICK["local-epochs"][:k]
    else:
        local = PAPER_LOCAL_EPOCHS[task.name]
    if x["fccl-train-sizes"]:
        sizes = _int_list(x["fccl-train-sizes"], "fccl-train-sizes", k)
    else:
        cap = prof["train-cap"]
        sizes = tuple(min(s, cap) if cap else s for s in task.train_sizes)
    return LogitSettings(
        public=x["fccl-public"] or task.public_default,
        public_size=x["fccl-public-size"] or prof["public-size"],
        public_batch_size=x["fccl-public-batch-size"] or prof["public-batch-size"],
        public_epochs=x["fccl-public-epochs"] or PAPER_PUBLIC_EPOCHS[task.name],
        public_augment=bool(x["fccl-public-augment"]),
        lr=float(x["fccl-lr"]),
        batch_size=int(x["fccl-batch-size"]),
        local_epochs=local,
        solo_epochs=x["fccl-solo-epochs"] or prof["solo-epochs"],
        train_sizes=sizes,
        test_size=x["fccl-test-size"] or prof["test-size"],
        lambda_col=float(x["fccl-lambda-col"]),
        lambda_loc=float(x["fccl-lambda-loc"]),
        eps=float(x["fccl-eps"]),
        target=x["fccl-target"],
        average_weights=bool(x["fccl-average-weights"]),
        solo_cache=str(x["fccl-solo-cache"]),
    )


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of rows whose label is among the ``k`` largest logits (top-1 = plain accuracy)."""
    if len(labels) == 0:
        return 0.0
    k = min(k, logits.shape[1])
    return float((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).float().mean())


def domain_accuracies(model: torch.nn.Module, data: ClientData, device: torch.device, k: int = 1
                      ) -> dict[str, Any]:
    """Intra-domain (own test set), per-domain and inter-domain (mean over the other domains) accuracy."""
    own_logits = predict_logits(model, data.x_test, device)
    loss = float(F.cross_entropy(own_logits, data.y_test)) if len(data.y_test) else 0.0
    per = {data.domain: topk_accuracy(own_logits, data.y_test, k)}
    for name, (x, y) in data.extra_tests.items():
        per[name] = topk_accuracy(predict_logits(model, x, device), y, k)
    others = [v for d, v in per.items() if d != data.domain]
    out: dict[str, Any] = {"loss": loss, "intra-accuracy": per[data.domain],
                           "inter-accuracy": float(np.mean(others)) if others else 0.0}
    out.update({f"acc-{d}": v for d, v in per.items()})
    return out


def public_view(x_public: torch.Tensor, seed: int, server_round: int, enabled: bool) -> torch.Tensor:
    """The public set as seen in ``server_round``: one seeded augmentation shared by all clients.

    FCCL's code augments public batches with RandomCrop(32, pad 4), HFlip and Rotation(15); the view
    depends only on (run seed, round), so every client's logits refer to the same images.
    """
    if not enabled:
        return x_public
    gen = torch.Generator().manual_seed(derive_seed(seed, server_round, _PUBLIC_VIEW))
    return augment(x_public, gen, crop_pad=4, hflip=True, rotation=15.0)


class LogitClient(PollenClient):
    """Shared round of the public-logit methods; subclasses only choose a :class:`Recipe`."""

    RECIPE = Recipe(collaborative="col", distill_local=True)
    NET, SOLO, PREV, LAST = "fccl-net", "fccl-solo", "fccl-prev", "fccl-last-logits"

    def __init__(self, cfg, node, context):
        super().__init__(cfg, node, context)
        self.domain_task = get_domain_task(cfg.task)
        self.settings = resolve_settings(cfg, self.domain_task)

    # data -----------------------------------------------------------------------------------
    @property
    def data(self) -> ClientData:  # type: ignore[override]
        if not hasattr(self, "_data"):
            opts = TaskOptions(data_root=self.node.data_root or self.cfg.data_root, download=self.cfg.download,
                               seed=self.cfg.seed, max_train_samples=self.cfg.max_train_samples)
            self._data = domain_client_data(self.cfg.task, opts, self.partition_id, self.node.num_partitions,
                                            self.settings.train_sizes, self.settings.test_size)
        return self._data

    @property
    def x_public(self) -> torch.Tensor:
        s = self.settings
        return public_inputs(s.public, self.node.data_root or self.cfg.data_root, s.public_size, self.cfg.seed,
                             self.domain_task.fmt)

    # models and state ----------------------------------------------------------------------
    def _solo_cache_path(self) -> str | None:
        """A file shared by runs that would pretrain the identical SOLO model (benchmarks)."""
        if not self.settings.solo_cache:
            return None
        s = self.settings
        key = json.dumps([self.cfg.task, self.partition_id, self.model_name, self.cfg.width_for(self.model_name),
                          self.cfg.seed, s.solo_epochs, s.train_sizes[self.partition_id], self.cfg.max_train_samples,
                          s.lr, s.batch_size])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return os.path.join(os.path.expanduser(s.solo_cache), f"solo-{self.cfg.task}-p{self.partition_id}-{digest}.pt")

    def pretrain_solo(self) -> SplitModel:
        """CE-only training on private data from a seeded init (Adam, ``fccl-solo-epochs``) [FCCL code]."""
        model = self.new_model(init_seed=self.cfg.seed)
        path = self._solo_cache_path()
        if path and os.path.exists(path):
            model.load_state_dict(torch.load(path, map_location=self.device))
            return model
        s = self.settings
        train_epochs(model, self.data.x_train, self.data.y_train, epochs=s.solo_epochs, batch_size=s.batch_size,
                     optimizer=torch.optim.Adam(model.parameters(), lr=s.lr),
                     generator=self.round_generator(0, _SOLO), device=self.device)
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, path)
        return model

    def models(self) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, bool]:
        """(net, solo, prev, fresh): from state, or SOLO-pretrained when this client runs first."""
        net, solo, prev = self.new_model(), self.new_model(), self.new_model()
        if self.state.load_module(self.NET, net):
            self.state.load_module(self.SOLO, solo)
            self.state.load_module(self.PREV, prev)
            return net, solo, prev, False
        solo = self.pretrain_solo()
        net.load_state_dict(solo.state_dict())
        prev.load_state_dict(solo.state_dict())
        self.state.save_module(self.SOLO, solo)
        self.state.save_module(self.NET, net)
        self.state.save_module(self.PREV, prev)
        return net, solo, prev, True

    # the round -----------------------------------------------------------------------------
    def contributed(self, config: dict) -> bool:
        """Are this client's last logits in the consensus? By node (``contributed``) or, after a
        restart under a new node id, by partition (``contributor-partitions``)."""
        partitions = config.get("contributor-partitions", [])
        return bool(config.get("contributed", False)) or self.partition_id in [int(p) for p in partitions]

    def collaborative_target(self, consensus: np.ndarray, count: int, contributed: bool) -> np.ndarray | None:
        if self.settings.target == "mean":
            return consensus
        own = None
        if contributed:
            stored = self.state.load_arrays(self.LAST)
            own = None if stored is None else stored["logits"]
        return leave_one_out_target(consensus, count, own)

    def collaborative_loss(self, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        kind = self.RECIPE.collaborative
        if kind == "col":
            return cross_correlation_loss(z, target, self.settings.lambda_col, self.settings.eps)
        if kind == "l1":
            return fedmd_l1_loss(z, target)
        return feddf_kl_loss(z, target)

    def collaborative_update(self, net: torch.nn.Module, target: np.ndarray, server_round: int) -> float:
        """One pass (or ``public-epochs``) over X0 towards ``target``, one fresh-Adam step per batch."""
        s = self.settings
        x = public_view(self.x_public, self.cfg.seed, server_round, s.public_augment)
        if target.shape != (len(x), self.task.num_classes):
            raise ValueError(f"consensus logits have shape {target.shape}, expected {(len(x), self.task.num_classes)}")
        z_bar = torch.from_numpy(np.asarray(target, dtype=np.float32))
        order = torch.Generator().manual_seed(derive_seed(self.cfg.seed, server_round, _PUBLIC_ORDER))
        net.train()
        losses = []
        for _ in range(s.public_epochs):
            for idx in batches(len(x), s.public_batch_size, order, drop_last=True):
                optimizer = torch.optim.Adam(net.parameters(), lr=s.lr)
                loss = self.collaborative_loss(net(x[idx].to(self.device)), z_bar[idx].to(self.device))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"collaborative loss became {float(loss)}")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
        return float(np.mean(losses)) if losses else float("nan")

    def local_update(self, net, solo, prev, server_round: int) -> dict[str, float]:
        s = self.settings
        distill = self.RECIPE.distill_local
        if distill:
            solo.eval()
            prev.eval()

        def loss_fn(model, x, y):
            if not distill:
                return fccl_local_loss(model(x), y, None, None)
            with torch.no_grad():
                prev_logits, solo_logits = prev(x), solo(x)
            return fccl_local_loss(model(x), y, prev_logits, solo_logits, s.lambda_loc)

        epochs = s.local_epochs[self.partition_id % len(s.local_epochs)]
        history = train_epochs(net, self.data.x_train, self.data.y_train, epochs=epochs, batch_size=s.batch_size,
                               optimizer=torch.optim.Adam(net.parameters(), lr=s.lr),
                               generator=self.round_generator(server_round, _LOCAL), device=self.device,
                               loss_fn=loss_fn)
        if not history:
            return {}
        return {"train-loss": history[-1].loss, **{f"train-{k}": v for k, v in history[-1].parts.items()}}

    def public_logits(self, net: torch.nn.Module, server_round: int) -> np.ndarray:
        """Logits on the view of X0 that round ``server_round + 1`` trains on (eval mode)."""
        x = public_view(self.x_public, self.cfg.seed, server_round + 1, self.settings.public_augment)
        return predict_logits(net, x, self.device).numpy().astype(np.float32)

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        server_round = int(config.get("server-round", 0))
        s = self.settings
        net, solo, prev, fresh = self.models()
        metrics: dict[str, Any] = {**self.base_metrics(), "domain": self.data.domain}
        if fresh:  # the SOLO row (round 0): the pretrained model before any collaboration
            solo_acc = domain_accuracies(solo, self.data, self.device, self.domain_task.top_k)
            metrics.update({f"solo-{k}": v for k, v in solo_acc.items() if k != "loss"})
        parameters = list(parameters)
        if s.average_weights and len(parameters) > 2:
            load_model_arrays(net, parameters[2:])
        if self.RECIPE.collaborative and len(parameters) >= 2:
            target = self.collaborative_target(parameters[0], int(parameters[1][0]),
                                               self.contributed(config))
            if target is not None:
                metrics["collab-loss"] = self.collaborative_update(net, target, server_round)
        metrics.update(self.local_update(net, solo, prev, server_round))
        self.state.save_module(self.NET, net)
        self.state.save_module(self.PREV, net)  # prev ← net: next round's inter-domain teacher
        reply: list[np.ndarray] = []
        if self.RECIPE.collaborative or s.average_weights:
            logits = self.public_logits(net, server_round)
            self.state.save_arrays(self.LAST, {"logits": logits})
            reply.append(logits)
            if s.average_weights:
                reply.extend(model_arrays(net))
        return reply, self.data.num_train, metrics

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        net, _, _, _ = self.models()
        acc = domain_accuracies(net, self.data, self.device, self.domain_task.top_k)
        loss = acc.pop("loss")
        return loss, len(self.data.y_test), {**self.base_metrics(), "domain": self.data.domain, **acc}


class FCCLClient(LogitClient):
    """FCCL: cross-correlation to the consensus, then CE + KL(prev) + KL(SOLO)."""

    RECIPE = Recipe(collaborative="col", distill_local=True)


class FCCLWithoutConClient(LogitClient):
    """FCCL w/o CON (ablation): cross-correlation to the consensus, then CE only."""

    RECIPE = Recipe(collaborative="col", distill_local=False)


class FedMDClient(LogitClient):
    """FedMD: L1 to the consensus logits, then CE only."""

    RECIPE = Recipe(collaborative="l1", distill_local=False)


class FedDFClient(LogitClient):
    """FedDF (heterogeneous variant): KL(σ(consensus) ‖ σ(logits)) on public batches, then CE only."""

    RECIPE = Recipe(collaborative="kl", distill_local=False)


class SoloClient(LogitClient):
    """SOLO: the pretrained model keeps training alone with CE; no logits leave the client."""

    RECIPE = Recipe(collaborative=None, distill_local=False)
