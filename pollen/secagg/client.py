"""The client's side of SecAgg+: one session per round, four stages, and the ClientApp mod that runs them.

``ClientApp(mods=[secagg_mod])`` answers the server driver's stage messages itself and hands the
``collect`` stage's train instruction to the app's own ``train`` handler: what that handler replies is
turned into integer parts (:mod:`pollen.secagg.payloads`), masked and sent instead of the plain reply.
Messages without a ``secagg`` record pass through untouched (evaluate, query, a strategy that does not
aggregate securely), unless the node's run config says ``secure-aggregation = true``: then a plain
train message is refused, so a server cannot quietly ask for what the node only sends masked.

Stage discipline: ``setup`` opens a session with fresh keys (dropping any older one); every other
stage must follow the one before it in the same session, or it is refused and the session dropped.
A node answers ``unmask`` once, and never with both secrets of one node. The session's secrets live in
``context.state`` (``secagg-session``) while the round runs — never on disk, and hidden from the train
handler, so the app's own state files never hold them — and are deleted after ``unmask``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from pollen.protocol.identity import PARTITION_ID
from pollen.protocol.records import METRICS, NUM_EXAMPLES
from pollen.protocol.secagg import (
    COLLECT,
    MASKED,
    SECAGG,
    SETUP,
    SHARE_KEYS,
    STAGES,
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
    decode_instruction,
    encode,
    encode_masked,
)
from pollen.secagg import crypto, payloads
from pollen.secagg import field as ring

STATE = "secagg-session"  # context.state record holding the open session
REQUIRED_KEY = "secure-aggregation"  # run-config key: when true, a plain train message is refused
# the run keys that make a run simulate a network (pollen.strategies.network.NetworkModel.simulated)
NETWORK_KEYS = ("client-dropout", "client-slow-fraction", "client-time-spread", "round-timeout")


@dataclass
class Session:
    """One node's secrets and view of one round (the ``secagg-session`` record, typed)."""

    setup: Setup
    node_id: int
    stage: str
    sk1: bytes
    pk1: bytes
    sk2: bytes
    pk2: bytes
    mask_seed: bytes = b""
    neighbours: tuple[int, ...] = ()
    pk1s: tuple[bytes, ...] = ()
    pk2s: tuple[bytes, ...] = ()
    sources: tuple[int, ...] = ()
    sealing_keys: dict[int, bytes] = field(default_factory=dict)  # agreed with each neighbour's pk2
    seed_shares: dict[int, bytes] = field(default_factory=dict)
    key_shares: dict[int, bytes] = field(default_factory=dict)

    def to_record(self) -> ConfigRecord:
        s = self.setup
        return ConfigRecord({
            "session": s.session, "threshold": s.threshold, "num-shares": s.num_shares,
            "modulus-bits": s.modulus_bits, "clipping-range": s.clipping_range, "levels": s.levels,
            "max-weight": s.max_weight, "kind": s.kind, "weighting": s.weighting, "dp-clip": s.clip_dp,
            "dp-noise-multiplier": s.noise_multiplier_dp, "dp-min-honest": s.min_honest_dp,
            "dp-sampling": s.sampling_dp, "node-id": self.node_id, "stage": self.stage, "sk1": self.sk1,
            "pk1": self.pk1, "sk2": self.sk2,
            "pk2": self.pk2, "seed": self.mask_seed, "neighbours": list(self.neighbours), "pk1s": list(self.pk1s),
            "pk2s": list(self.pk2s), "sources": list(self.sources),
            "sealing-owners": list(self.sealing_keys), "sealing-keys": list(self.sealing_keys.values()),
            "seed-share-owners": list(self.seed_shares), "seed-shares": list(self.seed_shares.values()),
            "key-share-owners": list(self.key_shares), "key-shares": list(self.key_shares.values())})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> Session:
        r: dict[str, Any] = dict(record)
        setup = Setup(str(r["session"]), int(r["threshold"]), int(r["num-shares"]), int(r["modulus-bits"]),
                      float(r["clipping-range"]), int(r["levels"]), int(r["max-weight"]), str(r["kind"]),
                      str(r["weighting"]), float(r["dp-clip"]), float(r["dp-noise-multiplier"]),
                      int(r["dp-min-honest"]), float(r["dp-sampling"]))

        def ids(key: str) -> tuple[int, ...]:
            return tuple(int(x) for x in r[key])

        def blobs(key: str) -> tuple[bytes, ...]:
            return tuple(bytes(x) for x in r[key])

        return cls(setup, int(r["node-id"]), str(r["stage"]), bytes(r["sk1"]), bytes(r["pk1"]),
                   bytes(r["sk2"]), bytes(r["pk2"]), bytes(r["seed"]), ids("neighbours"),
                   blobs("pk1s"), blobs("pk2s"), ids("sources"),
                   dict(zip(ids("sealing-owners"), blobs("sealing-keys"), strict=True)),
                   dict(zip(ids("seed-share-owners"), blobs("seed-shares"), strict=True)),
                   dict(zip(ids("key-share-owners"), blobs("key-shares"), strict=True)))


