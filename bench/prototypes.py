"""FedProto's MNIST table through Pollen's Flower simulation: FedProto, BD-FedProto and the baselines.

Setting (FedProto paper / official code): 20 clients, N-way K-shot with K = 100, stdev 2, batch 4,
SGD lr 0.01 momentum 0.5, one local epoch per round. Every run is a real ``flwr run`` on a SuperLink
this script owns (``pollen.launch.simulate``, 20 SuperNodes). Accuracies are read from the run's
``summary.json`` — mean ± std over clients of each client's test accuracy on its own classes, with
the local classifier and (prototype methods) with the nearest global prototype.

Results accumulate in ``bench/results/prototypes_mnist.json`` (a finished (method, ways, rounds)
entry is skipped on the next call, so the benchmark can be run in pieces); the Markdown table and
the MI / λ_D plots are rewritten from the JSON each time::

    python -m bench.prototypes --data-root ../shared/data --ways 3 4 --methods fedproto bd-fedproto
    python -m bench.prototypes --data-root ../shared/data --ways 3 --methods fedavg fedprox local --rounds 50

With ``bench/results/prototypes_reference.json`` present (``python -m bench.fedproto_reference``: the
official procedure without Flower), the table adds a seed-by-seed comparison of Pollen's
``official-split`` runs with the reference on the same split::

    python -m bench.prototypes --data-root ../shared/data --ways 3 --methods fedproto --seed 0 \
        --variant official-split --extra-config "shot-split='official'"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.kit import (
    RESULTS,
    fmt_paired,
    pop_sd,
    preset,
    pyplot,
    read_json,
    read_metrics,
    read_summary,
    save_figure,
    table,
    write_atomic,
    write_json,
)

JSON_PATH = RESULTS / "prototypes_mnist.json"
MD_PATH = RESULTS / "prototypes_mnist.md"
REFERENCE_PATH = RESULTS / "prototypes_reference.json"
METHODS = ("fedproto", "bd-fedproto", "fedavg", "fedprox", "local")
PROTO_METHODS = ("fedproto", "bd-fedproto")

# The official FedProto code run on this machine kind (issue 6): mean ± std over clients, counters
# reset per client; (local classifier, nearest prototype), 100 rounds, 413 s on 2 cores.
OFFICIAL = {3: {"accuracy": (98.85, 1.03), "proto-accuracy": (98.66, 1.20)},
            4: {"accuracy": (98.07, 1.69), "proto-accuracy": (98.03, 1.47)}}
OFFICIAL_SECONDS = 413.0
BD_RECONSTRUCTED = ("CPA's negative loss (hinge on the element-wise MSE distance with the server's median "
                    "inter-prototype margin) and DA's λ_D rule (loss-ratio softmax with an annealed "
                    "temperature) are reconstructed from the BD-FedProto paper's text; FedProto's parts "
                    "follow the official code.")


def run_config(method: str, ways: int, rounds: int, args: argparse.Namespace, out_dir: Path) -> dict:
    """FedProto's MNIST setting for one method and n, from its preset (``conf/<method>-mnist-n<n>.toml``;
    the baselines share FedProto's, without the ``proto-`` keys): the study overrides only rounds, seed,
    paths and the evaluation cadence; a variant's ``--extra-config`` keys go on top."""
    from pollen.launch import parse_run_config

    base = preset(f"{method if method in PROTO_METHODS else 'fedproto'}-mnist-n{ways}")
    if method not in PROTO_METHODS:
        base = {k: v for k, v in base.items() if not k.startswith("proto-")}
    return {**base, "method": method, "num-server-rounds": rounds, "seed": args.seed,
            "data-root": str(args.data_root), "out-dir": str(out_dir), "proto-evaluate-every": args.evaluate_every,
            **parse_run_config(args.extra_config)}


