"""A Grid whose train rounds are SecAgg+ rounds: any Message-API strategy aggregates securely, unchanged.

``strategy.start(grid=SecureGrid(grid, SecAggConfig(kind=...)), ...)``: evaluate and query messages pass
through; a round's train messages go out as one SecAgg+ round (:class:`~pollen.secagg.server.SecAggPlus`,
each message's content the ``collect`` stage's instruction; each stage waits the config's ``timeout``, a
fleet's ``round-timeout``, else the strategy's reply timeout), and what comes back is, for every node
whose contribution is in the sum, a reply in the family's own wire format that carries **the
aggregate** — the secure mean of the family (:func:`~pollen.secagg.payloads.mean_of_sums`) — with that
node's clear metrics. The strategy then screens and averages as always, and its mean of identical
replies is the secure aggregate (Flower's legacy SecAgg+ workflow hands its strategy the aggregate the
same way). ``num-examples`` stays inside the sum: the replies say 1 (for prototypes Σ of the class
weights), so the round's client metrics are unweighted means. Under distributed DP (``clip_dp`` > 0 in the
config) the aggregate is made from the survivors' noisy contributions
(:func:`~pollen.secagg.payloads.dp_aggregate`).

A simulated network (``network``: :class:`StageNetwork`, which Pollen's app makes from its run keys) acts
on each stage below the driver: a client it drops is not sent the stages from the one it vanishes at, and
a masked-input reply it holds back (late on its clock) never reaches the driver, so SecAgg+'s own rules
for missing clients apply — a client gone before sharing its keys is simply not in the sum, one gone
after has its masks rebuilt from its neighbours' shares, down to the threshold. ``on_round(round,
summary)`` receives each round's record (:meth:`SecureSum.summary`: stage bytes, who dropped at which stage).

Before anything is unmasked the grid vets the clear part of every masked reply: a node that claims
another partition than it did before, or a partition another node of the round also claims, is
refused, and its contribution leaves the sum as a dropout's. A node that dropped out (or was refused)
gets an error reply naming the stage, so the strategy records it as a failure; a round that cannot be
unmasked gives every node an error reply with the reason, and the strategy's empty-round rule applies.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol.identity import PARTITION_ID
from pollen.protocol.logits import encode_logit_reply
from pollen.protocol.prototypes import encode_prototype_reply
from pollen.protocol.records import ARRAYS, METRICS, NUM_EXAMPLES, reply_content
from pollen.protocol.secagg import SECAGG, STAGE
from pollen.secagg.payloads import CLASS_WEIGHTS, LOGITS, PROTOTYPES, dp_aggregate, dp_layout, mean_of_sums
from pollen.secagg.server import SecAggConfig, SecAggFailed, SecAggPlus, SecureSum

DROPPED_CODE = 910  # error code of the replies standing in for nodes that dropped out of a secure round


class StageNetwork(Protocol):
    """A network that acts on each SecAgg+ stage of a round (module docstring)."""

    timed: bool  # whether the masked-input replies must carry num-examples in clear (a simulated clock)

    def begin(self, server_round: int, grid: Grid, nodes: Sequence[int]) -> None: ...

    def outgoing(self, stage: str, messages: list[Message]) -> list[Message]: ...

    def incoming(self, stage: str, replies: list[Message]) -> list[Message]: ...

    def end(self, server_round: int, train: Sequence[Message], result: SecureSum | None) -> set[int]:
        """Close the round; the nodes missing by the network's rules (they get no reply: not failures)."""
        ...


class _StageGrid:
    """The grid the driver sends its stages through: the network's rules on the way out and back."""

    def __init__(self, grid: Grid, network: StageNetwork):
        self.grid, self.network = grid, network

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        stage = str(messages[0].content[SECAGG][STAGE]) if messages and SECAGG in messages[0].content else ""
        out = self.network.outgoing(stage, messages)
        replies = list(self.grid.send_and_receive(out, timeout=timeout)) if out else []
        return self.network.incoming(stage, replies)


