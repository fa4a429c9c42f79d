"""GLFC family (GLFC, its ablations, FedAvg + iCaRL, Finetune): a growing global model, old models
by version, and the proxy's prototype gradients — every array by name.

| direction | record / key | shape | dtype | notes |
|---|---|---|---|---|
| server → client | ``arrays[<state-dict name>]`` | per entry | per entry | global model state; head of ``num-classes`` rows |
| server → client | ``old-model-1[<state-dict name>]`` | per entry | per entry | slot 1's model, only when ``old1-sent`` |
| server → client | ``old-model-2[<state-dict name>]`` | per entry | per entry | slot 2's model, only when ``old2-sent`` |
| server → client | ``config["server-round"]``, ``["task"]``, ``["round-in-task"]`` | | int | task = (round - 1) // rounds-per-task; round-in-task 0-based |
| server → client | ``config["num-classes"]`` | | int | head size of ``arrays`` = classes seen so far |
| server → client | ``config["transition-slot"]`` | | int | 1 or 2: the slot a client that detects a new task distils from |
| server → client | ``config["old{1,2}-version"]``, ``["old{1,2}-classes"]`` | | int | the slot's version (0 = empty) and head size |
| server → client | ``config["old{1,2}-sent"]`` | | bool | the slot's model is in this message (the node's cached version differs) |
| server → client | ``config["num-tasks"]``, ``["classes-per-task"]``, ``["rounds-per-task"]`` | | int | the task plan |
| server → client | ``config["detect-only"]`` | | bool | evaluate messages only: run task detection on ``arrays``, train nothing |
| server → client | query: ``config["query"]`` | | str | ``"partition-id"``, once per node whose partition is unknown |
| client → server | ``arrays[<state-dict name>]`` | as received | as received | trained state; same keys, finite; ‖reply − broadcast‖ ≤ ``max-update-norm`` · max(‖broadcast‖, 1) |
| client → server | ``proto-grads["g{i}.{param}"]`` | LeNet param | float32 | gradient set i = 0..n-1 (one per new class, n <= classes-per-task); absent without a transition; each set's L2 norm ≤ ``max-grad-norm`` |
| client → server | ``audit-samples["x{i}"]`` | C×H×W | float32 | ``leak-audit`` only: the true perturbed sample behind gradient set i, as the LeNet took it (normalised); finite; one per set |
| client → server | ``audit-samples["y{i}"]`` | 1 | int64 | ``leak-audit`` only: that sample's class, 0 <= y < the LeNet's outputs |
| client → server | ``metrics["num-examples"]`` | | int | training samples (averaging is unweighted) |
| client → server | ``metrics["partition-id"]`` | | int | the node's partition (stream client id); also the whole query reply |
| client → server | ``metrics["old1-version"]``, ``["old2-version"]`` | | int | old-model versions the node has cached now |
| client → server | ``metrics["transition"]`` | | int | 1 when it detected a new task this round, else 0 |

Train messages carry ``arrays``, ``config`` and the old models the node lacks; evaluate messages are
sent only with ``detect-only`` (the official code's every-client task detection) and carry ``arrays``
and ``config``; query messages (``MessageType.QUERY``) carry only ``config``. The number of gradient
sets is read from the ``proto-grads`` keys, never from a metric or the config: no array count travels
in either direction; ``{param}`` are the names of the shared LeNet's ``named_parameters()``. Evaluate
and query replies carry only ``metrics``. ``audit-samples`` (simulations only: it hands the server
the client's images) is refused unless the run sets ``leak-audit``, and then required with every
gradient set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from pollen.protocol.identity import (  # noqa: F401  (the query is part of this family's contract)
    PARTITION_ID,
    QUERY,
    decode_identity_reply,
    encode_identity_reply,
    query_content,
)
from pollen.protocol.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    array_record,
    metric_record,
    reply_content,
)
from pollen.protocol.screening import (
    ArraySpec,
    PayloadBounds,
    check_gradient_norm,
    check_update_norm,
    decode_record,
)

OLD_MODEL = {1: "old-model-1", 2: "old-model-2"}
PROTO_GRADS = "proto-grads"
AUDIT_SAMPLES = "audit-samples"
DETECT_ONLY = "detect-only"
TRANSITION = "transition"
PLAN_KEYS = ("num-tasks", "classes-per-task", "rounds-per-task")
REPLY_RECORDS = frozenset({ARRAYS, PROTO_GRADS, AUDIT_SAMPLES, METRICS})
_GRAD_KEY = re.compile(r"^g(0|[1-9][0-9]*)\.(.+)$")


def grad_key(index: int, param: str) -> str:
    """The ``proto-grads`` key of parameter ``param`` in gradient set ``index``."""
    return f"g{index}.{param}"


@dataclass(frozen=True)
class TaskSchedule:
    """The class-incremental plan the server follows: which round is which task, who exists when.

    ``population[t]`` clients (partitions ``0 .. population[t] - 1``) exist at task ``t``; task ``t``
    brings classes ``t·s .. (t+1)·s - 1`` with ``s = classes_per_task``.
    """

    num_tasks: int
    classes_per_task: int
    rounds_per_task: int
    population: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("num_tasks", "classes_per_task", "rounds_per_task"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        pop = tuple(int(p) for p in self.population)
        if len(pop) != self.num_tasks or pop[0] < 1 or any(b < a for a, b in zip(pop, pop[1:])):
            raise ValueError(f"population must give a non-decreasing client count >= 1 for each of the "
                             f"{self.num_tasks} tasks, got {self.population}")
        object.__setattr__(self, "population", pop)

    @classmethod
    def from_plan(cls, plan: Any, rounds_per_task: int) -> TaskSchedule:
        """From a :class:`pollen.datasets.incremental.StreamPlan` (or anything shaped like it)."""
        return cls(int(plan.config.num_tasks), int(plan.config.classes_per_task), int(rounds_per_task),
                   tuple(int(p) for p in plan.population))

    @property
    def num_clients(self) -> int:
        """The final population: how many nodes / partitions a run needs."""
        return self.population[-1]

    @property
    def num_rounds(self) -> int:
        return self.num_tasks * self.rounds_per_task

    def task_of_round(self, server_round: int) -> int:
        return min(self.num_tasks - 1, max(0, server_round - 1) // self.rounds_per_task)

    def round_in_task(self, server_round: int) -> int:
        return max(0, server_round - 1) % self.rounds_per_task

    def active_clients(self, task: int) -> range:
        return range(self.population[task])

    def seen_classes(self, task: int) -> int:
        return (task + 1) * self.classes_per_task

    def config(self) -> dict[str, int]:
        """The plan keys every GLFC message carries."""
        return dict(zip(PLAN_KEYS, (self.num_tasks, self.classes_per_task, self.rounds_per_task)))


# -- server side ------------------------------------------------------------------------------------
def encode_train_content(model: ArrayRecord, config: ConfigRecord,
                         old_models: Mapping[int, ArrayRecord] | None = None) -> RecordDict:
    """A train message: the global state, the config, and the old models this node lacks."""
    content = RecordDict({ARRAYS: model, CONFIG: config})
    for slot, record in (old_models or {}).items():
        content[OLD_MODEL[slot]] = record
    return content


def gradient_specs(lenet_shapes: Mapping[str, Sequence[int]], num_sets: int) -> list[ArraySpec]:
    return [ArraySpec(grad_key(i, name), tuple(shape), "float32")
            for i in range(num_sets) for name, shape in lenet_shapes.items()]


def decode_gradients(record: Any, lenet_shapes: Mapping[str, Sequence[int]] | None, max_sets: int,
                     max_grad_norm: float = PayloadBounds.max_grad_norm,
                     ) -> tuple[list[dict[str, np.ndarray]] | None, str | None]:
    """Server side: the gradient sets of a ``proto-grads`` record, from its keys, or a reason.

    ``lenet_shapes`` is the shared LeNet's ``{name: shape}`` (``None`` when the method runs no proxy:
    then only an absent or empty record is accepted). At most ``max_sets`` sets; keys and metadata are
    checked before anything is decoded; each set's L2 norm within ``max_grad_norm`` (``max-grad-norm``)
    — so nothing absurd ever reaches the proxy's gradient inversion.
    """
    if record is None:
        return [], None
    if not isinstance(record, ArrayRecord):
        return None, f"'{PROTO_GRADS}': expected an ArrayRecord, got {type(record).__name__}"
    if len(record) == 0:
        return [], None
    if not lenet_shapes:
        return None, f"'{PROTO_GRADS}': {len(record)} gradient arrays sent, but this method runs no proxy"
    per = len(lenet_shapes)
    if len(record) > max_sets * per:
        return None, (f"'{PROTO_GRADS}': {len(record)} arrays, more than {max_sets} gradient sets "
                      f"(classes per task) × {per} LeNet parameters")
    for key in record.keys():
        match = _GRAD_KEY.match(key)
        if match is None or match.group(2) not in lenet_shapes:
            return None, f"'{PROTO_GRADS}': unexpected key '{key[:80]}' (expected g<i>.<LeNet parameter>)"
    if len(record) % per:
        return None, f"'{PROTO_GRADS}': {len(record)} arrays is not a whole number of {per}-array gradient sets"
    num_sets = len(record) // per
    arrays, reason = decode_record(record, gradient_specs(lenet_shapes, num_sets))
    if arrays is None:
        return None, f"'{PROTO_GRADS}': {reason}"
    sets = [{name: arrays[grad_key(i, name)] for name in lenet_shapes} for i in range(num_sets)]
    for i, gset in enumerate(sets):
        reason = check_gradient_norm(f"{PROTO_GRADS}' set 'g{i}", gset.values(), max_grad_norm)
        if reason is not None:
            return None, reason
    return sets, None


@dataclass(frozen=True)
class AuditSpec:
    """What a ``leak-audit`` run expects in ``audit-samples``: the LeNet's input shape and output count."""

    image_shape: tuple[int, ...]
    num_labels: int


