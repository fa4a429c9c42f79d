"""How many rounds does the GLFC-family global model need to learn task 1? The regime search behind
``bench.glfc_study``.

A method is only judged on class-incremental learning when it learns each task first. This runs the
first task of the MNIST + Fashion-MNIST stream (digits 0-4) with Finetune — the plain FedAvg core every
GLFC variant shares in task 1 — through the real strategy and ClientApp handlers (``bench.glfc``'s
in-process grid), and records the server's accuracy after every round of task 1. One record per
(setting, seed) in ``bench/results/glfc_regime.json``; finished ones are skipped::

    .venv/bin/python -m bench.glfc_regime --rounds-per-task 10 --seeds 0,1
    .venv/bin/python -m bench.glfc_regime --report
"""

from __future__ import annotations

import argparse
import builtins
import sys
import time
from pathlib import Path

from bench.kit import RESULTS, default_data_root, read_json, write_atomic, write_json

OUT = RESULTS / "glfc_regime.json"
KNOBS = ("rounds_per_task", "epochs", "lr", "width", "initial_clients", "new_clients", "clients_per_round",
         "max_per_class", "batch_size")


class _TaskOneDone(Exception):
    pass


def task_one(args: argparse.Namespace, seed: int) -> list[float]:
    """Server accuracy after each round of task 1 (the run is stopped at the task's end)."""
    import torch

    from bench.glfc import method_config, run_inprocess

    torch.set_num_threads(1)
    ns = argparse.Namespace(**{k: getattr(args, k) for k in KNOBS}, data_root=args.data_root, seed=seed, tasks=4,
                            memory=60, eval_per_class=200, proxy_iterations=20, proxy_keep=5, oracle=True, tau=1.2)
    accs: list[float] = []
    real_print = builtins.print

    def watch(*parts, **kw):  # run_inprocess prints "  round r: acc a (…)" after each round
        real_print(*parts, **kw)
        text = parts[0] if parts and isinstance(parts[0], str) else ""
        if text.startswith("  round "):
            accs.append(float(text.split("acc ")[1].split()[0]))
            if len(accs) == args.rounds_per_task:
                raise _TaskOneDone

    builtins.print = watch
    try:
        run_inprocess(method_config("finetune", ns))
    except _TaskOneDone:
        pass
    finally:
        builtins.print = real_print
    return accs


def report(records: list[dict]) -> str:
    lines = ["# GLFC family: the rounds task 1 needs (regime search)", "",
             "Task 1 of the MNIST + Fashion-MNIST stream (digits 0-4), Finetune (the FedAvg core every GLFC variant "
             "shares in task 1), ResNet-18, SGD without momentum, cosine learning rate within the task, 60 % of the "
             "task's classes per client, ≤ 100 images per client and class. Accuracy of the global model on 1,000 "
             "test images of the 5 classes after the task's last round.", "",
             "| rounds per task | local epochs | lr | width | clients (start, +per task, per round) | seed | "
             "accuracy after each round | at task end |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["rounds_per_task"], r["epochs"], -r["lr"], r["initial_clients"],
                                            r["seed"])):
        curve = ", ".join(f"{a:.2f}" for a in r["accuracy"])
        lines.append(f"| {r['rounds_per_task']} | {r['epochs']} | {r['lr']} | {r['width']} | {r['initial_clients']}, "
                     f"+{r['new_clients']}, {r['clients_per_round']} | {r['seed']} | {curve} | "
                     f"**{r['accuracy'][-1]:.3f}** |")
    lines += ["", "Why 20 rounds: at the paper's 10 rounds per task, seed 1 stops at 0.79 with "
              "4, 8 or 10 clients and with 1 local epoch, while seeds 0 and 2 pass 0.95; the curves flatten as the "
              "cosine schedule takes the learning rate towards 0 at the task's end. With 20 rounds per task seed 1 "
              "reaches 0.98. (More clients do not cure it: with 10 clients every class of seed 1 has at least two "
              "holders and the run still stops at 0.79.) `glfc_methods.md` reports task 1 for every run of the study "
              "(`python -m bench.glfc_study`).",
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds-per-task", type=int, default=20)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--width", type=float, default=0.125)
    p.add_argument("--initial-clients", type=int, default=4)
    p.add_argument("--new-clients", type=int, default=2)
    p.add_argument("--clients-per-round", type=int, default=4)
    p.add_argument("--max-per-class", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--report", action="store_true")
    args = p.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    records = read_json(OUT, [])
    if not args.report:
        for seed in (int(s) for s in args.seeds.split(",")):
            key = {**{k: getattr(args, k) for k in KNOBS}, "seed": seed}
            if any(all(r[k] == v for k, v in key.items()) for r in records):
                continue
            t0 = time.perf_counter()
            accs = task_one(args, seed)
            records.append({**key, "accuracy": accs, "wall-s": round(time.perf_counter() - t0, 1)})
            write_json(OUT, records)
    write_atomic(OUT.with_suffix(".md"), report(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
