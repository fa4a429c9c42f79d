"""The prototype family's core (FedProto, BD-FedProto and compositions): settings, loss terms, one round.

Each client keeps a private model (architectures may differ between clients as long as the embedding
size d is shared) and exchanges only class prototypes with the server — the payload contract is in
:mod:`pollen.protocol.prototypes`.

A :class:`PrototypeMethod` is its list of loss terms per round (:mod:`pollen.methods.terms`):

* FedProto: ``L_S + λ·L_P``;
* BD-FedProto: ``L_S + λ_D·L_P + λ_D·β·L_N`` — CPA's negatives are the global prototypes of classes
  the client does not hold, DA's ``λ_D`` follows the client's own (L_S, L_P) history;
* FedProto + proximal term: ``L_S + λ·L_P + μ/2·‖w − w_start‖²`` (``fedprox-mu``), the worked example of
  ``docs/development.md``: one method entry here, one registration in the app.

Round 1 has no global prototypes, so it trains with ``L_S`` (and any term that needs none) alone. As in
the official code, the loader drops the last incomplete batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pollen.datasets.tasks import ClientData
from pollen.methods.prototype_losses import (
    dynamic_lambda,
    mutual_information,
    negative_hinge_loss,
    negative_infonce_loss,
    negative_mask,
    prototype_loss,
    prototype_probabilities,
    squared_distances,
)
from pollen.methods.prototype_settings import (  # declared without torch (the registry reads them)
    MODEL_KEY,
    NEGATIVE_FORMS,
    ProtoSettings,
)
from pollen.methods.state import StateStore
from pollen.methods.terms import Batch, CrossEntropy, LossTerm, Proximal, train_terms
from pollen.methods.training import LocalTraining, evaluate_classifier, seed_everything
from pollen.models import SplitModel
from pollen.models.pretrained import load_stage_weights
from pollen.privacy.payload import PayloadPrivacy
from pollen.privacy.sample import SamplePrivacy
from pollen.protocol.prototypes import GlobalPrototypes, PrivatePrototypeReply, PrototypeReply

# DA clamps λ_D to [LOW, HIGH]·λ_0 (spec defaults).
DA_LOW, DA_HIGH = 0.1, 2.0


class PrototypeTargets:
    """The global prototypes on this client's device, as the loss terms read them: prototypes C×d,
    presence mask C (bool), CPA margin."""

    def __init__(self, protos: torch.Tensor, present: torch.Tensor, margin: float):
        self.protos = protos
        self.present = present
        self.margin = margin

    @classmethod
    def of(cls, glob: GlobalPrototypes | None, num_classes: int, embed_dim: int,
           device: torch.device) -> PrototypeTargets | None:
        """``None`` for round 1 (nothing received); ``ValueError`` for a payload this client cannot use."""
        if glob is None:
            return None
        glob.check(num_classes, embed_dim)
        protos, present = np.asarray(glob.prototypes), np.asarray(glob.present).astype(bool)
        return cls(torch.from_numpy(protos.astype(np.float32)).to(device), torch.from_numpy(present).to(device),
                   float(glob.margin))


def class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C×d per-class mean of ``z``, C counts); rows of classes absent from ``y`` are zero."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device)
    sums.index_add_(0, y, z.double())
    counts = torch.bincount(y, minlength=num_classes)
    means = sums / counts.clamp_min(1).unsqueeze(1)
    return means.float(), counts


# Loss terms -----------------------------------------------------------------------------------------
class PrototypeDistance(LossTerm):
    """FedProto's L_P: each embedding against its class's global prototype (MSE)."""

    name = "proto"

    def __init__(self, glob: PrototypeTargets, weight: float):
        self.glob, self.weight = glob, weight

    def value(self, batch: Batch) -> torch.Tensor:
        return prototype_loss(batch.z, batch.y, self.glob.protos, self.glob.present)


class ContrastiveNegatives(LossTerm):
    """CPA's L_N: push embeddings away from the global prototypes of classes the client lacks."""

    name = "neg"

    def __init__(self, glob: PrototypeTargets, own_classes: Sequence[int], form: str, tau: float, weight: float,
                 classes_from_data: bool = False):
        if form not in NEGATIVE_FORMS:
            raise ValueError(f"negative form must be one of {NEGATIVE_FORMS}, got {form!r}")
        self.glob, self.form, self.tau, self.weight = glob, form, tau, weight
        self.negatives = negative_mask(glob.present, own_classes)
        if classes_from_data:  # the negatives are then a statistic of the whole dataset
            self.data_statistics = ("the client's own classes, read off its training labels",)

    def value(self, batch: Batch) -> torch.Tensor:
        g = self.glob
        if self.form == "hinge":
            return negative_hinge_loss(batch.z, g.protos, self.negatives, g.margin)
        return negative_infonce_loss(batch.z, batch.y, g.protos, g.present, self.negatives, self.tau)