def sample_key(index: int) -> tuple[str, str]:
    """The ``audit-samples`` keys (image, label) of the sample behind gradient set ``index``."""
    return f"x{index}", f"y{index}"


def decode_audit(record: Any, audit: AuditSpec | None, num_sets: int
                 ) -> tuple[list[tuple[np.ndarray, int]] | None, str | None]:
    """Server side: the ``(image, label)`` behind each of the reply's ``num_sets`` gradient sets, in set
    order, or a reason. Without ``audit`` (``leak-audit`` off) only an absent or empty record passes."""
    empty = record is None or (isinstance(record, ArrayRecord) and len(record) == 0)
    if audit is None:
        return ([], None) if empty else (None, f"'{AUDIT_SAMPLES}': sent, but this run does not set leak-audit")
    if num_sets == 0:
        return ([], None) if empty else (None, f"'{AUDIT_SAMPLES}': samples sent without gradient sets")
    if empty:
        return None, f"'{AUDIT_SAMPLES}': leak-audit is on, but the {num_sets} gradient set(s) come without their samples"
    specs = [spec for i in range(num_sets) for spec in (
        ArraySpec(sample_key(i)[0], audit.image_shape, "float32"),
        ArraySpec(sample_key(i)[1], (1,), "int64", nonnegative=True, max_value=audit.num_labels - 1))]
    arrays, reason = decode_record(record, specs)
    if arrays is None:
        return None, f"'{AUDIT_SAMPLES}': {reason}"
    return [(arrays[sample_key(i)[0]], int(arrays[sample_key(i)[1]][0])) for i in range(num_sets)], None