def read_run(run_dir: Path) -> dict:
    summary = read_summary(run_dir)
    rounds = read_metrics(run_dir)
    final = summary["final"]["evaluate"]
    per_client = summary["final"]["evaluate-clients"]
    out = {"rounds": summary["rounds"], "app-wall-time-s": summary["wall-time-s"],
           "bytes-up-total": summary["bytes-up-total"], "bytes-down-total": summary["bytes-down-total"],
           "rejected-total": summary["rejected-total"], "failures-total": summary["failures-total"],
           "clients-evaluated": len(per_client)}
    for key in ("accuracy", "proto-accuracy"):
        if f"{key}-client-mean" in final:
            out[key] = {"mean": 100 * final[f"{key}-client-mean"], "std": 100 * final[f"{key}-client-std"]}
    curves: dict[str, list] = {"round": [r["round"] for r in rounds]}
    for key in ("mi-client-mean", "mi-classifier-client-mean", "lambda-client-mean", "lambda-client-std",
                "train-loss"):
        curves[key] = [r["fit"].get(key) for r in rounds]
    for key in ("accuracy-client-mean", "proto-accuracy-client-mean"):
        curves[key] = [r["evaluate"].get(key) for r in rounds]
    curves["round-wall-time-s"] = [r["wall-time-s"] for r in rounds]
    out["curves"] = curves
    return out


def load_results() -> dict:
    return read_json(JSON_PATH) or {
        "setting": {"task": "mnist-shot", "clients": 20, "shots": 100, "stdev": 2, "batch-size": 4, "lr": 0.01,
                    "momentum": 0.5, "local-epochs": 1},
        "official": {str(k): v for k, v in OFFICIAL.items()}, "official-wall-time-s": OFFICIAL_SECONDS,
        "bd-fedproto-reconstructed": BD_RECONSTRUCTED, "runs": []}


def save_results(results: dict) -> None:
    write_json(JSON_PATH, results)
    write_atomic(MD_PATH, markdown(results))
    plot(results)


def _fmt(entry: dict | None) -> str:
    return "–" if not entry else f"{entry['mean']:.2f} ± {entry['std']:.2f}"


def _key(r: dict) -> tuple:
    return (r["ways"], METHODS.index(r["method"]), r.get("variant", "default"), r["rounds"], r["seed"])


def _seed_groups(runs: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["ways"], r["method"], r.get("variant", "default"), r["rounds"]), []).append(r)
    return groups


def _mean_over_seeds(group: list[dict], key: str) -> dict | None:
    vals = [r[key] for r in group if key in r]
    if not vals:
        return None
    return {"mean": sum(v["mean"] for v in vals) / len(vals), "std": sum(v["std"] for v in vals) / len(vals)}


def _seed_spread(group: list[dict]) -> str:
    """Population std over seeds of the per-seed client means ("–" for a single seed)."""
    if len(group) < 2:
        return "–"
    out = []
    for key in ("accuracy", "proto-accuracy"):
        vals = [r[key]["mean"] for r in group if key in r]
        if len(vals) < 2:
            out.append("–")
            continue
        out.append(f"{pop_sd(vals):.2f}")
    return " / ".join(out)


def load_reference() -> list[dict]:
    """Rows of ``python -m bench.fedproto_reference`` (the official procedure without Flower), if run."""
    return read_json(REFERENCE_PATH, [])


