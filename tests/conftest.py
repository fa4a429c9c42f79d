"""Shared test fixtures: one torch thread, seeded global RNGs, the one real-data skip rule, a Flower
Context factory and a stub node."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)

# Property tests draw the same examples on every CI run (a red CI is then a real regression, never a
# draw); locally they keep drawing new ones. `--hypothesis-seed=N` reproduces a local failure.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# The console script `make install` puts beside python: what a user types.
POLLEN_SCRIPT = Path(sys.executable).parent / "pollen"


def pollen_command(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``pollen *args`` as a user runs it (no ``POLLEN_OUT_DIR`` from the test environment); skips the
    test where the console script is not installed."""
    if not POLLEN_SCRIPT.exists():
        pytest.skip("the `pollen` console script is not installed (make install)")
    env = {k: v for k, v in os.environ.items() if k != "POLLEN_OUT_DIR"}
    return subprocess.run([str(POLLEN_SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)

# The e2e launches give Ray one CPU, so one ClientApp actor runs their (tiny) clients one after another:
# a second actor's start (a Ray worker importing torch, Pollen and the data: ~3.5 CPU-s, measured) costs
# more than it saves at these sizes, and the suite is CPU-bound on CI's two cores. Several actors are
# exercised by the documented commands, make run's determinism test and the cluster tests.
RAY_CPUS = 1

# Every test starts from these seeds (the autouse fixture below), so an unseeded draw is the same run to run.
TEST_SEED = 20240601

# --- per-test time limits ------------------------------------------------------------------------------
# pyproject.toml sets the default limit (pytest-timeout, 300 s). End-to-end tests launch SuperLinks,
# SuperNodes and `flwr run` with their own, longer timeouts (up to 900 s) that fail with a useful message;
# their pytest limit sits above those so it only catches a hang the test's own timeout missed.
E2E_TIMEOUT_S = 1200


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


# --- global RNGs ----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Seed ``random``, ``numpy.random`` and torch's global generators before each test; restore the
    states they had afterwards, so a test neither depends on nor leaks into another's draws."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    # only touch CUDA's generators when CUDA is already in use (querying them would initialise it)
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    random.seed(TEST_SEED)
    np.random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)  # also seeds CUDA's generators (lazily when CUDA is not initialised)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


# --- real data: the one skip rule -----------------------------------------------------------------------

DATA_ENV = "POLLEN_DATA_ROOT"
NO_DATA_REASON = (f"{DATA_ENV} is unset or has no MNIST/raw folder "
                  "(point it at a folder with MNIST/ and FashionMNIST/ in torchvision layout, e.g. ../shared/data)")


def real_data_root() -> str | None:
    """The root of the full MNIST / Fashion-MNIST files, or None when tests needing them must skip.

    The one rule every test uses: ``POLLEN_DATA_ROOT`` is set and holds ``MNIST/raw``."""
    root = os.environ.get(DATA_ENV, "")
    return root if root and (Path(root) / "MNIST" / "raw").is_dir() else None


def require_real_data() -> str:
    """:func:`real_data_root`, skipping the calling test when there is none."""
    root = real_data_root()
    if root is None:
        pytest.skip(NO_DATA_REASON)
    return root


# Decorator form of the same rule, for tests that read the root at module level.
needs_real_data = pytest.mark.skipif(real_data_root() is None, reason=NO_DATA_REASON)


@pytest.fixture
def data_root() -> str:
    """Root of the full MNIST / Fashion-MNIST files; tests needing them skip when it is missing."""
    return require_real_data()


def make_context(run_config: dict | None = None, partition_id: int = 0, num_partitions: int = 3):
    """A real Flower Context as the engine builds one for a node."""
    from flwr.app import RecordDict
    from flwr.common import Context

    return Context(run_id=1, node_id=100 + partition_id,
                   node_config={"partition-id": partition_id, "num-partitions": num_partitions},
                   state=RecordDict(), run_config=dict(run_config or {}))


def stub_node(cid: str, partition: int | None = None):
    """A registered node a strategy may sample and label, but never train: only ``get_properties``
    answers (with its partition id, when given); any other call is a test failure."""
    from flwr.common import Code, GetPropertiesRes, Status
    from flwr.server.client_proxy import ClientProxy

    class StubNode(ClientProxy):
        def get_properties(self, ins, timeout, group_id):
            if partition is None:
                raise AssertionError("this test's strategy should not ask for properties")
            return GetPropertiesRes(Status(Code.OK, ""), {"partition-id": partition})

        def _never(self, *args, **kwargs):
            raise AssertionError("a stub node is never trained or evaluated")

        get_parameters = fit = evaluate = reconnect = _never

    node = StubNode(cid)
    node.partition = partition
    return node
