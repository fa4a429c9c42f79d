"""The class-incremental family's core: GLFC, its ablations, FedAvg + iCaRL and Finetune, apart from Flower.

One class, :class:`IncrementalRound`, configured by :class:`IncrementalSettings` (the method decides
the objective, whether there is an exemplar memory, which old model to distil from, whether to share
prototype gradients with the proxy). Per round it

1. rebuilds the received global model (head size ``num-classes``) and caches any old model the server
   sent (slots 1 and 2, by version) in ``context.state``;
2. finds its current data from the stream plan (partition ``i`` = stream client ``i``);
3. runs task-transition detection (mean softmax entropy of the global model on its current data
   jumping by more than ``tau``; or the oracle: the first round it sees a new task). On a transition
   the classes it held before become learned classes: old exemplar sets shrink to the new quota
   and the new ones are herded with the received model's features;
4. trains on current data + exemplars with the method's loss (an old model only once it has learned
   classes: on a transition round the slot the server designates — 2 until the task's gradients have
   reached the proxy, then 1 — otherwise slot 1);
5. on a transition (proxy methods), for each current class perturbs the image nearest its feature
   mean and returns the LeNet gradient of ``CE(LeNet(x), c)`` after the model weights.

Everything travels by name, end to end: the core takes the decoded message
(:class:`pollen.protocol.glfc.TrainInstruction`: the global state and the old models sent, each by
state-dict name) and answers with the trained state by name and one LeNet gradient set per new class
(``{parameter name: gradient}``), which :func:`pollen.protocol.glfc.encode_train_reply` puts on the
wire. No array counts travel anywhere. Everything remembered between rounds (learned classes, exemplar
indices, last entropy, held classes, cached old models by name) lives in ``context.state``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pollen.datasets.incremental import (
    client_task_data,
    plan_stream,
    shard_indices,
    stream_data,
)
from pollen.datasets.tasks import get_task
from pollen.datasets.transforms import augment
from pollen.methods.glfc_settings import IncrementalSettings  # declared without torch (the registry reads it)
from pollen.methods.incremental_losses import (
    incremental_loss,
    is_transition,
    learning_rate,
    mean_entropy,
)
from pollen.methods.memory import (
    memory_from_arrays,
    memory_to_arrays,
    nearest_to_mean,
    normalised_features,
    update_memory,
)
from pollen.methods.optim import SGD
from pollen.methods.training import (
    LocalTraining,
    derive_seed,
    load_state,
    model_state,
    predict_logits,
    seed_everything,
    train_epochs,
)
from pollen.models import LeNet, SplitModel, build_model
from pollen.privacy.payload import PayloadPrivacy
from pollen.protocol.glfc import TrainInstruction

Named = dict[str, np.ndarray]  # a model state or a gradient set, by name

def build_stream_model(task: str, model_name: str, num_classes: int, width: float) -> SplitModel:
    src = get_task(task)
    return build_model(model_name, num_classes, in_channels=src.fmt.channels, image_size=src.fmt.size,
                       width=width)


def build_lenet(task: str, seed: int) -> LeNet:
    """The proxy's fixed LeNet: one output per stream class, weights from the run seed (both sides)."""
    src = get_task(task)
    return LeNet(src.num_classes, in_channels=src.fmt.channels, image_size=src.fmt.size, seed=seed)


def perturb_prototype(model: torch.nn.Module, x: torch.Tensor, label: int, num_classes: int, steps: int,
                      lr: float, weight_decay: float = 1e-5) -> torch.Tensor:
    """GLFC's perturbation: ``steps`` SGD steps on the image, lowering the model's BCE towards ``label``."""
    model.eval()
    data = x.detach().clone().unsqueeze(0).requires_grad_(True)
    target = F.one_hot(torch.tensor([label]), num_classes).float().to(data.device)
    opt = SGD([data], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(data), target).backward()
        opt.step()
    return data.detach().squeeze(0)