def reference_lines(runs: list[dict]) -> list[str]:
    """Pollen's FedProto against the official procedure re-run here, seed by seed on the same split.

    ``official-split`` runs and the reference share the split of their seed (the official code's
    draw), so the per-seed difference is free of split luck; what is left is initialisation and
    batch order, which no two implementations share.
    """
    ref = [r for r in load_reference() if r["rounds"] == 100]
    if not ref:
        return []
    lines = ["", "Against the official procedure re-run here without Flower (`python -m bench.fedproto_reference`: the "
             "official code's order of random draws, split, training-time prototypes and unweighted mean, in one "
             "process; `prototypes_reference.md`), seed by seed on the same split (Pollen's *official-split* "
             "variant). Δ = Pollen − reference; the last row per n is the mean Δ ± its standard error:", "",
             "| ways | seed | Pollen local | Pollen proto | reference local | reference proto | Δ local | Δ proto |",
             "|---|---|---|---|---|---|---|---|"]
    for ways in sorted({r["ways"] for r in ref}):
        pairs = []
        for r in sorted(runs, key=lambda r: r["seed"]):
            if (r["method"], r["ways"], r.get("variant"), r["rounds"]) != ("fedproto", ways, "official-split", 100):
                continue
            twin = next((t for t in ref if t["ways"] == ways and t["seed"] == r["seed"]), None)
            if twin is None:
                continue
            d = (r["accuracy"]["mean"] - twin["local-mean"], r["proto-accuracy"]["mean"] - twin["proto-mean"])
            pairs.append(d)
            lines.append(f"| {ways} | {r['seed']} | {r['accuracy']['mean']:.2f} | {r['proto-accuracy']['mean']:.2f} | "
                         f"{twin['local-mean']:.2f} | {twin['proto-mean']:.2f} | {d[0]:+.2f} | {d[1]:+.2f} |")
        if pairs:
            lines.append(f"| {ways} | mean of {len(pairs)} | | | | | {fmt_paired([d[0] for d in pairs])} | "
                         f"{fmt_paired([d[1] for d in pairs])} |")
    lines += ["", "The reference itself, averaged over all its seeds, against the official run (seed 1234):", "",
              *table(("ways", "reference seeds", "reference local", "reference proto", "official local / proto",
                      "Δ local", "Δ proto"), ())]
    for ways in sorted({r["ways"] for r in ref}):
        group = [r for r in ref if r["ways"] == ways]
        loc = sum(r["local-mean"] for r in group) / len(group)
        pro = sum(r["proto-mean"] for r in group) / len(group)
        off = OFFICIAL.get(ways)
        lines.append(f"| {ways} | {len(group)} | {loc:.2f} | {pro:.2f} | "
                     + (f"{off['accuracy'][0]:.2f} / {off['proto-accuracy'][0]:.2f} | "
                        f"{loc - off['accuracy'][0]:+.2f} | {pro - off['proto-accuracy'][0]:+.2f} |" if off
                        else "– | – | – |"))
    return lines


