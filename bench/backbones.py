"""Training throughput of each backbone on this machine, NCHW vs channels-last weights.

Why: clients store conv backbones channels-last (pollen/clients/base.py); this measures whether that
helps here. Writes bench/results/backbones.{json,md}.

    python bench/backbones.py [--width 0.25] [--batch 64] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pollen.models import build_model, to_channels_last

RESULTS = Path(__file__).resolve().parent / "results"
BACKBONES = ("resnet10", "resnet12", "resnet18", "efficientnet_b0", "mobilenet_v2", "googlenet")


def images_per_second(name: str, width: float, batch: int, steps: int, channels_last: bool) -> float:
    torch.manual_seed(0)
    model = build_model(name, 10, width=width)
    if channels_last:
        to_channels_last(model)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for step in range(steps + 1):  # step 0 warms up allocators and kernels
        if step == 1:
            start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in BACKBONES:
        nchw = images_per_second(name, args.width, args.batch, args.steps, False)
        nhwc = images_per_second(name, args.width, args.batch, args.steps, True)
        rows.append({"model": name, "nchw-img-s": round(nchw, 1), "channels-last-img-s": round(nhwc, 1),
                     "speedup": round(nhwc / nchw, 2)})
        print(f"{name:16s} NCHW {nchw:8.1f} img/s  channels-last {nhwc:8.1f} img/s  x{nhwc / nchw:.2f}", flush=True)
    meta = {"width": args.width, "batch": args.batch, "steps": args.steps, "threads": args.threads,
            "torch": torch.__version__, "machine": platform.machine(), "cpu-count": torch.get_num_threads()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "backbones.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"Training throughput, CPU, width {args.width}, batch {args.batch}, {args.threads} thread(s), "
             f"torch {torch.__version__}", "", "| model | NCHW img/s | channels-last img/s | speed-up |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['nchw-img-s']} | {r['channels-last-img-s']} | ×{r['speedup']} |" for r in rows]
    (RESULTS / "backbones.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
