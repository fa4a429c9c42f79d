"""GPU benchmark, ready to run on a CUDA machine: what Pollen's families cost on one accelerator.

Three parts, each written to ``bench/results/gpu.{json,md}`` (``--out`` to change):

1. **Local training throughput** (images/s, SGD steps of cross-entropy, forward + backward) of the
   backbones each family trains: FedProto's MNIST CNN, ResNet-18 on CIFAR-sized input (FedProto
   CIFAR-10 and GLFC), and FCCL's heterogeneous backbones (ResNet-10/12, EfficientNet-B0,
   MobileNetV2) — fp32, after warm-up, with ``cuda.synchronize`` around the timed steps.
2. **A 20-client FedProto run** (``mnist-shot``, a real ``flwr run`` through ``pollen.launch.launcher``)
   with Ray GPU fractions: ``--gpus-per-client 0.25`` puts four clients on the GPU at once.
   Needs MNIST under ``--data-root``; skipped with a message otherwise.
3. **GLFC proxy**: gradient inversion of the clients' LeNet gradients, batched vs the official
   one-by-one loop, same L-BFGS settings.

On a machine without CUDA it says so and exits 0 (``--device cpu`` runs the same code on the CPU,
at whatever sizes you give, which is how the tests exercise it)::

    python -m bench.gpu --data-root ../shared/data            # about 5 minutes on one GPU
    python -m bench.gpu --device cpu --steps 2 --batch 8 --proxy-images 4 --skip-run --out /tmp/gpu
    python -m bench.gpu --device cpu --steps 1 --batch 2 --clients 3 --rounds 1 --run-config "shot-shots=20" \
        --ray-cpus 1 --threads 1 --out /tmp/gpu                        # the CPU check, smaller still
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from bench.kit import RESULTS, read_metrics, write_json

# (label, model name, input shape, classes): the backbones each family trains in its paper setting.
BACKBONES = (
    ("FedProto MNIST CNN", "cnn_mnist", (1, 28, 28), 10),
    ("ResNet-18, CIFAR-10 (FedProto CIFAR)", "resnet18", (3, 32, 32), 10),
    ("ResNet-18, CIFAR-100 (GLFC)", "resnet18", (3, 32, 32), 100),
    ("FCCL ResNet-10", "resnet10", (3, 32, 32), 10),
    ("FCCL ResNet-12", "resnet12", (3, 32, 32), 10),
    ("FCCL EfficientNet-B0", "efficientnet_b0", (3, 32, 32), 10),
    ("FCCL MobileNetV2", "mobilenet_v2", (3, 32, 32), 10),
)


def training_throughput(name: str, shape: tuple[int, ...], classes: int, device, *, batch: int, steps: int,
                        width: float) -> float:
    """Images/s of plain SGD training steps after one warm-up step."""
    import torch
    import torch.nn.functional as F

    from pollen.models import build_model

    torch.manual_seed(0)
    model = build_model(name, classes, in_channels=shape[0], image_size=shape[-1], width=width).to(device).train()
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return batch * steps / (time.perf_counter() - start)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput_figure(images_per_s: float) -> float:
    """One decimal, or three significant digits below 1 image/s (a tiny CPU check under load must not read 0)."""
    return round(images_per_s, 1) if images_per_s >= 1 else float(f"{images_per_s:.3g}")


def part_throughput(args, device) -> list[dict]:
    rows = []
    for label, name, shape, classes in BACKBONES:
        ips = training_throughput(name, shape, classes, device, batch=args.batch, steps=args.steps, width=args.width)
        rows.append({"backbone": label, "model": name, "input": list(shape), "classes": classes,
                     "batch": args.batch, "width": args.width, "images-per-s": throughput_figure(ips)})
        print(f"[gpu bench] {label:40s} {ips:10.1f} images/s", flush=True)
    return rows


def part_fedproto_run(args) -> dict:
    """One real 20-client FedProto simulation with Ray GPU fractions."""
    from pollen import launch
    from pollen.launch import parse_run_config

    data_root = Path(args.data_root).expanduser() if args.data_root else None
    if data_root is None or not (data_root / "MNIST" / "raw").is_dir():
        return {"skipped": f"MNIST not found under --data-root {args.data_root!r}"}
    gpus = args.gpus_per_client if args.device == "cuda" else 0.0
    run_config = {"method": "fedproto", "task": "mnist-shot", "num-server-rounds": args.rounds,
                  "seed": 0, "device": args.device, **parse_run_config(args.run_config)}
    out_dir = Path(args.out) / "gpu-runs"
    start = time.perf_counter()
    outcome = launch.simulate(num_supernodes=args.clients, gpus_per_client=gpus, run_config=run_config,
                              timeout=args.run_timeout, echo=False, out_dir=out_dir, data_root=data_root,
                              ray_cpus=args.ray_cpus)
    wall = time.perf_counter() - start
    row = {"clients": args.clients, "rounds": args.rounds, "gpus-per-client": gpus, "status": outcome.status,
           "wall-s": round(wall, 1), "flwr-run-s": round(outcome.wall_time_s, 1)}
    if args.run_config:
        row["run-config"] = args.run_config
    if outcome.results_dir is not None and (outcome.results_dir / "metrics.jsonl").exists():
        lines = read_metrics(outcome.results_dir)
        times = [r["wall-time-s"] for r in lines if isinstance(r.get("wall-time-s"), (int, float))]
        if times:
            row["round-1-s"] = round(times[0], 2)
            later = sorted(times[1:]) or times
            row["median-round-s-from-2"] = round(later[len(later) // 2], 2)
        final = lines[-1].get("evaluate", {}) if lines else {}
        for key in ("accuracy", "proto-accuracy"):
            if key in final:
                row[f"final-{key}"] = round(float(final[key]), 4)
    if not outcome.completed:
        row["failure"] = (outcome.failure_reason or outcome.log[-1500:]).strip()
    print(f"[gpu bench] FedProto {args.clients} clients x {args.rounds} rounds, {gpus} GPU per client: "
          f"{row['status']} in {row['wall-s']} s", flush=True)
    return row


def part_proxy(args, device) -> list[dict]:
    """GLFC's proxy on the device: batched inversion vs the official loop on the first few images."""
    import torch

    from pollen.methods.glfc import build_lenet
    from pollen.strategies.proxy import LBFGSSettings, reconstruct_batched, reconstruct_one_by_one

    lenet = build_lenet("mnist-fmnist-cil", 0).to(device)
    gen = torch.Generator().manual_seed(0)
    shape = (1, 28, 28)
    x = torch.rand(args.proxy_images, *shape, generator=gen).to(device)
    y = torch.randint(0, 20, (args.proxy_images,), generator=gen)
    grads = [lenet.gradient(x[i], int(y[i])) for i in range(len(y))]
    seeds = list(range(len(grads)))
    n1 = min(args.proxy_one_by_one, len(grads))
    settings = LBFGSSettings()
    rows = []
    for mode, fn, n in (("batched", reconstruct_batched, len(grads)), ("one-by-one", reconstruct_one_by_one, n1)):
        kwargs = {"chunk": len(grads)} if mode == "batched" else {}
        sync(device)
        rec = fn(lenet, grads[:n], shape, seeds[:n], iterations=args.proxy_iterations, keep_last=1,
                 settings=settings, **kwargs)
        sync(device)
        rows.append({"mode": mode, "images": n, "iterations": args.proxy_iterations, "seconds": round(rec.seconds, 2),
                     "images-per-s": round(n / rec.seconds, 3),
                     "label-accuracy": float((rec.labels == y[:n]).float().mean()),
                     "matching-loss-final-median": float(rec.losses.median())})
        print(f"[gpu bench] proxy {mode:10s} {n:4d} images {n / rec.seconds:9.2f} images/s", flush=True)
    return rows


