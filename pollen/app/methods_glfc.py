"""Registry entries for the class-incremental family: GLFC, its ablations, FedAvg + iCaRL, Finetune.

All share :class:`~pollen.strategies.glfc.IncrementalFedAvg` (Message API) and
:class:`~pollen.clients.glfc.IncrementalClient` (an adapter around
:class:`~pollen.methods.glfc.IncrementalRound`), joined by :data:`GLFC_ADAPTER`, which decodes the
named records of :mod:`pollen.protocol.glfc` for the client and encodes its named answer; the method name picks the
objective, the memory, the old model and the proxy. The strategy learns each node's partition from a
``query`` message, answered by the ClientApp's ``query`` handler. They run on the class-incremental
tasks of :mod:`pollen.datasets.incremental` (``mnist-fmnist-cil``, ``cifar100-cil``). Run keys are prefixed
``glfc-`` (``docs/usage.md``), declared once by :class:`~pollen.methods.glfc_settings.GlfcOptions`.
Start the simulation with ``glfc-initial-clients + (glfc-tasks - 1) · glfc-new-clients`` SuperNodes and
``num-server-rounds = glfc-tasks · glfc-rounds-per-task``.

Importing this module imports no torch (the launcher checks GLFC run configs with it): the keys are
declared in :mod:`pollen.methods.glfc_settings`; the models, the client and the server's test set are
imported where they are built. GLFC's ServerApp does import torch, when it builds its strategy (its
proxy server and its evaluation run models) and its initial model (issue 30: start-up cost).
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord

from pollen.app.method_spec import ClientAdapter, Family, MethodSpec, register_family, register_method, strategy_options
from pollen.datasets.incremental import StreamConfig, StreamError, plan_stream, stream_data
from pollen.datasets.tasks import get_task
from pollen.methods.glfc_settings import GlfcOptions, IncrementalSettings
from pollen.models.spec import choose_model
from pollen.protocol import glfc as protocol
from pollen.settings import ConfigError, Key, RunConfig, declared_keys, from_values
from pollen.strategies.glfc import IncrementalFedAvg, seeded_model

# Its own modules: the proxy server, the iCaRL memory and the losses are apart from the round and the
# strategy for their size (the proxy alone is ~600 lines); the streams are a kind of task (pollen.datasets).
FAMILY = register_family(Family("glfc", "Class-incremental methods", (
    "pollen.protocol.glfc", "pollen.strategies.glfc", "pollen.strategies.proxy", "pollen.methods.glfc_settings",
    "pollen.methods.glfc", "pollen.methods.incremental_losses", "pollen.methods.memory", "pollen.clients.glfc",
    "pollen.app.methods_glfc")))

# The class-incremental family's run keys, declared by its typed options.
GLFC_KEYS: dict[str, Key] = declared_keys(GlfcOptions)

# method -> (objective, use_gc, use_rd, use_memory, old model source)
VARIANTS = {
    "glfc": ("glfc", True, True, True, "proxy"),
    "glfc-wo-gc": ("glfc", False, True, True, "proxy"),
    "glfc-wo-rd": ("glfc", True, False, True, "none"),
    "glfc-wo-proxy": ("glfc", True, True, True, "previous-task"),
    "fedavg-icarl": ("icarl", False, False, True, "previous-task"),
    "finetune": ("ce", False, False, False, "none"),
}
DESCRIPTIONS = {
    "glfc": "GLFC (Dong et al. 2022): L_GC + L_RD, exemplar memory, entropy task detection, proxy server",
    "glfc-wo-gc": "GLFC without class-aware gradient compensation (plain BCE instead of L_GC)",
    "glfc-wo-rd": "GLFC without relation distillation (no old model, so no proxy either)",
    "glfc-wo-proxy": "GLFC without the proxy: distil from the previous task's final global model",
    "fedavg-icarl": "FedAvg + iCaRL: exemplar memory and BCE distillation from the previous task's model",
    "finetune": "Finetune: FedAvg with cross-entropy on the current task only (lower bound)",
}


def options(cfg: RunConfig) -> GlfcOptions:
    return from_values(GlfcOptions, cfg.extra)


def stream_config(cfg: RunConfig) -> StreamConfig:
    o = options(cfg)
    return StreamConfig(
        num_tasks=o.tasks, classes_per_task=o.classes_per_task, initial_clients=o.initial_clients,
        new_clients=o.new_clients, old_fraction=o.old_fraction, class_fraction=o.class_fraction,
        duplicate=o.duplicate_data, max_per_class=o.max_per_class, seed=cfg.seed)


def final_population(cfg: RunConfig) -> int:
    """SuperNodes a GLFC run needs: every client that exists by the last task."""
    stream = stream_config(cfg)
    return stream.initial_clients + (stream.num_tasks - 1) * stream.new_clients


def validate_glfc(cfg: RunConfig) -> None:
    """The task and the stream's sizes, and what the ranges of the ``glfc-…`` keys cannot say, before any
    data is loaded."""
    try:
        stream = stream_config(cfg)
    except StreamError as err:
        raise ConfigError(f"glfc stream keys: {err}") from err
    total = get_task(cfg.task, "class-incremental").num_classes
    if stream.total_classes > total:
        raise ConfigError(f"run config keys 'glfc-tasks' × 'glfc-classes-per-task' = {stream.total_classes} "
                          f"exceeds the {total} classes of task {cfg.task!r}")
    o = options(cfg)
    rounds = o.rounds_per_task
    if cfg.num_server_rounds != stream.num_tasks * rounds:
        raise ConfigError(f"run config key 'num-server-rounds' = {cfg.num_server_rounds} must equal "
                          f"glfc-tasks × glfc-rounds-per-task = {stream.num_tasks * rounds}")
    tau = o.tau
    if not o.oracle_boundary and math.log(stream.classes_per_task) <= tau:
        raise ConfigError(
            f"run config key 'glfc-tau' = {tau}: with {stream.classes_per_task} classes per task the mean "
            f"softmax entropy on a task's data is at most ln({stream.classes_per_task}) = "
            f"{math.log(stream.classes_per_task):.3f} nats, so the first task can never fire the detector; use "
            "more classes per task, a smaller glfc-tau, or glfc-oracle-boundary = true")
    iters, keep = o.proxy_iterations, o.proxy_keep
    if keep > iters:
        raise ConfigError(f"run config key 'glfc-proxy-keep' = {keep!r} is invalid: expected an integer <= "
                          f"glfc-proxy-iterations ({iters})")


def settings_for(cfg: RunConfig) -> IncrementalSettings:
    objective, gc, rd, memory, old = VARIANTS[cfg.method]
    o = options(cfg)
    return IncrementalSettings(
        task=cfg.task, stream=stream_config(cfg), rounds_per_task=o.rounds_per_task,
        clients_per_round=o.clients_per_round, objective=objective, use_gc=gc, use_rd=rd, use_memory=memory,
        old_model=old, memory_size=o.memory_size, tau=o.tau, oracle_boundary=o.oracle_boundary,
        lr_schedule=o.lr_schedule, class_order=o.class_order, herding_distinct=o.herding_distinct,
        perturb_steps=o.perturb_steps, perturb_lr=o.perturb_lr)


def _test_set(cfg: RunConfig):
    per_class = options(cfg).eval_per_class
    cache: dict[int, tuple] = {}

    def seen(num_classes: int):
        if num_classes not in cache:
            data = stream_data(cfg.task, cfg.data_root, "test", options(cfg).class_order, cfg.seed,
                               cfg.download)
            labels = data.y.numpy()
            idx = []
            for c in range(num_classes):
                rows = np.flatnonzero(labels == c)
                idx.append(rows[:per_class] if per_class else rows)
            cache.clear()  # keep one set: the current task's
            cache[num_classes] = data.select(np.concatenate(idx))
        return cache[num_classes]

    return seen


def _model_factory(cfg: RunConfig):
    from pollen.methods.glfc import build_stream_model  # torch: models are built on the server

    spec = choose_model(cfg, get_task(cfg.task))
    return lambda n: build_stream_model(cfg.task, spec.name, n, spec.width)


def make_strategy(cfg: RunConfig) -> IncrementalFedAvg:
    from pollen.methods.glfc import build_lenet  # torch: the proxy's LeNet, the evaluation's models
    from pollen.methods.training import pick_device

    s = settings_for(cfg)
    src = get_task(cfg.task)
    o = options(cfg)
    return IncrementalFedAvg(
        plan=plan_stream(s.stream), rounds_per_task=s.rounds_per_task, clients_per_round=s.clients_per_round,
        make_model=_model_factory(cfg), lenet=build_lenet(cfg.task, cfg.seed) if s.old_model == "proxy" else None,
        test_data=_test_set(cfg), old_model=s.old_model, proxy_iterations=o.proxy_iterations,
        proxy_keep=o.proxy_keep, proxy_lr=o.proxy_lr, proxy_reset_per_task=o.proxy_reset_per_task,
        proxy_chunk=o.proxy_chunk,
        image_shape=(src.fmt.channels, src.fmt.size, src.fmt.size), device=pick_device(cfg.device),
        leak_audit=cfg.leak_audit, image_mean=src.fmt.mean, image_std=src.fmt.std,
        detect_all_clients=o.detect_all_clients, torch_threads=cfg.torch_threads, **strategy_options(cfg))


def initial_arrays(cfg: RunConfig) -> ArrayRecord:
    """The initial global model (head of ``glfc-classes-per-task``), drawn from the run seed exactly as
    the strategy draws its own."""
    model = seeded_model(_model_factory(cfg), options(cfg).classes_per_task, cfg.seed)
    return ArrayRecord(model.state_dict())


def make_client(cfg: RunConfig, node, context):
    from pollen.clients.glfc import IncrementalClient  # torch: on the node, when it first builds a client

    return IncrementalClient(cfg, node, context, settings_for(cfg))


# How a GLFC client's messages reach it: the global model, the old models and the plan by name, its named
# reply out (evaluate messages carry the same records: detect-only).
GLFC_ADAPTER = ClientAdapter(protocol.decode_train_content)


for _name, _desc in DESCRIPTIONS.items():
    register_method(MethodSpec(name=_name, family="glfc", description=_desc, make_strategy=make_strategy,
                               make_client=make_client, adapter=GLFC_ADAPTER, initial_arrays=initial_arrays,
                               required_nodes=final_population,
                               keys=GLFC_KEYS, validate=validate_glfc, task_kinds=("class-incremental",),
                               dp_modes=("payload",), client_evaluation=False,
                               # leak-audit scores the proxy's reconstructions: only methods that run it
                               leak_audit=VARIANTS[_name][4] == "proxy"))
