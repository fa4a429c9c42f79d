"""What is kept: atomic checkpoints, refusal of corrupt ones, node state on disk, resume, final models.

Runs use Pollen's real ServerApp ``main`` and real ClientApp, served in this process by the in-process
grid (``pollen.testing``); the same files are written under ``flwr run`` (see the e2e tests).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from pollen.app import checkpoints
from pollen.app.checkpoints import (
    CheckpointError,
    checkpoint_paths,
    latest_checkpoint,
    list_checkpoints,
    load_arrays,
    load_records,
    save_records,
    write_checkpoint,
)
from pollen.app.client_app import app as client_app
from pollen.app.server_app import main as server_main
from pollen.testing import InProcessGrid, clientapp_node
from tests.test_run_regression import without_timings

CONFIG = {"method": "fedavg"}


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.array(seed, dtype=np.int64)}


def test_checkpoints_keep_the_newest_and_round_trip(tmp_path):
    for r in (1, 2, 3):
        write_checkpoint(tmp_path, r, _arrays(r), {"rng": [3, [1, 2], None], "k": r}, CONFIG, keep=2)
    assert list_checkpoints(tmp_path) == [2, 3]
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.round == 3 and ckpt.values["k"] == 3 and ckpt.config == CONFIG
    np.testing.assert_array_equal(ckpt.arrays["w"], _arrays(3)["w"])
    assert ckpt.arrays["n"].shape == () and ckpt.arrays["n"] == 3


def test_arrays_load_in_the_order_they_were_saved_in(tmp_path):
    """safetensors lays tensors out by dtype and name; a resumed strategy that got its model in that order
    summed its update norms in another order than the uninterrupted run, and a round's spread median moved
    by one bit (the family resume e2e test, under load). Files keep the saved order; a file written without
    it (another tool) loads in its own order."""
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    model = {"z.weight": rng.normal(size=(4, 3)).astype(np.float32), "b.count": np.array(7, dtype=np.int64),
             "m.bias": rng.normal(size=3), "a.weight": rng.normal(size=2).astype(np.float32)}
    checkpoints.save_arrays(tmp_path / "m.safetensors", model, metadata={"note": "kept"})
    assert list(load_arrays(tmp_path / "m.safetensors")) == list(model)
    write_checkpoint(tmp_path, 1, model, {}, CONFIG, keep=1)
    assert list(latest_checkpoint(tmp_path).arrays) == list(model)
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(save(model))
    loaded = load_arrays(foreign, allow_unverified=True)
    assert sorted(loaded) == sorted(model) and list(loaded) != list(model)  # the file's own order
    for key, value in model.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_a_truncated_checkpoint_is_refused_by_name_and_the_previous_one_used(tmp_path, caplog):
    for r in (1, 2):
        write_checkpoint(tmp_path, r, _arrays(r), {"k": r}, CONFIG, keep=2)
    newest, _ = checkpoint_paths(tmp_path, 2)
    newest.write_bytes(newest.read_bytes()[:40])
    assert latest_checkpoint(tmp_path).round == 1
    assert "round-0002.safetensors: content does not match its recorded SHA-256" in caplog.text
    oldest, _ = checkpoint_paths(tmp_path, 1)
    oldest.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no valid checkpoint .*round-0002.*round-0001"):
        latest_checkpoint(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_an_unwritable_folder_fails_naming_the_path_and_keeps_the_last_checkpoint(tmp_path):
    write_checkpoint(tmp_path, 1, _arrays(1), {}, CONFIG, keep=2)
    folder = tmp_path / "checkpoints"
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(CheckpointError, match=str(folder)):
            write_checkpoint(tmp_path, 2, _arrays(2), {}, CONFIG, keep=2)
    finally:
        folder.chmod(stat.S_IRWXU)
    assert latest_checkpoint(tmp_path).round == 1


def _chattr(flag: str, path: Path) -> bool:
    import subprocess

    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_a_checkpoint_folder_made_unwritable_mid_run_fails_the_run_naming_it(tmp_path):
    """A real fault, even for root: the checkpoint folder turns immutable (``chattr +i``) while round 2
    trains. The run fails with a message naming the folder; round 1's checkpoint stays valid."""
    probe = tmp_path / "probe"
    probe.mkdir()
    if not _chattr("+i", probe):
        pytest.skip("chattr +i is not available on this file system / for this user")
    _chattr("-i", probe)
    run_config = {"method": "fedavg", "task": "uci-dirichlet", "seed": 3, "local-epochs": 1,
                  "num-server-rounds": 3, "out-dir": str(tmp_path / "runs")}
    folder = tmp_path / "runs" / "7" / "checkpoints"
    nodes = {100 + p: clientapp_node(client_app, run_config, p, 2, state_dir=str(tmp_path / f"p{p}"))
             for p in range(2)}
    first = nodes[100]

    def turns_folder_immutable(msg):
        if msg.metadata.message_type == "train" and msg.content["config"]["server-round"] == 2:
            assert _chattr("+i", folder)
        return first(msg)

    nodes[100] = turns_folder_immutable
    try:
        with pytest.raises(CheckpointError, match=str(folder)):
            server_main(InProcessGrid(nodes), Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                                                      run_config=run_config))
    finally:
        _chattr("-i", folder)
    assert latest_checkpoint(tmp_path / "runs" / "7").round == 1
    summary = json.loads((tmp_path / "runs" / "7" / "summary.json").read_text())
    assert summary["status"] == "failed" and str(folder) in summary["failure-reason"]