def write_markdown(path: Path, data: dict) -> None:
    meta = data["config"]
    lines = ["# GPU benchmark", "",
             f"Device: {meta['device-name']} ({meta['device']}); torch {meta['torch']}; "
             f"written by `bench/gpu.py` at {meta['date']}.", "",
             "## Local training throughput", "",
             f"SGD steps, fp32, batch {meta['batch']}, width {meta['width']}, {meta['steps']} timed steps after "
             "one warm-up step.", "",
             "| backbone | model | input | images/s |", "|---|---|---|---|"]
    for r in data["throughput"]:
        lines.append(f"| {r['backbone']} | `{r['model']}` | {'x'.join(map(str, r['input']))} | {r['images-per-s']} |")
    lines += ["", "## FedProto, 20 clients with Ray GPU fractions", ""]
    run = data["fedproto-run"]
    if "skipped" in run:
        lines.append(f"Skipped: {run['skipped']}.")
    else:
        lines += ["| clients | rounds | GPU per client | status | round 1 s | median round s (from 2) | "
                  "final accuracy | final proto accuracy | wall s |", "|---|---|---|---|---|---|---|---|---|",
                  f"| {run['clients']} | {run['rounds']} | {run['gpus-per-client']} | {run['status']} | "
                  f"{run.get('round-1-s', '–')} | {run.get('median-round-s-from-2', '–')} | "
                  f"{run.get('final-accuracy', '–')} | {run.get('final-proto-accuracy', '–')} | {run['wall-s']} |"]
        if "failure" in run:
            lines += ["", "```", run["failure"], "```"]
    lines += ["", "## GLFC proxy: gradient inversion", "",
              "| mode | images | L-BFGS steps | seconds | images/s | label accuracy | final matching loss (median) |",
              "|---|---|---|---|---|---|---|"]
    for r in data["proxy"]:
        lines.append(f"| {r['mode']} | {r['images']} | {r['iterations']} | {r['seconds']} | {r['images-per-s']} | "
                     f"{r['label-accuracy']:.3f} | {r['matching-loss-final-median']:.4g} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--data-root", default=os.environ.get("POLLEN_DATA_ROOT"))
    parser.add_argument("--out", default=str(RESULTS), help="folder for gpu.json and gpu.md")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpus-per-client", type=float, default=0.25)
    parser.add_argument("--run-timeout", type=float, default=420.0)
    parser.add_argument("--skip-run", action="store_true", help="skip the FedProto simulation")
    parser.add_argument("--run-config", default="",
                        help="run config keys merged over the FedProto run's (e.g. smaller shot-shots for a CPU check)")
    parser.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the run's private Ray (default: all)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads of the throughput and proxy parts (0: torch's default)")
    parser.add_argument("--proxy-images", type=int, default=256)
    parser.add_argument("--proxy-one-by-one", type=int, default=8)
    parser.add_argument("--proxy-iterations", type=int, default=10)
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("[gpu bench] no CUDA device on this machine: nothing measured (run it where a GPU is, or pass "
              "--device cpu to exercise the script on the CPU)", flush=True)
        return 0
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": args.device, "device-name": name, "torch": torch.__version__, "batch": args.batch,
            "steps": args.steps, "width": args.width, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    data = {"config": meta, "throughput": part_throughput(args, device),
            "fedproto-run": {"skipped": "--skip-run"} if args.skip_run else part_fedproto_run(args),
            "proxy": part_proxy(args, device)}
    write_json(out / "gpu.json", data, indent=2)
    write_markdown(out / "gpu.md", data)
    print(f"[gpu bench] wrote {out / 'gpu.json'} and {out / 'gpu.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
