"""End to end: `flwr run` on a SuperLink the test owns, in simulation, on the embedded default task.

(A completed simulation's results are checked on the two launches of ``make run``'s shape in
``tests/test_deterministic_runs.py``.)"""

import json

import pytest

from pollen.launch import simulate
from tests.conftest import PROJECT_ROOT, RAY_CPUS

pytestmark = pytest.mark.e2e


def test_failed_server_app_is_reported_as_failed(tmp_path):
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=PROJECT_ROOT, flwr_home=tmp_path / "flwr", num_supernodes=2,
                       run_config="method='no-such-method' num-server-rounds=1", timeout=300, echo=False)
    assert outcome.status == "finished:failed" and outcome.status_from == "flower"  # it wrote no summary
    assert not outcome.completed
    # what the user sees: the key, the bad value and what exists
    assert "run config key 'method' = 'no-such-method' is invalid: expected one of" in outcome.log
    assert "fedavg" in outcome.log.split("no-such-method' is invalid", 1)[1][:2000]


def test_orphaned_server_app_of_a_superlink_is_stopped():
    """An interrupted run can leave `flwr-serverapp` (own session) behind; the launcher's cleanup finds it by
    the SuperLink address on its command line and leaves other processes alone."""
    import subprocess
    import sys
    import time

    from pollen.launch import free_port
    from pollen.launch.superlinks import stop_orphaned_apps

    port, other = free_port(), free_port()
    code = "import time; time.sleep(120)"

    def fake_app(p):
        return subprocess.Popen(["bash", "-c", f'exec -a /x/flwr-serverapp "{sys.executable}" -c "{code}" '
                                               f"--runtime-api-address 127.0.0.1:{p}"], start_new_session=True)

    mine, theirs = fake_app(port), fake_app(other)
    try:
        time.sleep(0.5)
        assert stop_orphaned_apps(port) == [mine.pid]
        assert mine.wait(timeout=10) != 0 and theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()


def test_more_min_clients_than_supernodes_fails_fast_naming_both_numbers(tmp_path):
    """Simulation registers every node before the ServerApp starts: no waiting for nodes that never come."""
    import time

    out = tmp_path / "runs"
    t0 = time.monotonic()
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=PROJECT_ROOT, flwr_home=tmp_path / "flwr", num_supernodes=2,
                       run_config=f"min-available-clients=5 num-server-rounds=1 out-dir='{out}'", timeout=300,
                       echo=False)
    assert outcome.status == "finished:failed"
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert "only 2 node(s) connected" in summary["failure-reason"] and "needs 5" in summary["failure-reason"]
    assert time.monotonic() - t0 < 240  # the launcher's own start-up dominates; no 120 s node wait