def start(instruction: Setup, node_id: int) -> tuple[Session, PublicKeys]:
    """``setup``: check the parameters, make this round's two key pairs, publish their public halves."""
    s = instruction
    if s.kind not in payloads.KINDS or s.weighting not in payloads.WEIGHTINGS:
        raise Refused(f"stage 'setup': kind {s.kind!r} / weighting {s.weighting!r} unknown "
                      f"(kinds {payloads.KINDS}, weightings {payloads.WEIGHTINGS})")
    if not 2 * s.threshold > s.num_shares or s.threshold > s.num_shares:
        raise Refused(f"stage 'setup': threshold {s.threshold} of {s.num_shares} shares must be more than half "
                      "of them (and at most all): otherwise the server could gather both secrets of a node")
    payloads.Quantization(s.clipping_range, s.levels, s.max_weight)  # refuses bad values by name
    sk1, pk1 = crypto.new_key_pair()
    sk2, pk2 = crypto.new_key_pair()
    return Session(s, node_id, SETUP, sk1, pk1, sk2, pk2), PublicKeys(s.session, pk1, pk2)


def share_keys(session: Session, instruction: ShareKeys) -> tuple[Session, SealedShares]:
    """``share-keys``: Shamir-share the mask seed and the mask key among the neighbours, sealed to each."""
    me, t = session.node_id, session.setup.threshold
    ids = instruction.node_ids
    if me not in ids:
        raise Refused("stage 'share-keys': this node is not among 'node-ids'")
    mine = ids.index(me)
    if (instruction.pk1s[mine], instruction.pk2s[mine]) != (session.pk1, session.pk2):
        raise Refused("stage 'share-keys': the public keys listed for this node are not the ones it sent")
    if not t <= len(ids) <= session.setup.num_shares:
        raise Refused(f"stage 'share-keys': {len(ids)} nodes listed; the threshold is {t} of at most "
                      f"{session.setup.num_shares} shares")
    if list(ids) != sorted(ids):
        raise Refused("stage 'share-keys': 'node-ids' must be in ascending order")
    keys = list(instruction.pk1s) + list(instruction.pk2s)
    if len(set(keys)) != len(keys):
        raise Refused("stage 'share-keys': some public keys are identical")
    try:
        loaded = [crypto.load_public(key) for key in instruction.pk2s]
        for key in instruction.pk1s:
            crypto.load_public(key)
    except ValueError as err:
        raise Refused(f"stage 'share-keys': a public key is not a P-384 point ({err})") from None
    seed = os.urandom(crypto.SEED_BYTES)
    seed_shares = crypto.split_secret(seed, t, len(ids))
    key_shares = crypto.split_secret(session.sk1, t, len(ids))
    destinations, ciphertexts, sealing = [], [], {}
    sk2 = crypto.load_private(session.sk2)
    for i, (node, pk2) in enumerate(zip(ids, loaded)):
        if node == me:
            continue
        plaintext = share_keys_plaintext_concat(me, node, seed_shares[i], key_shares[i])
        destinations.append(node)
        sealing[node] = crypto.agree(sk2, pk2)
        ciphertexts.append(crypto.seal(sealing[node], plaintext))
    updated = replace(session, stage=SHARE_KEYS, mask_seed=seed, neighbours=ids, pk1s=instruction.pk1s,
                      pk2s=instruction.pk2s, sealing_keys=sealing, seed_shares={me: seed_shares[mine]},
                      key_shares={me: key_shares[mine]})
    return updated, SealedShares(session.setup.session, tuple(destinations), tuple(ciphertexts),
                                 crypto.commitment(seed))


