"""GLFC-family server: unweighted FedAvg over a growing class-incremental population, plus the proxy.

:class:`IncrementalFedAvg` is a Flower ``Strategy`` that

* knows the stream plan (seeded, the same one clients compute) and samples, each round, only among the
  clients that exist at the current task (``task = (round - 1) // rounds_per_task``). Flower's simulation
  has a fixed number of SuperNodes (start it with the final population); the strategy learns which node
  serves which partition by asking each node once (``get_properties`` → ``partition-id``);
* grows the global head by ``s`` outputs at each task boundary (old rows kept) and averages the sampled
  clients' full state (BatchNorm statistics included) **unweighted**, as the official code does;
* GLFC: runs the proxy — label inference and batched gradient inversion of the clients' LeNet gradients
  (shuffled, so no link to the sender), scoring every new global model on the reconstructed set and
  keeping the best in two slots; baselines/ablations: slot 1 = the previous task's final global model;
* sends an old model to a client only when its cached version (reported back in its metrics) differs;
* evaluates the global model after every round, server-side, on the test images of all seen classes
  (plus one accuracy per seen task, the rows of the accuracy matrix);
* validates every reply: model arrays must match the global model, gradient arrays the LeNet's shapes,
  and be finite; bad replies are dropped with a logged reason.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch
from flwr.common import EvaluateIns, FitIns, FitRes, GetPropertiesIns, Parameters, Scalar, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from pollen.strategies.metrics import mean_std_metrics
from pollen.strategies.proxy import (LBFGSSettings, ProxyState, monitor_accuracy, reconstruct_batched)
from pollen.strategies.validation import ArraySpec, check_arrays, specs_like
from pollen.strategies.legacy import RejectionLog
from pollen.strategies.weights import average_arrays


def model_to_arrays(model: torch.nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def arrays_to_model(model: torch.nn.Module, arrays: Sequence[np.ndarray]) -> torch.nn.Module:
    keys = list(model.state_dict().keys())
    if len(keys) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for a model with {len(keys)} state entries")
    device = next(model.parameters()).device
    model.load_state_dict({k: torch.from_numpy(np.array(a, copy=True)).to(device) for k, a in zip(keys, arrays)})
    return model


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


class IncrementalFedAvg(RejectionLog, Strategy):
    """FedAvg for a class-incremental stream, with GLFC's proxy server as an option (module docstring)."""

    def __init__(self, *, plan, rounds_per_task: int, clients_per_round: int,
                 make_model: Callable[[int], torch.nn.Module], lenet: torch.nn.Module | None,
                 test_data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], old_model: str = "proxy",
                 proxy_iterations: int = 250, proxy_keep: int = 20, proxy_lr: float = 0.1,
                 proxy_reset_per_task: bool = True, proxy_chunk: int = 128, image_shape: Sequence[int] = (1, 28, 28),
                 seed: int = 0, device: torch.device | str = "cpu", partition_timeout: float | None = None,
                 detect_all_clients: bool = False):
        if old_model not in ("proxy", "previous-task", "none"):
            raise ValueError(f"old_model must be proxy, previous-task or none, got {old_model!r}")
        if old_model == "proxy" and lenet is None:
            raise ValueError("old_model = 'proxy' needs the shared LeNet")
        self._init_rejections()
        self.plan = plan
        self.rounds_per_task = rounds_per_task
        self.clients_per_round = clients_per_round
        self.make_model = make_model
        self.lenet = lenet.to(device) if lenet is not None else None
        self.test_data = test_data
        self.old_model = old_model
        self.proxy_iterations = proxy_iterations
        self.proxy_keep = proxy_keep
        self.lbfgs = LBFGSSettings(lr=proxy_lr)
        self.proxy_reset = proxy_reset_per_task
        self.proxy_chunk = proxy_chunk
        self.image_shape = tuple(image_shape)
        self.seed = seed
        self.device = torch.device(device)
        self.partition_timeout = partition_timeout
        self.detect_all_clients = detect_all_clients
        self._sampled: set[int] = set()
        self.rng = np.random.default_rng([seed, 0x9A0])
        self.task = 0
        self.num_classes = plan.config.classes_per_task
        torch.manual_seed(seed)
        self._global = model_to_arrays(make_model(self.num_classes))
        self.proxy = ProxyState()
        self.partitions: dict[str, int] = {}  # Flower node id -> partition id
        self.confirmed: dict[int, tuple[int, int]] = {}  # partition -> cached old-model versions
        self.acc_rows: dict[int, dict] = {}  # task -> accuracy on seen classes and per task at its end
        self.lenet_specs = ([ArraySpec(f"lenet-grad[{i}]", tuple(p.shape)) for i, p in
                             enumerate(self.lenet.parameters())] if self.lenet is not None else [])

    def __repr__(self) -> str:
        return f"IncrementalFedAvg(old_model={self.old_model}, clients_per_round={self.clients_per_round})"

    # helpers ------------------------------------------------------------------------------
    def task_of_round(self, server_round: int) -> int:
        return min(self.plan.config.num_tasks - 1, max(0, server_round - 1) // self.rounds_per_task)

    def transition_slot(self, task: int) -> int:
        """The slot a client that detects a transition distils from.

        ``best_model_2`` while this task's gradients have not arrived yet (it then holds the best model of
        the previous task, as in the code, where every client detects in a task's first round); once they
        have, the slots have rotated and the previous task's best model is ``best_model_1``, so clients
        that first detect the task later (only sampled clients detect, ours) distil from slot 1 as well
        instead of from a model of the current task.
        """
        return 2 if self.proxy.task < task else 1

    def _grow(self, task: int) -> None:
        """Enter ``task``: grow the head to all seen classes; baselines take the last model as the old one."""
        if task <= self.task:
            return
        if self.old_model == "previous-task":
            self.proxy.slot1 = type(self.proxy.slot1)([a.copy() for a in self._global], self.num_classes,
                                                      self.proxy._next_version())
        model = arrays_to_model(self.make_model(self.num_classes), self._global)
        torch.manual_seed(self.seed * 1009 + task)  # new head rows: reproducible init
        model.grow_classes(self.plan.seen_classes(task))
        self.num_classes = self.plan.seen_classes(task)
        self._global = model_to_arrays(model)
        self.task = task

    def _map_partitions(self, client_manager: ClientManager, server_round: int) -> None:
        unknown = [p for cid, p in client_manager.all().items() if cid not in self.partitions]
        if not unknown:
            return

        def ask(proxy: ClientProxy) -> tuple[str, int | None]:
            try:
                res = proxy.get_properties(GetPropertiesIns({}), timeout=self.partition_timeout,
                                           group_id=server_round)
                return proxy.cid, int(res.properties["partition-id"])
            except Exception:  # a node that cannot answer is simply never sampled
                return proxy.cid, None

        with ThreadPoolExecutor(max_workers=min(16, len(unknown))) as pool:
            for cid, pid in pool.map(ask, unknown):
                if pid is not None:
                    self.partitions[cid] = pid

    # Strategy API -------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self._global)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        task = self.task_of_round(server_round)
        self._grow(task)
        need = self.plan.num_clients
        client_manager.wait_for(need, timeout=60)
        self._map_partitions(client_manager, server_round)
        active = set(self.plan.active_clients(task))
        by_pid = {pid: cid for cid, pid in self.partitions.items() if pid in active}
        nodes = client_manager.all()
        candidates = sorted(pid for pid, cid in by_pid.items() if cid in nodes)
        if not candidates:
            raise RuntimeError(f"round {server_round}: none of the {len(active)} clients of task {task} is "
                               f"connected; start at least {need} SuperNodes (the final population)")
        k = min(self.clients_per_round, len(candidates))
        chosen = sorted(random.sample(candidates, k))
        self._sampled = set(chosen)
        out = []
        for pid in chosen:
            arrays = list(self._global)
            config: dict[str, Scalar] = {"server-round": server_round, "task": task,
                                         "round-in-task": (server_round - 1) % self.rounds_per_task,
                                         "num-classes": self.num_classes, "model-arrays": len(self._global),
                                         "transition-slot": self.transition_slot(task)}
            have = self.confirmed.get(pid, (0, 0))
            for i, slot in enumerate((self.proxy.slot1, self.proxy.slot2)):
                n = i + 1
                send = slot.arrays is not None and slot.version != have[i]
                config[f"old{n}-sent"] = bool(send)
                config[f"old{n}-version"] = slot.version
                config[f"old{n}-classes"] = slot.num_classes
                config[f"old{n}-arrays"] = len(slot.arrays) if send else 0
                if send:
                    arrays += slot.arrays
            out.append((nodes[by_pid[pid]], FitIns(ndarrays_to_parameters(arrays), config)))
        return out

    def _split_reply(self, arrays: list[np.ndarray], metrics: dict) -> tuple[list[np.ndarray], list, str | None]:
        n_model = len(self._global)
        reason = check_arrays(arrays[:n_model], specs_like(self._global))
        if reason is not None:
            return [], [], reason
        try:
            num = int(metrics.get("num-gradients", 0))
        except (TypeError, ValueError):
            return [], [], f"num-gradients = {metrics.get('num-gradients')!r} is not an integer"
        rest = arrays[n_model:]
        if num < 0 or num > self.plan.config.classes_per_task:
            return [], [], f"num-gradients = {num} outside 0..{self.plan.config.classes_per_task}"
        per = len(self.lenet_specs)
        if num and per == 0:
            return [], [], f"{num} gradient sets sent, but this method runs no proxy"
        if len(rest) != num * per:
            return [], [], f"{len(rest)} gradient arrays for num-gradients = {num} (expected {num * per})"
        grads = []
        for g in range(num):
            chunk = rest[g * per:(g + 1) * per]
            reason = check_arrays(chunk, self.lenet_specs)
            if reason is not None:
                return [], [], f"gradient set {g}: {reason}"
            grads.append(chunk)
        return arrays[:n_model], grads, None

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted, pool = [], []
        split: dict[int, tuple] = {}

        def check(arrays: list[np.ndarray], res: FitRes) -> str | None:
            model_arrays, grads, reason = self._split_reply(arrays, res.metrics or {})
            if reason is None and res.num_examples <= 0:
                reason = f"num_examples = {res.num_examples} (must be > 0)"
            split[id(res)] = (model_arrays, grads)
            return reason

        for _proxy, _arrays, res in self.screen_replies(server_round, results, check):
            model_arrays, grads = split[id(res)]
            accepted.append((model_arrays, res))
            pool += grads
            if "partition-id" in (res.metrics or {}):
                m = res.metrics
                self.confirmed[int(m["partition-id"])] = (int(m.get("old1-version", 0)), int(m.get("old2-version", 0)))
        metrics: dict[str, Scalar] = {"accepted": len(accepted), "rejected": len(results) - len(accepted),
                                      "failures": len(failures), "task": self.task,
                                      "num-classes": self.num_classes}
        if not accepted:
            return None, metrics
        self._global = average_arrays([a for a, _ in accepted], [1.0] * len(accepted))
        metrics.update(mean_std_metrics([(r.num_examples, r.metrics) for _, r in accepted]))
        metrics["transitions"] = sum(int((r.metrics or {}).get("transition", 0)) for _, r in accepted)
        if self.old_model == "proxy":
            metrics.update(self._run_proxy(server_round, pool))
        return ndarrays_to_parameters(self._global), metrics

    def _run_proxy(self, server_round: int, pool: list[list[np.ndarray]]) -> dict[str, Scalar]:
        out: dict[str, Scalar] = {"proxy-gradients": len(pool)}
        if pool:
            order = self.rng.permutation(len(pool))  # no link between a gradient and its sender
            grads = [pool[i] for i in order]
            seeds = [int(s) for s in self.rng.integers(0, 2**31 - 1, size=len(grads))]
            rec = reconstruct_batched(self.lenet, grads, self.image_shape, seeds, iterations=self.proxy_iterations,
                                      keep_last=self.proxy_keep, settings=self.lbfgs, chunk=self.proxy_chunk)
            x, y = rec.samples()
            out["proxy-rotated"] = int(self.proxy.receive(self.task, x, y, self.proxy_reset))
            out["proxy-seconds"] = round(rec.seconds, 3)
            out["proxy-matching-loss"] = float(rec.losses.mean())
            out["proxy-images-per-s"] = len(grads) / max(rec.seconds, 1e-9)
        model = arrays_to_model(self.make_model(self.num_classes), self._global).to(self.device)
        score = monitor_accuracy(model, self.proxy.monitor_x, self.proxy.monitor_y, self.device)
        out["proxy-monitor-size"] = 0 if self.proxy.monitor_x is None else len(self.proxy.monitor_x)
        out["proxy-monitor-accuracy"] = score
        out["proxy-new-best"] = int(self.proxy.consider(score, self._global, self.num_classes))
        out["old1-version"] = self.proxy.slot1.version
        out["old2-version"] = self.proxy.slot2.version
        return out

    def configure_evaluate(self, server_round, parameters, client_manager):
        """Nothing by default: the global model is evaluated server-side, on all seen classes.

        With ``detect_all_clients`` (the official code's behaviour) every existing client that was not
        sampled this round receives the new global model and runs task-transition detection on it.
        """
        if not self.detect_all_clients:
            return []
        task = self.task_of_round(server_round)
        nodes = client_manager.all()
        by_pid = {pid: cid for cid, pid in self.partitions.items() if cid in nodes}
        config: dict[str, Scalar] = {"server-round": server_round, "task": task, "detect-only": True,
                                     "num-classes": self.num_classes, "model-arrays": len(self._global)}
        ins = EvaluateIns(ndarrays_to_parameters(self._global), config)
        return [(nodes[by_pid[pid]], ins) for pid in self.plan.active_clients(task)
                if pid in by_pid and pid not in self._sampled]

    def aggregate_evaluate(self, server_round, results, failures):
        if not results:
            return None, {}
        return None, {"detect-clients": len(results),
                      "detect-transitions": sum(int((r.metrics or {}).get("transition", 0)) for _, r in results)}

    @torch.no_grad()
    def evaluate(self, server_round: int, parameters: Parameters):
        task = self.task_of_round(server_round) if server_round > 0 else 0
        if server_round > 0 and task != self.task:
            return None  # parameters are from before this task's head growth
        x, y = self.test_data(self.plan.seen_classes(task))
        model = arrays_to_model(self.make_model(self.num_classes), self._global).to(self.device)
        model.eval()
        preds, losses = [], []
        for i in range(0, len(y), 1024):
            out = model(x[i:i + 1024].to(self.device)).float().cpu()
            preds.append(out.argmax(1))
            losses.append(torch.nn.functional.cross_entropy(out, y[i:i + 1024], reduction="sum"))
        pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
        loss = float(sum(losses) / max(len(y), 1))
        metrics: dict[str, Scalar] = {"accuracy": float((pred == y).float().mean()) if len(y) else 0.0,
                                      "task": task, "seen-classes": self.plan.seen_classes(task)}
        s = self.plan.config.classes_per_task
        for j in range(task + 1):
            mask = (y >= j * s) & (y < (j + 1) * s)
            metrics[f"task{j}-accuracy"] = float((pred[mask] == y[mask]).float().mean()) if mask.any() else 0.0
        if server_round > 0 and server_round % self.rounds_per_task == 0:  # the end of a task
            self.acc_rows[task] = {"seen": metrics["accuracy"],
                                   "row": [metrics[f"task{j}-accuracy"] for j in range(task + 1)]}
            done = [self.acc_rows[t] for t in sorted(self.acc_rows)]
            metrics["aia"] = aia([r["seen"] for r in done])
            metrics["forgetting"] = average_forgetting([r["row"] for r in done])
        return loss, metrics
