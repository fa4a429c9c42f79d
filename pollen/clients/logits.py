"""The public-logit family's NumPyClient: a thin adapter from Flower's ``fit``/``evaluate`` to
:class:`pollen.methods.logits.LogitRound` (the method — FCCL, FCCL w/o CON, FedMD, FedDF, SOLO — lives
there; which one is the :class:`~pollen.methods.logit_settings.Recipe` the client is built with).

It reads a :class:`~pollen.protocol.logits.LogitInstruction` and answers with a
:class:`~pollen.protocol.logits.LogitReply`: ``fit``/``evaluate`` are the ``NumPyClient`` boundary, where
Flower's positional parameters become those named values and back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from flwr.common import Context, NDArrays, Scalar

from pollen.clients.base import PollenClient
from pollen.datasets.domain_tasks import PublicSet, public_set
from pollen.datasets.public import PUBLIC_FOLDER
from pollen.methods.logit_settings import FCCL, LogitOptions, Recipe, resolve_settings
from pollen.methods.logits import LogitRound, solo_cache_file
from pollen.privacy.leakage import logit_audit
from pollen.protocol.logits import PUBLIC_DIGEST, LogitInstruction, LogitReply
from pollen.protocol.records import Evaluation
from pollen.settings import from_values


class LogitClient(PollenClient):
    """Private model, SOLO teacher and last round's model in ``context.state``; only public-set
    logits (and, in homogeneous mode, model weights) leave the node."""

    NET = LogitRound.NET
    release_kind = "logits"

    def __init__(self, cfg, node, context: Context, recipe: Recipe = FCCL):
        super().__init__(cfg, node, context)
        self.recipe = recipe
        self.settings = resolve_settings(from_values(LogitOptions, cfg.extra), cfg.profile, self.task)

    def data_sizes(self) -> tuple[tuple[int, ...] | None, int]:
        """The resolved settings' sizes (``fccl-train-sizes``, ``fccl-test-size`` or the profile's); the
        task reads them only when it has built-in domains (``image-domains`` uses every image)."""
        return self.settings.train_sizes, self.settings.test_size

    @functools.cached_property
    def public(self) -> PublicSet:
        """X0, normalised as this client's own data; node config ``public-dir`` beats run key ``fccl-public-dir``."""
        s = self.settings
        folder = (self.node.public_dir or s.public_dir or None) if s.public == PUBLIC_FOLDER else None
        fmt = self.data.fmt or self.task.fmt
        return public_set(s.public, self.node.data_root or self.cfg.data_root, s.public_size, self.cfg.seed, fmt,
                          folder)

    def x_public(self):
        return self.public.inputs

    def _solo_cache_path(self) -> str | None:
        """A file shared by runs that would pretrain the identical SOLO model (benchmarks)."""
        s = self.settings
        if not s.solo_cache:
            return None
        data = s.train_sizes[self.partition_id] if s.train_sizes else self.node.data_dir or self.cfg.data_dir
        model = self.model_spec()
        return solo_cache_file(s.solo_cache, self.cfg.task, self.partition_id, model.name, model.width, self.cfg.seed,
                               s, data, self.cfg.max_train_samples)

    @functools.cached_property
    def core(self) -> LogitRound:
        return LogitRound(self.recipe, self.settings, self.state, self.data, self.x_public, self.task.num_classes,
                          self.task.top_k, self.device, self.new_model, self.cfg.seed, self.partition_id,
                          self._solo_cache_path(), self.payload_privacy())

    def contributed(self, config: Mapping[str, Any]) -> bool:
        """Are this client's last logits in the consensus? By node (``contributed``) or, after a
        restart under a new node id, by partition (``contributor-partitions``)."""
        partitions = config.get("contributor-partitions", [])
        return bool(config.get("contributed", False)) or self.partition_id in [int(p) for p in partitions]

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        reply = self.train(LogitInstruction.from_parameters(parameters, config, self.state_keys()))
        return reply.parameters(), reply.num_examples, dict(reply.metrics)

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        return self.numpy_evaluation(self.test(LogitInstruction.from_parameters(parameters, config, self.state_keys())))

    def train(self, ins: LogitInstruction) -> LogitReply:
        reply = self.core.fit(ins, self.contributed(ins.config))
        metrics = dict(reply.metrics)
        if reply.logits is not None:  # the server refuses logits on a public set other than the federation's
            metrics[PUBLIC_DIGEST] = self.public.digest
            if self.cfg.leak_audit:  # the labels of the client's records, read through the released logits
                metrics.update(logit_audit(self.public.inputs.numpy(), reply.logits, self.data.x_train.numpy(),
                                           self.data.y_train.numpy()))
        return dataclasses.replace(reply, metrics={**self.base_metrics(), **metrics})

    def test(self, ins: LogitInstruction) -> Evaluation:
        loss, num, metrics = self.core.evaluate()
        return Evaluation(loss, num, {**self.base_metrics(), **metrics})


def logit_client(recipe: Recipe):
    """The registry's ``make_client`` for ``recipe``: ``(cfg, node, context) -> LogitClient``."""
    return functools.partial(LogitClient, recipe=recipe)