def receive_shares(session: Session, instruction: Collect) -> Session:
    """``collect``, first half: open the shares the neighbours sealed to this node."""
    me, t = session.node_id, session.setup.threshold
    others = set(session.neighbours) - {me}
    if not set(instruction.sources) <= others:
        raise Refused(f"stage 'collect': sources {sorted(set(instruction.sources) - others)} are not neighbours")
    if len(instruction.sources) + 1 < t:
        raise Refused(f"stage 'collect': shares from {len(instruction.sources)} neighbours; the threshold needs "
                      f"{t - 1} besides this node")
    seed_shares, key_shares = dict(session.seed_shares), dict(session.key_shares)
    for src, ciphertext in zip(instruction.sources, instruction.ciphertexts):
        try:
            plaintext = crypto.open_sealed(session.sealing_keys[src], ciphertext)
        except crypto.DecryptionError:
            raise Refused(f"stage 'collect': the shares from node {src} do not open with its key") from None
        actual, dst, seed_share, key_share = share_keys_plaintext_separate(plaintext)
        if (actual, dst) != (src, me):
            raise Refused(f"stage 'collect': a sealed message says it is from {actual} to {dst}, "
                          f"but came from {src} to {me}")
        seed_shares[src], key_shares[src] = seed_share, key_share
    return replace(session, stage=COLLECT, sources=tuple(instruction.sources), seed_shares=seed_shares,
                   key_shares=key_shares)


def pairwise_sign(me: int, other: int) -> int:
    """The larger id adds the shared mask, the smaller subtracts it: the pair cancels in the sum."""
    return 1 if me > other else -1


def plain_contribution(session: Session, reply: RecordDict) -> tuple[Layout, np.ndarray]:
    """``collect`` without distributed DP: the train reply as the integer parts it adds to the sum."""
    s = session.setup
    layout, parts = payloads.contribution(s.kind, s.weighting, reply,
                                          payloads.Quantization(s.clipping_range, s.levels, s.max_weight))
    return layout, payloads.flatten(parts)


def masked_input(session: Session, layout: Layout, integers: np.ndarray) -> MaskedInput:
    """``collect``, second half: the contribution's integers plus the self mask and one pairwise mask per
    neighbour that sent this node its shares, in the ring."""
    s = session.setup
    bits = s.modulus_bits
    vector = np.array(integers, dtype=np.int64).view(np.uint64)  # two's complement; cut to the ring at the end
    masker = crypto.Masker(vector.size)
    masker.add(vector, session.mask_seed)
    sk1 = crypto.load_private(session.sk1)
    for other in session.sources:
        pk1 = session.pk1s[session.neighbours.index(other)]
        masker.add(vector, crypto.mask_key(crypto.agree(sk1, pk1)), pairwise_sign(session.node_id, other))
    return MaskedInput(s.session, layout, ring.reduce(vector, bits).astype(ring.wire_dtype(bits), copy=False))


