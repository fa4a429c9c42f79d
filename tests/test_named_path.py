"""One named path for every family: records are decoded into typed instructions and replies are encoded
from typed values by ``pollen/protocol/<family>.py``; a ``NumPyClient`` meets positional parameters only
at its ``fit``/``evaluate`` boundary, where the same protocol types convert them. Read from the source:
no positional decoding of arrays (an array count, ``arrays[0]``, ``reply[1:]``) anywhere between the wire
and the cores."""

from __future__ import annotations

import re

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from pollen.protocol import logits, prototypes, weights
from pollen.protocol.records import array_record
from tests.conftest import PROJECT_ROOT

# The packages between the wire and the cores (the protocol itself decodes; models and datasets never see
# a message).
SCANNED = ("app", "clients", "methods", "privacy", "strategies", "secagg")
# Flower's deprecated strategy API hands positional ``Parameters``: the legacy adapter is that API's boundary.
EXEMPT = {"pollen/strategies/legacy.py"}
_LISTS = r"(arrays|parameters|params|reply|replies|ndarrays|released|payload)"
POSITIONAL = re.compile(rf"len\({_LISTS}\)\s*(==|!=|>=|<=|>|<)\s*[1-9]"  # an array count told apart
                        rf"|\b{_LISTS}\[-?\d+\]"  # arrays[0], reply[2]
                        rf"|\b{_LISTS}\[-?\d*:-?\d*\]")  # arrays[2:], reply[1:]


def _offenders(root=PROJECT_ROOT) -> list[str]:
    found = []
    for package in SCANNED:
        for path in sorted((root / "pollen" / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel in EXEMPT:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if POSITIONAL.search(code):
                    found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_no_positional_decoding_outside_the_protocol():
    offenders = _offenders()
    assert not offenders, "positional decoding outside pollen/protocol/:\n" + "\n".join(offenders)


def test_the_scan_finds_positional_decoding(tmp_path):
    fake = tmp_path / "pollen" / "app"
    fake.mkdir(parents=True)
    (fake / "old.py").write_text("if len(arrays) == 3:\n    s = arrays[0]\nm = reply[1:]\nok = len(arrays) == 0\n")
    assert [line.rsplit(": ", 1)[1] for line in _offenders(tmp_path)] == ["if len(arrays) == 3:", "s = arrays[0]",
                                                                          "m = reply[1:]"]


def _content(arrays: dict, config: dict, **extra: dict) -> RecordDict:
    content = RecordDict({"arrays": array_record(arrays), "config": ConfigRecord(config)})
    for name, record in extra.items():
        content[name] = array_record(record)
    return content


def test_weights_records_and_positional_parameters_give_one_instruction():
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "steps": np.array(4, dtype=np.int64)}
    config = {"server-round": 2, "proximal-mu": 0.5}
    named = weights.decode_instruction(_content(state, config))
    positional = weights.WeightsInstruction.from_parameters(["w", "steps"], list(state.values()), config)
    assert named.proximal_mu == positional.proximal_mu == 0.5 and named.server_round == 2
    assert all(np.array_equal(named.state[k], positional.state[k]) for k in state)
    reply = weights.WeightsReply(named.state, 7, {"train-loss": 0.25})
    content = reply.content()
    assert list(content["arrays"].keys()) == ["w", "steps"] and content["metrics"]["num-examples"] == 7
    assert [a.shape for a in reply.parameters()] == [(2, 3), ()]


def test_prototype_records_and_positional_parameters_give_one_instruction():
    protos, present = np.ones((3, 4), np.float32), np.array([1, 0, 1])
    named = prototypes.decode_instruction(RecordDict({"arrays": prototypes.encode_global_prototypes(protos, present, 0.5),
                                                      "config": ConfigRecord({"server-round": 3})}))
    positional = prototypes.PrototypeInstruction.from_parameters(
        [protos, present, np.array([0.5], np.float32)], {"server-round": 3})
    for ins in (named, positional):
        assert ins.glob is not None and ins.glob.margin == 0.5 and ins.server_round == 3 and ins.monitor
        np.testing.assert_array_equal(ins.glob.prototypes, protos)
        ins.glob.check(3, 4)
    assert prototypes.decode_instruction(RecordDict({"arrays": ArrayRecord()})).glob is None
    assert prototypes.PrototypeInstruction.from_parameters([], {}).glob is None
    # a private reply travels under its own keys, by its type (no array count tells it apart)
    private = prototypes.PrivatePrototypeReply(np.zeros((3, 4), np.float32), np.array([5.0, -1.0, 2.0], np.float32),
                                               0.75, 6, {})
    assert set(private.content()["arrays"].keys()) == {"proto-sums", "noisy-counts", "count-noise-std"}
    plain = prototypes.PrototypeReply(protos, np.array([2, 0, 3]), 5, {})
    assert set(plain.content()["arrays"].keys()) == {"prototypes", "class-counts"}
    assert plain.released_counts.tolist() == [2, 0, 3] and private.released_counts.tolist() == [5.0, -1.0, 2.0]


def test_logit_records_and_positional_parameters_give_one_instruction():
    consensus = np.full((5, 3), 0.5, np.float32)
    model = {"a": np.zeros(2, np.float32), "b": np.ones((2, 2), np.float32)}
    content = RecordDict({"arrays": logits.encode_consensus(consensus, 4), "config": ConfigRecord({"server-round": 2}),
                          "model": array_record(model)})
    named = logits.decode_instruction(content)
    positional = logits.LogitInstruction.from_parameters([consensus, np.array([4]), *model.values()],
                                                         {"server-round": 2}, ["a", "b"])
    for ins in (named, positional):
        assert ins.contributors == 4 and ins.server_round == 2 and ins.model is not None and list(ins.model) == ["a", "b"]
        np.testing.assert_array_equal(ins.consensus, consensus)
    solo = logits.LogitReply(None, None, 9, {})
    assert len(solo.content()["arrays"]) == 0 and solo.parameters() == []
    homogeneous = logits.LogitReply(consensus, model, 9, {})
    assert list(homogeneous.content()["model"].keys()) == ["a", "b"] and len(homogeneous.parameters()) == 3


def test_every_family_reaches_its_client_through_its_protocol_module():
    from pollen.app.registry import METHODS

    for spec in METHODS.values():
        assert spec.adapter is not None, spec.name
        assert spec.adapter.decode.__module__.startswith("pollen.protocol."), (spec.name, spec.adapter.decode)
