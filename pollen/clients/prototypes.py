"""FedProto and BD-FedProto clients: private models, prototype-regularised training, two inference modes.

Each client keeps its own model in ``context.state`` (architectures may differ between clients as long
as the embedding size d is shared) and exchanges only class prototypes with the server — the payload
contract is in :mod:`pollen.strategies.prototypes`.

Local objective per batch (losses in :mod:`pollen.clients.prototype_losses`):

* FedProto: ``L_S + λ·L_P``;
* BD-FedProto: ``L_S + λ_D·(L_P + β·L_N)`` — CPA's negatives are the global prototypes of classes the
  client does not hold, DA's ``λ_D`` follows the client's own (L_S, L_P) history.

Round 1 has no global prototypes, so it trains with ``L_S`` alone. As in the official code, the loader
drops the last incomplete batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import NDArrays, Scalar

from pollen.clients.base import PollenClient
from pollen.clients.prototype_losses import (
    dynamic_lambda,
    mutual_information,
    negative_hinge_loss,
    negative_infonce_loss,
    negative_mask,
    prototype_loss,
    prototype_probabilities,
    squared_distances,
)
from pollen.clients.training import derive_seed, evaluate_classifier, make_sgd, train_epochs
from pollen.models.pretrained import load_stage_weights

LOCAL_PROTO_MODES = ("post-pass", "training")
NEGATIVE_FORMS = ("hinge", "infonce")
# DA clamps λ_D to [LOW, HIGH]·λ_0 (spec defaults).
DA_LOW, DA_HIGH = 0.1, 2.0


def heterogeneous_channels(partition_id: int) -> int:
    """FedProto's model-heterogeneous MNIST: conv2 width 18 / 20 / 22 for clients 0-6 / 7-13 / 14+."""
    return 18 if partition_id < 7 else 20 if partition_id < 14 else 22


class GlobalPrototypes:
    """Decoded server payload: prototypes C×d, presence mask C (bool), CPA margin."""

    def __init__(self, protos: torch.Tensor, present: torch.Tensor, margin: float):
        self.protos = protos
        self.present = present
        self.margin = margin

    @classmethod
    def decode(cls, arrays: list[np.ndarray], num_classes: int, embed_dim: int,
               device: torch.device) -> GlobalPrototypes | None:
        """``None`` for the empty first-round payload; ``ValueError`` for a malformed one."""
        if len(arrays) == 0:
            return None
        if len(arrays) != 3:
            raise ValueError(f"global prototype payload must be 3 arrays (protos, mask, margin), got {len(arrays)}")
        protos, mask, margin = (np.asarray(a) for a in arrays)
        if protos.shape != (num_classes, embed_dim) or mask.shape != (num_classes,) or margin.shape != (1,):
            raise ValueError(f"global prototype payload shapes {protos.shape}, {mask.shape}, {margin.shape} "
                             f"!= ({num_classes}, {embed_dim}), ({num_classes},), (1,)")
        present = mask.astype(bool)
        if not np.isfinite(protos[present]).all() or not np.isfinite(margin).all():
            raise ValueError("global prototype payload contains NaN or infinite values")
        return cls(torch.from_numpy(protos.astype(np.float32)).to(device),
                   torch.from_numpy(present).to(device), float(margin[0]))


def class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C×d per-class mean of ``z``, C counts); rows of classes absent from ``y`` are zero."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device)
    sums.index_add_(0, y, z.double())
    counts = torch.bincount(y, minlength=num_classes)
    means = sums / counts.clamp_min(1).unsqueeze(1)
    return means.float(), counts


