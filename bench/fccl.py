"""FCCL benchmark on the offline Digits task: FCCL, SOLO, FedMD, FedDF and FCCL w/o CON.

Each method is one real ``flwr run`` simulation (4 clients: MNIST / UCI / MNIST-M / SYN with
ResNet10 / ResNet12 / EfficientNetB0 / MobileNetV2), all from the same SOLO-pretrained models (a
shared SOLO cache makes every method start from identical round-0 models). Writes, under
``bench/results/``:

* ``fccl_digits_offline.json`` — settings, per-round per-client accuracies, tables, bytes, wall times;
* ``fccl_digits_offline.md`` — tables shaped like the paper's Table 1 (inter-domain) and Table 2
  (intra-domain), plus communication per client per round beside FedAvg's model sizes;
* ``fccl_digits_offline.png`` — inter- and intra-domain accuracy (client mean) against the round.

Run (CPU, shared machine)::

    POLLEN_DATA_ROOT=../shared/data flock /tmp/pollen-cpu.lock .venv/bin/python -m bench.fccl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.kit import RESULTS, ROOT, default_data_root, pyplot, read_metrics, save_figure, simulate_run, write_json

METHODS = ("solo", "fccl", "fedmd", "feddf", "fccl-wo-con")
LABELS = {"solo": "SOLO", "fccl": "FCCL", "fedmd": "FedMD", "feddf": "FedDF", "fccl-wo-con": "FCCL w/o CON"}
DOMAINS = ("mnist", "uci", "mnistm", "syn")
SHORT = {"mnist": "M", "uci": "U", "mnistm": "MM", "syn": "SY"}
MODELS = ("resnet10", "resnet12", "efficientnet_b0", "mobilenet_v2")


def run_config(args, method: str, out_dir: Path, cache: Path) -> dict:
    """One method's run keys for the setting in ``args`` (``simulate`` writes them as Flower's run config)."""
    return {
        "method": method, "task": "digits-offline", "num-server-rounds": args.rounds, "seed": args.seed,
        "data-root": str(args.data_root), "out-dir": str(out_dir), "model-width": args.width,
        "fccl-public": args.public, "fccl-public-size": args.public_size,
        "fccl-public-batch-size": args.public_batch_size, "fccl-train-sizes": args.train_sizes,
        "fccl-local-epochs": args.local_epochs, "fccl-solo-epochs": args.solo_epochs,
        "fccl-batch-size": args.batch_size, "fccl-test-size": args.test_size, "fccl-solo-cache": str(cache),
    }


def _domain(metrics: dict) -> str:
    """The client's domain: offline Digits puts domain i on partition i (metrics carry numbers only)."""
    return metrics["domain"] if "domain" in metrics else DOMAINS[int(metrics["partition-id"])]


def read_run(run_dir: Path) -> dict:
    """Per round: per-domain client accuracies (evaluate) and bytes; round 0 from the SOLO metrics."""
    rounds = read_metrics(run_dir)
    per_round = []
    solo = {}
    for rec in rounds:
        clients = {}
        for metrics in rec["evaluate-clients"].values():
            clients[_domain(metrics)] = {k: metrics[k] for k in metrics if "accuracy" in k or k.startswith("acc-")}
        if rec["round"] == 1:
            for metrics in rec["fit-clients"].values():
                if "solo-intra-accuracy" in metrics:
                    solo[_domain(metrics)] = {k[5:]: v for k, v in metrics.items() if k.startswith("solo-")}
        sampled = max(rec.get("sampled", 0), 1)
        per_round.append({"round": rec["round"], "clients": clients, "wall-time-s": rec["wall-time-s"],
                          "bytes-up-per-client": rec["bytes-up"] / sampled,
                          "bytes-down-per-client": rec["bytes-down"] / sampled,
                          "rejected": len(rec["rejected"])})
    return {"rounds": per_round, "solo-round0": solo}