class GlfcUpdate(NamedTuple):
    """Server side: one accepted reply: the state by name, the gradient sets by LeNet parameter name and,
    under ``leak-audit``, the sample behind each set."""

    state: dict[str, np.ndarray]
    gradients: list[dict[str, np.ndarray]]
    samples: list[tuple[np.ndarray, int]]


def decode_train_reply(content: RecordDict, model_specs: Sequence[ArraySpec],
                       lenet_shapes: Mapping[str, Sequence[int]] | None, max_sets: int,
                       broadcast: Mapping[str, np.ndarray] | None = None, bounds: PayloadBounds | None = None,
                       audit: AuditSpec | None = None,
                       ) -> tuple[GlfcUpdate | None, str | None]:
    """Server side: ``((state by name, gradient sets, audit samples), None)`` or ``(None, reason naming
    the key)``; the samples (set i's at i) only with ``audit``, else ``[]``.

    With ``broadcast`` (the global state sent this round) the state's update norm is bounded by
    ``bounds.max_update_norm``; every gradient set's norm by ``bounds.max_grad_norm``.
    """
    bounds = bounds if bounds is not None else PayloadBounds()
    extra = [k for k in content.keys() if k not in REPLY_RECORDS]
    if extra:
        return None, f"unexpected record(s) {extra[:5]}"
    state, reason = decode_record(content.get(ARRAYS), model_specs)
    if state is None:
        return None, f"'{ARRAYS}': {reason}"
    if broadcast is not None:
        reason = check_update_norm(state, broadcast, bounds.max_update_norm)
        if reason is not None:
            return None, f"'{ARRAYS}': {reason}"
    grads, reason = decode_gradients(content.get(PROTO_GRADS), lenet_shapes, max_sets, bounds.max_grad_norm)
    if grads is None:
        return None, reason
    samples, reason = decode_audit(content.get(AUDIT_SAMPLES), audit, len(grads))
    if samples is None:
        return None, reason
    return GlfcUpdate(state, grads, samples), None


