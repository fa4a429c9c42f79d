"""A resume never forgets spent budget: a private run interrupted after some clients replied in a round,
resumed from an older checkpoint (the nodes roll their state back and train the rounds again), ends with
every node's ledger holding every release it ever made, and a client that reached ``dp-max-epsilon``
before the interrupt stays stopped after it.

Pollen's ServerApp and real ClientApps in this process (``pollen.testing``); the interrupt is a
``BaseException`` raised while the server sends round k's messages, which nothing in the app catches
(as a Ctrl-C or a killed process ends a run: the round is never recorded). The resumed nodes start with
an empty ``context.state`` (a restarted SuperNode) on the same state folders."""

from __future__ import annotations

import json
import re

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import Context, Message, MessageType, RecordDict

from pollen.app.checkpoints import list_checkpoints
from pollen.app.client_app import app as client_app
from pollen.app.server_app import main as server_main
from pollen.privacy import Ledger, LedgerFile
from pollen.testing import InProcessGrid, clientapp_node

DELTA, SIGMA = 1e-5, 2.0
NODES = 3


class Interrupt(BaseException):
    """The run stops here, as under Ctrl-C: no handler of the app sees it."""


def independent_epsilon(releases: int) -> float:
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(SIGMA), releases)
    return accountant.get_epsilon(DELTA)


def _run(rc: dict, states, seen: dict[int, list[float]], interrupt_at: tuple[int, int] | None = None) -> None:
    """One launch: fresh nodes (empty context.state) on ``states``; every train reply's ε is kept in
    ``seen``; ``interrupt_at`` = (round, partition): the run stops when that partition is sent that round."""
    nodes = {100 + p: clientapp_node(client_app, rc, p, NODES, node_id=100 + p, state_dir=str(states[p]))
             for p in range(NODES)}

    def node(pid):
        def handle(msg: Message) -> Message:
            training = msg.metadata.message_type == MessageType.TRAIN
            if training and interrupt_at == (int(msg.content["config"]["server-round"]), pid):
                raise Interrupt
            reply = nodes[100 + pid](msg)
            if training and not reply.has_error():
                seen[pid].append(float(reply.content["metrics"]["dp-epsilon"]))
            return reply
        return handle

    grid = InProcessGrid({100 + p: node(p) for p in range(NODES)})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


def test_a_resumed_run_counts_every_release_and_a_reached_cap_still_stops(tmp_path):
    out = tmp_path / "runs"
    states = [tmp_path / "nodes" / f"partition-{p}" for p in range(NODES)]
    cap = independent_epsilon(4) * 1.0001  # room for exactly four releases
    rc = {"method": "fedproto", "task": "uci-dirichlet", "max-train-samples": 40, "batch-size": 8,
          "num-server-rounds": 4, "fraction-evaluate": 0.0, "checkpoint-every": 2, "max-empty-rounds": 1,
          "dp-mode": "payload", "dp-noise-multiplier": SIGMA, "dp-clip": 1.0, "dp-max-epsilon": cap,
          "out-dir": str(out)}
    seen: dict[int, list[float]] = {p: [] for p in range(NODES)}
    # partitions 0 and 1 reply in round 4 (their 4th release: the cap), then the run stops
    with pytest.raises(Interrupt):
        _run(rc, states, seen, interrupt_at=(4, 2))
    run_dir = out / "7"
    assert list_checkpoints(run_dir) == [2]  # round 3's checkpoint is not kept (every 2), round 4 never closed
    assert [len(seen[p]) for p in range(NODES)] == [4, 4, 3]

    # resume from round 2: the nodes roll back to their round-2 state and are asked for rounds 3 and 4 again
    _run({**rc, "resume-from": str(run_dir)}, states, seen)
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and [r["round"] for r in rounds] == [1, 2, 3, 4]
    stopped = {r["round"]: sorted(re.search(r"(partition \d) stops releasing", f["reason"]).group(1)
                                  for f in r.get("failure-reasons", [])) for r in rounds}
    # the cap reached before the interrupt still stops 0 and 1; 2 makes its 4th release, then stops too
    assert stopped == {1: [], 2: [], 3: ["partition 0", "partition 1"],
                       4: ["partition 0", "partition 1", "partition 2"]}
    assert list(rounds[2]["fit-clients"]) == ["partition 2"] and not rounds[3]["fit-clients"]

    per_client = summary["privacy"]["dp-epsilon-row-given-model-per-client"]  # payload prototypes: one row
    for p in range(NODES):
        ledger = Ledger(DELTA, LedgerFile.in_folder(states[p]).releases())
        assert ledger.count == len(seen[p]) == 4  # every release the server may have seen, and no other
        assert seen[p] == sorted(seen[p])  # never rolled back, not even when the state was
        assert ledger.epsilon() >= max(seen[p]) and ledger.epsilon() == pytest.approx(independent_epsilon(4), rel=1e-3)
        assert ledger.epsilon() <= cap
        # what the run reports for the node is what its ledger holds, not the last ε before the rollback
        assert per_client[f"partition {p}"] == pytest.approx(ledger.epsilon(), rel=1e-12)
    assert summary["privacy"]["dp-epsilon-row-given-model-max"] >= max(max(v) for v in seen.values())