def row(clients: dict, key: str) -> dict:
    vals = {d: 100.0 * clients[d][key] for d in DOMAINS if d in clients}
    vals["AVG"] = sum(vals.values()) / len(vals) if vals else float("nan")
    return vals


def model_bytes(width: float) -> dict:
    """FedAvg would send each client's full state (float32) each way per round."""
    import torch

    from pollen.models import build_model

    out = {}
    for name in MODELS:
        m = build_model(name, 10, 3, 32, width)
        out[name] = sum(v.numel() * v.element_size() for v in m.state_dict().values() if torch.is_floating_point(v))
    return out


ROW_ORDER = ("SOLO (round 0)", "SOLO", "FedMD", "FedDF", "FCCL w/o CON", "FCCL")


def ordered(names):
    """Table rows in the paper's order (baselines first, FCCL last), whatever order a JSON kept."""
    return sorted(names, key=lambda n: ROW_ORDER.index(n) if n in ROW_ORDER else len(ROW_ORDER))


def fmt_row(name: str, vals: dict) -> str:
    return f"| {name} | " + " | ".join(f"{vals.get(d, float('nan')):.2f}" for d in (*DOMAINS, "AVG")) + " |"


def by_model(sizes: dict) -> list[tuple[str, int]]:
    """Model sizes in the domains' order (a JSON written with sorted keys keeps them alphabetical)."""
    return sorted(sizes.items(), key=lambda kv: MODELS.index(kv[0]) if kv[0] in MODELS else len(MODELS))


