"""Secure aggregation on a real TLS fleet (SuperLink with HTTPS and SuperNode authentication, 4 SuperNodes):
one SuperNode is SIGKILLed in the middle of a SecAgg+ round — after it has sent its keys and its sealed
shares, before its masked update — and the round still aggregates the three others (its pairwise masks
rebuilt from the survivors' shares), the run completes, and the results name the lost node."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from pollen.launch.fleet import Fleet, compose_run_config, format_config, plan_nodes
from pollen.launch.processes import groups_alive


def sent_train_replies(log: str) -> int:
    """Train replies a SuperNode's log says it sent (``Sending: train message`` then ``Sent successfully``)."""
    count, sending = 0, False
    for line in log.splitlines():
        if "Sending: " in line:
            sending = "Sending: train message" in line
        elif "Sent successfully" in line and sending:
            count, sending = count + 1, False
    return count


@pytest.mark.e2e
def test_tls_fleet_with_secure_aggregation_survives_a_supernode_killed_mid_protocol(tmp_path):
    out = tmp_path / "runs"
    values, _ = compose_run_config(method="fedavg", rounds=1, out_dir=out, data_root=None,
                                   user=format_config({"local-epochs": 1, "secure-aggregation": True,
                                                       "secagg-threshold": 0.6}),
                                   num_supernodes=4)
    done: dict = {}
    with Fleet(tmp_path / "work", tls=True, echo=False) as fleet:
        nodes = [fleet.add_supernode(spec) for spec in plan_nodes(4)]
        fleet.wait_for_nodes(4, timeout=240)

        def run() -> None:
            try:
                done["outcome"] = fleet.run(values, timeout=900, echo=False)
            except BaseException as err:  # reported below
                done["error"] = err

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        victim = nodes[2]
        deadline = time.monotonic() + 600
        # its 'setup' and 'share-keys' replies have left: its secrets are in the round, its update is not
        while sent_train_replies(victim.log_path.read_text(errors="replace")) < 2:
            assert thread.is_alive() and time.monotonic() < deadline, f"{done}\n{fleet.log_tails()}"
            time.sleep(0.1)
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(timeout=30)
        thread.join(timeout=900)
        assert not thread.is_alive(), fleet.log_tails()
        groups = fleet.process_groups()
        sent = sent_train_replies(victim.log_path.read_text(errors="replace"))
    assert not groups_alive(groups), "a SuperLink/SuperNode outlived its fleet"
    assert "error" not in done, done.get("error")
    outcome = done["outcome"]
    assert outcome.completed, outcome.log[-4000:]
    assert sent == 2  # it never sent its masked update
    run_dir = out / str(outcome.run_id)
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(row["fit-clients"]) == ["partition 0", "partition 1", "partition 3"], row
    lost = [f for f in row["failure-reasons"] if f["stage"] == "train"]
    assert len(lost) == 1 and "secure aggregation: no reply at stage 'collect'" in lost[0]["reason"], row
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 1
