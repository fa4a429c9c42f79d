"""SecAgg+ stage records: what the server driver and the ClientApp mod say to each other, per stage.

Every stage is a ``train`` message whose content holds a ConfigRecord ``secagg`` (``stage``, ``session``
and the stage's keys below); the reply answers with a ``secagg`` record of the same stage and session.
A round is four stages; the session is a fresh random id per round, and keys are fresh per session.

| stage | server → client (``secagg``) | client → server (``secagg``) |
|---|---|---|
| ``setup`` | ``threshold``, ``num-shares``, ``modulus-bits``, ``clipping-range``, ``levels``, ``max-weight``, ``kind``, ``weighting``; ``dp-clip``, ``dp-noise-multiplier``, ``dp-min-honest`` (0: no distributed DP), ``dp-sampling`` (each node's probability of contributing its update, 1: always) | ``pk1``, ``pk2``: compressed P-384 points (49 bytes) |
| ``share-keys`` | ``node-ids`` (neighbours and itself, ascending), ``pk1s``, ``pk2s`` | ``destinations``, ``ciphertexts`` (one sealed share pair per neighbour), ``commitment`` (SHA-256 of its mask seed) |
| ``collect`` | the strategy's train instruction (``arrays``, ``config``) + ``sources``, ``ciphertexts`` (the shares sent to it); ``layout-*`` (under distributed DP the contribution's layout, else empty); ``timed`` (a simulated network times the round: ``num-examples`` travels in clear) | ``layout-names``, ``layout-roles``, ``layout-ranks``, ``layout-dims``; ``arrays`` record ``secagg-masked`` = ``{"vector": uint32 (modulus <= 2^32) or uint64}``; the train reply's scalar metrics except ``num-examples`` |
| ``unmask`` | ``survivors``, ``dropped`` (neighbours) | ``owners``, ``shares``: the mask-seed share of each survivor, the private-key share of each dropped node |

A client holds share number ``i + 1`` of each owner, ``i`` its position among the owner's ``node-ids``.
Decoding refuses, naming the key, any record that breaks this table (missing key, wrong type, a list of
the wrong length, a duplicate id, a stage other than the one asked for, another session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

SECAGG = "secagg"  # the stage record's name, in every stage message and reply
MASKED = "secagg-masked"  # the collect reply's ArrayRecord
VECTOR = "vector"
SETUP, SHARE_KEYS, COLLECT, UNMASK = "setup", "share-keys", "collect", "unmask"
STAGES = (SETUP, SHARE_KEYS, COLLECT, UNMASK)
STAGE, SESSION = "stage", "session"
MAX_CIPHERTEXT_BYTES = 4096  # a sealed pair of shares is ~300 bytes; anything far larger is refused
ROLES = ("value", "integer", "weight", "noisy")


class Refused(ValueError):
    """A stage record that breaks the contract; the message names the stage, the key and the reason."""


@dataclass(frozen=True)
class Part:
    """One named array inside the flat vector; ``role`` says how its sum is read back."""

    name: str
    shape: tuple[int, ...]
    role: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


Layout = tuple[Part, ...]


@dataclass(frozen=True)
class Setup:
    session: str
    threshold: int
    num_shares: int
    modulus_bits: int
    clipping_range: float
    levels: int
    max_weight: int
    kind: str
    weighting: str
    clip_dp: float = 0.0  # > 0: distributed DP, each client clips its contribution to this L2 norm
    noise_multiplier_dp: float = 0.0
    min_honest_dp: int = 0
    sampling_dp: float = 1.0  # < 1: each node contributes its update with this probability, its own secret draw


@dataclass(frozen=True)
class PublicKeys:
    session: str
    pk1: bytes
    pk2: bytes


@dataclass(frozen=True)
class ShareKeys:
    session: str
    node_ids: tuple[int, ...]
    pk1s: tuple[bytes, ...]
    pk2s: tuple[bytes, ...]


@dataclass(frozen=True)
class SealedShares:
    session: str
    destinations: tuple[int, ...]
    ciphertexts: tuple[bytes, ...]
    commitment: bytes


@dataclass(frozen=True)
class Collect:
    session: str
    sources: tuple[int, ...]
    ciphertexts: tuple[bytes, ...]
    layout: Layout = ()  # under distributed DP: what every contribution looks like (a node not sampled sends zeros)
    timed: bool = False  # a simulated network times this stage by each node's num-examples, which then travels in clear


@dataclass(frozen=True)
class MaskedInput:
    session: str
    layout: Layout
    vector: np.ndarray


@dataclass(frozen=True)
class Unmask:
    session: str
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class Shares:
    session: str
    owners: tuple[int, ...]
    shares: tuple[bytes, ...]


_STAGE_OF = {Setup: SETUP, ShareKeys: SHARE_KEYS, Collect: COLLECT, Unmask: UNMASK,
             PublicKeys: SETUP, SealedShares: SHARE_KEYS, MaskedInput: COLLECT, Shares: UNMASK}


def stage_of(record: Any) -> str:
    return _STAGE_OF[type(record)]


def encode(record: Setup | PublicKeys | ShareKeys | SealedShares | Collect | Unmask | Shares) -> ConfigRecord:
    """A stage record as the ``secagg`` ConfigRecord (a MaskedInput: :func:`encode_masked`)."""
    values: dict[str, Any] = {STAGE: stage_of(record), SESSION: record.session}
    if isinstance(record, Setup):
        values.update({"threshold": record.threshold, "num-shares": record.num_shares,
                       "modulus-bits": record.modulus_bits, "clipping-range": float(record.clipping_range),
                       "levels": record.levels, "max-weight": record.max_weight, "kind": record.kind,
                       "weighting": record.weighting, "dp-clip": float(record.clip_dp),
                       "dp-noise-multiplier": float(record.noise_multiplier_dp), "dp-min-honest": record.min_honest_dp,
                       "dp-sampling": float(record.sampling_dp)})
    elif isinstance(record, PublicKeys):
        values.update({"pk1": record.pk1, "pk2": record.pk2})
    elif isinstance(record, ShareKeys):
        values.update({"node-ids": list(record.node_ids), "pk1s": list(record.pk1s), "pk2s": list(record.pk2s)})
    elif isinstance(record, SealedShares):
        values.update({"destinations": list(record.destinations), "ciphertexts": list(record.ciphertexts),
                       "commitment": record.commitment})
    elif isinstance(record, Collect):
        values.update({"sources": list(record.sources), "ciphertexts": list(record.ciphertexts),
                       "timed": bool(record.timed), **_layout_values(record.layout)})
    elif isinstance(record, Unmask):
        values.update({"survivors": list(record.survivors), "dropped": list(record.dropped)})
    elif isinstance(record, Shares):
        values.update({"owners": list(record.owners), "shares": list(record.shares)})
    else:
        raise TypeError(f"not a SecAgg+ stage record: {type(record).__name__}")
    return ConfigRecord(values)


def _layout_values(layout: Layout) -> dict[str, list]:
    return {"layout-names": [p.name for p in layout], "layout-roles": [p.role for p in layout],
            "layout-ranks": [len(p.shape) for p in layout], "layout-dims": [int(d) for p in layout for d in p.shape]}


def encode_masked(record: MaskedInput) -> tuple[ConfigRecord, ArrayRecord]:
    """The collect reply's ``secagg`` record (layout) and ``secagg-masked`` record (the vector)."""
    cfg = ConfigRecord({STAGE: COLLECT, SESSION: record.session, **_layout_values(record.layout)})
    return cfg, ArrayRecord({VECTOR: Array(np.ascontiguousarray(record.vector))})