def write_outputs(results: dict, out: Path, stem: str = "fccl_single_run") -> None:
    write_json(out / f"{stem}.json", results, indent=2, sort_keys=True)
    s = results["settings"]
    lines = [
        "# FCCL on the offline Digits task (quick profile)",
        "",
        f"4 clients, one domain each: MNIST (M, ResNet10), UCI digits (U, ResNet12), MNIST-M (MM, EfficientNetB0), "
        f"SYN (SY, MobileNetV2); width {s['width']}; private train sizes {s['train_sizes']}; "
        f"public set {s['public']} N0 = {s['public_size']} (batch {s['public_batch_size']}); "
        f"{s['rounds']} rounds; local epochs {s['local_epochs']}; SOLO pretraining {s['solo_epochs']} epochs; "
        f"private batch {s['batch_size']}, Adam 1e-3; "
        f"test sets {s['test_size']} per domain; seed {s['seed']}. Accuracies in %, after the last round; "
        "'SOLO (round 0)' is the shared pretrained starting point of every method.",
        "",
        "## Inter-domain accuracy (Table 1 shape): each model on the other three domains' test sets",
        "",
        "| method | M→ | U→ | MM→ | SY→ | AVG |",
        "|---|---|---|---|---|---|",
    ]
    tables = results["tables"]
    for name in ordered(tables["inter"]):
        lines.append(fmt_row(name, tables["inter"][name]))
    lines += ["", "## Intra-domain accuracy (Table 2 shape): each model on its own domain's test set", "",
              "| method | M | U | MM | SY | AVG |", "|---|---|---|---|---|---|"]
    for name in ordered(tables["intra"]):
        lines.append(fmt_row(name, tables["intra"][name]))
    lines += ["", "## Communication per client per round", "",
              "| method | up (bytes) | down (bytes, mean over rounds) |", "|---|---|---|"]
    by_label = {LABELS[m]: m for m in results["runs"]}
    for method in (by_label[n] for n in ordered(by_label)):
        comm = results["communication"][method]
        lines.append(f"| {LABELS[method]} | {comm['up']:.0f} | {comm['down']:.0f} |")
    mb, full = results["fedavg-model-bytes"], results["fedavg-model-bytes-full"]
    lines += ["", "FedAvg would instead send a whole model each way (float32 state; it also needs one architecture "
              "for all clients): at this width " + ", ".join(f"{k} {v:,} B" for k, v in by_model(mb))
              + "; at width 1.0 " + ", ".join(f"{k} {v:,} B" for k, v in by_model(full))
              + f". The logit payload is N0·C·4 = {s['public_size'] * 10 * 4:,} B plus framing, whatever the "
              "architectures (round 1 sends nothing down: no consensus yet).", "",
              "## Inter-domain AVG per round (client mean, %)", "",
              "| method | " + " | ".join(str(r) for r in range(s["rounds"] + 1)) + " |",
              "|---|" + "---|" * (s["rounds"] + 1)]
    for method in (by_label[n] for n in ordered(by_label)):
        run = results["runs"][method]
        solo = run["solo-round0"]
        vals = [100 * sum(c["inter-accuracy"] for c in solo.values()) / max(len(solo), 1)]
        vals += [100 * sum(c["inter-accuracy"] for c in r["clients"].values()) / max(len(r["clients"]), 1)
                 for r in run["rounds"]]
        lines.append(f"| {LABELS[method]} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    lines += ["", "## Checks (paper ordering), last round", ""]
    for text in results["checks"]:
        lines.append(f"- {text}")
    tail = last_rounds_mean(results, 3)
    lines += ["", "## Less noisy: AVG over clients, then mean over the last 3 rounds (%)", "",
              "| method | inter AVG | intra AVG |", "|---|---|---|"]
    for name in ordered(tail):
        lines.append(f"| {name} | {tail[name]['inter']:.2f} | {tail[name]['intra']:.2f} |")
    lines.append("")
    for a, b, key in (("FCCL", "SOLO", "inter"), ("FCCL", "FedDF", "inter"), ("FCCL", "FedMD", "inter"),
                      ("FCCL", "FCCL w/o CON", "inter"), ("FedDF", "SOLO", "inter"), ("FedMD", "SOLO", "inter"),
                      ("FCCL", "SOLO", "intra")):
        if a in tail and b in tail:
            x, y = tail[a][key], tail[b][key]
            lines.append(f"- {key}-domain, last-3 mean: {a} {x:.2f} vs {b} {y:.2f} ({x - y:+.2f})")
    walls = ", ".join(f"{LABELS[m]} {results['wall-time-s'][m]:.0f}" for m in METHODS if m in results["wall-time-s"])
    lines += ["", f"Wall time per method (s, 2 CPU cores; SOLO pretraining is in the first run): {walls}",
              "", f"![accuracy vs round]({stem}.png)", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    plot(results, out / f"{stem}.png")


def last_rounds_mean(results: dict, k: int) -> dict:
    """Per method: client-mean inter/intra accuracy (%) averaged over the last ``k`` rounds."""
    out = {}
    for method, run in results["runs"].items():
        recs = run["rounds"][-k:]
        out[LABELS[method]] = {
            key: sum(100 * sum(c[f"{key}-accuracy"] for c in r["clients"].values()) / len(r["clients"])
                     for r in recs) / len(recs)
            for key in ("inter", "intra")}
    return out


def plot(results: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "inter-accuracy", "inter-domain"), (axes[1], "intra-accuracy", "intra-domain")):
        for method in sorted(results["runs"], key=lambda m: METHODS.index(m) if m in METHODS else 99):
            run = results["runs"][method]
            solo = run["solo-round0"]
            xs, ys = [0], [100 * sum(solo[d][key] for d in solo) / max(len(solo), 1)]
            for rec in run["rounds"]:
                c = rec["clients"]
                xs.append(rec["round"])
                ys.append(100 * sum(c[d][key] for d in c) / max(len(c), 1))
            ax.plot(xs, ys, marker="o", ms=3, label=LABELS[method])
        ax.set_xlabel("round")
        ax.set_ylabel(f"{title} accuracy, client mean (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("offline Digits (M / U / MM / SY), heterogeneous models")
    save_figure(fig, path, dpi=110)


def summarise(args, runs: dict, walls: dict) -> dict:
    inter, intra = {}, {}
    first = next(iter(runs.values()))
    inter["SOLO (round 0)"] = row(first["solo-round0"], "inter-accuracy")
    intra["SOLO (round 0)"] = row(first["solo-round0"], "intra-accuracy")
    for method, run in runs.items():
        final = run["rounds"][-1]["clients"]
        inter[LABELS[method]] = row(final, "inter-accuracy")
        intra[LABELS[method]] = row(final, "intra-accuracy")
    comm = {m: {"up": sum(r["bytes-up-per-client"] for r in run["rounds"]) / len(run["rounds"]),
                "down": sum(r["bytes-down-per-client"] for r in run["rounds"]) / len(run["rounds"])}
            for m, run in runs.items()}
    checks = []

    def cmp(a: str, b: str, table: dict, what: str, strict: bool = True) -> None:
        if a in table and b in table:
            x, y = table[a]["AVG"], table[b]["AVG"]
            ok = x > y if strict else x >= y
            checks.append(f"{what}: {a} {x:.2f} {'>' if strict else '>='} {b} {y:.2f}: "
                          f"{'holds' if ok else 'does NOT hold'} (difference {x - y:+.2f})")

    for b in ("SOLO", "SOLO (round 0)", "FedDF", "FedMD", "FCCL w/o CON"):
        cmp("FCCL", b, inter, "inter-domain AVG")
    cmp("FedDF", "SOLO", inter, "inter-domain AVG")
    cmp("FedMD", "SOLO", inter, "inter-domain AVG")
    cmp("FCCL", "SOLO", intra, "intra-domain AVG", strict=False)
    cmp("FCCL", "SOLO (round 0)", intra, "intra-domain AVG", strict=False)
    return {"settings": vars(args), "runs": runs, "tables": {"inter": inter, "intra": intra},
            "communication": comm, "fedavg-model-bytes": model_bytes(args.width),
            "fedavg-model-bytes-full": model_bytes(1.0), "checks": checks, "wall-time-s": walls}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--public", default="fashion_mnist", choices=("fashion_mnist", "photo_patches"))
    p.add_argument("--public-size", type=int, default=1000)
    p.add_argument("--public-batch-size", type=int, default=250)
    p.add_argument("--train-sizes", default="150,80,500,500")
    p.add_argument("--local-epochs", default="10,10,2,2")
    p.add_argument("--solo-epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--test-size", type=int, default=300)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--work", type=Path, default=None, help="run folders and SOLO cache (default: a temp dir)")
    p.add_argument("--stem", default="fccl_single_run",
                   help="output file name stem (fccl_digits_offline.* is bench.fccl_study's 3-seed study)")
    p.add_argument("--render", type=Path, default=None,
                   help="only rewrite the Markdown and PNG from an existing results JSON")
    args = p.parse_args(argv)
    if args.render is not None:
        write_outputs(json.loads(args.render.read_text()), args.out, args.stem)
        return 0
    args.data_root = str(Path(args.data_root).resolve())
    work = (args.work or Path(tempfile.mkdtemp(prefix="pollen-fccl-bench-"))).resolve()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    runs, walls = {}, {}
    for method in methods:
        t0 = time.perf_counter()
        out_dir = work / method
        outcome = simulate_run(method, app_dir=ROOT, flwr_home=work / "flwr-home", num_supernodes=4,
                               run_config=run_config(args, method, out_dir, work / "solo-cache"),
                               timeout=3600, echo=True)
        runs[method] = read_run(outcome.results_dir)
        walls[method] = time.perf_counter() - t0
        print(f"[bench] {method} done in {walls[method]:.0f}s", flush=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args_ns = argparse.Namespace(**settings)
    results = summarise(args_ns, runs, walls)
    write_outputs(results, args.out, args.stem)
    print("\n".join(results["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