def reveal(session: Session, instruction: Unmask) -> Shares:
    """``unmask``: the seed share of each surviving neighbour, the key share of each dropped one."""
    held = set(session.sources) | {session.node_id}
    asked = set(instruction.survivors) | set(instruction.dropped)
    if not asked <= held:
        raise Refused(f"stage 'unmask': this node holds no shares of {sorted(asked - held)}")
    if session.node_id in instruction.dropped:
        raise Refused("stage 'unmask': this node is listed as dropped")
    if len(instruction.survivors) < session.setup.threshold:
        raise Refused(f"stage 'unmask': {len(instruction.survivors)} survivors listed, fewer than the threshold "
                      f"{session.setup.threshold}")
    owners = instruction.survivors + instruction.dropped
    shares = tuple(session.seed_shares[n] for n in instruction.survivors) + tuple(
        session.key_shares[n] for n in instruction.dropped)
    return Shares(session.setup.session, owners, shares)


def _session(context: Context, stage: str, session_id: str) -> Session:
    record = context.state.get(STATE)
    if not isinstance(record, ConfigRecord):
        raise Refused(f"stage {stage!r} without an open session (no 'setup' seen)")
    session = Session.from_record(record)
    expected = STAGES[STAGES.index(session.stage) + 1] if session.stage != UNMASK else SETUP
    if session.setup.session != session_id:
        raise Refused(f"stage {stage!r} of session {session_id!r}, but the open session is {session.setup.session!r}")
    if stage != expected:
        raise Refused(f"stage {stage!r} where {expected!r} was due")
    return session


def _scalar_metrics(reply: RecordDict) -> MetricRecord:
    """What of the train reply's metrics travels beside the masked vector: scalars other than
    ``num-examples`` (which is inside the sum). Lists (per-class figures) stay home."""
    metrics = reply.get(METRICS)
    if not isinstance(metrics, MetricRecord):
        return MetricRecord({})
    return MetricRecord({k: v for k, v in metrics.items() if k != NUM_EXAMPLES and isinstance(v, (int, float))})


def _num_examples(reply: RecordDict) -> int:
    metrics = reply.get(METRICS)
    value = metrics.get(NUM_EXAMPLES) if isinstance(metrics, MetricRecord) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0


