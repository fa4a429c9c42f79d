"""GLFC-family server on Flower's Message API: unweighted FedAvg over a growing class-incremental
population, plus the proxy.

:class:`IncrementalFedAvg` is a :class:`~pollen.strategies.base.PollenStrategy` (so a
:class:`flwr.serverapp.strategy.Strategy`; ``strategy.start(grid=..., initial_arrays=..., num_rounds=...)``
runs it from any ``@app.main()`` ServerApp). Its wire contract is :mod:`pollen.protocol.glfc`. It

* follows a :class:`~pollen.protocol.glfc.TaskSchedule` (task of each round, clients existing at each
  task) and samples, each round, ``clients_per_round`` nodes among the clients that exist at the
  current task. Flower's simulation has a fixed number of SuperNodes (start it with the final
  population). Which node serves which partition is learned from the ``partition-id`` metric of
  replies (bound for the run by the base class); a node whose partition is still unknown receives one
  ``query`` message (``MessageType.QUERY``) that its ClientApp answers with its partition id — under
  Flower's simulation engine none: the engine's assignment is each node's provisional claim until its
  first reply confirms it (:meth:`~pollen.strategies.base.PollenStrategy.identify`);
* grows the global head by ``classes_per_task`` outputs at each task boundary (old rows kept) and
  averages the sampled clients' full state (BatchNorm statistics included) **unweighted**, as the
  official code does;
* GLFC: runs the proxy — label inference and batched gradient inversion of the clients' LeNet
  gradients (shuffled, so no link to the sender), scoring every new global model on the
  reconstructed set and keeping the best in two slots; baselines/ablations: slot 1 = the previous
  task's final global model;
* with ``leak_audit`` (``leak-audit``, simulations: clients then send the true perturbed sample behind
  each gradient set) scores the proxy's final reconstructions and inferred labels against those samples,
  paired through the shuffle, in [0, 1] — ``leak-psnr``, ``leak-ssim``, ``leak-label-acc`` and their
  ``-floor`` among the round's fit metrics (:func:`pollen.privacy.leakage.reconstruction_audit`);
* sends an old model to a node only when the version it has cached (reported in its metrics) differs
  (a node that failed is sent them again; the versions are kept in checkpoints by partition);
* evaluates the global model server-side (:meth:`evaluate_global`, which Pollen's ServerApp calls
  after every round and for round 0) on the test images of all seen classes, plus one accuracy per
  seen task, average incremental accuracy and forgetting at each task's end;
* with ``detect_all_clients`` (the official code) sends the new global model to every active node that
  was not sampled, as a detect-only ``evaluate`` message, so it runs task detection too;
* screens every reply before use (base class + :func:`pollen.protocol.glfc.decode_train_reply`):
  state keys/shapes/dtypes as the global model and its update norm within ``max-update-norm``,
  gradient sets from their keys (at most ``classes_per_task``), LeNet shapes, float32, finite, each
  set's norm within ``max-grad-norm`` — bad replies are rejected with a reason, and nothing of them
  reaches the proxy;
* combines the accepted states by the strategy's ``aggregation`` (unweighted mean, median or
  trimmed mean: :mod:`pollen.strategies.aggregation`).

torch is imported only inside the methods that need it (model growth, evaluation, the proxy), and
this module is not imported by ``pollen.strategies``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol import glfc as protocol
from pollen.protocol.records import ARRAYS, CONFIG, array_record
from pollen.protocol.screening import (
    ArraySpec,
    MetricBound,
    check_metrics,
    decode_record,
)
from pollen.strategies.base import PollenStrategy
from pollen.strategies.replies import Accepted, NoTrainingError
from pollen.strategies.spread import GRADIENT_NORM, UPDATE_NORM, largest_norm, update_norm

OLD_MODEL_SOURCES = ("proxy", "previous-task", "none")


def model_to_arrays(model) -> list[np.ndarray]:
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def arrays_to_model(model, arrays: Sequence[np.ndarray]):
    import torch

    keys = list(model.state_dict().keys())
    if len(keys) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for a model with {len(keys)} state entries")
    device = next(model.parameters()).device
    model.load_state_dict({k: torch.from_numpy(np.array(a, copy=True)).to(device) for k, a in zip(keys, arrays)})
    return model


def seeded_model(make_model: Callable[[int], Any], num_classes: int, seed: int):
    """``make_model(num_classes)`` with torch's global RNG seeded by ``seed`` — and restored afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_model(num_classes)


