"""The class-incremental family's run keys and per-method settings, without torch.

:class:`GlfcOptions` declares the ``glfc-…`` keys, :class:`IncrementalSettings` what distinguishes GLFC
from its ablations; the registry and the launcher's checks read these, and importing
:mod:`pollen.methods.glfc` (the round: torch) for them would make the launcher pay torch's import
(issue 30: start-up cost). GLFC's ServerApp does import torch, when it builds its strategy: its proxy
and its evaluation run models.
"""

from __future__ import annotations

from dataclasses import dataclass

from pollen.datasets.incremental import CLASS_ORDERS, StreamConfig
from pollen.settings import setting

LR_SCHEDULES = ("cosine", "code", "constant")  # a task's learning rate (pollen.methods.incremental_losses)
OLD_MODEL_SOURCES = ("proxy", "previous-task", "none")


@dataclass(frozen=True)
class GlfcOptions:
    """The class-incremental family's run keys (``glfc-…``), each declared once: default, range, help."""

    tasks: int = setting("glfc-tasks", 4, "int >= 1", "T: tasks in the class-incremental stream")
    classes_per_task: int = setting("glfc-classes-per-task", 5, "int >= 1", "s: new classes per task")
    rounds_per_task: int = setting("glfc-rounds-per-task", 2, "int >= 1",
                                   "rounds per task (`num-server-rounds` = T × this)")
    initial_clients: int = setting("glfc-initial-clients", 4, "int >= 1", "clients at the first task")
    new_clients: int = setting("glfc-new-clients", 2, "int >= 0", "clients joining at each new task")
    clients_per_round: int = setting("glfc-clients-per-round", 3, "int >= 1",
                                     "clients sampled per round among those that exist")
    old_fraction: float = setting("glfc-old-fraction", 0.1, "float in [0, 1)",
                                  "fraction of existing clients that keep their old classes at a new task")
    class_fraction: float = setting("glfc-class-fraction", 0.6, "float in (0, 1]",
                                    "fraction of a task's classes a learning client draws")
    duplicate_data: bool = setting("glfc-duplicate-data", False, "bool",
                                   "every client gets all images of its classes (the official code); "
                                   "false = disjoint shards")
    max_per_class: int = setting("glfc-max-per-class", 200, "int >= 0",
                                 "cap on a client's images per class; 0 = no cap")
    class_order: str = setting("glfc-class-order", "label", "choice",
                               "classes in label order or shuffled by the seed", choices=CLASS_ORDERS)
    memory_size: int = setting("glfc-memory-size", 100, "int >= 0", "exemplar memory per client (iCaRL herding)")
    tau: float = setting("glfc-tau", 1.2, "float > 0", "entropy threshold of the task-transition detector (nats)")
    oracle_boundary: bool = setting("glfc-oracle-boundary", False, "bool",
                                    "clients know task boundaries instead of detecting them")
    detect_all_clients: bool = setting("glfc-detect-all-clients", False, "bool",
                                       "every client runs detection every round (the official code); "
                                       "false = sampled clients only")
    lr_schedule: str = setting("glfc-lr-schedule", "cosine", "choice",
                               "learning rate within a task: cosine, the official code's steps, or constant",
                               choices=LR_SCHEDULES)
    herding_distinct: bool = setting("glfc-herding-distinct", True, "bool", "herding never picks an image twice")
    perturb_steps: int = setting("glfc-perturb-steps", 50, "int >= 0",
                                 "steps perturbing a client's class prototypes before sending gradients")
    perturb_lr: float = setting("glfc-perturb-lr", 0.2, "float > 0", "learning rate of that perturbation")
    proxy_iterations: int = setting("glfc-proxy-iterations", 250, "int >= 1",
                                    "proxy server: L-BFGS iterations of gradient inversion")
    proxy_keep: int = setting("glfc-proxy-keep", 20, "int >= 1",
                              "proxy server: iterations whose reconstructions are kept (<= iterations)")
    proxy_lr: float = setting("glfc-proxy-lr", 0.1, "float > 0", "proxy server: L-BFGS learning rate")
    proxy_reset_per_task: bool = setting("glfc-proxy-reset-per-task", True, "bool",
                                         "reset the best-old-model score at each task (false = the official code)")
    proxy_chunk: int = setting("glfc-proxy-chunk", 128, "int >= 1", "proxy server: gradients inverted per batch")
    eval_per_class: int = setting("glfc-eval-per-class", 0, "int >= 0", "server test images per seen class; 0 = all")


@dataclass(frozen=True)
class IncrementalSettings:
    """What distinguishes the GLFC-family methods, plus the stream they run on and the ``glfc-…`` keys the
    round reads (no defaults here: :class:`GlfcOptions` declares them)."""

    task: str
    stream: StreamConfig
    rounds_per_task: int
    clients_per_round: int
    memory_size: int
    tau: float
    oracle_boundary: bool
    lr_schedule: str
    class_order: str
    herding_distinct: bool
    perturb_steps: int
    perturb_lr: float
    objective: str = "glfc"  # glfc | icarl | ce
    use_gc: bool = True
    use_rd: bool = True
    use_memory: bool = True
    old_model: str = "proxy"  # proxy | previous-task | none

    @property
    def shares_gradients(self) -> bool:
        return self.old_model == "proxy"

    @property
    def distils(self) -> bool:
        return self.old_model != "none" and (self.objective == "icarl" or self.use_rd)

    def task_of_round(self, server_round: int) -> int:
        return min(self.stream.num_tasks - 1, max(0, server_round - 1) // self.rounds_per_task)
