"""GLFC benchmarks on the offline MNIST + Fashion-MNIST class-incremental stream.

(a) ``methods``: GLFC vs FedAvg + iCaRL vs Finetune (+ ablations) — per-task accuracy matrix, average
    incremental accuracy (AIA), average forgetting, accuracy vs round. Writes
    ``bench/results/glfc_runs.{json,md,png}`` (the 3-seed study in ``glfc_methods.*`` is
    ``bench.glfc_study``'s).
(b) ``proxy``: gradient inversion throughput, batched vs the official one-by-one loop at equal L-BFGS
    iterations, with the final gradient-matching loss and the label accuracy of both. Writes
    ``bench/results/glfc_proxy.{json,md}``.

Runs are CPU-sized (tiny ResNet-18 width, few rounds per task, small shards; see ``--help``). Method
runs go through the real strategy and clients; ``--engine flwr`` runs each through ``flwr run``
(simulation), ``--engine inprocess`` (default, ~1 min less per method on 2 cores) runs the same
Message-API strategy (``strategy.start``) and ClientApp handlers in one process over an in-process grid.

    python -m bench.glfc proxy --data-root ../shared/data
    python -m bench.glfc methods --data-root ../shared/data [--methods glfc fedavg-icarl finetune]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.kit import RESULTS, preset, pyplot, read_metrics, save_figure, simulate_run, write_json
from pollen.testing import run_inprocess

PRESET = "glfc-mnist-fmnist"
METHODS = ("glfc", "fedavg-icarl", "finetune", "glfc-wo-gc", "glfc-wo-rd", "glfc-wo-proxy")
# a GLFC bench's options (the stream, the clients, the training) -> the run keys they set over the preset's
RUN_KEYS = {"tasks": "glfc-tasks", "rounds_per_task": "glfc-rounds-per-task", "initial_clients": "glfc-initial-clients",
            "new_clients": "glfc-new-clients", "clients_per_round": "glfc-clients-per-round",
            "max_per_class": "glfc-max-per-class", "memory": "glfc-memory-size",
            "eval_per_class": "glfc-eval-per-class", "proxy_iterations": "glfc-proxy-iterations",
            "proxy_keep": "glfc-proxy-keep", "width": "model-width", "epochs": "local-epochs",
            "batch_size": "batch-size", "lr": "lr"}


def preset_setting() -> dict:
    """The preset's values of :data:`RUN_KEYS`, by option name: the study's defaults."""
    keys = preset(PRESET)
    return {name: keys[key] for name, key in RUN_KEYS.items()}


# ----------------------------------------------------------------------------------------------
# (a) methods


def method_config(method: str, args) -> dict:
    """The preset's run keys with the :data:`RUN_KEYS` of ``args``; per run the method, data, seed, the rounds
    and classes per task the stream implies, the boundaries (oracle or detected) and the detector's τ."""
    return {**preset(PRESET), **{key: getattr(args, name) for name, key in RUN_KEYS.items()},
            "method": method, "data-root": args.data_root, "seed": args.seed,
            "num-server-rounds": args.tasks * args.rounds_per_task, "glfc-classes-per-task": 20 // args.tasks,
            "glfc-oracle-boundary": args.oracle, "glfc-tau": args.tau}


