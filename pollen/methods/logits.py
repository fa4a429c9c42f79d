"""The public-logit family's core: FCCL, its w/o-CON ablation, FedMD, FedDF and SOLO, apart from Flower.

All of them share one round (``specs/fccl.md``), differing only in two switches
(:class:`~pollen.methods.logit_settings.Recipe`):

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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pollen.datasets.tasks import ClientData
from pollen.datasets.transforms import augment, batches
from pollen.methods.logit_losses import (
    cross_correlation_loss,
    fccl_local_loss,
    feddf_kl_loss,
    fedmd_l1_loss,
    leave_one_out_target,
)
from pollen.methods.logit_settings import (  # declared without torch (the registry reads them)
    NET_KEY,
    LogitSettings,
    Recipe,
)
from pollen.methods.optim import Adam
from pollen.methods.training import (
    derive_seed,
    load_state,
    model_state,
    predict_logits,
    seed_everything,
    train_epochs,
)
from pollen.models import SplitModel
from pollen.privacy.payload import PayloadPrivacy
from pollen.protocol.logits import LogitInstruction, LogitReply

# Purposes for derive_seed, so each random stream is independent of the others.
_PUBLIC_ORDER, _PUBLIC_VIEW, _LOCAL, _SOLO, _COLLAB = 11, 12, 13, 14, 15


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
    out: dict[str, Any] = {"loss": loss, "intra-accuracy": per[data.domain]}
    if others:  # a node with only its own data (node config data-dir) has no other domain to test on
        out["inter-accuracy"] = float(np.mean(others))
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




def solo_cache_file(folder: str, task: str, partition_id: int, model: str, width: float, seed: int,
                    settings: LogitSettings, data: int | str, max_train_samples: int) -> str:
    """Where a SOLO model is cached: one file per everything that decides its weights.

    ``data`` is the partition's training size (built-in domain tasks) or its data folder (your own).
    """
    s = settings
    key = json.dumps([task, partition_id, model, width, seed, s.solo_epochs, data, max_train_samples, s.lr,
                      s.batch_size])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(folder), f"solo-{task}-p{partition_id}-{digest}.pt")


class LogitRound:
    """One client's round of a public-logit method, apart from Flower.

    ``seed`` and ``partition_id`` seed every random stream (SOLO pretraining, local order, the shared
    public order and view); ``new_model`` builds this client's architecture; ``solo_cache_path`` is a
    file shared by runs that would pretrain the identical SOLO model (or ``None``). The store also
    keeps arrays (``load_arrays``/``save_arrays``: this client's last reply).
    """

    NET, SOLO, PREV, LAST = NET_KEY, "fccl-solo", "fccl-prev", "fccl-last-logits"

    def __init__(self, recipe: Recipe, settings: LogitSettings, store: Any, data: ClientData,
                 x_public: Callable[[], torch.Tensor], num_classes: int, top_k: int, device: torch.device,
                 new_model: Callable[[], SplitModel], seed: int, partition_id: int,
                 solo_cache_path: str | None = None, privacy: PayloadPrivacy | None = None):
        self.recipe, self.settings, self.store, self.data = recipe, settings, store, data
        self._x_public, self.num_classes, self.top_k, self.device = x_public, num_classes, top_k, device
        self.new_model, self.seed, self.partition_id = new_model, seed, partition_id
        self.solo_cache_path = solo_cache_path
        self.privacy = privacy  # dp-mode = payload: the logits released are clipped and noisy

    @property
    def x_public(self) -> torch.Tensor:
        return self._x_public()

    def generator(self, server_round: int, purpose: int) -> torch.Generator:
        return seed_everything(derive_seed(self.seed, self.partition_id, server_round, purpose))

    # models and state ----------------------------------------------------------------------
    def pretrain_solo(self) -> SplitModel:
        """CE-only training on private data from a seeded init (Adam, ``fccl-solo-epochs``) [FCCL code]."""
        torch.manual_seed(self.seed)
        model = self.new_model()
        path = self.solo_cache_path
        if path and os.path.exists(path):
            model.load_state_dict(torch.load(path, map_location=self.device))
            return model
        s = self.settings
        train_epochs(model, self.data.x_train, self.data.y_train, epochs=s.solo_epochs, batch_size=s.batch_size,
                     optimizer=Adam(model.parameters(), lr=s.lr),
                     generator=self.generator(0, _SOLO), device=self.device)
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, path)
        return model

    def models(self) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, bool]:
        """(net, solo, prev, fresh): from state, or SOLO-pretrained when this client runs first."""
        net, solo, prev = self.new_model(), self.new_model(), self.new_model()
        if self.store.load_module(self.NET, net):
            self.store.load_module(self.SOLO, solo)
            self.store.load_module(self.PREV, prev)
            return net, solo, prev, False
        solo = self.pretrain_solo()
        net.load_state_dict(solo.state_dict())
        prev.load_state_dict(solo.state_dict())
        self.store.save_module(self.SOLO, solo)
        self.store.save_module(self.NET, net)
        self.store.save_module(self.PREV, prev)
        return net, solo, prev, True

    # the round -----------------------------------------------------------------------------
    def collaborative_target(self, consensus: np.ndarray, count: int, contributed: bool) -> np.ndarray | None:
        if self.settings.target == "mean":
            return consensus
        own = None
        if contributed:
            stored = self.store.load_arrays(self.LAST)
            own = None if stored is None else stored["logits"]
        return leave_one_out_target(consensus, count, own)

    def collaborative_loss(self, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        kind = self.recipe.collaborative
        if kind == "col":
            return cross_correlation_loss(z, target, self.settings.lambda_col, self.settings.eps)
        if kind == "l1":
            return fedmd_l1_loss(z, target)
        return feddf_kl_loss(z, target)

    def collaborative_update(self, net: torch.nn.Module, target: np.ndarray, server_round: int) -> float:
        """One pass (or ``public-epochs``) over X0 towards ``target``, one fresh-Adam step per batch."""
        s = self.settings
        x = public_view(self.x_public, self.seed, server_round, s.public_augment)
        if target.shape != (len(x), self.num_classes):
            raise ValueError(f"consensus logits have shape {target.shape}, expected {(len(x), self.num_classes)}")
        z_bar = torch.from_numpy(np.asarray(target, dtype=np.float32))
        order = torch.Generator().manual_seed(derive_seed(self.seed, server_round, _PUBLIC_ORDER))
        # Dropout (EfficientNet's head, cnn_mnist) draws from the global RNG: seeded from (seed, partition,
        # round), else it holds whatever the process ran before (another node's round under Ray), so two
        # runs differ and a resumed one cannot repeat the round.
        self.generator(server_round, _COLLAB)
        net.train()
        losses = []
        for _ in range(s.public_epochs):
            for idx in batches(len(x), s.public_batch_size, order, drop_last=True):
                optimizer = Adam(net.parameters(), lr=s.lr)
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
        distill = self.recipe.distill_local
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
                               optimizer=Adam(net.parameters(), lr=s.lr),
                               generator=self.generator(server_round, _LOCAL), device=self.device,
                               loss_fn=loss_fn)
        if not history:
            return {}
        return {"train-loss": history[-1].loss, **{f"train-{k}": v for k, v in history[-1].parts.items()}}

    def public_logits(self, net: torch.nn.Module, server_round: int) -> np.ndarray:
        """Logits on the view of X0 that round ``server_round + 1`` trains on (eval mode)."""
        x = public_view(self.x_public, self.seed, server_round + 1, self.settings.public_augment)
        return predict_logits(net, x, self.device).numpy().astype(np.float32)

    def fit(self, ins: LogitInstruction, contributed: bool) -> LogitReply:
        """Collaborative step towards the consensus (``ins``: the consensus and its contributor count, in
        homogeneous mode the averaged model), local step, then this client's public logits (and model
        state when averaging); ``contributed``: this client's last logits are in the consensus.

        Under ``privacy`` the logits are the mechanism's release (kept as this client's own for the
        leave-one-out target, since that is what the consensus holds) and the metrics say only ε."""
        s = self.settings
        server_round = ins.server_round
        releases = self.privacy is not None and (self.recipe.collaborative or s.average_weights)
        if releases:
            assert self.privacy is not None
            self.privacy.check()  # out of budget: stop before training, saying so
        net, solo, prev, fresh = self.models()
        metrics: dict[str, Any] = {"domain": self.data.domain}
        if fresh:  # the SOLO row (round 0): the pretrained model before any collaboration
            solo_acc = domain_accuracies(solo, self.data, self.device, self.top_k)
            metrics.update({f"solo-{k}": v for k, v in solo_acc.items() if k != "loss"})
        if s.average_weights and ins.model:
            load_state(net, ins.model)
        if self.recipe.collaborative and ins.consensus is not None:
            target = self.collaborative_target(ins.consensus, ins.contributors, contributed)
            if target is not None:
                metrics["collab-loss"] = self.collaborative_update(net, target, server_round)
        metrics.update(self.local_update(net, solo, prev, server_round))
        self.store.save_module(self.NET, net)
        self.store.save_module(self.PREV, net)  # prev ← net: next round's inter-domain teacher
        num_examples = 1 if releases else self.data.num_train
        if not (self.recipe.collaborative or s.average_weights):
            return LogitReply(None, None, num_examples, metrics)  # SOLO: nothing leaves the client
        logits = self.public_logits(net, server_round)
        if releases:
            assert self.privacy is not None
            logits, metrics = self.privacy.logits(logits)
        self.store.save_arrays(self.LAST, {"logits": logits})
        return LogitReply(logits, model_state(net) if s.average_weights else None, num_examples, metrics)

    def evaluate(self) -> tuple[float, int, dict[str, Any]]:
        net, _, _, _ = self.models()
        acc = domain_accuracies(net, self.data, self.device, self.top_k)
        loss = acc.pop("loss")
        return loss, len(self.data.y_test), {"domain": self.data.domain, **acc}
