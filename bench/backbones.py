"""Training throughput of each backbone on this machine, NCHW vs channels-last weights.

Why: clients store conv backbones channels-last (pollen/clients/base.py); this measures whether that
helps here. Writes bench/results/backbones.{json,md}.

    python -m bench.backbones [--width 0.25] [--batch 64] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from bench.kit import RESULTS, read_json, write_atomic, write_json
from pollen.models import build_model, to_channels_last

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


def markdown(data: dict) -> str:
    s = data["settings"]
    lines = [f"Training throughput, CPU, width {s['width']}, batch {s['batch']}, {s['threads']} thread(s), "
             f"torch {s['torch']}", "", "| model | NCHW img/s | channels-last img/s | speed-up |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['nchw-img-s']} | {r['channels-last-img-s']} | ×{r['speedup']} |"
              for r in data["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown from the results JSON")
    args = parser.parse_args()
    if args.report:
        write_atomic(RESULTS / "backbones.md", markdown(read_json(RESULTS / "backbones.json")))
        return
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
    data = {"settings": meta, "rows": rows}
    write_json(RESULTS / "backbones.json", data, indent=2)
    write_atomic(RESULTS / "backbones.md", markdown(data))


if __name__ == "__main__":
    main()
