"""``secure-aggregation = true``: the ServerApp's grid becomes a :class:`~pollen.secagg.grid.SecureGrid`, so the
method's own strategy aggregates each train round through SecAgg+ (docs/secure-aggregation.md). The
run keys become one :class:`~pollen.secagg.SecAggConfig`: the payload kind is the method's family, the
weighting the strategy's, the largest weight the strategy's ``max_examples``.

A simulated network (``client-dropout``, slow clients, ``round-timeout``; docs/stragglers.md) acts on the
secure round's stages (:class:`SecureNetwork`), not on the strategy's one training exchange: by the time
that exchange sees a reply, the client is in the sum. On a fleet nothing is simulated and ``round-timeout``
is the wall-clock wait of **each** SecAgg+ stage (:func:`secure_grid`): a node that has not answered a stage
by then drops out at that stage, late, and SecAgg+'s dropout rules decide the round."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Message, MetricRecord
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.privacy.distributed import calibrate
from pollen.protocol.records import METRICS, NUM_EXAMPLES
from pollen.protocol.secagg import COLLECT, STAGES
from pollen.secagg import SecAggConfig
from pollen.secagg.grid import SecureGrid
from pollen.secagg.server import SecureSum
from pollen.settings import RunConfig
from pollen.strategies.exchange import FLEET_FAULTS, is_deployment
from pollen.strategies.network import NetworkModel, close_round, slow_partitions

_VANISH = 4  # the draw of the stage a dropped client vanishes at (pollen.strategies.network uses 1-3)


def vanishing_stage(seed: int, server_round: int, partition: int) -> str:
    """The SecAgg+ stage a client that drops out of ``server_round`` vanishes at: uniform over the four, from
    ``(seed, round, partition)`` alone, so two runs with one seed lose the same clients at the same stages."""
    draw = float(np.random.default_rng([int(seed), _VANISH, int(server_round), int(partition)]).random())
    return STAGES[min(int(draw * len(STAGES)), len(STAGES) - 1)]


class SecureNetwork:
    """The simulated network on a secure round's stages (:class:`~pollen.secagg.grid.StageNetwork`).

    * a client the network drops out of a round (``client-dropout``) vanishes at a stage
      (:func:`vanishing_stage`): it is sent nothing from that stage on. SecAgg+'s rules then apply: gone at
      ``setup`` or ``share-keys`` it is not in the sum; at ``collect`` its masks are rebuilt from its
      neighbours' shares; at ``unmask`` its contribution is in the sum and the others' shares suffice;
    * a masked-input reply (the client trained) arrives at its simulated time (its ``num-examples``, sent
      in clear for the clock, its speed and jitter: :class:`~pollen.strategies.network.NetworkModel`); after
      ``round-timeout`` it is late and held back, so it leaves the sum as a dropout at ``collect``;
    * the round's record is the strategy's ``network`` report (``metrics.jsonl``: simulated round and clock,
      who is missing, why and at which stage); a missing client is not a failure.

    The clock is the strategy's (``sim_clock_s``, in its checkpoint: a resumed run's clock goes on). On a
    fleet (a deployment grid) nothing is simulated — dropouts and speeds are refused — and each stage waits
    ``round-timeout`` of wall time (:func:`secure_grid`); a node that has not answered a stage by then is
    missing, ``late`` at that stage (not a failure), as a plain round's late replies are."""

    timed = True  # False on a fleet: no simulated clock, so no example count travels in clear

    def __init__(self, model: NetworkModel, strategy: Any):
        self.model, self.strategy = model, strategy
        self.fleet = False
        self._slow: frozenset[int] | None = None
        self._round = 0
        self._vanish: dict[int, str] = {}
        self._arrivals: dict[int, float] = {}
        self._late: dict[int, float] = {}

    def _key(self, node: int) -> int:
        pid = self.strategy.partition_of.get(node)
        return pid if pid is not None else node

    def begin(self, server_round: int, grid: Grid, nodes: Sequence[int]) -> None:
        self.fleet = is_deployment(grid)  # simulated faults on a fleet were refused before (secure_grid)
        self.timed = not self.fleet
        self.strategy.identify(server_round, grid, [n for n in nodes if n not in self.strategy.partition_of])
        if self.fleet:
            self._round, self._arrivals, self._late, self._vanish = server_round, {}, {}, {}
            return
        if self._slow is None:
            everyone = sorted(int(n) for n in grid.get_node_ids())
            self._slow = slow_partitions([self._key(n) for n in everyone], self.model.slow_fraction, self.model.seed)
        self._round, self._arrivals, self._late = server_round, {}, {}
        self._vanish = {n: vanishing_stage(self.model.seed, server_round, self._key(n)) for n in nodes
                        if self.model.drops(server_round, self._key(n))}

    def outgoing(self, stage: str, messages: list[Message]) -> list[Message]:
        at = STAGES.index(stage) if stage in STAGES else 0
        return [m for m in messages if int(m.metadata.dst_node_id) not in self._vanish
                or STAGES.index(self._vanish[int(m.metadata.dst_node_id)]) > at]

    def incoming(self, stage: str, replies: list[Message]) -> list[Message]:
        if self.fleet or stage != COLLECT:
            return replies
        kept = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                kept.append(reply)
                continue
            metrics = reply.content.get(METRICS)
            count = metrics.get(NUM_EXAMPLES) if isinstance(metrics, MetricRecord) else None
            examples = int(count) if isinstance(count, (int, float)) and not isinstance(count, bool) else 0
            key = self._key(node)
            at = self.model.duration(self._round, key, examples, key in (self._slow or frozenset()))
            self._arrivals[node] = at
            if self.model.deadline > 0 and at > self.model.deadline:
                self._late[node] = at - self.model.deadline
                continue
            kept.append(reply)
        return kept

    def end(self, server_round: int, train: Sequence[Message], result: SecureSum | None) -> set[int]:
        if self.fleet:
            return self._end_on_fleet(server_round, train, result)
        strategy = self.strategy
        summed = set(result.replies) if result is not None else set()
        missing = []
        arrivals: dict[str, float | None] = {}
        for node in sorted((int(m.metadata.dst_node_id) for m in train), key=strategy.book.order):
            label = strategy.label(node)
            if node in self._vanish and node not in summed:
                arrivals[label] = None
                missing.append({"client": label, "node": node, "why": "dropped", "stage": self._vanish[node],
                                "late-by-s": None, "sim-time-s": None})
            elif node in self._late:
                arrivals[label] = self._arrivals[node]
                missing.append({"client": label, "node": node, "why": "late", "stage": COLLECT,
                                "late-by-s": round(self._late[node], 6),
                                "sim-time-s": round(self._arrivals[node], 6)})
            elif node in self._arrivals:
                arrivals[label] = self._arrivals[node]
        timing = close_round(arrivals, self.model.wait_s(), 1)
        strategy.sim_clock_s += timing.round_s
        gone = {e["node"] for e in missing}
        strategy.replies.outbox = [m for m in strategy.replies.outbox if int(m.metadata.dst_node_id) not in gone]
        strategy.report(server_round).network = {
            "sim-round-s": round(timing.round_s, 6), "sim-clock-s": round(strategy.sim_clock_s, 6),
            "deadline-s": self.model.deadline or None, "arrived": len(timing.arrived),
            "missing": missing, "vanished-in-sum": {strategy.label(n): s for n, s in sorted(self._vanish.items())
                                                    if n in summed}}
        if missing:
            LOGGER.info("secure aggregation round %d: %d of %d sampled client(s) missing (%s); simulated round %.2fs",
                        server_round, len(missing), len(train),
                        ", ".join(f"{e['client']} {e['why']} at {e['stage']}" for e in missing[:8]), timing.round_s)
        return gone

    def _end_on_fleet(self, server_round: int, train: Sequence[Message], result: SecureSum | None) -> set[int]:
        """A fleet's round: who did not answer a stage within ``round-timeout`` is missing, late at that stage."""
        strategy = self.strategy
        silent: dict[int, str] = {}
        if result is not None:
            answered_badly = {(e["node"], e["stage"]) for e in result.failures + result.refused}
            silent = {n: stage for n, stage in result.dropped.items() if (n, stage) not in answered_badly}
        nodes = sorted((int(m.metadata.dst_node_id) for m in train), key=strategy.book.order)
        missing = [{"client": strategy.label(n), "node": n, "why": "late", "stage": silent[n], "late-by-s": None,
                    "sim-time-s": None} for n in nodes if n in silent]
        strategy.replies.outbox = [m for m in strategy.replies.outbox if int(m.metadata.dst_node_id) not in silent]
        strategy.report(server_round).network = {
            "sim-round-s": None, "sim-clock-s": None, "deadline-s": self.model.deadline or None,
            "arrived": len(result.replies) if result is not None else 0, "missing": missing}
        if missing:
            LOGGER.info("secure aggregation round %d: %d of %d sampled client(s) did not answer a stage within "
                        "round-timeout = %gs (%s)", server_round, len(missing), len(train), self.model.deadline,
                        ", ".join(f"{e['client']} at {e['stage']}" for e in missing[:8]))
        return set(silent)