def test_a_failing_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    """Disk full, simulated where the bytes hit the disk: the rename never happens."""
    write_checkpoint(tmp_path, 1, _arrays(1), {}, CONFIG, keep=2)
    before = checkpoint_paths(tmp_path, 1)[0].read_bytes()

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        write_checkpoint(tmp_path, 1, _arrays(9), {}, CONFIG, keep=2)
    assert checkpoint_paths(tmp_path, 1)[0].read_bytes() == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_node_state_round_trips_through_disk(tmp_path):
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    state = RecordDict({"model": ArrayRecord({"w": Array(np.ones((2, 2), np.float32)),
                                              "steps": Array(np.array(3))}),
                        "small": ConfigRecord({"json": '{"history": [1, 2]}', "flag": True}),
                        "m": MetricRecord({"x": 1.5})})
    save_records(tmp_path, state)
    again = RecordDict()
    assert load_records(tmp_path, again)
    assert again["model"]["steps"].numpy().shape == () and again["small"]["flag"] is True
    np.testing.assert_array_equal(again["model"]["w"].numpy(), state["model"]["w"].numpy())
    assert again["m"]["x"] == 1.5 and not load_records(tmp_path / "empty", RecordDict())


def _flip(path: Path, at: int = -8) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_saved_arrays_and_json_carry_a_sidecar_and_a_flipped_byte_is_refused_by_name(tmp_path, caplog):
    path = tmp_path / "final" / "global.safetensors"
    digest = checkpoints.save_arrays(path, _arrays(1))
    assert checkpoints.sidecar(path).read_text() == f"{digest}  global.safetensors\n"  # sha256sum -c format
    np.testing.assert_array_equal(load_arrays(path)["w"], _arrays(1)["w"])
    checkpoints.write_json(tmp_path / "final" / "global.json", {"round": 3})
    assert checkpoints.read_json(tmp_path / "final" / "global.json") == {"round": 3}
    _flip(path)
    with pytest.raises(CheckpointError, match=rf"{path}: content does not match its recorded SHA-256"):
        load_arrays(path)
    _flip(tmp_path / "final" / "global.json", at=3)
    assert [str(path) in p or "global.json" in p for p in checkpoints.verify_files(tmp_path)] == [True, True]
    checkpoints.save_arrays(path, _arrays(2))
    checkpoints.sidecar(path).unlink()  # deleting the sidecar does not turn the check into a warning
    with pytest.raises(checkpoints.UnverifiedFileError, match=rf"{path}: no global.safetensors.sha256 beside it"):
        load_arrays(path)
    assert any("no global.safetensors.sha256 beside it" in p for p in checkpoints.verify_files(tmp_path))
    assert load_arrays(path, allow_unverified=True)["n"] == 2  # only when the caller asks, with a warning
    assert "global.safetensors: no global.safetensors.sha256 beside it: loaded UNVERIFIED" in caplog.text


def test_a_flipped_byte_inside_a_checkpoints_tensor_data_is_refused_and_the_previous_one_used(tmp_path, caplog):
    """One bit of one weight (the file still parses, the header is intact): the checkpoint's JSON records the
    arrays' SHA-256, so round 2 is refused by name and round 1 continues the run; a resume's check of the
    run folder leaves checkpoints to this fallback and still refuses any other changed file."""
    for r in (1, 2):
        write_checkpoint(tmp_path, r, _arrays(r), {"k": r}, CONFIG, keep=2)
    newest, _ = checkpoint_paths(tmp_path, 2)
    header = 8 + int.from_bytes(newest.read_bytes()[:8], "little")  # safetensors: u64 length + JSON header
    assert header < newest.stat().st_size - 8
    _flip(newest, at=header + 3)
    from safetensors.numpy import load

    assert set(load(newest.read_bytes())) == {"w", "n"}  # still a valid file with other numbers in it
    assert latest_checkpoint(tmp_path).round == 1
    assert "round-0002.safetensors: content does not match its recorded SHA-256 (in round-0002.json)" in caplog.text
    assert checkpoints.verify_files(tmp_path, skip=("checkpoints",)) == []
    assert any("round-0002.safetensors" in p for p in checkpoints.verify_files(tmp_path))