class _Reader:
    """Typed reads from a ``secagg`` record; every failure names the stage and the key."""

    def __init__(self, record: Any, stage: str):
        if not isinstance(record, ConfigRecord):
            raise Refused(f"no '{SECAGG}' ConfigRecord (stage {stage!r})")
        self.record, self.stage = record, stage

    def _get(self, key: str) -> Any:
        if key not in self.record:
            raise Refused(f"stage {self.stage!r}: key {key!r} is missing")
        return self.record[key]

    def _fail(self, key: str, what: str, value: Any) -> Refused:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return Refused(f"stage {self.stage!r}: {key!r} must be {what}, got {shown}")

    def whole(self, key: str, low: int = 0, high: int | None = None) -> int:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            raise self._fail(key, f"a whole number in [{low}, {high if high is not None else '...'}]", v)
        return v

    def positive(self, key: str, zero: bool = False) -> float:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
                (v == 0 and not zero):
            raise self._fail(key, f"a finite number {'>=' if zero else '>'} 0", v)
        return float(v)

    def text(self, key: str, choices: tuple[str, ...] | None = None) -> str:
        v = self._get(key)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self._fail(key, f"one of {choices}" if choices else "a string", v)
        return v

    def blob(self, key: str, length: int | None = None) -> bytes:
        v = self._get(key)
        if not isinstance(v, bytes) or (length is not None and len(v) != length):
            raise self._fail(key, f"{length} bytes" if length else "bytes", v)
        return v

    def ids(self, key: str, unique: bool = True) -> tuple[int, ...]:
        v = self._get(key)
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
            raise self._fail(key, "a list of node ids", v)
        if unique and len(set(v)) != len(v):
            raise self._fail(key, "a list without duplicates", v)
        return tuple(v)

    def byte_list(self, key: str, count: int, max_bytes: int = MAX_CIPHERTEXT_BYTES) -> tuple[bytes, ...]:
        v = self._get(key)
        if not isinstance(v, list) or any(not isinstance(x, bytes) or len(x) > max_bytes for x in v):
            raise self._fail(key, f"a list of byte strings of at most {max_bytes} bytes", v)
        if len(v) != count:
            raise Refused(f"stage {self.stage!r}: {key!r} has {len(v)} entries for {count} ids")
        return tuple(v)

    def str_list(self, key: str) -> tuple[str, ...]:
        v = self._get(key)
        if not isinstance(v, list) or any(not isinstance(x, str) for x in v):
            raise self._fail(key, "a list of strings", v)
        return tuple(v)

    def flag(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise self._fail(key, "true or false", v)
        return v

    def fraction(self, key: str) -> float:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise self._fail(key, "a number in (0, 1]", v)
        return float(v)

    def layout(self) -> Layout:
        names, roles = self.str_list("layout-names"), self.str_list("layout-roles")
        ranks, dims = self.ids("layout-ranks", unique=False), self.ids("layout-dims", unique=False)
        if not (len(names) == len(roles) == len(ranks)) or sum(ranks) != len(dims) or len(set(names)) != len(names):
            raise Refused(f"stage {self.stage!r}: the layout's names, roles, ranks and dims do not agree")
        if any(role not in ROLES for role in roles):
            raise Refused(f"stage {self.stage!r}: 'layout-roles' must be among {ROLES}, got {list(roles)}")
        layout, at = [], 0
        for name, role, rank in zip(names, roles, ranks):
            layout.append(Part(name, tuple(dims[at:at + rank]), role))
            at += rank
        return tuple(layout)


def read_header(record: Any, expected_stage: str | None = None, session: str | None = None) -> str:
    """The stage a record says it belongs to; refused unless it is ``expected_stage`` of ``session``."""
    if not isinstance(record, ConfigRecord):
        raise Refused(f"no '{SECAGG}' ConfigRecord")
    stage = record.get(STAGE)
    if stage not in STAGES:
        raise Refused(f"'{STAGE}' must be one of {', '.join(STAGES)}, got {stage!r}")
    if expected_stage is not None and stage != expected_stage:
        raise Refused(f"a {stage!r} record where stage {expected_stage!r} was asked for")
    if session is not None and record.get(SESSION) != session:
        raise Refused(f"stage {stage!r}: session {record.get(SESSION)!r} is not this round's ({session!r})")
    if not isinstance(record.get(SESSION), str):
        raise Refused(f"stage {stage!r}: '{SESSION}' must be a string")
    return str(stage)


def decode_instruction(record: Any) -> Setup | ShareKeys | Collect | Unmask:
    """Client side: the server's stage record, typed."""
    stage = read_header(record)
    r = _Reader(record, stage)
    session = r.text(SESSION)
    if stage == SETUP:
        return Setup(session, r.whole("threshold", 2), r.whole("num-shares", 2), r.whole("modulus-bits", 8, 64),
                     r.positive("clipping-range"), r.whole("levels", 2), r.whole("max-weight", 1),
                     r.text("kind"), r.text("weighting"), r.positive("dp-clip", zero=True),
                     r.positive("dp-noise-multiplier", zero=True), r.whole("dp-min-honest"), r.fraction("dp-sampling"))
    if stage == SHARE_KEYS:
        ids = r.ids("node-ids")
        return ShareKeys(session, ids, r.byte_list("pk1s", len(ids)), r.byte_list("pk2s", len(ids)))
    if stage == COLLECT:
        sources = r.ids("sources")
        return Collect(session, sources, r.byte_list("ciphertexts", len(sources)), r.layout(), r.flag("timed"))
    survivors, dropped = r.ids("survivors"), r.ids("dropped")
    if set(survivors) & set(dropped):
        raise Refused(f"stage 'unmask': nodes {sorted(set(survivors) & set(dropped))} are listed as both "
                      "survivors and dropped (that would reveal both their secrets)")
    return Unmask(session, survivors, dropped)


def decode_reply(content: RecordDict, stage: str, session: str, *,
                 modulus_bits: int | None = None) -> PublicKeys | SealedShares | MaskedInput | Shares:
    """Server side: a node's reply to ``stage`` of ``session``, typed; :class:`Refused` names what is wrong."""
    record = content.get(SECAGG)
    read_header(record, stage, session)
    r = _Reader(record, stage)
    if stage == SETUP:
        return PublicKeys(session, r.blob("pk1"), r.blob("pk2"))
    if stage == SHARE_KEYS:
        dsts = r.ids("destinations")
        return SealedShares(session, dsts, r.byte_list("ciphertexts", len(dsts)), r.blob("commitment", 32))
    if stage == UNMASK:
        owners = r.ids("owners")
        return Shares(session, owners, r.byte_list("shares", len(owners)))
    layout = r.layout()
    masked = content.get(MASKED)
    if not isinstance(masked, ArrayRecord) or list(masked.keys()) != [VECTOR]:
        raise Refused(f"stage 'collect': the reply needs an ArrayRecord '{MASKED}' holding exactly '{VECTOR}'")
    array = masked[VECTOR]
    want = "uint32" if (modulus_bits or 64) <= 32 else "uint64"
    size = sum(p.size for p in layout)
    if array.dtype != want or tuple(array.shape) != (size,):
        raise Refused(f"stage 'collect': '{MASKED}.{VECTOR}' must be {want} of shape ({size},) as its layout "
                      f"says, got {array.dtype} {tuple(array.shape)}")
    vector = array.numpy()
    if modulus_bits is not None and modulus_bits < 64 and vector.size and int(vector.max()) >= 1 << modulus_bits:
        raise Refused(f"stage 'collect': '{MASKED}.{VECTOR}' has values outside the ring 2^{modulus_bits}")
    return MaskedInput(session, layout, vector)