def markdown(results: dict) -> str:
    s = results["setting"]
    lines = [
        "# FedProto MNIST table (Pollen, Flower simulation)", "",
        f"{s['clients']} clients, N-way {s['shots']}-shot (stdev {s['stdev']}), batch {s['batch-size']}, "
        f"lr {s['lr']}, momentum {s['momentum']}, {s['local-epochs']} local epoch per round; test: 40 "
        "samples per own class per client. Accuracy in %, mean ± std over clients (counters reset per "
        "client). *Local*: the client's own classifier (FedAvg / FedProx: the global model); *proto*: "
        "nearest global prototype among the client's classes. Prototype methods evaluate every "
        "10 rounds and in the last, the baselines every round (as Pollen's weight strategies do). Wall time: "
        "the whole `flwr run` (SuperLink start to final status, 20 "
        "SuperNodes, 2 Ray actors) on this machine's 2 CPU cores, shared with other jobs; the official "
        f"FedProto code takes {results['official-wall-time-s']:.0f} s for 100 rounds. Variant *default* = "
        "Pollen's defaults (count-weighted aggregation, prototypes from a no-grad pass after training); "
        "*official-protos* = the official code's choices (unweighted mean, training-time prototypes); "
        "*official-split* = the official code's own client split (`shot-split = \"official\"`: its RNG "
        "calls, k ∈ {99, 100} per client, label-sorted slices) drawn with the run's seed; at the "
        "official default seed 1234 it gives the same class sets and sizes per client as the official run; "
        "*model-heter* = FedProto's model-heterogeneous CNNs (conv2 with 18 / 20 / 22 channels for clients "
        "0–6 / 7–13 / 14–19).", "",
        "| ways | method | variant | seed | rounds | local | proto | wall s | s/round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = sorted(results["runs"], key=_key)
    for r in runs:
        lines.append(f"| {r['ways']} | {r['method']} | {r.get('variant', 'default')} | {r['seed']} | {r['rounds']} | "
                     f"{_fmt(r.get('accuracy'))} | {_fmt(r.get('proto-accuracy'))} | "
                     f"{r['wall-time-s']:.0f} | {r['wall-time-s'] / r['rounds']:.2f} |")
    groups = _seed_groups(runs)
    lines += ["", "Against the official FedProto code (100 rounds; ours averaged over the seeds run, "
              "± = mean client std; Δ = ours − official, percentage points):", "",
              "| ways | method | variant | seeds | local | proto | official local | official proto | Δ local | Δ proto "
              "| seed-to-seed std of the mean (local / proto) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (ways, method, variant, rounds), group in sorted(groups.items(), key=lambda kv: _key(kv[1][0])):
        if method != "fedproto" or rounds != 100 or str(ways) not in results["official"] \
                or variant not in ("default", "official-protos", "official-split"):
            continue
        off = results["official"][str(ways)]
        ours = {k: _mean_over_seeds(group, k) for k in ("accuracy", "proto-accuracy")}
        deltas = [f"{ours[k]['mean'] - off[k][0]:+.2f}" if ours[k] else "–" for k in ("accuracy", "proto-accuracy")]
        lines.append(f"| {ways} | {method} | {variant} | {len(group)} | {_fmt(ours['accuracy'])} | "
                     f"{_fmt(ours['proto-accuracy'])} | {off['accuracy'][0]:.2f} ± {off['accuracy'][1]:.2f} | "
                     f"{off['proto-accuracy'][0]:.2f} ± {off['proto-accuracy'][1]:.2f} | {deltas[0]} | {deltas[1]} | "
                     f"{_seed_spread(group)} |")
    lines += reference_lines(runs)
    bd_lines = []
    for r in runs:
        if r["method"] != "bd-fedproto":
            continue
        base = next((b for b in runs if b["method"] == "fedproto" and b["ways"] == r["ways"]
                     and b["rounds"] == r["rounds"] and b["seed"] == r["seed"]
                     and b.get("variant", "default") == r.get("variant", "default")), None)
        if base is None:
            continue
        diffs = [f"{r[k]['mean'] - base[k]['mean']:+.2f}" if k in r and k in base else "–"
                 for k in ("accuracy", "proto-accuracy")]
        bd_lines.append(f"| {r['ways']} | {r.get('variant', 'default')} | {r['seed']} | {r['rounds']} | "
                        f"{diffs[0]} | {diffs[1]} |")
    if bd_lines:
        lines += ["", "BD-FedProto minus FedProto (percentage points, same split, seed and variant):", "",
                  "| ways | variant | seed | rounds | Δ local | Δ proto |", "|---|---|---|---|---|---|", *bd_lines]
    lines += ["", f"BD-FedProto: {results['bd-fedproto-reconstructed']}", "",
              "Curves: `prototypes_mnist_mi.png` (MI monitor, client mean per round), "
              "`prototypes_mnist_lambda.png` (BD-FedProto's λ_D, client mean ± std per round).", ""]
    return "\n".join(lines)


def plot(results: dict) -> None:
    plt = pyplot()
    runs = [r for r in results["runs"] if r["method"] in PROTO_METHODS]
    if not runs:
        return
    # one curve per (method, n, variant): its lowest seed (the other seeds look alike)
    first: dict[tuple, dict] = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        if r.get("mi-temperature") != "tau*margin":  # runs recorded before the MI temperature was fixed
            continue
        first.setdefault((r["method"], r["ways"], r.get("variant", "default")), r)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, r in enumerate(sorted(first.values(), key=_key)):
        c = r["curves"]
        pts = [(x, y) for x, y in zip(c["round"], c["mi-client-mean"]) if y is not None]
        if pts:
            ax.plot(*zip(*pts), color=colors(i % 10), ls="-" if r["method"] == "fedproto" else "--",
                    label=f"{r['method']} n={r['ways']} seed {r['seed']} {r.get('variant', 'default')}")
    ax.set_xlabel("round")
    ax.set_ylabel("normalised MI (prototype softmax, τ = 0.5·m)")
    ax.set_title("MI monitor, mean over clients")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, RESULTS / "prototypes_mnist_mi.png", dpi=100)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        if r["method"] != "bd-fedproto":
            continue
        c = r["curves"]
        pts = [(x, y, s or 0.0) for x, y, s in zip(c["round"], c["lambda-client-mean"], c["lambda-client-std"])
               if y is not None]
        if pts:
            xs, ys, ss = zip(*pts)
            ax.plot(xs, ys, label=f"bd-fedproto n={r['ways']} seed {r['seed']} {r.get('variant', 'default')}")
            ax.fill_between(xs, [y - s for y, s in zip(ys, ss)], [y + s for y, s in zip(ys, ss)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("λ_D (λ_0 = 1)")
    ax.set_title("DA: global-loss weight, mean ± std over clients")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    save_figure(fig, RESULTS / "prototypes_mnist_lambda.png", dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="folder with MNIST/raw (e.g. ../shared/data)")
    parser.add_argument("--ways", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate-every", type=int, default=10,
                        help="prototype methods evaluate every this many rounds and in the last one")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pollen-bench-prototypes"),
                        help="FLWR_HOME and the runs' own output folders")
    parser.add_argument("--variant", default="default",
                        help="label of a non-default setting, stored with the run (e.g. official-protos)")
    parser.add_argument("--extra-config", default="",
                        help="more run-config overrides for this variant, e.g. \"proto-weighting='uniform'\"")
    parser.add_argument("--replot", action="store_true", help="only rewrite the table and plots")
    args = parser.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    results = load_results()
    if args.replot:
        save_results(results)
        return 0
    from pollen.launch import simulate

    for ways in args.ways:
        for method in args.methods:
            if any(r["method"] == method and r["ways"] == ways and r["rounds"] == args.rounds
                   and r["seed"] == args.seed and r.get("variant", "default") == args.variant
                   for r in results["runs"]):
                print(f"[bench] skip {method} n={ways} ({args.rounds} rounds, seed {args.seed}, "
                      f"{args.variant}): already in {JSON_PATH}", flush=True)
                continue
            out_dir = args.work_dir / "runs"
            print(f"[bench] {method} n={ways}, {args.rounds} rounds ...", flush=True)
            started = time.monotonic()
            outcome = simulate(flwr_home=args.work_dir / "flwr", num_supernodes=20,
                               run_config=run_config(method, ways, args.rounds, args, out_dir),
                               timeout=6 * 3600, echo=False)
            wall = time.monotonic() - started
            if not outcome.completed:
                print(f"[bench] {method} n={ways} FAILED ({outcome.status}):\n{outcome.log[-3000:]}", flush=True)
                return 1
            entry = {"method": method, "ways": ways, "seed": args.seed, "variant": args.variant,
                     "mi-temperature": "tau*margin",
                     "extra-config": args.extra_config, "run-id": outcome.run_id,
                     "wall-time-s": round(wall, 1), "evaluate-every": args.evaluate_every
                     if method in PROTO_METHODS else 1, **read_run(outcome.results_dir)}
            results["runs"].append(entry)
            save_results(results)
            acc = entry.get("accuracy", {})
            print(f"[bench] {method} n={ways}: local {_fmt(acc)} proto {_fmt(entry.get('proto-accuracy'))} "
                  f"in {wall:.0f} s", flush=True)
    save_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