# -- client side ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainInstruction:
    """What a client reads from a GLFC train (or detect-only evaluate) message."""

    model: dict[str, np.ndarray]  # global state by name, in the order received
    old_models: dict[int, dict[str, np.ndarray]]  # slot -> state by name (only the slots sent)
    config: dict[str, Any]

    @property
    def num_classes(self) -> int:
        return int(self.config["num-classes"])


def decode_train_content(content: RecordDict) -> TrainInstruction:
    """Client side: the global model, the old models sent and the config; ``ValueError`` naming the key."""
    model = content.get(ARRAYS)
    if not isinstance(model, ArrayRecord) or len(model) == 0:
        raise ValueError(f"GLFC message lacks the global model under '{ARRAYS}'")
    config = dict(content.get(CONFIG) or {})
    if "num-classes" not in config:
        raise ValueError("GLFC message lacks config['num-classes']")
    keys = list(model.keys())
    old: dict[int, dict[str, np.ndarray]] = {}
    for slot, name in OLD_MODEL.items():
        if not bool(config.get(f"old{slot}-sent", False)):
            continue
        record = content.get(name)
        if not isinstance(record, ArrayRecord):
            raise ValueError(f"config['old{slot}-sent'] is true but the message has no '{name}' record")
        if sorted(record.keys()) != sorted(keys):
            raise ValueError(f"'{name}' keys differ from the global model's")
        old[slot] = {k: record[k].numpy() for k in keys}
    return TrainInstruction({k: model[k].numpy() for k in keys}, old, config)


@dataclass(frozen=True)
class TrainReply:
    """Client side: the trained state by name, the gradient sets by LeNet parameter name, the metrics, and
    under ``leak-audit`` the sample behind each set (else none)."""

    state: Mapping[str, np.ndarray]
    gradients: Sequence[Mapping[str, np.ndarray]]
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)
    samples: Sequence[tuple[np.ndarray, int]] = ()

    def content(self) -> RecordDict:
        return encode_train_reply(self.state, self.num_examples, self.gradients, self.metrics, self.samples)


def encode_train_reply(state: ArrayRecord | Mapping[str, np.ndarray], num_examples: int,
                       gradients: Sequence[Mapping[str, np.ndarray]] = (),
                       metrics: Mapping[str, Any] | None = None,
                       samples: Sequence[tuple[np.ndarray, int]] = ()) -> RecordDict:
    """Client side: the trained state by name, the gradient sets (``g{i}.{param}``) and the metrics;
    under ``leak-audit`` also the sample behind each set (``samples[i]`` for set i).

    ``metrics`` should carry ``partition-id``, ``old1-version``, ``old2-version`` and ``transition``.
    """
    grads = {grad_key(i, name): np.asarray(g, dtype=np.float32)
             for i, gset in enumerate(gradients) for name, g in gset.items()}
    extra = {PROTO_GRADS: array_record(grads)} if grads else {}
    if samples:
        audit: dict[str, np.ndarray] = {}
        for i, (image, label) in enumerate(samples):
            x_key, y_key = sample_key(i)
            audit[x_key] = np.asarray(image, dtype=np.float32)
            audit[y_key] = np.array([label], dtype=np.int64)
        extra[AUDIT_SAMPLES] = array_record(audit)
    return reply_content(state, num_examples, metrics, **extra)


def encode_evaluate_reply(num_examples: int, metrics: Mapping[str, Any] | None = None) -> RecordDict:
    """Client side: an evaluate (detect-only) reply, metrics only (``transition`` among them)."""
    return RecordDict({METRICS: metric_record(num_examples, metrics)})