def test_node_state_is_kept_per_round_back_to_what_a_kept_checkpoint_needs():
    assert checkpoints.rounds_to_keep([1, 2, 3, 4, 5], newest=5, keep_back=2) == {3, 4, 5}
    assert checkpoints.rounds_to_keep([1, 4, 9], newest=9, keep_back=2) == {4, 9}  # round 7's checkpoint needs round 4
    assert checkpoints.rounds_to_keep([9], newest=9, keep_back=0) == {9}


def test_node_state_rolls_back_to_the_round_before_the_one_asked_for(tmp_path):
    from flwr.app import ConfigRecord

    for r in (1, 2, 3, 4):
        save_records(tmp_path, RecordDict({"h": ConfigRecord({"last-round": r})}), r, keep_back=2)
    assert checkpoints.state_rounds(tmp_path) == [2, 3, 4]
    for before, expected in ((5, 4), (4, 3), (3, 2), (None, 4)):
        state = RecordDict()
        assert load_records(tmp_path, state, before) and state["h"]["last-round"] == expected
    assert not load_records(tmp_path, RecordDict(), 2)  # nothing trained before round 2 is kept: fresh
    _flip(tmp_path / "round-0004" / "small-state.json", at=5)
    with pytest.raises(CheckpointError, match=r"round-0004/small-state.json: content does not match"):
        load_records(tmp_path, RecordDict(), 5)


def test_node_state_of_the_flat_layout_of_older_runs_is_still_read(tmp_path):
    from flwr.app import ConfigRecord

    checkpoints.write_json(tmp_path / "small-state.json", {"h": {"kind": "config", "values": {"r": 7}}})
    state = RecordDict()
    assert load_records(tmp_path, state, 9) and state["h"]["r"] == 7
    checkpoints.sidecar(tmp_path / "small-state.json").unlink()
    with pytest.raises(CheckpointError, match="small-state.json.sha256 beside it"):  # never loaded unverified
        load_records(tmp_path, RecordDict(), 9)
    save_records(tmp_path, RecordDict({"h": ConfigRecord({"r": 8})}), 8)
    assert not (tmp_path / "small-state.json").exists() and checkpoints.state_rounds(tmp_path) == [8]


# -- resume: an interrupted run continued to the end equals the uninterrupted run ----------------------
def _run(run_config, out_dir, state_root, num_partitions=3):
    grid = InProcessGrid({100 + p: clientapp_node(client_app, run_config, p, num_partitions,
                                                  state_dir=str(state_root / f"p{p}"))
                          for p in range(num_partitions)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**run_config, "out-dir": str(out_dir)}))
    return Path(run_config["resume-from"]) if run_config.get("resume-from") else out_dir / "7"


