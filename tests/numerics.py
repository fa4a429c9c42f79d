"""Which CPU kernels produced a float: this machine's numeric platform, for tests that pin exact bits.

Torch's CPU kernels (ATen's vectorised paths, MKL's BLAS, oneDNN's convolutions) choose their code by
the CPU's vendor and instruction set, so one seed gives floats that differ in their last bits from one
kind of CPU to another. Measured: the same round-1 reply of a FedAvg client hashes differently on an
AMD EPYC (AVX2) than on the machine that recorded the stored digests, and a 2-round FCCL run's round-1
accuracy on 80 test images is 0.075 there against 0.0875 stored (one image). A test that pins exact bits
or stored numbers therefore keeps one value per platform where they differ, each computed on that
platform from the same reference (the code before the feature under test, checked out and run there),
and the recorded value (``REFERENCE``) elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")
REFERENCE = "reference"  # the platform the first values were recorded on (not named when recorded)


@functools.cache
def numeric_platform() -> str:
    """``<CPU vendor>-<torch's CPU capability>``, e.g. ``AuthenticAMD-AVX2``."""
    import torch

    vendor = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def on_this_platform(values: Mapping[str, T]) -> T:
    """This platform's value, or the reference platform's when it has none of its own."""
    return values.get(numeric_platform(), values[REFERENCE])
