"""The ring the masked vectors live in (integers modulo 2^b) and the fixed-point code between floats and it.

A value ``x`` clipped to ``[-c, c]`` becomes the integer ``rint(x · L / 2c)`` (``L`` = quantization
levels, so ``|q| <= L/2``), and negative integers wrap into the ring as two's complement. A sum of
integers whose true total stays inside ``(-2^(b-1), 2^(b-1))`` is read back exactly by taking the ring
element as a signed number: the capacity check below refuses a round before that could fail.

Rounding is to nearest (deterministic): a sum under secure aggregation is then the same, to the bit,
whatever the masks were, and each coordinate moves by at most half a step (``c / L``), which also bounds
how far quantization can raise a clipped vector's norm (``sqrt(d) / 2`` steps), the figure distributed
DP needs. Flower's ``quantize`` is not used: it rounds stochastically from numpy's global RNG and casts
to int32.
"""

from __future__ import annotations

import numpy as np

MIN_BITS, MAX_BITS = 8, 64


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"the modulus is 2^b with b a whole number in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return bits


def wire_dtype(bits: int) -> np.dtype:
    """The narrowest unsigned type that holds the ring: what a masked vector travels as."""
    return np.dtype(np.uint32) if bits <= 32 else np.dtype(np.uint64)


def _low(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1) if bits < 64 else np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def to_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Whole numbers (any signed or unsigned integer dtype) as ring elements (uint64, two's complement)."""
    return np.asarray(values).astype(np.int64, copy=False).view(np.uint64) & _low(bits)


def add(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """``(a + b) mod 2^bits``; uint64 wraps modulo 2^64, a multiple of every smaller modulus."""
    return (a + b) & _low(bits)


def sub(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    return (a - b) & _low(bits)


def reduce(values: np.ndarray, bits: int) -> np.ndarray:
    """uint64 values cut to the ring in place (after additions that wrapped modulo 2^64); returns them."""
    if bits < 64:
        np.bitwise_and(values, _low(bits), out=values)
    return values


def signed(ring: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements read as the integers in ``[-2^(b-1), 2^(b-1))`` they stand for (int64)."""
    values = np.asarray(ring, dtype=np.uint64).view(np.int64).copy()
    if bits < 64:
        values[values >= (1 << (bits - 1))] -= 1 << bits
    return values


def step(clipping_range: float, levels: int) -> float:
    """The value of one quantization step."""
    return 2.0 * clipping_range / levels


def quantize(values: np.ndarray, clipping_range: float, levels: int) -> np.ndarray:
    """Floats clipped to ``[-c, c]`` and rounded to the nearest step (int64, ``|q| <= levels / 2``).

    Non-finite values are refused: a NaN has no place in a sum nobody can inspect."""
    x = np.array(values, dtype=np.float64)  # one copy, then every pass in place
    if not np.isfinite(x).all():
        raise ValueError("a value to aggregate securely is NaN or infinite")
    np.clip(x, -clipping_range, clipping_range, out=x)
    np.divide(x, step(clipping_range, levels), out=x)
    return np.rint(x, out=x).astype(np.int64)


def dequantize(integers: np.ndarray, clipping_range: float, levels: int) -> np.ndarray:
    return np.asarray(integers, dtype=np.float64) * step(clipping_range, levels)


def check_capacity(bound: int, bits: int, what: str) -> None:
    """Refuse a sum whose largest possible magnitude ``bound`` would wrap around the ring."""
    if bound >= 1 << (bits - 1):
        raise ValueError(f"{what}: the sum can reach {bound:,}, which does not fit a ring of 2^{bits} "
                         f"(largest signed value {(1 << (bits - 1)) - 1:,}); raise secagg-modulus-bits or lower "
                         "secagg-quantization")
