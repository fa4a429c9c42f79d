"""``python -m bench.gpu`` must be ready when a GPU machine is lent: it exits 0 with a message where there is no
CUDA, and its every part runs end to end (here on the CPU, tiny) and writes its JSON and Markdown."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import PROJECT_ROOT, RAY_CPUS, require_real_data


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device on this machine: nothing measured" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing written that could pass for a measurement


@pytest.mark.e2e
def test_every_part_runs_on_the_cpu_and_writes_its_tables(tmp_path):
    data_root = require_real_data()  # the FedProto part trains on MNIST
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--steps", "1", "--batch", "2",
                           "--width", "0.25", "--proxy-images", "2", "--proxy-one-by-one", "1",
                           "--proxy-iterations", "1", "--clients", "3", "--rounds", "1", "--data-root", data_root,
                           "--run-config", "shot-shots=20 shot-test-per-class=5", "--ray-cpus", str(RAY_CPUS),
                           "--threads", "1", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert len(data["throughput"]) == 7 and all(r["images-per-s"] > 0 for r in data["throughput"])
    assert [r["mode"] for r in data["proxy"]] == ["batched", "one-by-one"]
    assert [r["images"] for r in data["proxy"]] == [2, 1]
    md = (tmp_path / "gpu.md").read_text()
    assert "| FCCL MobileNetV2 | `mobilenet_v2` | 3x32x32 |" in md
    run = data["fedproto-run"]
    assert run["status"] == "finished:completed" and run["clients"] == 3 and run["gpus-per-client"] == 0.0, run
    assert 0.0 <= run["final-accuracy"] <= 1.0 and run["round-1-s"] > 0
    assert run["run-config"] == "shot-shots=20 shot-test-per-class=5"  # the run says what it was given


def test_a_slow_throughput_keeps_three_significant_digits_and_never_reads_zero():
    from bench.gpu import throughput_figure

    assert throughput_figure(1234.56) == 1234.6 and throughput_figure(1.04) == 1.0
    assert throughput_figure(0.0412345) == 0.0412 and throughput_figure(0.000123456) == 0.000123
