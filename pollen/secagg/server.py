"""The server's side of SecAgg+: drive one round's four stages over any Flower ``Grid``, learn only the sum.

:class:`SecAggPlus` takes the train instruction a strategy built for each sampled node and returns the
sum of what the nodes that finished replied (:class:`SecureSum`), never one node's contribution:

1. ``setup``: parameters out, two fresh public keys back per node;
2. ``share-keys``: each node gets its neighbours' keys on a k-regular graph (a shuffled ring, each node
   joined to the ``neighbours`` nearest) and seals Shamir shares of its mask seed and mask key to each;
3. ``collect``: the sealed shares are forwarded with the train instruction; each node trains, masks its
   integer parts with its self mask and one pairwise mask per neighbour, and replies with that vector;
4. ``unmask``: survivors hand in shares of the survivors' seeds and of the dropped nodes' keys; the
   server rebuilds them (``threshold`` shares each, checked against the seed's commitment and the key's
   public half), removes the self masks and the dropped nodes' pairwise masks, and reads the sum.

A node that does not answer a stage, answers with an error, or whose reply is refused drops out at
that stage and the round goes on: every secret that must be rebuilt needs ``threshold`` live holders,
so with the complete graph up to N − t drops are recovered. When one cannot be, the round fails with
:class:`SecAggFailed` naming the stage, the node and the counts. Refused replies — a stage not asked
for, another session, a second reply from one node, a reply from a node not asked, malformed keys,
shares or vectors, a layout unlike the round's — are logged as WARNINGs and kept in
:attr:`SecureSum.refused`.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pollen.log import LOGGER
from pollen.protocol.records import record_bytes
from pollen.protocol.secagg import (
    COLLECT,
    SECAGG,
    SETUP,
    SHARE_KEYS,
    UNMASK,
    Collect,
    Layout,
    MaskedInput,
    PublicKeys,
    Refused,
    SealedShares,
    Setup,
    ShareKeys,
    Shares,
    Unmask,
    decode_reply,
    encode,
)
from pollen.secagg import crypto, payloads
from pollen.secagg import field as ring
from pollen.secagg.client import pairwise_sign
from pollen.settings.common import SecureAggregationKeys


class SecAggFailed(RuntimeError):
    """The round could not be aggregated securely (too many drops, a secret that does not rebuild)."""


@dataclass(frozen=True)
class SecAggConfig:
    """SecAgg+ parameters (docs/secure-aggregation.md says how to size them).

    neighbours: each node's neighbours on the graph (rounded up to even; all others when N − 1 or less).
    threshold: the share of a node's neighbourhood (itself included) needed to rebuild its secrets,
        in (1/2, 1]: t = ceil(threshold · (neighbours + 1)), at least 2.
    clipping_range / levels: values are clipped to ±clipping_range and rounded to 2·clipping_range/levels.
    modulus_bits: the ring is integers modulo 2^modulus_bits (8..64).
    max_weight: the largest weight (num-examples, a class count) a node may contribute.
    kind / weighting: what a reply contributes (:mod:`pollen.secagg.payloads`).
    timeout: seconds each stage waits for replies (None: until every node answered or failed); a node that
        has not answered by then drops out at that stage.
    min_contributions: the fewest contributions a round may sum (a run's ``min-train-clients``): a round left
        with fewer nodes at any stage fails there, so nobody trains for a sum that will not be read.
    """

    neighbours: int = SecureAggregationKeys.secagg_neighbours
    threshold: float = SecureAggregationKeys.secagg_threshold
    clipping_range: float = SecureAggregationKeys.secagg_clipping_range
    levels: int = SecureAggregationKeys.secagg_quantization
    modulus_bits: int = SecureAggregationKeys.secagg_modulus_bits
    max_weight: int = 10_000_000  # the strategies' max_examples
    kind: str = "weights"
    weighting: str = payloads.SAMPLES
    timeout: float | None = None
    min_contributions: int = 1  # fewer nodes left at any stage: the round fails (nothing of it is unmasked)
    clip_dp: float = 0.0  # > 0: distributed DP (pollen.privacy.distributed), the parameters every node checks
    noise_multiplier_dp: float = 0.0
    min_honest_dp: int = 0
    sampling_dp: float = 1.0  # each node's probability of contributing its update (its own secret draw)
    dp_shape: tuple[int, ...] = ()  # distributed DP on prototypes (C, d) or logits (N0, C): the contribution's sizes

    def __post_init__(self):
        if isinstance(self.neighbours, bool) or not isinstance(self.neighbours, int) or self.neighbours < 2:
            raise ValueError(f"secagg-neighbours must be a whole number >= 2, got {self.neighbours!r}")
        if not 0.5 < self.threshold <= 1.0:
            raise ValueError(f"secagg-threshold must be in (0.5, 1], got {self.threshold!r}: at or below one "
                             "half a server could gather both secrets of a node")
        ring.check_bits(self.modulus_bits)
        if self.kind not in payloads.KINDS or self.weighting not in payloads.WEIGHTINGS:
            raise ValueError(f"kind must be one of {payloads.KINDS} and weighting one of {payloads.WEIGHTINGS}, "
                             f"got {self.kind!r} / {self.weighting!r}")
        if isinstance(self.min_contributions, bool) or not isinstance(self.min_contributions, int) \
                or self.min_contributions < 1:
            raise ValueError(f"min_contributions must be a whole number >= 1, got {self.min_contributions!r}")
        if not 0 < self.sampling_dp <= 1:
            raise ValueError(f"the distributed-DP sampling probability must be in (0, 1], got {self.sampling_dp!r}")
        self.quantization()

    def quantization(self) -> payloads.Quantization:
        return payloads.Quantization(self.clipping_range, self.levels, self.max_weight)

    def degree(self, num_nodes: int) -> int:
        """Neighbours per node for a round of ``num_nodes``."""
        k = self.neighbours + (self.neighbours % 2)
        return num_nodes - 1 if k >= num_nodes - 1 else k

    def shares_needed(self, num_nodes: int) -> int:
        return max(2, math.ceil(self.threshold * (self.degree(num_nodes) + 1) - 1e-9))


@dataclass
class SecureSum:
    """What one secure round gave the server: the sums, who made it, what was refused or dropped."""

    sums: dict[str, np.ndarray]
    layout: Layout
    sampled: list[int]
    survivors: list[int]
    replies: dict[int, Message]  # the collect-stage replies of the survivors (metrics only, masked vector)
    # node -> the stage it dropped out at (not answered, failed or refused); a node that stopped only at
    # 'unmask' is still in the sum and is not listed
    dropped: dict[int, str] = field(default_factory=dict)
    refused: list[dict[str, Any]] = field(default_factory=list)  # {"node", "stage", "reason"}
    failures: list[dict[str, Any]] = field(default_factory=list)  # error replies {"node", "stage", "reason"}
    bytes_down: int = 0
    bytes_up: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_bytes: dict[str, list[int]] = field(default_factory=dict)  # stage -> [bytes down, bytes up]
    server_cpu_s: float = 0.0
    threshold: int = 0  # t: shares needed to rebuild a secret in each neighbourhood

    def summary(self, label: Callable[[int], str] = str) -> dict[str, Any]:
        """The round as a results file records it: per stage the nodes asked and answering, bytes each way
        and seconds; who was summed; who dropped out at which stage (``label``: how a node is named)."""
        stages = {stage: {"bytes-down": down, "bytes-up": up, "seconds": round(self.stage_seconds.get(stage, 0.0), 4)}
                  for stage, (down, up) in self.stage_bytes.items()}
        return {"stages": stages, "sampled": len(self.sampled), "summed": len(self.survivors),
                "threshold": self.threshold,
                "dropped": {label(n): stage for n, stage in sorted(self.dropped.items())},
                "refused": [{**r, "node": label(r["node"])} for r in self.refused]}


def neighbour_graph(nodes: list[int], degree: int) -> dict[int, tuple[int, ...]]:
    """Each node's neighbours, itself included, ascending: a ring in random order, each node joined to the
    ``degree / 2`` nearest on either side (the complete graph when ``degree`` is N − 1)."""
    if degree >= len(nodes) - 1:
        return {n: tuple(sorted(nodes)) for n in nodes}
    ring_order = list(nodes)
    secrets.SystemRandom().shuffle(ring_order)
    half, n = degree // 2, len(ring_order)
    return {node: tuple(sorted(ring_order[(i + off) % n] for off in range(-half, half + 1)))
            for i, node in enumerate(ring_order)}


def _content_bytes(content: RecordDict) -> int:
    """Bytes a message carries: its arrays and the byte strings of its config records."""
    total = record_bytes(content)
    for record in content.config_records.values():
        for value in record.values():
            if isinstance(value, bytes):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(v) if isinstance(v, bytes) else 8 for v in value)
    return total


class SecAggPlus:
    """SecAgg+ server driver for any Message-API ServerApp or strategy (module docstring)."""

    def __init__(self, config: SecAggConfig | None = None, **options: Any):
        self.config = config if config is not None else SecAggConfig(**options)

    # -- one round ------------------------------------------------------------------------------------
    def aggregate(self, grid: Grid, instructions: Mapping[int, RecordDict], *, server_round: int = 0,
                  layout: Layout | None = None,
                  vet: Callable[[dict[int, Message]], dict[int, str]] | None = None, timed: bool = False) -> SecureSum:
        """Run the four stages for these nodes (node id -> its train instruction) and return the sum.

        ``layout`` is what every contribution must look like; ``None`` takes the one most survivors
        declared (a contribution unlike it is refused). Under distributed DP it is required and stated to the
        nodes with the instruction (a node not sampled contributes zeros of it). ``vet({node: reply})`` judges
        the masked-input replies by what travels in clear (their metrics: partition claims, say) before anything
        is unmasked and returns ``{node: reason}`` for those it refuses: their contributions leave the sum like
        dropouts'. ``timed``: ask the nodes for their ``num-examples`` in clear (a simulated network's clock)."""
        cpu0 = time.process_time()
        self._grid, self._round = grid, server_round
        nodes = sorted(int(n) for n in instructions)
        cfg = self.config
        if len(nodes) < 2:
            raise SecAggFailed(f"secure aggregation needs at least 2 sampled nodes, got {len(nodes)}")
        if cfg.clip_dp > 0 and not layout:
            raise ValueError("distributed DP needs the contributions' layout stated before the round")
        degree, t = cfg.degree(len(nodes)), cfg.shares_needed(len(nodes))
        q = cfg.quantization()
        try:
            ring.check_capacity(payloads.sum_bound(cfg.kind, cfg.weighting, len(nodes), q), cfg.modulus_bits,
                                f"{len(nodes)} nodes of max weight {cfg.max_weight:,}")
        except ValueError as err:
            raise SecAggFailed(str(err)) from None
        self.result = result = SecureSum({}, (), nodes, [], {}, threshold=t)
        session = secrets.token_hex(16)
        graph = neighbour_graph(nodes, degree)
        self._graph, self._t, self._session = graph, t, session

        setup = Setup(session, t, degree + 1, cfg.modulus_bits, cfg.clipping_range, cfg.levels, cfg.max_weight,
                      cfg.kind, cfg.weighting, cfg.clip_dp, cfg.noise_multiplier_dp, cfg.min_honest_dp, cfg.sampling_dp)
        keys = self._stage(SETUP, {n: RecordDict({SECAGG: encode(setup)}) for n in nodes})
        pk: dict[int, PublicKeys] = {}
        seen: dict[bytes, int] = {}
        for node, reply in keys.items():
            assert isinstance(reply, PublicKeys)
            try:
                crypto.load_public(reply.pk1), crypto.load_public(reply.pk2)
                clash = seen.get(reply.pk1) or seen.get(reply.pk2)
                if clash is not None or reply.pk1 == reply.pk2:
                    raise ValueError(f"its public keys repeat node {clash}'s or each other")
            except ValueError as err:
                self._refuse(node, SETUP, f"public keys refused: {err}")
                continue
            seen[reply.pk1] = seen[reply.pk2] = node
            pk[node] = reply
        alive = set(pk)
        self._check(SETUP, alive, alive)

        def neighbourhood(node: int, among: set[int]) -> list[int]:
            return [n for n in graph[node] if n in among]

        share_msgs = {}
        self._dealt: dict[int, list[int]] = {}
        for node in sorted(alive):
            ids = self._dealt[node] = neighbourhood(node, alive)
            share_msgs[node] = RecordDict({SECAGG: encode(ShareKeys(
                session, tuple(ids), tuple(pk[n].pk1 for n in ids), tuple(pk[n].pk2 for n in ids)))})
        sealed_replies = self._stage(SHARE_KEYS, share_msgs)
        sealed: dict[int, SealedShares] = {}
        for node, reply in sealed_replies.items():
            assert isinstance(reply, SealedShares)
            expected = [n for n in neighbourhood(node, alive) if n != node]
            if list(reply.destinations) != expected:
                self._refuse(node, SHARE_KEYS, f"sealed shares for {list(reply.destinations)}, its neighbours are "
                                               f"{expected}")
                continue
            sealed[node] = reply
        keyed = set(sealed)  # these nodes' masks may be in the sum: their secrets must be rebuildable
        self._check(SHARE_KEYS, keyed, keyed)

        collect_msgs, sources = {}, {}
        for node in sorted(keyed):
            srcs = [s for s in neighbourhood(node, keyed) if s != node]
            sources[node] = srcs
            cts = [sealed[s].ciphertexts[sealed[s].destinations.index(node)] for s in srcs]
            content = _copy(instructions[node])
            stated = layout if cfg.clip_dp > 0 and layout is not None else ()
            content[SECAGG] = encode(Collect(session, tuple(srcs), tuple(cts), stated, timed))
            collect_msgs[node] = content
        masked_replies = self._stage(COLLECT, collect_msgs, keep=True)
        wanted = layout if layout is not None else _most_common_layout(masked_replies)
        masked: dict[int, MaskedInput] = {}
        for node, reply in masked_replies.items():
            assert isinstance(reply, MaskedInput)
            if reply.layout != wanted:
                self._refuse(node, COLLECT, f"contribution laid out as {_layout_text(reply.layout)}, the round's "
                                            f"is {_layout_text(wanted)}")
                continue
            masked[node] = reply
        vetoes = vet({n: self._kept[n] for n in sorted(masked)}) if vet is not None else {}
        for node, reason in sorted(vetoes.items()):
            if node in masked:
                self._refuse(node, COLLECT, reason)
                del masked[node]
        survivors = set(masked)
        result.replies = {n: m for n, m in self._kept.items() if n in survivors}
        result.layout = wanted
        dropped = keyed - survivors
        self._check(COLLECT, keyed, survivors)
        if len(survivors) < cfg.min_honest_dp:
            raise SecAggFailed(f"secure aggregation round {server_round} not unmasked: {len(survivors)} contributions "
                               f"left, fewer than dp-min-honest = {cfg.min_honest_dp}: the sum's noise would be less "
                               "than what the clients accounted")

        asked: dict[int, Unmask] = {}
        for node in sorted(survivors):
            held = set(sources[node]) | {node}
            asked[node] = Unmask(session, tuple(sorted(held & survivors)), tuple(sorted(held & dropped)))
        share_replies = self._stage(UNMASK, {n: RecordDict({SECAGG: encode(u)}) for n, u in asked.items()})
        seed_shares: dict[int, list[tuple[int, bytes]]] = {n: [] for n in survivors}
        key_shares: dict[int, list[tuple[int, bytes]]] = {n: [] for n in dropped}
        for node, reply in share_replies.items():
            assert isinstance(reply, Shares)
            problem = self._check_shares(node, reply, [*asked[node].survivors, *asked[node].dropped], survivors)
            if problem:
                self._refuse(node, UNMASK, problem)
                continue
            for owner, share in zip(reply.owners, reply.shares):
                (seed_shares[owner] if owner in survivors else key_shares[owner]).append((node, share))

        # in Z_{2^64} in place (a multiple of the ring's modulus), cut to the ring once at the end
        total = np.zeros(payloads.length(wanted), dtype=np.uint64)
        for node in sorted(survivors):
            np.add(total, masked[node].vector, out=total)
        masker = crypto.Masker(total.size)
        for node in sorted(survivors):
            seed = self._rebuild(node, seed_shares[node], "mask seed", lambda s, n=node: (
                len(s) == crypto.SEED_BYTES and crypto.commitment(s) == sealed[n].commitment))
            masker.add(total, seed, -1)
        for node in sorted(dropped):
            sk1 = crypto.load_private(self._rebuild(node, key_shares[node], "mask key", lambda s, n=node: (
                len(s) == crypto.PRIVATE_KEY_BYTES and crypto.public_of(s) == pk[n].pk1)))
            for other in sources[node]:
                if other not in survivors:
                    continue
                # the survivor added sign(other, node) · mask; take it away
                masker.add(total, crypto.mask_key(crypto.agree(sk1, pk[other].pk1)), -pairwise_sign(other, node))
        result.sums = payloads.unflatten(wanted, ring.signed(ring.reduce(total, cfg.modulus_bits), cfg.modulus_bits), q)
        result.survivors = sorted(survivors)
        result.server_cpu_s = time.process_time() - cpu0
        LOGGER.info("secure aggregation round %d: %d of %d nodes summed (%d dropped, %d refused), t = %d of %d",
                    server_round, len(survivors), len(nodes), len(result.dropped), len(result.refused), t, degree + 1)
        return result

    # -- helpers ----------------------------------------------------------------------------------------
    def _stage(self, stage: str, contents: dict[int, RecordDict], keep: bool = False) -> dict[int, Any]:
        """Send one stage to these nodes; the decoded replies of those that answered properly."""
        started = time.perf_counter()
        result, cfg = self.result, self.config
        messages = [Message(content=c, dst_node_id=n, message_type=MessageType.TRAIN, group_id=str(self._round))
                    for n, c in contents.items()]
        down = sum(_content_bytes(c) for c in contents.values())
        result.bytes_down += down
        up = 0
        replies = self._grid.send_and_receive(messages, timeout=cfg.timeout)
        out: dict[int, Any] = {}
        self._kept: dict[int, Message] = {}
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node not in contents:
                self._refuse(node, stage, "a reply from a node this stage was not sent to")
                continue
            if node in out or any(r["node"] == node and r["stage"] == stage for r in result.refused):
                self._refuse(node, stage, "a second reply to one stage message")
                out.pop(node, None)
                continue
            if reply.has_error():
                result.failures.append({"node": node, "stage": stage, "reason": reply.error.reason})
                continue
            up += _content_bytes(reply.content)
            try:
                out[node] = decode_reply(reply.content, stage, self._session, modulus_bits=cfg.modulus_bits)
            except Refused as err:
                self._refuse(node, stage, str(err))
                continue
            if keep:
                self._kept[node] = reply
        if stage != UNMASK:
            for node in contents:
                if node not in out:
                    result.dropped.setdefault(node, stage)
        result.bytes_up += up
        result.stage_seconds[stage] = time.perf_counter() - started
        result.stage_bytes[stage] = [down, up]
        return out

    def _refuse(self, node: int, stage: str, reason: str) -> None:
        """Log and keep a refused reply; a node of the round whose reply is refused drops out there."""
        LOGGER.warning("secure aggregation round %d: node %d's %s reply refused: %s", self._round, node, stage, reason)
        self.result.refused.append({"node": node, "stage": stage, "reason": reason})
        if node in self.result.sampled and stage != UNMASK:
            self.result.dropped.setdefault(node, stage)

    def _check(self, stage: str, owners: set[int], holders: set[int]) -> None:
        """At least ``min_contributions`` nodes are left and every owner whose secrets may be needed keeps at
        least t live holders, or the round fails."""
        if len(holders) < self.config.min_contributions:
            raise SecAggFailed(
                f"secure aggregation round {self._round} failed after stage {stage!r}: {len(holders)} of "
                f"{len(self.result.sampled)} nodes left, fewer than the {self.config.min_contributions} contributions "
                "a round needs (min-train-clients): nothing is aggregated")
        for node in sorted(owners):
            live = [n for n in self._graph[node] if n in holders]
            if len(live) < self._t:
                errors = self.result.failures or self.result.refused
                first = f"; first error: node {errors[0]['node']}: {errors[0]['reason'][-300:]}" if errors else ""
                raise SecAggFailed(
                    f"secure aggregation round {self._round} failed after stage {stage!r}: node {node} has "
                    f"{len(live)} live holders of its shares, the threshold is {self._t} "
                    f"({len(holders)} of {len(self.result.sampled)} nodes left){first}")

    def _check_shares(self, holder: int, reply: Shares, expected: list[int], survivors: set[int]) -> str | None:
        """The shares a holder hands in: exactly the owners asked for, each of its secret's length and
        carrying the holder's own share number (its place among the owner's ``node-ids``)."""
        if list(reply.owners) != expected:
            return f"shares of {list(reply.owners)}, asked for {expected}"
        for owner, share in zip(reply.owners, reply.shares):
            size = crypto.share_length(crypto.SEED_BYTES if owner in survivors else crypto.PRIVATE_KEY_BYTES)
            if len(share) != size:
                return f"its share of node {owner} is {len(share)} bytes, not {size}"
            number = self._dealt[owner].index(holder) + 1
            if crypto.share_index(share) != number:
                return f"its share of node {owner} carries number {crypto.share_index(share)}, not {number}"
        return None

    def _rebuild(self, owner: int, shares: list[tuple[int, bytes]], what: str, valid) -> bytes:
        """The owner's secret from the first ``t`` shares handed in; when those do not rebuild what the owner
        committed to, each of them in turn is swapped for a spare one, so one bad share is found, named and
        left out. More than that fails the round with the reason."""
        t = self._t
        if len(shares) < t:
            raise SecAggFailed(f"secure aggregation round {self._round} failed at stage 'unmask': {len(shares)} "
                               f"shares of node {owner}'s {what}, the threshold is {t}")
        candidates = [list(range(t))] + [[j for j in range(t) if j != i] + [spare]
                                         for spare in range(t, len(shares)) for i in range(t)]
        for chosen in candidates:
            try:
                secret = crypto.combine_secret([shares[j][1] for j in chosen])
            except ValueError:
                continue
            if valid(secret):
                for j in sorted(set(range(t)) - set(chosen)):
                    self._refuse(shares[j][0], UNMASK, f"its share of node {owner}'s {what} does not fit the others'")
                return secret
        raise SecAggFailed(f"secure aggregation round {self._round} failed at stage 'unmask': the shares of "
                           f"node {owner}'s {what} do not rebuild the secret it committed to")


def _copy(content: RecordDict) -> RecordDict:
    """A shallow copy (the same records): one instruction may be shared by many nodes."""
    out = RecordDict()
    for name, record in content.items():
        out[name] = record
    return out


def _layout_text(layout: Layout) -> str:
    return ", ".join(f"{p.name}{list(p.shape)}" for p in layout) or "nothing"


def _most_common_layout(replies: Mapping[int, Any]) -> Layout:
    counts = Counter(r.layout for r in replies.values())
    if not counts:
        return ()
    best = max(counts.values())
    return min((lay for lay, c in counts.items() if c == best), key=lambda lay: min(
        n for n, r in replies.items() if r.layout == lay))


