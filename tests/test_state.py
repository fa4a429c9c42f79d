import numpy as np
import torch
from flwr.app import RecordDict

from pollen.clients.state import ClientState
from pollen.models import build_model


def test_module_round_trip_includes_buffers():
    torch.manual_seed(0)
    model = build_model("resnet10", 10, width=0.125)
    model.train()
    model(torch.randn(4, 3, 32, 32))  # moves BatchNorm running statistics away from their init
    state = ClientState(RecordDict())
    state.save_module("net", model)

    torch.manual_seed(1)
    other = build_model("resnet10", 10, width=0.125)
    assert ClientState(state.records).load_module("net", other)
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    assert not state.load_module("missing", other)


def test_arrays_and_values_round_trip():
    state = ClientState(RecordDict())
    idx = np.array([3, 1, 4], dtype=np.int64)
    losses = np.array([0.5, 0.25], dtype=np.float32)
    state.save_arrays("memory", {"idx": idx, "losses": losses})
    state.save_values("history", {"rounds": [1, 2], "entropy": 0.7})
    arrays = state.load_arrays("memory")
    assert arrays["idx"].dtype == np.int64 and np.array_equal(arrays["idx"], idx)
    assert np.array_equal(arrays["losses"], losses)
    assert state.load_values("history") == {"rounds": [1, 2], "entropy": 0.7}
    assert state.load_values("nothing", {"a": 1}) == {"a": 1}
    assert state.load_arrays("nothing") is None