def dp_shape(strategy: Any) -> tuple[int, ...]:
    """The two sizes of a prototype (C, d) or logit (N0, C) contribution, from the strategy; () for weights."""
    if strategy.family == "prototypes":
        return int(strategy.num_classes), int(strategy.embed_dim)
    if strategy.family == "logits":
        return int(strategy.num_public), int(strategy.num_classes)
    return ()


def secagg_config(cfg: RunConfig, strategy: Any) -> SecAggConfig:
    weighting = getattr(strategy, "weighting", "uniform") if strategy.family != "logits" else "uniform"
    dp: dict[str, Any] = {}
    if cfg.dp_mode == "distributed":  # the clients check these against their own run config, and refuse less
        q = cfg.fraction_fit  # each client draws its own participation (pollen.privacy.distributed)
        z = cfg.dp_noise_multiplier or calibrate(cfg.dp_target_epsilon, cfg.dp_delta, q, cfg.num_server_rounds)
        dp = {"clip_dp": cfg.dp_clip, "noise_multiplier_dp": z, "min_honest_dp": cfg.dp_min_honest,
              "sampling_dp": q, "dp_shape": dp_shape(strategy)}
    return SecAggConfig(neighbours=cfg.secagg_neighbours, threshold=cfg.secagg_threshold,
                        clipping_range=cfg.secagg_clipping_range, levels=cfg.secagg_quantization,
                        modulus_bits=cfg.secagg_modulus_bits, max_weight=int(strategy.max_examples),
                        kind=strategy.family, weighting=weighting, min_contributions=cfg.min_train_clients, **dp)


def secure_grid(grid: Grid, cfg: RunConfig, strategy: Any) -> Grid:
    """The grid the strategy runs on: ``grid`` itself, or under secure aggregation a SecureGrid around it,
    with the run's simulated network on its stages and each round's stages recorded in the strategy's report
    (``metrics.jsonl``: ``secure-aggregation``)."""
    if not cfg.secure_aggregation:
        return grid
    model = NetworkModel.of(cfg)
    fleet = is_deployment(grid)
    if fleet and model.faults:
        raise ValueError(FLEET_FAULTS)
    network = SecureNetwork(model, strategy) if model.simulated else None
    config = secagg_config(cfg, strategy)
    if fleet and model.deadline > 0:  # each stage waits round-timeout of wall time, not the strategy's timeout
        config = dataclasses.replace(config, timeout=model.deadline)

    def record(server_round: int, result: SecureSum) -> None:
        strategy.report(server_round).secure = result.summary(strategy.label)

    return SecureGrid(grid, config, network=network, on_round=record)  # type: ignore[return-value]
