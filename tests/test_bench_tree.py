"""The studies' process samplers find every process a launch starts by its environment mark — a
grandchild that its parent left behind included — and measure those processes, not the test."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.footprint import Peaks
from bench.scale import TreeMemory
from pollen.launch.processes import proc_table

pytestmark = pytest.mark.skipif(proc_table() is None, reason="needs /proc")

# The child starts a grandchild in its own session and exits at once (the orphan is what a
# daemon-started Ray worker looks like to a launch). The grandchild holds 64 MB, spins for 1 CPU-second,
# says so in a file, and rests 1 s more so that its CPU time can be read after the spin.
LAUNCH = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", '''
import pathlib, sys, time
block = bytearray(64 * 2**20)
for i in range(0, len(block), 4096): block[i] = 1
while time.process_time() < 1.0: pass
pathlib.Path(sys.argv[1]).touch()
time.sleep(1.0)
''', sys.argv[1]], start_new_session=True)
"""


def _launch(tree, done: Path) -> None:
    subprocess.run([sys.executable, "-c", LAUNCH, str(done)], env=tree.env(), check=True)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done.exists(), "the grandchild never finished its spin"


def test_peaks_sees_the_orphaned_grandchild_and_its_memory(tmp_path):
    with Peaks() as peaks:
        _launch(peaks, tmp_path / "spun")
        time.sleep(0.5)  # a scan after the spin
    assert max(peaks.peak.values()) >= 64 * 2**20
    rest = peaks.by_role()["Ray and the rest"]
    assert rest["largest-mb"] >= 64 and rest["processes"] == len(peaks.peak) >= 1


def test_tree_memory_traces_the_cpu_of_the_marked_processes_only(tmp_path):
    with TreeMemory() as tree:
        time.sleep(0.6)  # the trace has samples before and after the span asked about, as within a run
        started = time.monotonic()
        _launch(tree, tmp_path / "spun")
        ended = time.monotonic()
        time.sleep(0.3)
    assert tree.peak_bytes >= 64 * 2**20 and tree.peak_processes >= 1
    spent = tree.cpu_by_role(started, ended)
    assert spent is not None
    # the grandchild's 1 CPU-second (read in clock ticks) and its start-up; not this test's own process
    assert 0.9 <= spent["Ray and the rest"] <= 2.5
