"""What every Pollen strategy shares on Flower's Message API, composed from three parts.

:class:`PollenStrategy` is a :class:`flwr.serverapp.strategy.Strategy`; ``strategy.start(grid=...,
initial_arrays=..., num_rounds=...)`` runs it from any ``@app.main()`` ServerApp. Subclasses build the
round's messages (``configure_train``) and combine what passed screening (``aggregate_train``, decoding
each reply through the protocol inside :meth:`PollenStrategy.screen`); no reply reaches that code
unchecked. The parts, each usable and tested without a grid:

* :class:`~pollen.strategies.partitions.PartitionBook` (``strategy.book``): which node may speak for
  which partition — claims, pins, quarantine, the simulation engine's provisional assignment;
* :class:`~pollen.strategies.replies.ReplyScreen` (``strategy.replies``): failures named by destination,
  metrics screened, replies refused with a reason, round reports (:meth:`take_round_report`), and
  :class:`NoTrainingError` when more rounds than ``max_empty_rounds`` trained nobody;
* :class:`~pollen.strategies.sampling.NodeSampler` (``strategy.nodes``): waiting for nodes, drawing a
  sample with the strategy's own RNG, identity queries.

The round loop is :meth:`PollenStrategy.start`; every message of a round goes out and comes back through
one seam, :meth:`PollenStrategy.exchange` (``grid.send_and_receive`` by default): a strategy that runs a
round differently on the wire (secure aggregation, deadlines) overrides that method alone.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from pollen.log import LOGGER
from pollen.protocol.records import ARRAYS, CONFIG
from pollen.protocol.screening import PayloadBounds
from pollen.strategies.aggregation import DEFAULT_TRIM_FRACTION, average_arrays, robust_arrays
from pollen.strategies.exchange import NetworkExchange
from pollen.strategies.network import NetworkModel
from pollen.strategies.options import check_options
from pollen.strategies.partitions import PartitionBook, Quarantine
from pollen.strategies.replies import (
    Accepted,
    Decode,
    MetricsAggrFn,
    NoTrainingError,  # noqa: F401  (importable from here, as before the split)
    ReplyScreen,
    RoundReport,
)
from pollen.strategies.rounds import run_rounds
from pollen.strategies.sampling import NodeSampler
from pollen.strategies.spread import DEFAULT_OUTLIER_FACTOR, check_factor, far_outside, spread_record


class PollenStrategy(Strategy):
    """Base class: sampling, message building, screening and reporting (module docstring).

    Args:
        fraction_train / fraction_evaluate: share of connected nodes sampled per round (as Flower's).
        min_train_nodes / min_evaluate_nodes: at least this many sampled (when connected).
        min_available_nodes: wait for this many nodes before sampling — at most ``node_wait_s``
            seconds, then fail naming both numbers instead of hanging.
        evaluate_every: evaluate every this many rounds and always in round ``num_rounds``.
        max_examples: the largest ``num-examples`` (and class count) a client may claim.
        max_empty_rounds: rounds allowed to train nobody before the run fails.
        seed: seeds this strategy's own sampling RNG (never the global ``random``).
        identify_nodes / query_timeout: ask each node its partition before drawing a fraction, so the same
            seed samples the same partitions (:class:`~pollen.strategies.sampling.NodeSampler`).
        aggregation / trim_fraction: ``mean`` (the family's weighted mean), ``median`` or
            ``trimmed-mean`` (:mod:`pollen.strategies.aggregation`: breakdown points and cost).
        bounds: the declared payload bounds (:class:`~pollen.protocol.screening.PayloadBounds`).
        partition_pins: ``{partition: node id}`` the operator vouches for; a pinned partition is
            served by that node only (:mod:`pollen.strategies.partitions`).
        network: a simulated network (:class:`~pollen.strategies.network.NetworkModel`: dropouts, slow
            clients, a round deadline after which at least ``min_train_nodes`` replies are aggregated);
            on a fleet only its deadline applies, as wall time (:mod:`pollen.strategies.exchange`).
        outlier_factor: a train reply more than this × the round's median size of its family's measure is
            refused (:mod:`pollen.strategies.spread`); 0 turns the rule off.
        train_metrics_aggr_fn / evaluate_metrics_aggr_fn: Flower's: ``fn(contents, "num-examples") ->
            MetricRecord`` replaces the clients' mean ± std; ``contents`` holds one
            ``RecordDict({"metrics": MetricRecord})`` per accepted reply, its metrics as screened.
        weighted_by_key / arrayrecord_key / configrecord_key: Flower's; only the values of Pollen's
            wire contract (``FLOWER_FIXED_OPTIONS``) are accepted.

    Any other keyword is refused with a TypeError that lists the supported ones.
    """

    family = "base"

    def __init__(self, *, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 1, min_evaluate_nodes: int = 1, min_available_nodes: int = 1,
                 evaluate_every: int = 1, num_rounds: int | None = None, max_examples: int = 10_000_000,
                 max_empty_rounds: int = 0, node_wait_s: float = 120.0, seed: int = 0,
                 identify_nodes: bool = False, query_timeout: float | None = None, aggregation: str = "mean",
                 trim_fraction: float = DEFAULT_TRIM_FRACTION, bounds: PayloadBounds | None = None,
                 partition_pins: Mapping[int, int] | None = None, network: NetworkModel | None = None,
                 outlier_factor: float = DEFAULT_OUTLIER_FACTOR,
                 train_metrics_aggr_fn: MetricsAggrFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
                 weighted_by_key: str = "num-examples", arrayrecord_key: str = ARRAYS, configrecord_key: str = CONFIG,
                 **unsupported: Any):
        if unsupported:
            raise TypeError(f"{type(self).__name__} does not support {', '.join(sorted(unsupported))}; "
                            f"its options: {', '.join(self.supported_options())} (docs/strategies.md, "
                            "'Differences from Flower's FedAvg/FedProx')")
        check_options(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                      min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                      min_available_nodes=min_available_nodes, evaluate_every=evaluate_every,
                      max_examples=max_examples, max_empty_rounds=max_empty_rounds, node_wait_s=node_wait_s,
                      aggregation=aggregation, trim_fraction=trim_fraction,
                      fixed={"weighted_by_key": weighted_by_key, "arrayrecord_key": arrayrecord_key,
                             "configrecord_key": configrecord_key},
                      aggr_fns={"train_metrics_aggr_fn": train_metrics_aggr_fn,
                                "evaluate_metrics_aggr_fn": evaluate_metrics_aggr_fn})
        self.aggregation = aggregation
        self.outlier_factor = check_factor(outlier_factor)
        self.trim_fraction = float(trim_fraction)
        self.bounds = bounds if bounds is not None else PayloadBounds()
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.evaluate_every = evaluate_every
        self.num_rounds = num_rounds
        self.max_examples = int(max_examples)
        self.query_timeout = query_timeout
        self.timeout: float | None = None  # start()'s, the default wait for query replies
        self.rng = random.Random(seed)
        self.book = PartitionBook(partition_pins, plan=self.partition_claim_reason)
        self.replies = ReplyScreen(self.book, max_examples=max_examples, max_empty_rounds=max_empty_rounds,
                                   train_metrics_aggr_fn=train_metrics_aggr_fn,
                                   evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        self.nodes = NodeSampler(self.book, self.replies, self.rng, node_wait_s=node_wait_s,
                                 min_available_nodes=min_available_nodes, identify_nodes=identify_nodes)
        # the simulated network (dropouts, slow clients, a round deadline), applied to training exchanges
        self.network = NetworkExchange(network, min_train_nodes) if network is not None and network.simulated else None
        # simulated seconds since round 1: advanced by the simulated network, whichever exchange runs it (the
        # strategy's, or secure aggregation's stages: pollen.app.secure), and kept in the checkpoint
        self.sim_clock_s = 0.0

    @classmethod
    def supported_options(cls) -> list[str]:
        """The keyword options of this class and the classes it builds on, in name order."""
        names: set[str] = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object or not issubclass(klass, PollenStrategy):
                continue
            names.update(p.name for p in inspect.signature(init).parameters.values()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)
        return sorted(names)

    # ------------------------------------------------------------------ the parts, as subclasses use them
    @property
    def node_of(self) -> dict[int, int]:
        """``{partition: node id}``: the one node trusted to serve each partition."""
        return self.book.node_of

    @property
    def partition_of(self) -> dict[int, int]:
        """``{node id: partition}``: each node's (first) claim."""
        return self.book.partition_of

    @property
    def reports(self) -> dict[int, RoundReport]:
        return self.replies.reports

    def quarantined(self) -> Quarantine:
        return self.book.quarantined()

    def label(self, node_id: int) -> str:
        return self.book.label(node_id)

    def report(self, server_round: int) -> RoundReport:
        return self.replies.report(server_round)

    def take_round_report(self, server_round: int) -> RoundReport:
        """The report of ``server_round``, removed from the strategy (rounds are reported once)."""
        return self.replies.take(server_round)

    def partition_claim_reason(self, pid: int) -> str | None:
        """Why a node may not serve partition ``pid`` (``None``: it may); strategies with a plan override it."""
        return None

    def wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        return self.nodes.wait_for_nodes(grid, needed)

    def sample(self, grid: Grid, fraction: float, minimum: int, server_round: int | None = None) -> list[int]:
        return self.nodes.sample(grid, fraction, minimum, server_round, self._query_timeout())

    def identify(self, server_round: int, grid: Grid, node_ids: Iterable[int]) -> None:
        self.nodes.identify(server_round, grid, node_ids, self._query_timeout())

    def _query_timeout(self) -> float | None:
        return self.query_timeout if self.query_timeout is not None else self.timeout

    def screen(self, server_round: int, stage: str, replies: Iterable[Message], decode: Decode) -> list[Accepted]:
        """This round's replies judged (:meth:`ReplyScreen.screen`); the accepted ones in partition order."""
        return self.replies.screen(server_round, stage, replies, decode, self.nodes.live())

    def hold_to_round(self, server_round: int, accepted: Sequence[Accepted],
                      size: Callable[[Any], Mapping[str, float]]) -> list[Accepted]:
        """``accepted`` less the replies far outside the round's spread: ``size(payload)`` gives a reply's
        size per measure (:mod:`pollen.strategies.spread`); each one refused is a WARNING and a rejection."""
        sizes = [size(a.payload) for a in accepted]
        self.report(server_round).spread = spread_record(sizes)
        return self.replies.refuse_outliers(server_round, accepted, far_outside(sizes, self.outlier_factor),
                                            self.outlier_factor)

    def train_metrics(self, server_round: int, accepted: Sequence[Accepted], **extra: float) -> MetricRecord:
        return self.replies.train_metrics(server_round, accepted, **extra)

    def close_train_round(self, server_round: int, accepted: Sequence[Accepted]) -> None:
        self.replies.close_train_round(server_round, accepted)

    def evaluates(self, server_round: int) -> bool:
        return server_round % self.evaluate_every == 0 or server_round == self.num_rounds

    def build_messages(self, server_round: int, node_ids: Sequence[int], message_type: str,
                       content_for: Callable[[int], RecordDict]) -> list[Message]:
        messages = [Message(content=content_for(n), message_type=message_type, dst_node_id=n) for n in node_ids]
        self.replies.sending(server_round, message_type, messages)
        return messages

    @staticmethod
    def round_config(config: ConfigRecord | None, server_round: int, **extra: Any) -> ConfigRecord:
        """A fresh ConfigRecord per message: Flower reuses the caller's ``train_config`` every round."""
        out = ConfigRecord(dict(config or {}))
        out["server-round"] = server_round
        for key, value in extra.items():
            out[key] = value
        return out

    def combine(self, client_arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
        """The accepted clients' arrays combined by the strategy's ``aggregation``: the family's weighted
        mean (``weights``), or the unweighted median / trimmed mean (:mod:`pollen.strategies.aggregation`)."""
        if self.aggregation == "mean":
            return average_arrays(client_arrays, weights)
        return robust_arrays(client_arrays, self.aggregation, self.trim_fraction)

    # ------------------------------------------------------------------ evaluate (shared)
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate <= 0 or not self.evaluates(server_round):
            return []
        nodes = self.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes, server_round)
        content = self.evaluate_content(server_round, arrays, config)
        return self.build_messages(server_round, nodes, MessageType.EVALUATE, lambda _n: content)

    def evaluate_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """What evaluating clients receive; by default the current global arrays."""
        return RecordDict({ARRAYS: arrays, CONFIG: self.round_config(config, server_round)})

    def evaluate_weight(self, accepted: Accepted) -> float:
        """Weight of one client's evaluate metrics: its number of test examples."""
        return float(accepted.num_examples)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        accepted = self.screen(server_round, "evaluate", replies, lambda _m, _x: (None, None))
        if not accepted:
            return None
        out = self.replies.client_metrics(server_round, "evaluate",
                                          [(self.evaluate_weight(a), a) for a in accepted])
        self.report(server_round).evaluate = dict(out)
        return MetricRecord(out)

    def summary(self) -> None:
        LOGGER.info("%r", self)

    # ------------------------------------------------------------------ checkpoint state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(named arrays, JSON-able values)``: everything needed to continue after a restart.

        Partition bindings are not kept: a restarted run's nodes have new node ids and bind anew.
        """
        version, internal, gauss = self.rng.getstate()
        values: dict[str, Any] = {"rng": [version, list(internal), gauss], "empty-rounds": self.replies.empty_rounds}
        if self.network is not None or self.sim_clock_s:
            values["sim-clock-s"] = self.sim_clock_s
        return {}, values

    def restore(self, arrays: dict[str, np.ndarray], values: dict[str, Any]) -> None:
        version, internal, gauss = values["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.replies.empty_rounds = int(values["empty-rounds"])
        self.sim_clock_s = float(values.get("sim-clock-s", 0.0))

    # ------------------------------------------------------------------ the round loop
    def exchange(self, server_round: int, stage: str, messages: Iterable[Message], grid: Grid,
                 timeout: float) -> Iterable[Message]:
        """The seam between a round and the wire: send ``messages`` (``stage``: ``train`` or ``evaluate``)
        and return the replies. Override it to run a round's exchange another way. Training goes through the
        simulated network when the run has one (:mod:`pollen.strategies.exchange`: dropouts, stragglers, the
        round deadline)."""
        if stage == "train" and self.network is not None:
            return self.network.exchange(self, server_round, messages, grid, timeout)
        return grid.send_and_receive(messages=messages, timeout=timeout)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              first_round: int = 1) -> Result:
        """Flower's ``Strategy.start`` loop, able to continue from ``first_round`` (a resumed run):
        :func:`pollen.strategies.rounds.run_rounds`."""
        self.timeout = timeout
        return run_rounds(self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                          evaluate_fn, first_round)