def _flag(context: Context, key: str) -> bool:
    value = context.run_config.get(key, False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _required(context: Context) -> bool:
    return _flag(context, REQUIRED_KEY)


def _simulates_a_network(context: Context) -> bool:
    """Whether this node's own run config sets a simulated network (docs/stragglers.md): only then does it let
    its example count travel in clear for the simulated clock."""
    return any(isinstance(context.run_config.get(k), (int, float)) and not isinstance(context.run_config.get(k), bool)
               and float(context.run_config[k]) > 0 for k in NETWORK_KEYS)


# (context, setup, contribution size) -> (sampled, the function that clips, rounds and noises the contribution into
# integer steps, the metrics to report): how a node takes part in distributed DP (dp-mode = distributed); it draws
# whether the node is sampled this round and appends the round's release to its ledger before answering
PrivatizerFactory = Callable[[Context, Setup, int],
                             tuple[bool, Callable[[np.ndarray], np.ndarray], dict[str, float]]]


class SecAggMod:
    """A Flower ClientApp mod running SecAgg+ on the client (module docstring). ``privatizer``: the node's
    side of distributed DP, asked for each round that states DP parameters (none: such rounds are refused)."""

    def __init__(self, privatizer: PrivatizerFactory | None = None):
        self.privatizer = privatizer

    def __call__(self, msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        if SECAGG not in msg.content:
            if _required(context):
                raise Refused("a plain train message, but this node's run config says secure-aggregation = "
                              "true: it sends its update only through secure aggregation")
            return call_next(msg, context)
        try:
            return _stage(msg, context, call_next, self.privatizer)
        except Exception:
            if STATE in context.state:  # a refused or failed stage ends the session: its secrets go
                del context.state[STATE]
            raise


secagg_mod = SecAggMod()  # ``ClientApp(mods=[secagg_mod])``: SecAgg+ without distributed DP


def _train(msg: Message, context: Context, call_next, session: Session) -> Message:
    """The app's own train handler, which sees neither the session's secrets nor the stage record."""
    del context.state[STATE]
    try:
        return call_next(msg, context)
    finally:
        context.state[STATE] = session.to_record()


def _collect(msg: Message, context: Context, call_next, session: Session, instruction: Collect,
             privatizer: PrivatizerFactory | None) -> Message | tuple[MetricRecord, MaskedInput]:
    """``collect``: train (unless distributed DP's draw says this node sits the round out), then the masked
    contribution and the metrics that travel in clear; an error reply of the train handler is returned as is."""
    setup = session.setup
    del msg.content[SECAGG]  # the train handler sees exactly the strategy's instruction
    broadcast = RecordDict(dict(msg.content.items()))
    timed = instruction.timed and _simulates_a_network(context)
    if setup.clip_dp <= 0:
        reply = _train(msg, context, call_next, session)
        if reply.has_error():
            return reply
        clear = _scalar_metrics(reply.content)
        if timed:
            clear[NUM_EXAMPLES] = _num_examples(reply.content)
        return clear, masked_input(session, *plain_contribution(session, reply.content))
    if privatizer is None:
        raise Refused("stage 'collect': the round asks for distributed DP and this node has no privatizer")
    layout = instruction.layout
    if not layout:
        raise Refused("stage 'collect': the round asks for distributed DP but states no contribution layout")
    sampled, privatize, dp_metrics = privatizer(context, setup, payloads.length(layout))
    floats = np.zeros(payloads.length(layout))
    examples = 0
    clear = MetricRecord({})
    if sampled:
        reply = _train(msg, context, call_next, session)
        if reply.has_error():
            return reply
        mine, floats = payloads.dp_vector(setup.kind, reply.content, broadcast, setup.clip_dp)
        if mine != layout:
            raise Refused(f"stage 'collect': this node's contribution is laid out as {_layout_text(mine)}, the "
                          f"round states {_layout_text(layout)}")
        examples = _num_examples(reply.content)
        if setup.sampling_dp >= 1:  # under sampling, what a sampled node's training reports would tell it apart
            clear = _scalar_metrics(reply.content)
    partition = context.node_config.get(PARTITION_ID)
    if isinstance(partition, int) and not isinstance(partition, bool):
        clear[PARTITION_ID] = partition
    for key, value in dp_metrics.items():
        clear[key] = value
    if timed:
        clear[NUM_EXAMPLES] = examples
    return clear, masked_input(session, layout, privatize(floats))


def _layout_text(layout: Layout) -> str:
    return ", ".join(f"{p.name}{list(p.shape)}" for p in layout) or "nothing"


def _stage(msg: Message, context: Context, call_next, privatizer: PrivatizerFactory | None) -> Message:
    instruction = decode_instruction(msg.content[SECAGG])
    out = RecordDict()
    if isinstance(instruction, Setup):
        session, keys = start(instruction, msg.metadata.dst_node_id)
        out[SECAGG] = encode(keys)
    elif isinstance(instruction, ShareKeys):
        session, sealed = share_keys(_session(context, SHARE_KEYS, instruction.session), instruction)
        out[SECAGG] = encode(sealed)
    elif isinstance(instruction, Collect):
        session = receive_shares(_session(context, COLLECT, instruction.session), instruction)
        collected = _collect(msg, context, call_next, session, instruction, privatizer)
        if isinstance(collected, Message):
            return collected
        out[METRICS], masked = collected
        out[SECAGG], out[MASKED] = encode_masked(masked)
    else:
        session = _session(context, UNMASK, instruction.session)
        out[SECAGG] = encode(reveal(session, instruction))
        del context.state[STATE]
        return Message(out, reply_to=msg)
    context.state[STATE] = session.to_record()
    return Message(out, reply_to=msg)


def parts_of(reply: RecordDict, setup: Setup) -> tuple[payloads.Layout, np.ndarray]:
    """The integer vector a reply adds to the sum, unmasked (tests compare the protocol's sum with it)."""
    q = payloads.Quantization(setup.clipping_range, setup.levels, setup.max_weight)
    layout, parts = payloads.contribution(setup.kind, setup.weighting, reply, q)
    return layout, payloads.flatten(parts)