@dataclass(frozen=True)
class RoundInputs:
    """What a method's loss terms are built from, once per round."""

    settings: ProtoSettings
    training: LocalTraining
    glob: PrototypeTargets | None  # None in round 1
    lam: float  # λ this round (λ_D under DA)
    own_classes: Sequence[int]
    own_classes_from_data: bool = False  # read off the labels (user data), not fixed by the task's plan


def fedproto_terms(r: RoundInputs) -> list[LossTerm]:
    terms: list[LossTerm] = [CrossEntropy()]
    if r.glob is not None:
        terms.append(PrototypeDistance(r.glob, weight=r.lam))
    return terms


def bd_fedproto_terms(r: RoundInputs) -> list[LossTerm]:
    terms = fedproto_terms(r)
    if r.glob is not None and r.settings.cpa:
        terms.append(ContrastiveNegatives(r.glob, r.own_classes, r.settings.negative, r.settings.tau,
                                          weight=r.lam * r.settings.beta, classes_from_data=r.own_classes_from_data))
    return terms


def fedproto_prox_terms(r: RoundInputs) -> list[LossTerm]:
    return [*fedproto_terms(r), Proximal(r.training.proximal_mu)]


@dataclass(frozen=True)
class PrototypeMethod:
    """A prototype-family method: its loss terms per round, and whether λ follows DA (``proto-da``)."""

    name: str
    terms: Callable[[RoundInputs], list[LossTerm]]
    dynamic_lambda: bool = False


FEDPROTO = PrototypeMethod("fedproto", fedproto_terms)
BD_FEDPROTO = PrototypeMethod("bd-fedproto", bd_fedproto_terms, dynamic_lambda=True)
FEDPROTO_PROX = PrototypeMethod("fedproto-prox", fedproto_prox_terms)
# Each method by name: the registry names a method and its client finds the core here when it first runs,
# so registering (launcher, ServerApp) needs no torch.
PROTOTYPE_METHODS: dict[str, PrototypeMethod] = {m.name: m for m in (FEDPROTO, BD_FEDPROTO, FEDPROTO_PROX)}


# One client round ----------------------------------------------------------------------------------
class TrainingTimePrototypes:
    """Observer: per-class mean of the last epoch's training-time embeddings (the official code's
    prototypes, ``proto-local-protos = training``)."""

    def __init__(self, num_classes: int, batches_per_epoch: int):
        self.num_classes, self.batches_per_epoch = num_classes, batches_per_epoch
        self.calls = 0
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def __call__(self, batch: Batch) -> None:
        z, y = batch.z.detach(), batch.y
        if self.calls % self.batches_per_epoch == 0 or self.sums is None or self.counts is None:
            self.sums = torch.zeros(self.num_classes, z.shape[1], dtype=torch.float64, device=z.device)
            self.counts = torch.zeros(self.num_classes, dtype=torch.long, device=z.device)
        self.sums.index_add_(0, y, z.double())
        self.counts += torch.bincount(y, minlength=self.num_classes)
        self.calls += 1