def _metrics(run_dir):
    """Every round record, timings aside (the round's spread included: a resume must not move its last bit)."""
    return without_timings([json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.parametrize("method, task, extra", [
    ("fedavg", "uci-dirichlet", {}),
    ("local", "uci-dirichlet", {}),
    ("fedproto", "mnist-shot", {"shot-shots": 12, "shot-stdev": 1, "shot-test-per-class": 5}),
    ("bd-fedproto", "mnist-shot", {"shot-shots": 12, "shot-stdev": 1, "shot-test-per-class": 5}),
])
def test_resumed_run_ends_with_the_metrics_of_an_uninterrupted_one(method, task, extra, tmp_path):
    if task == "mnist-shot":
        from tests.conftest import require_real_data

        extra = {**extra, "data-root": require_real_data()}
    base = {"method": method, "task": task, "seed": 3, "local-epochs": 1, **extra}
    full = _run({**base, "num-server-rounds": 3}, tmp_path / "full", tmp_path / "full-nodes")
    part = _run({**base, "num-server-rounds": 2}, tmp_path / "part", tmp_path / "part-nodes")
    assert json.loads((part / "summary.json").read_text())["status"] == "completed"
    resumed = _run({**base, "num-server-rounds": 3, "resume-from": str(part)}, tmp_path / "unused",
                   tmp_path / "part-nodes")
    assert resumed == part
    assert _metrics(resumed) == _metrics(full)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["files"]["checkpoint"].endswith("round-0003.safetensors")
    if method != "local":
        assert (resumed / "final" / "global.safetensors").exists()
    if method in ("local", "fedproto", "bd-fedproto"):
        info = json.loads((tmp_path / "part-nodes" / "p0" / "final-model.json").read_text())
        assert info["round"] == 3 and info["method"] == method and info["partition-id"] == 0


def test_a_run_stopped_after_its_last_checkpoint_gets_its_final_files_on_resume(tmp_path):
    """Killed between the last round's checkpoint and the final files (a SIGKILL lands there): there is no
    round left to run, but the resume writes ``final/`` from that checkpoint, equal to an unstopped run's."""
    base = {"method": "fedavg", "task": "uci-dirichlet", "seed": 3, "local-epochs": 1, "num-server-rounds": 2}
    full = _run(base, tmp_path / "full", tmp_path / "full-nodes")
    part = _run(base, tmp_path / "part", tmp_path / "part-nodes")
    shutil.rmtree(part / "final")
    resumed = _run({**base, "resume-from": str(part)}, tmp_path / "unused", tmp_path / "part-nodes")
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["files"]["global"].endswith("global.safetensors")
    mine, theirs = (checkpoints.load_arrays(r / "final" / "global.safetensors") for r in (resumed, full))
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("method", ["fedproto", "bd-fedproto"])
def test_a_run_interrupted_between_training_and_its_checkpoint_resumes_exactly(method, tmp_path):
    """The SIGINT case: every node trained (and saved) round 3, the server's round-3 checkpoint was never
    written. The resumed run restarts at round 3 from checkpoint 2; each node must roll back to its
    round-2 state, not train round 3 a second time on its round-3 model. Metrics and every personal
    model end as in the uninterrupted run."""
    from tests.conftest import require_real_data

    base = {"method": method, "task": "mnist-shot", "seed": 3, "local-epochs": 1, "shot-shots": 12,
            "shot-stdev": 1, "shot-test-per-class": 5, "data-root": require_real_data(), "num-server-rounds": 3}
    full = _run(base, tmp_path / "full", tmp_path / "full-nodes")
    part = _run(base, tmp_path / "part", tmp_path / "part-nodes")
    for path in checkpoint_paths(part, 3):
        path.unlink()
    assert checkpoints.state_rounds(tmp_path / "part-nodes" / "p0") == [1, 2, 3]  # what the nodes had kept
    resumed = _run({**base, "resume-from": str(part)}, tmp_path / "unused", tmp_path / "part-nodes")
    assert _metrics(resumed) == _metrics(full)
    for p in range(3):
        mine = load_arrays(tmp_path / "part-nodes" / f"p{p}" / "final-model.safetensors")
        theirs = load_arrays(tmp_path / "full-nodes" / f"p{p}" / "final-model.safetensors")
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in theirs)


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path):
    base = {"method": "fedavg", "task": "uci-dirichlet", "num-server-rounds": 1}
    part = _run(base, tmp_path / "part", tmp_path / "nodes")
    with pytest.raises(CheckpointError, match=r"differs in \['lr', 'method'\]"):
        _run({**base, "method": "fedprox", "lr": 0.1, "num-server-rounds": 2, "resume-from": str(part)},
             tmp_path / "x", tmp_path / "nodes")


def test_resumed_fccl_run_ends_with_the_metrics_of_an_uninterrupted_one(tmp_path):
    """The logit family: consensus, private/teacher models and SOLO state all come back from disk; with
    the leave-one-out target each node also learns, by partition, that its own logits are in the mean."""
    from tests.conftest import require_real_data
    from tests.test_fccl_client import TINY

    base = {**TINY, "method": "fccl", "model": "cnn_mnist", "data-root": require_real_data(), "seed": 1,
            "fccl-target": "leave-one-out"}
    full = _run({**base, "num-server-rounds": 3}, tmp_path / "full", tmp_path / "full-nodes", num_partitions=4)
    part = _run({**base, "num-server-rounds": 2}, tmp_path / "part", tmp_path / "part-nodes", num_partitions=4)
    resumed = _run({**base, "num-server-rounds": 3, "resume-from": str(part)}, tmp_path / "unused",
                   tmp_path / "part-nodes", num_partitions=4)
    assert _metrics(resumed) == _metrics(full)
    assert (resumed / "final" / "global.safetensors").exists()
    assert json.loads((tmp_path / "part-nodes" / "p3" / "final-model.json").read_text())["round"] == 3


def test_a_key_added_after_a_run_started_counts_as_its_default_on_resume():
    """A run folder from before a key existed resumes while that key keeps its default; set otherwise,
    or any other key changed, is refused by name."""
    from pollen.app.registry import all_defaults
    from pollen.app.server_app import config_differences

    now = {**all_defaults(), "method": "fedavg", "task": "uci-dirichlet"}
    older = {k: v for k, v in now.items() if not k.startswith("dp-") and k not in ("aggregation", "trim-fraction")}
    assert config_differences(older, now) == []
    assert config_differences(older, {**now, "dp-mode": "payload", "aggregation": "median"}) == ["aggregation",
                                                                                                 "dp-mode"]
    assert config_differences({**older, "lr": now["lr"] * 2}, now) == ["lr"]