def run_flwr(run_config: dict, num_nodes: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs"
        outcome = simulate_run("flwr run", flwr_home=Path(tmp) / "flwr", num_supernodes=num_nodes,
                               run_config={**run_config, "out-dir": str(out)}, timeout=7200, echo=False)
        return read_metrics(outcome.results_dir)


def summarise(rounds: list[dict], tasks: int, rounds_per_task: int) -> dict:
    from pollen.strategies.glfc import aia, average_forgetting

    ends = [rounds[(t + 1) * rounds_per_task - 1]["server-evaluate"] for t in range(tasks)]
    matrix = [[ev[f"task{j}-accuracy"] for j in range(t + 1)] for t, ev in enumerate(ends)]
    seen = [ev["accuracy"] for ev in ends]
    return {"accuracy-per-round": [r["server-evaluate"]["accuracy"] for r in rounds],
            "seen-accuracy-at-task-end": seen, "task-accuracy-matrix": matrix, "aia": aia(seen),
            "forgetting": average_forgetting(matrix), "final-accuracy": seen[-1],
            "wall-time-s": sum(r.get("wall-time-s", 0.0) for r in rounds),
            "transitions": sum(int(r["fit"].get("transitions", 0)) for r in rounds),
            "proxy-gradients": sum(int(r["fit"].get("proxy-gradients", 0)) for r in rounds)}


def bench_methods(args) -> None:
    from pollen.datasets.incremental import StreamConfig, plan_stream

    results = {}
    out_json = Path(args.out) / "glfc_runs.json"
    if args.table_only:
        write_methods(json.loads(out_json.read_text())["methods"], args)
        return
    if out_json.exists() and args.resume:
        results = json.loads(out_json.read_text()).get("methods", {})
    for method in args.methods:
        name = f"{method}{args.label}"
        if name in results:
            continue
        rc = method_config(method, args)
        print(f"[glfc bench] {name}", flush=True)
        plan = plan_stream(StreamConfig(num_tasks=args.tasks, classes_per_task=20 // args.tasks,
                                        initial_clients=args.initial_clients, new_clients=args.new_clients,
                                        old_fraction=0.1, class_fraction=0.6, duplicate=False, max_per_class=0,
                                        seed=args.seed))
        rounds = run_inprocess(rc) if args.engine == "inprocess" else run_flwr(rc, plan.num_clients)
        results[name] = {**summarise(rounds, args.tasks, args.rounds_per_task),
                         "boundaries": "oracle" if args.oracle else f"entropy, tau {args.tau}",
                         "seed": args.seed}
        print(f"[glfc bench] {name}: AIA {results[name]['aia']:.4f} forgetting "
              f"{results[name]['forgetting']:.4f}, {results[name]['transitions']} transitions", flush=True)
        write_methods(results, args)
    write_methods(results, args)


def write_methods(results: dict, args) -> None:
    out = Path(args.out)
    per_row = ("method", "data-root", "seed", "glfc-oracle-boundary", "glfc-tau")  # stored with each row
    meta = {k: v for k, v in method_config("glfc", args).items() if k not in per_row}
    meta.update({"engine": args.engine, "torch": torch.__version__, "machine": platform.machine()})
    write_json(out / "glfc_runs.json", {"config": meta, "methods": results}, indent=2)
    lines = ["# GLFC family on MNIST + Fashion-MNIST (20 classes, class-incremental)", "",
             f"{args.tasks} tasks × {20 // args.tasks} classes, {args.rounds_per_task} rounds per task, "
             f"{args.initial_clients} clients + {args.new_clients} per new task, {args.clients_per_round} per round, "
             "task boundaries per row (oracle: known; entropy: detected by the clients), "
             f"≤ {args.max_per_class} images per client per class, memory {args.memory}, ResNet-18 width "
             f"{args.width}, {args.epochs} local epochs, lr {args.lr}, proxy {args.proxy_iterations} L-BFGS steps; "
             f"engine {args.engine}; seed per row.", "",
             "| method | " + " | ".join(f"acc @ task {t + 1}" for t in range(args.tasks))
             + " | AIA | forgetting | boundaries | transitions | seed | wall s |",
             "|---|" + "---|" * (args.tasks + 6)]
    for m, r in sorted(results.items(), key=lambda kv: -kv[1]["aia"]):
        lines.append(f"| {m} | " + " | ".join(f"{a:.3f}" for a in r["seen-accuracy-at-task-end"])
                     + f" | **{r['aia']:.3f}** | {r['forgetting']:.3f} | {r.get('boundaries', 'oracle')} | "
                     f"{r['transitions']} | {r.get('seed', 0)} | {r['wall-time-s']:.0f} |")
    lines += ["", "Per-task accuracy matrix (row = end of task i, column = task j's classes):", ""]
    for m, r in results.items():
        lines.append(f"- {m}: " + "; ".join("[" + ", ".join(f"{a:.2f}" for a in row) + "]"
                                            for row in r["task-accuracy-matrix"]))
    notes = []
    if "glfc" in results and "glfc-wo-proxy" in results and \
            results["glfc"]["accuracy-per-round"] == results["glfc-wo-proxy"]["accuracy-per-round"]:
        notes.append("GLFC and GLFC w/o proxy have identical per-round accuracies: every old model the proxy "
                     "designated (best score on the reconstructed set) was the previous task's final global model, "
                     "which is what the w/o-proxy rule uses.")
    best_baseline = max((r["aia"] for m, r in results.items() if m in ("fedavg-icarl", "finetune")), default=None)
    if "glfc" in results and best_baseline is not None:
        notes.append(f"GLFC's AIA minus the best baseline's: {results['glfc']['aia'] - best_baseline:+.3f}.")
    seeds = {m: [r["aia"] for name, r in results.items()
                 if r.get("boundaries", "oracle") == "oracle" and name.split("-seed")[0] == m]
             for m in ("glfc", "fedavg-icarl", "finetune")}
    if all(len(v) > 1 for v in seeds.values()):
        notes.append("AIA over seeds (oracle boundaries): " + "; ".join(
            f"{m} {np.mean(v):.3f} ± {np.std(v):.3f} ({', '.join(f'{a:.3f}' for a in v)})"
            for m, v in seeds.items()) + ".")
    if notes:
        lines += [""] + notes
    (out / "glfc_runs.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    shown = [(m, r) for m, r in results.items() if "-seed" not in m]  # other seeds: in the table
    colors = plt.get_cmap("tab10")
    for i, (m, r) in enumerate(shown):
        ys = r["accuracy-per-round"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, color=colors(i % 10),
                ls="--" if r.get("boundaries", "oracle") != "oracle" else "-", label=f"{m} (AIA {r['aia']:.3f})")
    for t in range(1, args.tasks):
        ax.axvline(t * args.rounds_per_task + 0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel("round (dotted: task boundary)")
    ax.set_ylabel("global accuracy on seen classes")
    ax.set_title("seed 0; dashed: boundaries detected by entropy", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, out / "glfc_runs.png", dpi=100)


# ----------------------------------------------------------------------------------------------
# (b) proxy


def bench_proxy(args) -> None:
    from pollen.datasets.incremental import stream_data
    from pollen.methods.glfc import build_lenet
    from pollen.strategies.proxy import LBFGSSettings, reconstruct_batched, reconstruct_one_by_one

    lenet = build_lenet("mnist-fmnist-cil", args.seed)
    test = stream_data("mnist-fmnist-cil", args.data_root, "test")
    rng = np.random.default_rng(args.seed)
    idx = rng.choice(len(test.y), size=args.batch, replace=False)
    x, y = test.select(idx)
    grads = [lenet.gradient(x[i], int(y[i])) for i in range(len(y))]
    seeds = [args.seed * 100_000 + i for i in range(len(y))]
    settings = LBFGSSettings()
    shape = tuple(x.shape[1:])
    n1 = args.one_by_one
    rows, speedups, same = [], {}, {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"[proxy bench] {threads} thread(s), batched: {len(grads)} gradients, {args.iterations} L-BFGS steps",
              flush=True)
        batched = reconstruct_batched(lenet, grads, shape, seeds, iterations=args.iterations, keep_last=1,
                                      settings=settings, chunk=args.batch)
        print(f"[proxy bench] {threads} thread(s), one-by-one: {n1} gradients", flush=True)
        single = reconstruct_one_by_one(lenet, grads[:n1], shape, seeds[:n1], iterations=args.iterations,
                                        keep_last=1, settings=settings)
        pair = []
        for name, rec, n in (("batched", batched, len(grads)), ("one-by-one", single, n1)):
            final = rec.images[:, -1]
            pair.append({"mode": name, "threads": threads, "images": n, "seconds": round(rec.seconds, 2),
                         "images-per-s": n / rec.seconds,
                         "matching-loss-initial": float(rec.initial_losses.mean()),
                         "matching-loss-final": float(rec.losses.mean()),
                         "matching-loss-final-median": float(rec.losses.median()),
                         "label-accuracy": float((rec.labels == y[:n]).float().mean()),
                         "image-mse-vs-original": float(((final - x[:n]) ** 2).mean()),
                         "image-mse-vs-original-median": float(((final - x[:n]) ** 2).flatten(1).mean(1).median()),
                         "objective-evaluations": rec.evaluations})
            print(f"[proxy bench]   {name}: {n / rec.seconds:.2f} images/s", flush=True)
        rows += pair
        speedups[str(threads)] = pair[0]["images-per-s"] / pair[1]["images-per-s"]
        same[str(threads)] = {
            "batched-matching-loss-median": float(batched.losses[:n1].median()),
            "one-by-one-matching-loss-median": float(single.losses.median()),
            "max-abs-image-difference": float((batched.images[:n1, -1] - single.images[:, -1]).abs().max())}
    meta = {"iterations": args.iterations, "lbfgs": settings.__dict__, "batch": args.batch, "one-by-one": n1,
            "threads": list(args.threads), "cores": os.cpu_count(), "torch": torch.__version__,
            "machine": platform.machine(), "device": "cpu", "image-shape": list(shape)}
    data = {"config": meta, "rows": rows, "speedup": speedups, "common-images": same}
    write_json(RESULTS / "glfc_proxy.json", data, indent=2)
    write_proxy_md(data)


def write_proxy_md(data: dict) -> None:
    """``glfc_proxy.md`` from the JSON (``python -m bench.glfc proxy-table`` re-renders it)."""
    cfg, rows = data["config"], data["rows"]
    lines = ["# GLFC proxy: gradient inversion, batched vs one-by-one", "",
             f"DLG LeNet (20 classes, 1×28×28), gradients of real MNIST/Fashion-MNIST test images, "
             f"{cfg['iterations']} L-BFGS steps for both (torch defaults: ≤ 20 inner iterations each, lr 0.1, "
             f"history 100); {cfg['device']} ({cfg['cores']} cores), torch {cfg['torch']}. Batched: all "
             f"{cfg['batch']} gradients in one batch; one-by-one: the official loop (one `torch.optim.LBFGS` and "
             f"`create_graph` autograd per image) on the first {cfg['one-by-one']}.", "",
             "| threads | mode | images | seconds | images/s | matching loss start → end: mean (median) | "
             "label acc | pixel MSE vs original: mean (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['mode']} | {r['images']} | {r['seconds']:.1f} | {r['images-per-s']:.3f} | "
                     f"{r['matching-loss-initial']:.1f} → {r['matching-loss-final']:.4f} "
                     f"({r['matching-loss-final-median']:.4f}) | {r['label-accuracy']:.3f} | "
                     f"{r['image-mse-vs-original']:.4f} ({r['image-mse-vs-original-median']:.4f}) |")
    best = {m: max((r for r in rows if r["mode"] == m), key=lambda r: r["images-per-s"])
            for m in ("batched", "one-by-one")}
    lines += ["", "Throughput ratio batched / one-by-one (same thread count): "
              + ", ".join(f"**{v:.1f}×** at {t} thread(s)" for t, v in data["speedup"].items()) + ". "
              f"Each mode at its best thread count (batched {best['batched']['threads']}, one-by-one "
              f"{best['one-by-one']['threads']}: the official loop's tiny kernels only lose from a second "
              f"thread): **{best['batched']['images-per-s'] / best['one-by-one']['images-per-s']:.1f}×**.", ""]
    for t, c in data["common-images"].items():
        lines.append(f"On the {cfg['one-by-one']} images both modes reconstructed ({t} thread(s)): median final "
                     f"matching loss {c['batched-matching-loss-median']:.4f} batched vs "
                     f"{c['one-by-one-matching-loss-median']:.4f} one-by-one, max pixel difference "
                     f"{c['max-abs-image-difference']:.2e}.")
    lines += ["", "Both modes run the same L-BFGS arithmetic; in float64 the batched trajectories equal torch's "
              "one-by-one ones to 1e-8 (tests/test_proxy.py). In float32, DLG's L-BFGS is chaotic: rounding "
              "differences of the batched kernels grow into visibly different (equally good) reconstructions "
              "for some images, and a few runs from unlucky N(0, 1) starts diverge in either mode, which is "
              "why the medians are shown next to the means."]
    (RESULTS / "glfc_proxy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    pm = sub.add_parser("methods", help="(a) GLFC vs baselines on the offline stream")
    pm.add_argument("--data-root", required=True)
    pm.add_argument("--methods", nargs="+", default=list(METHODS[:3]), choices=METHODS)
    pm.add_argument("--engine", choices=("inprocess", "flwr"), default="inprocess")
    pm.add_argument("--tasks", type=int, default=4)
    pm.add_argument("--rounds-per-task", type=int, default=4)
    pm.add_argument("--initial-clients", type=int, default=4)
    pm.add_argument("--new-clients", type=int, default=2)
    pm.add_argument("--clients-per-round", type=int, default=4)
    pm.add_argument("--max-per-class", type=int, default=100)
    pm.add_argument("--memory", type=int, default=60)
    pm.add_argument("--eval-per-class", type=int, default=200)
    pm.add_argument("--proxy-iterations", type=int, default=20)
    pm.add_argument("--proxy-keep", type=int, default=5)
    pm.add_argument("--width", type=float, default=0.125)
    pm.add_argument("--epochs", type=int, default=2)
    pm.add_argument("--batch-size", type=int, default=32)
    pm.add_argument("--lr", type=float, default=0.5)
    pm.add_argument("--seed", type=int, default=0)
    pm.add_argument("--tau", type=float, default=1.2)
    pm.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                    help="known task boundaries (default: at CPU scale the entropy jump stays below tau = 1.2)")
    pm.add_argument("--label", default="", help="suffix of the result rows' names (e.g. -detect)")
    pm.add_argument("--resume", action="store_true", help="keep methods already in glfc_runs.json")
    pm.add_argument("--out", default=str(RESULTS), help="results folder (default bench/results)")
    pm.add_argument("--table-only", action="store_true", help="re-render the table and plot from glfc_runs.json")
    pp = sub.add_parser("proxy", help="(b) batched vs one-by-one gradient inversion")
    pp.add_argument("--data-root", required=True)
    pp.add_argument("--batch", type=int, default=64)
    pp.add_argument("--one-by-one", type=int, default=8)
    pp.add_argument("--iterations", type=int, default=10)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="torch thread counts to measure (both modes at each)")
    sub.add_parser("proxy-table", help="re-render glfc_proxy.md from glfc_proxy.json")
    args = parser.parse_args()
    if args.what == "proxy-table":
        write_proxy_md(json.loads((RESULTS / "glfc_proxy.json").read_text()))
        return
    torch.set_num_threads(1)
    random.seed(0)
    if args.what == "methods":
        bench_methods(args)
    else:
        bench_proxy(args)


if __name__ == "__main__":
    main()