class PrototypeRound:
    """One client's round of a prototype method, apart from Flower: load the private model from the
    store → decode the global prototypes → build the method's loss terms → train → encode the local
    prototypes. ``new_model`` builds this client's model with its reproducible initial weights.

    With ``privacy`` the reply is what the mechanism released — noisy sums and counts of all classes
    from the post-pass embeddings — and the metrics only what reveals no data; under ``dp-mode = sample``
    (:class:`SamplePrivacy`) the model is trained with DP-SGD first."""

    MODEL_KEY = MODEL_KEY
    DA_KEY = "proto-da-state"

    def __init__(self, method: PrototypeMethod, settings: ProtoSettings, training: LocalTraining,
                 store: StateStore, data: ClientData, num_classes: int, device: torch.device,
                 new_model: Callable[[], SplitModel], privacy: PayloadPrivacy | SamplePrivacy | None = None):
        self.method, self.settings, self.training = method, settings, training
        self.store, self.data, self.num_classes = store, data, num_classes
        self.device, self.new_model, self.privacy = device, new_model, privacy

    def load_model(self) -> SplitModel:
        """The private model: from the store, else a fresh init (its ResNet stages from
        ``proto-pretrained`` when set, as the official CIFAR-10 setup)."""
        model = self.new_model()
        if not self.store.load_module(self.MODEL_KEY, model) and self.settings.pretrained.strip():
            load_stage_weights(model, self.settings.pretrained.strip())
        return model

    def targets(self, glob: GlobalPrototypes | None, model: SplitModel) -> PrototypeTargets | None:
        return PrototypeTargets.of(glob, self.num_classes, model.feature_dim, self.device)

    @torch.no_grad()
    def embed(self, model: SplitModel, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        model.eval()
        out = [model.features(x[i:i + batch_size].to(self.device)) for i in range(0, len(x), batch_size)]
        return torch.cat(out) if out else torch.zeros(0, model.feature_dim, device=self.device)

    def lambda_for_round(self, server_round: int, glob: PrototypeTargets | None) -> tuple[float, dict]:
        s = self.settings
        da = self.store.load_values(self.DA_KEY, {"history": [], "lambda": s.lam})
        if not (self.method.dynamic_lambda and s.da) or glob is None:
            return s.lam, da
        da["lambda"] = dynamic_lambda(
            [tuple(h) for h in da["history"]], float(da["lambda"]), s.lam, server_round,
            alpha=s.da_alpha, t0=s.da_t0, kappa=s.da_kappa, t_min=s.da_tmin, low=DA_LOW, high=DA_HIGH)
        return float(da["lambda"]), da

    def fit(self, received: GlobalPrototypes | None, server_round: int, round_seed: int,
            monitor: bool) -> PrototypeReply | PrivatePrototypeReply:
        """Train one round against the ``received`` global prototypes (None in round 1): the local
        prototypes (C×d f32) and class counts (C i64) with the samples and metrics, or under ``privacy``
        the mechanism's release (noisy sums C×d, noisy counts C, the count noise's std; a sample count from
        the noisy counts; ε metrics)."""
        if self.privacy is not None:
            self.privacy.check()  # out of budget: stop before training, saying so
            monitor = False  # the monitors read the training data: not released under DP
        model = self.load_model()
        glob = self.targets(received, model)
        lam, da_state = self.lambda_for_round(server_round, glob)
        data, training = self.data, self.training
        terms = self.method.terms(RoundInputs(self.settings, training, glob, lam, data.classes,
                                              data.classes_from_data))
        for term in terms:
            term.start(model)
        observers = []
        if self.settings.local_protos == "training":
            observers.append(TrainingTimePrototypes(self.num_classes, max(1, data.num_train // training.batch_size)))
        sample = self.privacy if isinstance(self.privacy, SamplePrivacy) else None
        history, trained = train_terms(model, data.x_train, data.y_train, terms, training,
                                       generator=seed_everything(round_seed), device=self.device, sample=sample,
                                       drop_last=data.num_train >= training.batch_size, observers=observers)
        self.store.save_module(self.MODEL_KEY, model)

        y_train = data.y_train.to(self.device)
        counts = torch.bincount(y_train, minlength=self.num_classes)
        sums, seen_counts = (observers[0].sums, observers[0].counts) if observers else (None, None)
        # the extra no-grad pass over the training set: for post-pass prototypes and for the monitors only
        z_train = (self.embed(model, data.x_train) if sums is None or seen_counts is None or monitor
                   or self.privacy is not None else None)
        if sums is not None and seen_counts is not None:
            protos = (sums / seen_counts.clamp_min(1).unsqueeze(1)).float()
            counts = torch.where(seen_counts > 0, counts, torch.zeros_like(counts))
        else:
            assert z_train is not None
            protos, _ = class_means(z_train, y_train, self.num_classes)

        metrics: dict[str, Any] = {"lambda": lam}
        if history:
            last = history[-1]
            metrics["train-loss"] = last.loss
            metrics.update({f"loss-{k}": v for k, v in last.parts.items()})
            if glob is not None and "proto" in last.parts:
                da_state["history"] = (list(da_state["history"]) + [[last.parts["ce"], last.parts["proto"]]])[-3:]
        self.store.save_values(self.DA_KEY, da_state)
        if self.privacy is not None:
            assert z_train is not None
            z_np, y_np = z_train.cpu().numpy(), y_train.cpu().numpy()
            if isinstance(self.privacy, SamplePrivacy):
                assert trained is not None
                released = self.privacy.prototypes(z_np, y_np, self.num_classes)
                dp_metrics = self.privacy.spend(trained)
            else:
                released, dp_metrics = self.privacy.prototypes(z_np, y_np, self.num_classes)
            return PrivatePrototypeReply(released.sums.astype(np.float32), released.counts.astype(np.float32),
                                         float(np.float32(released.count_std)),  # as it travels
                                         max(1, round(float(released.counts.sum()))), dp_metrics)
        if monitor:  # only on rounds the server evaluates
            assert z_train is not None
            metrics.update(self.monitors(model, z_train, glob))
        return PrototypeReply(protos.cpu().numpy().astype(np.float32), counts.cpu().numpy().astype(np.int64),
                              data.num_train, metrics)

    @torch.no_grad()
    def monitors(self, model: SplitModel, z_train: torch.Tensor, glob: PrototypeTargets | None) -> dict[str, float]:
        """Mutual information of the classifier's and the prototypes' predictions on the training set."""
        metrics = {"mi-classifier": mutual_information(torch.softmax(model.head(z_train), dim=1))}
        if glob is not None:  # scale-free temperature τ·m: MSE distances are tiny next to τ alone
            tau = self.settings.tau
            tau_mi = tau * glob.margin if glob.margin > 0 else tau
            metrics["mi"] = mutual_information(prototype_probabilities(z_train, glob.protos, glob.present, tau_mi))
        return metrics

    def evaluate(self, received: GlobalPrototypes | None) -> tuple[float, int, dict[str, Any]]:
        """The private classifier's loss and accuracy on the client's test set, and the nearest-prototype
        accuracy among its own classes once global prototypes exist."""
        model = self.load_model()
        glob = self.targets(received, model)
        x, y = self.data.x_test, self.data.y_test
        loss, acc = evaluate_classifier(model, x, y, self.device)
        metrics: dict[str, Any] = {"accuracy": acc}
        if glob is not None and len(y):
            own = torch.as_tensor(self.data.classes, dtype=torch.long, device=self.device)
            candidates = own[glob.present[own]]
            if len(candidates):
                z = self.embed(model, x)
                pred = candidates[squared_distances(z, glob.protos[candidates]).argmin(dim=1)]
                metrics["proto-accuracy"] = float((pred.cpu() == y).float().mean())
        return float(loss), len(y), metrics