def average_forgetting(acc_matrix: Sequence[Sequence[float]]) -> float:
    """Mean over tasks j < T-1 of (best accuracy on task j at an earlier task end) - (final accuracy on j).

    ``acc_matrix[i][j]`` is the accuracy on task j's classes at the end of task i (defined for j <= i).
    """
    t = len(acc_matrix)
    if t < 2:
        return 0.0
    drops = [max(acc_matrix[i][j] for i in range(j, t - 1)) - acc_matrix[t - 1][j] for j in range(t - 1)]
    return float(np.mean(drops))


def aia(seen_accuracy_at_task_end: Sequence[float]) -> float:
    """Average incremental accuracy: mean over tasks of the seen-class accuracy at each task's end."""
    if not seen_accuracy_at_task_end:
        raise ValueError("aia needs at least one task")
    return float(np.mean(seen_accuracy_at_task_end))


class IncrementalFedAvg(PollenStrategy):
    """FedAvg for a class-incremental stream, with GLFC's proxy server as an option (module docstring).

    Args:
        schedule: the task plan (or give ``plan`` — a ``StreamPlan`` — and ``rounds_per_task``).
        clients_per_round: nodes sampled per round among the active ones (GLFC's 10 of the paper).
        make_model: ``num_classes -> torch.nn.Module`` with ``grow_classes``; the global model.
        lenet: the shared, never-trained LeNet of the proxy (``None`` unless ``old_model = "proxy"``).
        test_data: ``num_seen_classes -> (x, y)`` tensors for server-side evaluation (``None``: none).
        old_model: ``proxy`` (GLFC), ``previous-task`` (iCaRL, w/o proxy) or ``none``.
        proxy_*: gradient inversion settings (iterations, iterates kept, L-BFGS lr, chunk size) and
            whether the best score resets at each task.
        image_shape: C×H×W of the images the LeNet takes.
        leak_audit: ``leak-audit``: clients also send the true sample behind each gradient set, and each
            round's fit metrics score the proxy's reconstructions against them (``leak-psnr``...).
        image_mean, image_std: the per-channel normalisation of the LeNet's input (the task's image
            format), undone to compare images in [0, 1]; needed with ``leak_audit``.
        device: where the proxy and evaluation run.
        detect_all_clients: also send unsampled active nodes the new model for task detection.
        torch_threads: torch threads for the proxy and the evaluation (``None``: torch's setting). The
            inversion's numbers depend on it, so a run repeats only on the same count (the app passes
            ``torch-threads``, as its clients use: a launched run then equals an in-process one).
        query_timeout: seconds to wait for query replies (default: ``start()``'s ``timeout``).
        **kwargs: :class:`~pollen.strategies.base.PollenStrategy` options (``seed`` seeds sampling,
            the initial model, head growth and the proxy; ``min_available_nodes``, ``max_empty_rounds``,
            ``max_examples``, ``node_wait_s``...). ``fraction_train`` is not used: ``clients_per_round``
            decides; ``fraction_evaluate`` is not used: evaluation is server-side.
    """

    family = "glfc"

    def __init__(self, *, schedule: protocol.TaskSchedule | None = None, plan: Any = None,
                 rounds_per_task: int | None = None, clients_per_round: int, make_model: Callable[[int], Any],
                 lenet: Any = None, test_data: Callable[[int], tuple[Any, Any]] | None = None,
                 old_model: str = "proxy", proxy_iterations: int = 250, proxy_keep: int = 20,
                 proxy_lr: float = 0.1, proxy_reset_per_task: bool = True, proxy_chunk: int = 128,
                 image_shape: Sequence[int] = (1, 28, 28), device: Any = "cpu", detect_all_clients: bool = False,
                 torch_threads: int | None = None, query_timeout: float | None = None, leak_audit: bool = False,
                 image_mean: Sequence[float] | None = None, image_std: Sequence[float] | None = None, **kwargs):
        if schedule is None:
            if plan is None or rounds_per_task is None:
                raise ValueError("give a TaskSchedule as schedule, or plan and rounds_per_task")
            schedule = protocol.TaskSchedule.from_plan(plan, rounds_per_task)
        if old_model not in OLD_MODEL_SOURCES:
            raise ValueError(f"old_model must be proxy, previous-task or none, got {old_model!r}")
        if old_model == "proxy" and lenet is None:
            raise ValueError("old_model = 'proxy' needs the shared LeNet")
        if leak_audit and (old_model != "proxy" or image_mean is None or image_std is None or test_data is None):
            raise ValueError("leak_audit scores the proxy's reconstructions: it needs old_model = 'proxy', "
                             "the images' image_mean and image_std, and test_data (its class means are the floor)")
        if int(clients_per_round) != clients_per_round or clients_per_round < 1:
            raise ValueError(f"clients_per_round must be an integer >= 1, got {clients_per_round}")
        super().__init__(query_timeout=query_timeout, **kwargs)
        import torch

        from pollen.strategies.proxy import LBFGSSettings, ProxyState

        seed = int(kwargs.get("seed", 0))
        self.schedule = schedule
        self.plan = plan
        self.clients_per_round = int(clients_per_round)
        self.make_model = make_model
        self.device = torch.device(device)
        self.lenet = lenet.to(self.device) if lenet is not None else None
        self.test_data = test_data
        self.old_model = old_model
        self.proxy_iterations = proxy_iterations
        self.proxy_keep = proxy_keep
        self.lbfgs = LBFGSSettings(lr=proxy_lr)
        self.proxy_reset = proxy_reset_per_task
        self.proxy_chunk = proxy_chunk
        self.image_shape = tuple(image_shape)
        self.seed = seed
        self.detect_all_clients = detect_all_clients
        self.torch_threads = torch_threads
        self.proxy_rng = np.random.default_rng([seed, 0x9A0])  # gradient shuffling, dummy seeds
        self.task = 0
        self.num_classes = schedule.classes_per_task
        model = seeded_model(make_model, self.num_classes, seed)
        self.keys = list(model.state_dict().keys())
        self._record: ArrayRecord | None = None
        self._old_records: dict[tuple[int, int], ArrayRecord] = {}
        self._global = model_to_arrays(model)
        self.proxy = ProxyState()
        self.confirmed: dict[int, tuple[int, int]] = {}  # node id -> old-model versions it has cached
        self._cached_at_restore: dict[int, tuple[int, int]] = {}  # partition -> versions, from a checkpoint
        self._sampled: set[int] = set()  # node ids trained this round
        self._noise_warned = False  # the DP noise warning is said once, before the first round trains
        self.acc_rows: dict[int, dict] = {}  # task -> accuracy on seen classes and per task at its end
        self.lenet_shapes = ({name: tuple(p.shape) for name, p in self.lenet.named_parameters()}
                             if self.lenet is not None else None)
        self.audit: protocol.AuditSpec | None = None
        if leak_audit and self.lenet_shapes:
            self.audit = protocol.AuditSpec(self.image_shape, int(list(self.lenet_shapes.values())[-1][0]))
        self.image_mean = None if image_mean is None else tuple(float(m) for m in image_mean)
        self.image_std = None if image_std is None else tuple(float(v) for v in image_std)

    def __repr__(self) -> str:
        s = self.schedule
        return (f"IncrementalFedAvg(old_model={self.old_model}, clients_per_round={self.clients_per_round}, "
                f"tasks={s.num_tasks}×{s.classes_per_task} classes, rounds_per_task={s.rounds_per_task}, "
                f"population={list(s.population)})")

    # helpers ------------------------------------------------------------------------------
    def task_of_round(self, server_round: int) -> int:
        return self.schedule.task_of_round(server_round)

    def transition_slot(self, task: int) -> int:
        """The slot a client that detects a transition distils from.

        ``best_model_2`` while this task's gradients have not arrived yet (it then holds the best model of
        the previous task, as in the code, where every client detects in a task's first round); once they
        have, the slots have rotated and the previous task's best model is ``best_model_1``, so clients
        that first detect the task later (only sampled clients detect, ours) distil from slot 1 as well
        instead of from a model of the current task.
        """
        return 2 if self.proxy.task < task else 1

    @property
    def _global(self) -> list[np.ndarray]:
        """The global model state, in ``self.keys`` order."""
        return self._global_arrays

    @_global.setter
    def _global(self, arrays: list[np.ndarray]) -> None:
        self._global_arrays = [np.asarray(a) for a in arrays]  # numpy scalars (0-d averages) become 0-d arrays
        self._record = None

    def global_record(self) -> ArrayRecord:
        """The current global model state by name (serialised once per change)."""
        if self._record is None:
            self._record = array_record(dict(zip(self.keys, self._global)))
        return self._record

    def model_specs(self) -> list[ArraySpec]:
        """A reply's state must have exactly the global model's names, shapes and dtypes."""
        return [ArraySpec(k, tuple(a.shape), str(a.dtype)) for k, a in zip(self.keys, self._global)]

    def _old_record(self, slot: int, model_slot) -> ArrayRecord:
        key = (slot, int(model_slot.version))
        if key not in self._old_records:
            self._old_records = {k: v for k, v in self._old_records.items() if k[0] != slot}  # keep the latest
            self._old_records[key] = array_record(dict(zip(self.keys, model_slot.arrays)))
        return self._old_records[key]

    def _new_model(self, num_classes: int, arrays: Sequence[np.ndarray]):
        return arrays_to_model(self.make_model(num_classes), arrays)

    def _grow(self, task: int) -> None:
        """Enter ``task``: grow the head to all seen classes; baselines take the last model as the old one."""
        if task <= self.task:
            return
        import torch

        from pollen.strategies.proxy import ModelSlot

        if self.old_model == "previous-task":
            self.proxy.slot1 = ModelSlot([a.copy() for a in self._global], self.num_classes,
                                         self.proxy._next_version())
        model = self._new_model(self.num_classes, self._global)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1009 + task)  # new head rows: reproducible init
            model.grow_classes(self.schedule.seen_classes(task))
        self.num_classes = self.schedule.seen_classes(task)
        self._global = model_to_arrays(model)
        self.task = task

    def adopt_initial(self, initial: ArrayRecord | None) -> None:
        """Start from the caller's ``initial_arrays`` (empty: the strategy's own seeded model).

        They must be the state of ``make_model(classes_per_task)``: same names, shapes and dtypes.
        """
        if initial is None or len(initial) == 0:
            return
        arrays, reason = decode_record(initial, self.model_specs())
        if arrays is None:
            raise ValueError(f"initial_arrays do not match make_model({self.num_classes}): {reason}")
        self._global = [arrays[k] for k in self.keys]

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None, first_round: int = 1):
        """The base loop after adopting ``initial_arrays`` (fresh runs; empty = the strategy's own model).

        A resumed run (``first_round > 1``, after :meth:`restore`) continues from the restored state and
        ignores ``initial_arrays``.
        """
        if first_round == 1:
            self.adopt_initial(initial_arrays)
        self.timeout = timeout
        if self.num_rounds is None:
            self.num_rounds = num_rounds
        if num_rounds != self.schedule.num_rounds:
            LOGGER.warning("GLFC: num_rounds = %d but the plan has %d tasks × %d rounds = %d", num_rounds,
                           self.schedule.num_tasks, self.schedule.rounds_per_task, self.schedule.num_rounds)
        return super().start(grid=grid, initial_arrays=self.global_record(), num_rounds=num_rounds,
                             timeout=timeout, train_config=train_config, evaluate_config=evaluate_config,
                             evaluate_fn=evaluate_fn, first_round=first_round)

    # checkpoint state ---------------------------------------------------------------------
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Global model (``model.<name>``), old-model slots (``old{1,2}.<name>``), the proxy's monitor set
        and best score, the task, the accuracy rows and both RNGs.

        Which old-model versions each partition has cached is kept (``old-models-cached``): a resumed
        run's nodes roll their state back to the checkpoint's round, so they are not sent again what they
        hold, and the run's messages (``bytes-down``) are those of the uninterrupted run.
        """
        arrays, values = super().state()
        arrays.update({f"model.{k}": a for k, a in zip(self.keys, self._global)})
        slots = {}
        for n, slot in ((1, self.proxy.slot1), (2, self.proxy.slot2)):
            if slot.arrays is not None:
                arrays.update({f"old{n}.{k}": a for k, a in zip(self.keys, slot.arrays)})
            slots[str(n)] = {"version": int(slot.version), "classes": int(slot.num_classes)}
        if self.proxy.monitor_x is not None:
            assert self.proxy.monitor_y is not None  # the monitor images come with their labels
            arrays["proxy.monitor-x"] = self.proxy.monitor_x.detach().cpu().numpy()
            arrays["proxy.monitor-y"] = self.proxy.monitor_y.detach().cpu().numpy()
        best = float(self.proxy.best_score)
        values.update({"task": self.task, "num-classes": self.num_classes, "slots": slots,
                       "proxy-task": int(self.proxy.task), "proxy-versions": int(self.proxy.versions),
                       "proxy-best-score": best if np.isfinite(best) else None,
                       "acc-rows": {str(t): row for t, row in self.acc_rows.items()},
                       "proxy-rng": self.proxy_rng.bit_generator.state,
                       "old-models-cached": self._cached_by_partition()})
        return arrays, values

    def _cached_by_partition(self) -> dict[str, list[int]]:
        cached = dict(self._cached_at_restore)  # partitions not trained since a restore keep what they had
        for node, versions in self.confirmed.items():
            pid = self.partition_of.get(node)
            if pid is not None:
                cached[pid] = versions
        return {str(pid): [int(v) for v in versions] for pid, versions in sorted(cached.items())}

    def restore(self, arrays: dict[str, np.ndarray], values: dict[str, Any]) -> None:
        import torch

        from pollen.strategies.proxy import ModelSlot, ProxyState

        super().restore(arrays, values)

        def model(prefix: str) -> list[np.ndarray] | None:
            found = [k for k in self.keys if f"{prefix}.{k}" in arrays]
            if not found:
                return None
            if len(found) != len(self.keys):
                missing = [k for k in self.keys if f"{prefix}.{k}" not in arrays][:5]
                raise ValueError(f"checkpoint '{prefix}' lacks {missing}")
            return [np.asarray(arrays[f"{prefix}.{k}"]) for k in self.keys]

        state = model("model")
        if state is None:
            raise ValueError("checkpoint has no global model (model.<name> arrays)")
        self.task = int(values["task"])
        self.num_classes = int(values["num-classes"])
        self._global = state
        proxy = ProxyState()
        for n in (1, 2):
            meta = values["slots"][str(n)]
            setattr(proxy, f"slot{n}", ModelSlot(model(f"old{n}"), int(meta["classes"]), int(meta["version"])))
        if "proxy.monitor-x" in arrays:
            proxy.monitor_x = torch.from_numpy(np.array(arrays["proxy.monitor-x"], copy=True))
            proxy.monitor_y = torch.from_numpy(np.array(arrays["proxy.monitor-y"], copy=True))
        best = values["proxy-best-score"]
        proxy.best_score = float("-inf") if best is None else float(best)
        proxy.task = int(values["proxy-task"])
        proxy.versions = int(values["proxy-versions"])
        self.proxy = proxy
        self.acc_rows = {int(t): row for t, row in values["acc-rows"].items()}
        self.proxy_rng.bit_generator.state = values["proxy-rng"]
        self.confirmed, self._sampled, self._old_records = {}, set(), {}
        self.book.asked = set()
        # older checkpoints lack it: then every node is sent the old models once more
        self._cached_at_restore = {int(pid): (int(v[0]), int(v[1]))
                                   for pid, v in values.get("old-models-cached", {}).items()}

    # node identity --------------------------------------------------------------------------
    def partition_claim_reason(self, pid: int) -> str | None:
        if pid >= self.schedule.num_clients:
            return (f"partition-id {pid} is outside the plan's {self.schedule.num_clients} clients; "
                    "this node is never sampled")
        return None

    # Strategy API -------------------------------------------------------------------------
    def plan_config(self, config: ConfigRecord | None, server_round: int, task: int, **extra: Any) -> ConfigRecord:
        return self.round_config(config, server_round, task=task, **{"num-classes": self.num_classes},
                                 **self.schedule.config(), **extra)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        task = self.task_of_round(server_round)
        self._grow(task)
        active = self.schedule.active_clients(task)
        nodes = self.wait_for_nodes(grid, max(self.min_available_nodes, len(active)))
        self.identify(server_round, grid, nodes)
        self.book.prune(nodes)  # a claimant that left no longer keeps its partition quarantined
        self.replies.note_quarantine(server_round)  # a quarantined partition is never sampled: say so every round
        connected = set(nodes)
        candidates = sorted(pid for pid in active if self.node_of.get(pid) in connected)
        self._sampled = set()
        if not candidates:
            LOGGER.warning("round %d: none of the %d clients of task %d is connected and identified (%d nodes "
                           "connected, partitions known: %s); start at least %d SuperNodes (the final population)",
                           server_round, len(active), task, len(nodes), sorted(self.node_of),
                           self.schedule.num_clients)
            return []
        chosen = sorted(self.rng.sample(candidates, min(self.clients_per_round, len(candidates))))
        self._sampled = {self.node_of[pid] for pid in chosen}
        for pid in chosen:  # after a restore: the first node serving a partition holds what it held
            if pid in self._cached_at_restore and self.node_of[pid] not in self.confirmed:
                self.confirmed[self.node_of[pid]] = self._cached_at_restore.pop(pid)
        model = self.global_record()
        if self.bounds.dp is not None and not self._noise_warned:
            self._noise_warned = True  # GLFC's releases carry noise σ·clip·√(1 + K) per entry
            warning = self.bounds.dp.model_noise_warning({k: a.numpy() for k, a in model.items()}, len(chosen),
                                                         std_units=float(np.sqrt(1 + self.schedule.classes_per_task)))
            if warning is not None:
                LOGGER.warning("%s", warning)
        slots = (self.proxy.slot1, self.proxy.slot2)

        def content_for(node: int) -> RecordDict:
            have = self.confirmed.get(node, (0, 0))
            extra: dict[str, Any] = {"round-in-task": self.schedule.round_in_task(server_round),
                                     "transition-slot": self.transition_slot(task)}
            send = {}
            for n, slot in ((1, slots[0]), (2, slots[1])):
                sent = slot.arrays is not None and slot.version != have[n - 1]
                extra[f"old{n}-sent"] = bool(sent)
                extra[f"old{n}-version"] = int(slot.version)
                extra[f"old{n}-classes"] = int(slot.num_classes)
                if sent:
                    send[n] = self._old_record(n, slot)
            return protocol.encode_train_content(model, self.plan_config(config, server_round, task, **extra), send)

        return self.build_messages(server_round, [self.node_of[pid] for pid in chosen], MessageType.TRAIN,
                                   content_for)

    def _train_bounds(self) -> dict[str, MetricBound]:
        versions = float(self.proxy.versions)
        return {"old1-version": MetricBound(0, versions, integer=True),
                "old2-version": MetricBound(0, versions, integer=True),
                protocol.TRANSITION: MetricBound(0, 1, integer=True)}

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        answered = {int(m.metadata.src_node_id) for m in replies if not m.has_error()}
        for node in self._sampled - answered:  # it failed or did not answer: what it caches is unknown
            self.confirmed.pop(node, None)
        specs = self.model_specs()
        bounds = self._train_bounds()
        max_sets = self.schedule.classes_per_task
        broadcast = dict(zip(self.keys, self._global))  # the state sent this round: the update bound's base

        def decode(msg: Message, metrics: dict) -> tuple[object, str | None]:
            node = int(msg.metadata.src_node_id)
            if node not in self._sampled:
                return None, "a train reply from a node that was not sampled this round"
            reason = check_metrics(metrics, bounds)
            if reason is not None:
                return None, reason
            decoded, reason = protocol.decode_train_reply(msg.content, specs, self.lenet_shapes, max_sets, broadcast,
                                                          self.bounds.declared(), self.audit)
            dp = self.bounds.dp
            if decoded is not None and dp is not None and dp.bounds_models:
                reason = dp.check_glfc(decoded[0], broadcast, decoded[1], max_sets)
            return (decoded, None) if reason is None else (None, reason)

        def size(update: protocol.GlfcUpdate) -> dict[str, float]:
            out = {UPDATE_NORM: update_norm(update.state, broadcast)}
            if update.gradients:  # the gradient sets it shares (a transition), each a group of LeNet arrays
                out[GRADIENT_NORM] = largest_norm(g.values() for g in update.gradients)
            return out

        accepted = self.hold_to_round(server_round, self.screen(server_round, "train", replies, decode), size)
        pool: list[list[np.ndarray]] = []
        truth: list[tuple[np.ndarray, int]] = []  # leak-audit: truth[i] is the sample behind pool[i]
        lenet_names = list(self.lenet_shapes or {})  # without a proxy, replies carry no gradient sets
        for a in accepted:
            self.confirmed[a.node_id] = (int(a.metrics.get("old1-version", 0)), int(a.metrics.get("old2-version", 0)))
            pool += [[g[name] for name in lenet_names] for g in a.payload.gradients]
            truth += a.payload.samples
        extra: dict[str, Any] = {"task": self.task, "num-classes": self.num_classes}
        if accepted:
            self._global = self.combine([[a.payload.state[k] for k in self.keys] for a in accepted],
                                        [1.0] * len(accepted))
            extra["transitions"] = sum(int(a.metrics.get(protocol.TRANSITION, 0)) for a in accepted)
            if self.old_model == "proxy":
                extra.update(self._run_proxy(server_round, pool, truth))
        metrics = self.train_metrics(server_round, accepted, **extra)
        self.close_train_round(server_round, accepted)
        return (self.global_record() if accepted else None), metrics

    @contextlib.contextmanager
    def _threads(self):
        """torch's thread count set to ``torch_threads`` for the server's own torch work, then restored."""
        import torch

        before = torch.get_num_threads()
        if self.torch_threads is not None and self.torch_threads != before:
            torch.set_num_threads(self.torch_threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _run_proxy(self, server_round: int, pool: list[list[np.ndarray]],
                   truth: Sequence[tuple[np.ndarray, int]] = ()) -> dict[str, Any]:
        with self._threads():
            return self._proxy_round(server_round, pool, truth)

    def to_unit_range(self, images: np.ndarray) -> np.ndarray:
        """LeNet inputs (N×C×H×W, normalised) back to pixels in [0, 1]: ``x·std + mean``, clipped (the
        inversion and the perturbation both leave the pixel range)."""
        if self.image_mean is None or self.image_std is None:
            raise ValueError("to_unit_range needs the strategy's image_mean and image_std")
        mean = np.asarray(self.image_mean, dtype=np.float64).reshape(-1, 1, 1)
        std = np.asarray(self.image_std, dtype=np.float64).reshape(-1, 1, 1)
        return np.clip(np.asarray(images, dtype=np.float64) * std + mean, 0.0, 1.0)

    def leak_metrics(self, reconstructions: np.ndarray, inferred: np.ndarray,
                     truth: Sequence[tuple[np.ndarray, int]]) -> dict[str, float]:
        """``leak-audit``: the proxy's final reconstructions and inferred labels against the true samples
        (pairs in the same order), both in [0, 1] (:func:`pollen.privacy.leakage.reconstruction_audit`).
        Floors: the class-mean images of the server's own test set and 1/K, K the task's classes."""
        from pollen.privacy.leakage import class_mean_images, reconstruction_audit

        assert self.audit is not None and self.test_data is not None
        x, y = self.test_data(self.schedule.seen_classes(self.task))
        means = class_mean_images(self.to_unit_range(np.asarray(x)), np.asarray(y), self.audit.num_labels)
        return reconstruction_audit(self.to_unit_range(np.stack([x for x, _ in truth])),
                                    self.to_unit_range(reconstructions), np.array([y for _, y in truth]),
                                    np.asarray(inferred), means, self.schedule.classes_per_task)

    def _proxy_round(self, server_round: int, pool: list[list[np.ndarray]],
                     truth: Sequence[tuple[np.ndarray, int]] = ()) -> dict[str, Any]:
        from pollen.strategies.proxy import monitor_accuracy, reconstruct_batched

        out: dict[str, Any] = {"proxy-gradients": len(pool)}
        if pool:
            assert self.lenet is not None  # old_model = "proxy" needs the LeNet (checked in __init__)
            order = self.proxy_rng.permutation(len(pool))  # no link between a gradient and its sender
            grads = [pool[i] for i in order]
            seeds = [int(s) for s in self.proxy_rng.integers(0, 2**31 - 1, size=len(grads))]
            rec = reconstruct_batched(self.lenet, grads, self.image_shape, seeds, iterations=self.proxy_iterations,
                                      keep_last=self.proxy_keep, settings=self.lbfgs, chunk=self.proxy_chunk)
            x, y = rec.samples()
            out["proxy-rotated"] = int(self.proxy.receive(self.task, x, y, self.proxy_reset))
            out["proxy-seconds"] = round(rec.seconds, 3)
            out["proxy-matching-loss"] = loss = float(rec.losses.mean())
            if not np.isfinite(loss):
                LOGGER.warning("round %d: the proxy's gradient-matching loss is %s: its reconstructions of this "
                               "round's %d gradient set(s) are unreliable", server_round, loss, len(grads))
            out["proxy-images-per-s"] = len(grads) / max(rec.seconds, 1e-9)
            if self.audit is not None:  # the samples follow their gradients through the shuffle
                out.update(self.leak_metrics(rec.images[:, -1].numpy(), rec.labels.numpy(),
                                             [truth[i] for i in order]))
        model = self._new_model(self.num_classes, self._global).to(self.device)
        score = monitor_accuracy(model, self.proxy.monitor_x, self.proxy.monitor_y, self.device)
        out["proxy-monitor-size"] = 0 if self.proxy.monitor_x is None else len(self.proxy.monitor_x)
        out["proxy-monitor-accuracy"] = float(score)
        out["proxy-new-best"] = int(self.proxy.consider(score, self._global, self.num_classes))
        out["old1-version"] = self.proxy.slot1.version
        out["old2-version"] = self.proxy.slot2.version
        return out

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Nothing by default: the global model is evaluated server-side, on all seen classes.

        With ``detect_all_clients`` (the official code's behaviour) every active node that was not
        sampled this round receives the new global model and runs task-transition detection on it.
        """
        if not self.detect_all_clients:
            return []
        task = self.task_of_round(server_round)
        connected = set(grid.get_node_ids())
        nodes = [self.node_of[pid] for pid in self.schedule.active_clients(task)
                 if self.node_of.get(pid) in connected and self.node_of[pid] not in self._sampled]
        content = RecordDict({ARRAYS: self.global_record(),
                              CONFIG: self.plan_config(config, server_round, task, **{protocol.DETECT_ONLY: True})})
        return self.build_messages(server_round, nodes, MessageType.EVALUATE, lambda _n: content)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        bounds = {protocol.TRANSITION: MetricBound(0, 1, integer=True)}
        accepted = self.screen(server_round, "evaluate", replies, lambda _m, x: (None, check_metrics(x, bounds)))
        if not accepted:
            return None
        out: dict[str, Any] = {"detect-clients": len(accepted),
               "detect-transitions": sum(int(a.metrics.get(protocol.TRANSITION, 0)) for a in accepted)}
        self.report(server_round).evaluate = dict(out)
        return MetricRecord(out)

    def evaluate_global(self, server_round: int, arrays: ArrayRecord | None = None) -> MetricRecord | None:
        """Server-side evaluation of the current global model on the test images of all seen classes.

        ``accuracy`` and ``loss`` on seen classes, ``task{j}-accuracy`` per seen task and, at the end of
        each task, ``aia`` and ``forgetting`` over the tasks so far. ``arrays`` (what Flower passes to
        ``evaluate_fn``) is the same state the strategy holds; the strategy's own copy is evaluated.
        """
        with self._threads():
            return self._evaluate_global(server_round)

    def _evaluate_global(self, server_round: int) -> MetricRecord | None:
        if self.test_data is None:
            return None
        import torch

        task = self.task_of_round(server_round) if server_round > 0 else 0
        if server_round > 0 and task != self.task:
            return None  # the model is from before this task's head growth
        x, y = self.test_data(self.schedule.seen_classes(task))
        model = self._new_model(self.num_classes, self._global).to(self.device)
        model.eval()
        preds, losses = [], []
        with torch.no_grad():
            for i in range(0, len(y), 1024):
                out = model(x[i:i + 1024].to(self.device)).float().cpu()
                preds.append(out.argmax(1))
                losses.append(float(torch.nn.functional.cross_entropy(out, y[i:i + 1024], reduction="sum")))
        pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
        metrics: dict[str, Any] = {"accuracy": float((pred == y).float().mean()) if len(y) else 0.0,
                                   "loss": float(sum(losses) / max(len(y), 1)), "task": task,
                                   "seen-classes": self.schedule.seen_classes(task)}
        s = self.schedule.classes_per_task
        for j in range(task + 1):
            mask = (y >= j * s) & (y < (j + 1) * s)
            metrics[f"task{j}-accuracy"] = float((pred[mask] == y[mask]).float().mean()) if mask.any() else 0.0
        if server_round > 0 and server_round % self.schedule.rounds_per_task == 0:  # the end of a task
            self.acc_rows[task] = {"seen": metrics["accuracy"],
                                   "row": [metrics[f"task{j}-accuracy"] for j in range(task + 1)]}
            done = [self.acc_rows[t] for t in sorted(self.acc_rows)]
            metrics["aia"] = aia([r["seen"] for r in done])
            metrics["forgetting"] = average_forgetting([r["row"] for r in done])
        return MetricRecord(metrics)


__all__ = [
    "Accepted",
    "IncrementalFedAvg",
    "NoTrainingError",
    "aia",
    "arrays_to_model",
    "average_forgetting",
    "model_to_arrays",
    "seeded_model",
]