class SecureGrid:
    """A ``Grid`` (module docstring); every other Grid method is the wrapped grid's."""

    def __init__(self, grid: Grid, config: SecAggConfig, *, network: StageNetwork | None = None,
                 on_round: Callable[[int, SecureSum], None] | None = None):
        self.grid, self.config, self.network, self.on_round = grid, config, network, on_round
        self.claims: dict[int, int] = {}  # node -> the partition it first claimed in a secure round
        self.last: SecureSum | None = None  # the last round's sum, for reports and tests

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        other = [m for m in messages if m.metadata.message_type != MessageType.TRAIN]
        replies = list(self.grid.send_and_receive(other, timeout=timeout)) if other else []
        return replies + (self._secure_round(train, timeout) if train else [])

    # ----------------------------------------------------------------------------------------------
    def _secure_round(self, train: list[Message], timeout: float | None) -> list[Message]:
        by_node = {int(m.metadata.dst_node_id): m for m in train}
        server_round = _round_of(train[0])
        # each stage waits the config's own timeout (a fleet's round-timeout), else the strategy's
        stage_wait = self.config.timeout if self.config.timeout is not None else timeout
        driver = SecAggPlus(dataclasses.replace(self.config, timeout=stage_wait))
        cfg = self.config
        grid: Any = self.grid
        if self.network is not None:
            self.network.begin(server_round, self.grid, sorted(by_node))
            grid = _StageGrid(self.grid, self.network)
        try:
            try:  # distributed DP: the server states the contributions' layout before anyone trains
                layout = dp_layout(cfg.kind, train[0].content, cfg.dp_shape) if cfg.clip_dp > 0 else None
            except ValueError as err:
                raise SecAggFailed(str(err)) from None
            result = driver.aggregate(grid, {n: m.content for n, m in by_node.items()}, server_round=server_round,
                                      vet=self._vet, layout=layout,
                                      timed=self.network is not None and self.network.timed)
        except SecAggFailed as err:
            LOGGER.warning("round %d not aggregated: %s", server_round, err)
            partial = getattr(driver, "result", None)
            gone = self.network.end(server_round, train, partial) if self.network is not None else set()
            if self.on_round is not None and partial is not None:
                self.on_round(server_round, partial)
            return [Message(Error(code=DROPPED_CODE, reason=f"secure aggregation failed: {err}"), reply_to=m)
                    for m in train if int(m.metadata.dst_node_id) not in gone]
        self.last = result
        gone = self.network.end(server_round, train, result) if self.network is not None else set()
        if self.on_round is not None:
            self.on_round(server_round, result)
        aggregate = self._aggregate(result, train[0])
        out = []
        for node, msg in by_node.items():
            if node in gone and node not in result.replies:  # missing by the network's rules: no reply
                continue
            if node in result.replies:
                content = self._reply(aggregate, msg, result.replies[node].content.get(METRICS))
                out.append(Message(content, reply_to=msg))
                continue
            why = next((r["reason"] for r in result.refused if r["node"] == node), None)
            stage = result.dropped.get(node, "collect")
            reason = (f"secure aggregation: refused at stage {stage!r}: {why}" if why
                      else f"secure aggregation: no reply at stage {stage!r}")
            out.append(Message(Error(code=DROPPED_CODE, reason=reason), reply_to=msg))
        return out

    def _aggregate(self, result: SecureSum, msg: Message) -> dict[str, np.ndarray]:
        """The family's aggregate from the sums (under distributed DP from the noisy sums of the survivors)."""
        cfg = self.config
        if cfg.clip_dp <= 0:
            return mean_of_sums(cfg.kind, result.sums)
        broadcast = msg.content.get(ARRAYS)
        base = {k: a.numpy() for k, a in broadcast.items()} if isinstance(broadcast, ArrayRecord) else {}
        step = 2 * cfg.clipping_range / cfg.levels
        size = sum(p.size for p in result.layout)
        m = len(result.survivors)  # each added its noise share; each contributed its update with probability q
        noise_std = cfg.noise_multiplier_dp * (cfg.clip_dp / step + size ** 0.5 / 2) * step * (
            m / max(cfg.min_honest_dp, 1)) ** 0.5
        return dp_aggregate(cfg.kind, result.sums, cfg.sampling_dp * m, cfg.clip_dp, base, noise_std)

    def _vet(self, replies: dict[int, Message]) -> dict[int, str]:
        """Partition claims in clear, judged before unmasking (module docstring)."""
        claimed: dict[int, int] = {}
        for node, reply in replies.items():
            metrics = reply.content.get(METRICS)
            value = metrics.get(PARTITION_ID) if isinstance(metrics, MetricRecord) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value):
                claimed[node] = int(value)
        twice = {p for p, c in Counter(claimed.values()).items() if c > 1}
        out = {}
        for node, pid in claimed.items():
            first = self.claims.setdefault(node, pid)
            if first != pid:
                out[node] = f"claims partition {pid}, after partition {first} in an earlier round"
            elif pid in twice:
                others = sorted(n for n, p in claimed.items() if p == pid and n != node)
                out[node] = f"partition {pid} is also claimed by node(s) {others} this round"
        return out

    def _reply(self, aggregate: dict[str, np.ndarray], msg: Message, metrics: Any) -> RecordDict:
        clear = {k: v for k, v in (metrics or {}).items() if k != NUM_EXAMPLES}  # the clock's count stays here
        kind = self.config.kind
        if kind == "prototypes":
            weights = aggregate[CLASS_WEIGHTS]
            return encode_prototype_reply(aggregate[PROTOTYPES].astype(np.float32), weights, clear,
                                          num_examples=max(1, int(np.sum(weights))))
        if kind == "logits":
            return encode_logit_reply(aggregate[LOGITS].astype(np.float32), 1, clear)
        broadcast = msg.content.get(ARRAYS)
        dtypes = {k: a.numpy().dtype for k, a in broadcast.items()} if isinstance(broadcast, ArrayRecord) else {}
        arrays = {k: _cast(v, dtypes.get(k, np.dtype(np.float32))) for k, v in aggregate.items()}
        return reply_content(arrays, 1, clear)


def _cast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Back to the broadcast's dtype; integers rounded and clipped so they never wrap."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.asarray(np.clip(np.rint(value), info.min, info.max)).astype(dtype)
    return np.asarray(value).astype(dtype)


def _round_of(msg: Message) -> int:
    config = msg.content.get("config")
    value = config.get("server-round", 0) if config is not None else 0
    return int(value) if isinstance(value, (int, float)) else 0