class PrototypeClient(PollenClient):
    """FedProto (``bd = False``) or BD-FedProto (``bd = True``) client.

    Run keys (``proto-…``): ``lambda`` (λ / λ_0), ``beta``, ``cpa``, ``da`` and ``da-*`` (BD-FedProto
    parts), ``negative`` (``hinge`` | ``infonce``), ``tau``, ``local-protos`` (``post-pass``: a no-grad
    pass after training; ``training``: mean of the last epoch's training-time embeddings, as the
    official code), ``pretrained`` (a local ImageNet ResNet state dict for the stages) and
    ``model-heter``.
    """

    bd = False
    MODEL_KEY = "proto-model"
    DA_KEY = "proto-da-state"

    def opt(self, key: str) -> Any:
        return self.cfg.extra[f"proto-{key}"]

    # model and payloads ------------------------------------------------------------------------
    def model_kwargs(self) -> dict[str, Any]:
        if self.opt("model-heter") and self.model_name == "cnn_mnist":
            return {"channels": heterogeneous_channels(self.partition_id)}
        return {}

    def load_model(self):
        """This client's private model: from ``context.state``, else a fresh per-client init (its ResNet
        stages from ``proto-pretrained`` when set, as the official CIFAR-10 setup)."""
        model = self.new_model(init_seed=derive_seed(self.cfg.seed, self.partition_id, 0, 0x5052),
                               **self.model_kwargs())
        if not self.state.load_module(self.MODEL_KEY, model) and self.opt("pretrained").strip():
            load_stage_weights(model, self.opt("pretrained").strip())
        return model

    def decode(self, parameters, model) -> GlobalPrototypes | None:
        return GlobalPrototypes.decode(list(parameters), self.task.num_classes, model.feature_dim, self.device)

    @torch.no_grad()
    def embed(self, model, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        model.eval()
        out = [model.features(x[i:i + batch_size].to(self.device)) for i in range(0, len(x), batch_size)]
        return torch.cat(out) if out else torch.zeros(0, model.feature_dim, device=self.device)

    def get_parameters(self, config):
        return []

    # training ----------------------------------------------------------------------------------
    def lambda_for_round(self, server_round: int, glob: GlobalPrototypes | None) -> tuple[float, dict]:
        lam0 = float(self.opt("lambda"))
        da = self.state.load_values(self.DA_KEY, {"history": [], "lambda": lam0})
        if not (self.bd and self.opt("da")) or glob is None:
            return lam0, da
        da["lambda"] = dynamic_lambda(
            [tuple(h) for h in da["history"]], float(da["lambda"]), lam0, server_round,
            alpha=float(self.opt("da-alpha")), t0=float(self.opt("da-t0")), kappa=float(self.opt("da-kappa")),
            t_min=float(self.opt("da-tmin")), low=DA_LOW, high=DA_HIGH)
        return float(da["lambda"]), da

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        server_round = int(config.get("server-round", 0))
        model = self.load_model()
        glob = self.decode(parameters, model)
        lam, da_state = self.lambda_for_round(server_round, glob)
        num_classes = self.task.num_classes
        use_cpa = self.bd and bool(self.opt("cpa")) and glob is not None
        negatives = negative_mask(glob.present, self.data.classes) if use_cpa and glob is not None else None
        beta, tau = float(self.opt("beta")), float(self.opt("tau"))
        training_protos = self.opt("local-protos") == "training"
        batches_per_epoch = max(1, self.data.num_train // self.cfg.batch_size)
        acc: dict[str, Any] = {"calls": 0, "sums": None, "counts": None}

        def loss_fn(m, x, y):
            z = m.features(x)
            ce = F.cross_entropy(m.classify(z), y)
            parts = {"ce": float(ce.detach())}
            loss = ce
            if glob is not None:
                lp = prototype_loss(z, y, glob.protos, glob.present)
                parts["proto"] = float(lp.detach())
                reg = lp
                if use_cpa:
                    if self.opt("negative") == "hinge":
                        ln = negative_hinge_loss(z, glob.protos, negatives, glob.margin)
                    else:
                        ln = negative_infonce_loss(z, y, glob.protos, glob.present, negatives, tau)
                    parts["neg"] = float(ln.detach())
                    reg = lp + beta * ln
                loss = ce + lam * reg
            if training_protos:  # the last epoch's embeddings, as the official code averages them
                if acc["calls"] % batches_per_epoch == 0:
                    acc["sums"] = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device)
                    acc["counts"] = torch.zeros(num_classes, dtype=torch.long, device=z.device)
                acc["sums"].index_add_(0, y, z.detach().double())
                acc["counts"] += torch.bincount(y, minlength=num_classes)
                acc["calls"] += 1
            return loss, parts

        history = train_epochs(model, self.data.x_train, self.data.y_train, epochs=self.cfg.local_epochs,
                               batch_size=self.cfg.batch_size, generator=self.round_generator(server_round),
                               device=self.device, drop_last=self.data.num_train >= self.cfg.batch_size,
                               optimizer=make_sgd(model, self.cfg.lr, self.cfg.momentum, self.cfg.weight_decay),
                               loss_fn=loss_fn)
        self.state.save_module(self.MODEL_KEY, model)

        y_train = self.data.y_train.to(self.device)
        z_train = self.embed(model, self.data.x_train)
        counts = torch.bincount(y_train, minlength=num_classes)
        if training_protos and acc["sums"] is not None:
            protos = (acc["sums"] / acc["counts"].clamp_min(1).unsqueeze(1)).float()
            counts = torch.where(acc["counts"] > 0, counts, torch.zeros_like(counts))
        else:
            protos, _ = class_means(z_train, y_train, num_classes)

        metrics: dict[str, Any] = {**self.base_metrics(), "lambda": lam}
        if history:
            last = history[-1]
            metrics["train-loss"] = last.loss
            metrics.update({f"loss-{k}": v for k, v in last.parts.items()})
            if glob is not None and "proto" in last.parts:
                da_state["history"] = (list(da_state["history"]) + [[last.parts["ce"], last.parts["proto"]]])[-3:]
        self.state.save_values(self.DA_KEY, da_state)
        if bool(config.get("monitor", True)):  # only on rounds the server evaluates: a full extra pass
            metrics.update(self.monitors(model, z_train, glob, tau))

        reply = [protos.cpu().numpy().astype(np.float32), counts.cpu().numpy().astype(np.int64)]
        return reply, self.data.num_train, metrics

    @torch.no_grad()
    def monitors(self, model, z_train: torch.Tensor, glob: GlobalPrototypes | None, tau: float) -> dict[str, float]:
        """Mutual information of the classifier's and the prototypes' predictions on the training set."""
        metrics = {"mi-classifier": mutual_information(torch.softmax(model.head(z_train), dim=1))}
        if glob is not None:  # scale-free temperature τ·m: MSE distances are tiny next to τ alone
            tau_mi = tau * glob.margin if glob.margin > 0 else tau
            metrics["mi"] = mutual_information(prototype_probabilities(z_train, glob.protos, glob.present, tau_mi))
        return metrics

    # evaluation --------------------------------------------------------------------------------
    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        model = self.load_model()
        glob = self.decode(parameters, model)
        x, y = self.data.x_test, self.data.y_test
        loss, acc = evaluate_classifier(model, x, y, self.device)
        metrics: dict[str, Any] = {**self.base_metrics(), "accuracy": acc}
        if glob is not None and len(y):
            own = torch.as_tensor(self.data.classes, dtype=torch.long, device=self.device)
            candidates = own[glob.present[own]]
            if len(candidates):
                z = self.embed(model, x)
                pred = candidates[squared_distances(z, glob.protos[candidates]).argmin(dim=1)]
                metrics["proto-accuracy"] = float((pred.cpu() == y).float().mean())
        return float(loss), len(y), metrics


class BDPrototypeClient(PrototypeClient):
    """BD-FedProto: FedProto plus CPA negatives (``proto-cpa``) and DA's dynamic λ_D (``proto-da``)."""

    bd = True