class IncrementalRound:
    """One client's round of a class-incremental method (see the module docstring), apart from Flower:
    ``store`` keeps what the client remembers, ``new_model(num_classes)`` builds its architecture on its
    device, ``root``/``download`` locate the stream's images, ``seed`` seeds its random streams."""

    STATE = "cil-state"
    MEMORY = "cil-memory"

    def __init__(self, settings: IncrementalSettings, training: LocalTraining, store: Any, partition_id: int,
                 seed: int, device: torch.device, new_model: Callable[[int], SplitModel], root: str | None,
                 download: bool, privacy: PayloadPrivacy | None = None):
        self.privacy = privacy  # dp-mode = payload: the model update and gradient sets are clipped and noisy
        self.settings, self.training, self.store = settings, training, store
        self.partition_id, self.seed, self.device, self.new_model = partition_id, seed, device, new_model
        self.root, self.download = root, download
        self.plan = plan_stream(settings.stream)

    def _train_pool(self):
        return stream_data(self.settings.task, self.root, "train", self.settings.class_order,
                           self.settings.stream.seed, self.download)

    def _old_model(self, slot: int) -> SplitModel | None:
        meta = self.store.load_values(f"old{slot}-meta", {"version": 0, "classes": 0})
        if not meta["version"]:
            return None
        arrays = self.store.load_arrays(f"old{slot}")
        assert arrays is not None  # _cache_old_models saves the arrays with their meta
        model = self.new_model(int(meta["classes"]))
        load_state(model, arrays)
        model.eval()
        return model

    def _cache_old_models(self, old_models: Mapping[int, Mapping[str, np.ndarray]], config: dict) -> None:
        """Keep the old models sent; one not sent must be the one cached (the server believes it is)."""
        for slot in (1, 2):
            if slot not in old_models:
                want = int(config.get(f"old{slot}-version", 0))
                have = int(self.store.load_values(f"old{slot}-meta", {"version": 0})["version"])
                if want and want != have:
                    raise ValueError(f"the server did not send old model {slot} version {want}, believing this node "
                                     f"caches it, but it caches version {have} (its state was lost?); the server "
                                     "sends it again after this failure")
                continue
            self.store.save_arrays(f"old{slot}", old_models[slot])
            self.store.save_values(f"old{slot}-meta", {"version": int(config[f"old{slot}-version"]),
                                                       "classes": int(config[f"old{slot}-classes"])})

    def _load_memory(self, st: dict) -> dict[int, np.ndarray]:
        """The exemplar sets in the order they were made: the training set is built in that order, and a
        state read back from disk (a resumed run) returns its arrays in no fixed order."""
        memory = memory_from_arrays(self.store.load_arrays(self.MEMORY))
        order = [int(c) for c in st.get("memory-order", sorted(memory))]
        if sorted(order) != sorted(memory):
            raise ValueError(f"exemplar memory holds classes {sorted(memory)} but its recorded order is {order}")
        return {c: memory[c] for c in order}

    def _detect(self, model: SplitModel, task: int):
        """Task-transition detection and, on a transition, learned classes + exemplar memory update.

        Returns (transition, state values, memory, current x, current y, current classes, entropy);
        the state and memory are already saved.
        """
        s = self.settings
        st = self.store.load_values(self.STATE, {"learned": [], "held": [], "pending": [], "last-entropy": 0.0,
                                                 "last-task": -1})
        memory = self._load_memory(st)
        classes = list(self.plan.client_classes(self.partition_id, task))
        if not classes:
            raise RuntimeError(f"partition {self.partition_id} was contacted at task {task} but joins later "
                               f"(population {self.plan.population[task]}); the strategy must contact active clients")
        if task != st["last-task"] and classes != st["held"]:
            if st["held"]:  # the classes held before become the ones to learn at the next transition
                st["pending"] = sorted(set(st["pending"]) | set(st["held"]))
            st["held"] = classes
        x_cur, y_cur, _ = client_task_data(s.task, self.plan, self.root, self.partition_id, task,
                                           s.class_order, self.download)
        entropy = mean_entropy(predict_logits(model, x_cur, self.device))
        if s.oracle_boundary:
            transition = task != st["last-task"]
        else:
            transition = is_transition(entropy, float(st["last-entropy"]), s.tau)
        st["last-entropy"] = entropy
        st["last-task"] = task
        if transition and st["pending"]:
            learned_now = [c for c in st["pending"] if c not in st["learned"]]
            st["learned"] = sorted(set(st["learned"]) | set(learned_now))
            st["pending"] = []
            if s.use_memory and learned_now:
                pool = self._train_pool()
                labels = pool.y.numpy()
                new_sets = {}
                for c in learned_now:
                    idx = shard_indices(self.plan, labels, self.partition_id, c)
                    xc, _ = pool.select(idx)
                    new_sets[c] = (idx, normalised_features(model, xc, self.device))
                memory = update_memory(memory, new_sets, s.memory_size, s.herding_distinct)
                self.store.save_arrays(self.MEMORY, memory_to_arrays(memory))
                st["memory-order"] = [int(c) for c in memory]
        self.store.save_values(self.STATE, st)
        return transition, st, memory, x_cur, y_cur, classes, entropy

    # the round ----------------------------------------------------------------------------
    def fit(self, ins: TrainInstruction) -> tuple[Named, list[Named], int, dict[str, Any],
                                                   list[tuple[np.ndarray, int]]]:
        """The round: ``(trained state by name, gradient sets by LeNet parameter name, examples, metrics,
        samples)``; ``samples[i]`` is the perturbed image and class behind gradient set i, which only a
        ``leak-audit`` run sends (to measure the proxy's reconstructions)."""
        s = self.settings
        config = ins.config
        server_round = int(config.get("server-round", 0))
        task = int(config.get("task", s.task_of_round(server_round)))
        num_classes = int(config["num-classes"])
        if self.privacy is not None:
            self.privacy.check()  # out of budget: stop before training, saying so
        generator = seed_everything(derive_seed(self.seed, self.partition_id, server_round, 0))

        model = self.new_model(num_classes)
        load_state(model, ins.model)
        self._cache_old_models(ins.old_models, config)

        transition, st, memory, x_cur, y_cur, classes, entropy = self._detect(model, task)

        # training set: current data + exemplars
        x_train, y_train = x_cur, y_cur
        if s.use_memory and memory:
            ex_idx = np.concatenate([v for v in memory.values()]) if memory else np.zeros(0, np.int64)
            if len(ex_idx):
                x_ex, y_ex = self._train_pool().select(ex_idx)
                x_train, y_train = torch.cat([x_cur, x_ex]), torch.cat([y_cur, y_ex])

        old = None
        if s.distils and st["learned"]:
            slot = int(config.get("transition-slot", 2)) if transition else 1
            old = (self._old_model(slot) if slot == 2 else None) or self._old_model(1)
        learned = list(st["learned"])

        stream = get_task(s.task).stream
        augment_batch = stream is not None and stream.augment

        def loss_fn(m, xb, yb):
            if augment_batch:
                xb = augment(xb, generator, crop_pad=4, hflip=True, brightness=0.247)
            old_logits = None
            if old is not None:
                with torch.no_grad():
                    old_logits = old(xb)
            return incremental_loss(m(xb), yb, objective=s.objective, learned_classes=learned,
                                    old_logits=old_logits, use_gc=s.use_gc, use_rd=s.use_rd)

        round_in_task = int(config.get("round-in-task", 0))
        history = []
        opt = SGD(model.parameters(), lr=self.training.lr, momentum=self.training.momentum,
                  weight_decay=self.training.weight_decay)
        for epoch in range(self.training.epochs):
            lr = learning_rate(s.lr_schedule, self.training.lr, round_in_task=round_in_task,
                               rounds_per_task=s.rounds_per_task, epoch=epoch, epochs=self.training.epochs,
                               global_round=max(0, server_round - 1), first_task=task == 0)
            for group in opt.param_groups:
                group["lr"] = lr
            history += train_epochs(model, x_train, y_train, epochs=1, batch_size=self.training.batch_size,
                                    optimizer=opt, generator=generator, device=self.device, loss_fn=loss_fn)

        grad_sets: list[Named] = []
        samples: list[tuple[np.ndarray, int]] = []
        lenet_names: list[str] = []
        if transition and s.shares_gradients:
            lenet = build_lenet(s.task, self.seed).to(self.device)
            lenet_names = [name for name, _ in lenet.named_parameters()]  # the order lenet.gradient lists
            feats = normalised_features(model, x_cur, self.device)
            for c in classes:
                rows = torch.nonzero(y_cur == c).squeeze(1)
                if len(rows) == 0:
                    continue
                proto = x_cur[rows[nearest_to_mean(feats[rows])]].to(self.device)
                proto = perturb_prototype(model, proto, c, num_classes, s.perturb_steps, s.perturb_lr)
                grads = lenet.gradient(proto, c)
                grad_sets.append({name: g.cpu().numpy().astype(np.float32) for name, g in zip(lenet_names, grads)})
                samples.append((proto.cpu().numpy().astype(np.float32), int(c)))

        self.store.save_values(self.STATE, st)
        metrics = {"task": task, "transition": int(transition), "entropy": entropy,
                   "learned-classes": len(st["learned"]),
                   "exemplars": int(sum(len(v) for v in memory.values())), "distilled": int(old is not None),
                   "old1-version": int(self.store.load_values("old1-meta", {"version": 0})["version"]),
                   "old2-version": int(self.store.load_values("old2-meta", {"version": 0})["version"])}
        trained = model_state(model)
        if self.privacy is not None:  # what the mechanism released; metrics that reveal no data
            released, grad_sets, dp_metrics = self.privacy.glfc(ins.model, trained, grad_sets,
                                                                s.stream.classes_per_task)
            keep = ("task", "old1-version", "old2-version")
            return (released, grad_sets, 1,
                    {**{k: metrics[k] for k in keep}, **dp_metrics}, samples)
        if history:
            metrics["train-loss"] = history[-1].loss
        return trained, grad_sets, int(len(y_train)), metrics, samples

    def evaluate(self, ins: TrainInstruction) -> tuple[float, int, dict[str, Any]]:
        """Accuracy of the global model on this client's current data (the server evaluates globally).

        With ``detect-only`` (the code's every-client-every-round detection, ``glfc-detect-all-clients``)
        the client instead runs task-transition detection and its memory update on the received model;
        under differential privacy its reply then carries no statistic of its data (no transition, entropy,
        class or exemplar count, training-set size).
        """
        config = ins.config
        task = int(config.get("task", 0))
        model = self.new_model(ins.num_classes)
        load_state(model, ins.model)
        if bool(config.get("detect-only", False)):
            transition, st, memory, _, y_cur, _, entropy = self._detect(model, task)
            if self.privacy is not None:  # the client updates its memory; the reply carries nothing of its data
                return 0.0, 1, {}
            return 0.0, int(len(y_cur)), {"transition": int(transition), "entropy": entropy,
                                          "learned-classes": len(st["learned"]),
                                          "exemplars": int(sum(len(v) for v in memory.values()))}
        x, y, _ = client_task_data(self.settings.task, self.plan, self.root, self.partition_id, task,
                                   self.settings.class_order, self.download)
        logits = predict_logits(model, x, self.device)
        loss = float(F.cross_entropy(logits, y)) if len(y) else 0.0
        acc = float((logits.argmax(1) == y).float().mean()) if len(y) else 0.0
        return loss, int(len(y)), {"accuracy": acc}
