"""Shared test fixtures: one torch thread, the real-data root, a Flower Context factory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def data_root() -> str:
    """Root of the full MNIST / Fashion-MNIST files; tests needing them skip when it is unset."""
    root = os.environ.get("POLLEN_DATA_ROOT", "")
    if not root or not (Path(root) / "MNIST" / "raw").is_dir():
        pytest.skip("POLLEN_DATA_ROOT does not point at a folder with MNIST/raw (set it to ../shared/data)")
    return root


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
