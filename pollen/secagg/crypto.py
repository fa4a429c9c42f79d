"""The cryptography SecAgg+ needs, from maintained libraries only: nothing here is a cipher or a scheme.

* key pairs and key agreement: Flower's ``generate_key_pairs`` (ECDH on P-384, ``cryptography``) and
  ``generate_shared_key`` (ECDH + HKDF-SHA256 to 32 bytes);
* authenticated encryption of shares: Flower's ``encrypt``/``decrypt`` (Fernet: AES-128-CBC + HMAC);
* Shamir t-of-n sharing: Flower's ``create_shares``/``combine_shares`` (PyCryptodome, GF(2^128));
* masks: AES-256 in counter mode from ``cryptography``, keyed by the 32-byte seed, as a keystream.

Why not Flower's own mask generator (``pseudo_rand_gen``): it folds the seed into 32 bits before seeding
numpy's Mersenne Twister, so every mask is one of 2^32 streams a server can enumerate, and it draws from
``[0, modulus - 1)``, never ``modulus - 1`` (tests/test_secagg_crypto.py shows both). A keystream of a
256-bit key is uniform over ``Z_{2^b}`` once its words are cut to ``b`` bits.

Keys travel as compressed points (49 bytes) and are shared as raw 48-byte scalars, not PEM (~215 and
~185 bytes): Shamir works on 16-byte chunks, so the smaller secret costs a third of the sharing.
"""

from __future__ import annotations

import base64
import hashlib

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.supercore.primitives.asymmetric import generate_key_pairs

CURVE = ec.SECP384R1()  # Flower's generate_key_pairs curve
PUBLIC_KEY_BYTES = 49  # compressed P-384 point
PRIVATE_KEY_BYTES = 48  # P-384 scalar
SEED_BYTES = 32  # self-mask seed: an AES-256 key
SHARE_CHUNK = 16  # Flower's Shamir: 4-byte index + 16 bytes per chunk of the padded secret
DecryptionError = (InvalidToken, InvalidTag, ValueError, TypeError)


def new_key_pair() -> tuple[bytes, bytes]:
    """A fresh (private scalar, compressed public point) pair; a new one every round."""
    private, public = generate_key_pairs()
    return private_bytes(private), public.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)


def private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_numbers().private_value.to_bytes(PRIVATE_KEY_BYTES, "big")


def load_private(raw: bytes) -> ec.EllipticCurvePrivateKey:
    if len(raw) != PRIVATE_KEY_BYTES:
        raise ValueError(f"a private key is {PRIVATE_KEY_BYTES} bytes, got {len(raw)}")
    return ec.derive_private_key(int.from_bytes(raw, "big"), CURVE)


def load_public(raw: bytes) -> ec.EllipticCurvePublicKey:
    """A peer's public key; ``ValueError`` for anything that is not a point of the curve."""
    if not isinstance(raw, bytes) or len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"a public key is a {PUBLIC_KEY_BYTES}-byte compressed P-384 point")
    return ec.EllipticCurvePublicKey.from_encoded_point(CURVE, raw)


def public_of(private_raw: bytes) -> bytes:
    """The compressed public key of a raw private key (checks a reconstructed key against its owner's)."""
    return load_private(private_raw).public_key().public_bytes(Encoding.X962, PublicFormat.CompressedPoint)


def agree(private: ec.EllipticCurvePrivateKey | bytes, public: ec.EllipticCurvePublicKey | bytes) -> bytes:
    """The 32-byte secret two nodes share (ECDH + HKDF), base64url as Fernet wants it. Pass loaded keys
    when agreeing with many peers: loading a key costs a good part of an agreement."""
    key = load_private(private) if isinstance(private, bytes) else private
    return generate_shared_key(key, load_public(public) if isinstance(public, bytes) else public)


def seal(key: bytes, plaintext: bytes) -> bytes:
    return encrypt(key, plaintext)


def open_sealed(key: bytes, ciphertext: bytes) -> bytes:
    """Decrypt and authenticate; raises one of ``DecryptionError`` for a forged or misdirected message."""
    return decrypt(key, ciphertext)


def commitment(secret: bytes) -> bytes:
    """SHA-256 of a secret, published before its shares are: a reconstruction can then be checked."""
    return hashlib.sha256(secret).digest()


def split_secret(secret: bytes, threshold: int, num_shares: int) -> list[bytes]:
    return create_shares(secret, threshold, num_shares)


def combine_secret(shares: list[bytes]) -> bytes:
    return combine_shares(shares)


def share_length(secret_length: int) -> int:
    """Bytes of one share of a ``secret_length``-byte secret (PKCS#7-padded to whole chunks)."""
    return 4 + SHARE_CHUNK * (secret_length // SHARE_CHUNK + 1)


def share_index(share: bytes) -> int:
    return int.from_bytes(share[:4], "little")


def mask_key(agreed: bytes) -> bytes:
    """The 32 raw bytes behind an agreed base64url key: the pairwise mask's AES key."""
    return base64.urlsafe_b64decode(agreed)


def _keystream(seed: bytes, zeros: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The AES-256-CTR keystream of ``seed`` over ``zeros`` (its length in bytes), written into ``out``
    (15 bytes longer, as ``update_into`` wants), read as little-endian 64-bit words. A seed is used for one
    vector only (keys and seeds are fresh every round), so the zero nonce is never reused."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")
    Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update_into(zeros.data, out.data)
    return out[:zeros.size].view("<u8")


def mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` uniform elements of ``Z_{2^bits}`` (uint64) from a 32-byte seed: the AES-256-CTR
    keystream of the seed, read as little-endian 64-bit words cut to ``bits`` bits."""
    words = _keystream(seed, np.zeros(8 * length, np.uint8), np.empty(8 * length + 15, np.uint8))
    return words & np.uint64((1 << bits) - 1) if bits < 64 else words.astype(np.uint64)


class Masker:
    """Adds masks to (and takes them off) vectors of one length in place, in ``Z_{2^64}``: a vector's masks
    cost one AES pass and one addition each. One keystream buffer serves every mask: a fresh 8-byte-per-
    element buffer per mask costs several times the AES itself (page faults). uint64 arithmetic wraps
    modulo 2^64, a multiple of every ring's modulus, so the caller cuts the result to its ring once
    (:func:`pollen.secagg.field.reduce`) and gets what :func:`mask` and ring additions would give."""

    def __init__(self, length: int):
        self._zeros = np.zeros(8 * length, np.uint8)
        self._out = np.empty(8 * length + 15, np.uint8)

    def add(self, vector: np.ndarray, seed: bytes, sign: int = 1) -> None:
        """``vector += sign · mask(seed)`` (uint64, in place); ``sign`` is +1 or -1."""
        words = _keystream(seed, self._zeros, self._out)
        (np.add if sign > 0 else np.subtract)(vector, words, out=vector)
