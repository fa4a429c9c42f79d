"""GLFC against its baselines and ablations in a trained regime, three seeds, with a joint-training bound.

The offline MNIST + Fashion-MNIST class-incremental stream (4 tasks × 5 classes), run through the
real Message-API strategy and ClientApp handlers (``bench.glfc``'s in-process grid), each run from
the preset ``conf/glfc-mnist-fmnist.toml`` with the study's setting. The regime
is chosen so that the global model learns task 1 (≥ 95 % at its end): 20 rounds per task (the
paper has 10, with 30 clients), ResNet-18 width 0.125, 2 local epochs, SGD lr 0.5; the search is in
``bench/results/glfc_regime.md``. Per seed, every method sees the same stream plan and client shards, so
differences are paired by seed.

Also measured:

* **joint training** on the same data budget: a model trained centrally on the union of every
  client's images of the tasks so far (the upper bound of any incremental method);
* the **entropy detector** at the paper's τ = 1.2 (``glfc-detect``): the rounds where clients declared
  a new task, against the true boundaries;
* the **proxy's choice**: whether the old model the proxy keeps (best score on the reconstructed
  set) ever differs from the previous task's last global model (what GLFC w/o proxy uses).

One file per finished run under ``bench/results/glfc_study/``; finished runs are skipped, so the
study resumes. The report goes to ``bench/results/glfc_methods.{md,json,png}``::

    POLLEN_DATA_ROOT=../shared/data nohup .venv/bin/python -m bench.glfc_study > /tmp/glfc_study.log 2>&1 &
    .venv/bin/python -m bench.glfc_study --report
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.glfc import preset_setting
from bench.kit import (
    RESULTS,
    RunFiles,
    default_data_root,
    emphasis,
    fmt_mean_se,
    fmt_paired,
    plot_band,
    pyplot,
    run_study,
    save_figure,
    seed_band,
    table,
    verdict,
    write_json,
)

RUNS = RunFiles(RESULTS / "glfc_study")
STEM = "glfc_methods"
# arm -> (method, oracle boundaries)
ARMS = {
    "glfc": ("glfc", True), "fedavg-icarl": ("fedavg-icarl", True), "finetune": ("finetune", True),
    "glfc-wo-gc": ("glfc-wo-gc", True), "glfc-wo-rd": ("glfc-wo-rd", True), "glfc-wo-proxy": ("glfc-wo-proxy", True),
    "glfc-detect": ("glfc", False),
}
LABELS = {"glfc": "GLFC", "fedavg-icarl": "FedAvg + iCaRL", "finetune": "Finetune", "glfc-wo-gc": "GLFC w/o GC",
          "glfc-wo-rd": "GLFC w/o RD", "glfc-wo-proxy": "GLFC w/o proxy", "glfc-detect": "GLFC, entropy detector",
          "joint": "Joint training (upper bound)"}
BASELINES = ("fedavg-icarl", "finetune", "glfc-wo-gc", "glfc-wo-rd", "glfc-wo-proxy")
# the setting: the preset's stream, clients and training, then the detector's τ (the paper's) and the joint
# bound's epochs, which are the study's own
DEFAULTS = {**preset_setting(), "tau": 1.2, "joint_epochs": 10}
SETTING_KEYS = tuple(DEFAULTS)
TASK1_BAR = 0.95


def setting_of(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in SETTING_KEYS}


def bench_args(args: argparse.Namespace, seed: int, oracle: bool) -> argparse.Namespace:
    """The namespace ``bench.glfc.method_config`` reads."""
    return argparse.Namespace(**setting_of(args), data_root=args.data_root, seed=seed, oracle=oracle)


def run_method(arm: str, seed: int, args: argparse.Namespace) -> dict:
    from bench.glfc import method_config, run_inprocess, summarise

    method, oracle = ARMS[arm]
    rc = method_config(method, bench_args(args, seed, oracle))
    t0 = time.perf_counter()
    rounds = run_inprocess(rc)
    wall = time.perf_counter() - t0
    per_round = [{"round": r["round"], "accuracy": r["server-evaluate"]["accuracy"],
                  "transitions": int(r["fit"].get("transitions", 0)),
                  "proxy-new-best": r["fit"].get("proxy-new-best"),
                  "proxy-gradients": r["fit"].get("proxy-gradients"),
                  "proxy-monitor-accuracy": r["fit"].get("proxy-monitor-accuracy"),
                  "rejected": len(r["rejected"]), "failures": r["failures"]} for r in rounds]
    return {"arm": arm, "method": method, "oracle": oracle, "seed": seed, "setting": setting_of(args),
            "wall-s": round(wall, 1), "summary": summarise(rounds, args.tasks, args.rounds_per_task),
            "rounds": per_round}


def run_joint(seed: int, args: argparse.Namespace) -> dict:
    """Central training on the union of all clients' images of tasks ≤ t, for each task end t."""
    import numpy as np
    import torch

    from bench.glfc import method_config
    from pollen.app.config import parse_run_config
    from pollen.app.registry import METHODS
    from pollen.datasets.incremental import shard_indices, stream_data
    from pollen.methods.training import train_epochs
    from pollen.strategies.glfc import aia, average_forgetting

    torch.set_num_threads(1)
    cfg = parse_run_config(method_config("finetune", bench_args(args, seed, True)))
    strategy = METHODS[cfg.method].make_strategy(cfg)
    plan, s = strategy.plan, strategy.schedule.classes_per_task
    train = stream_data(cfg.task, cfg.data_root, "train", "label", seed)
    labels = train.y.numpy()
    t0 = time.perf_counter()
    seen_acc, matrix = [], []
    for t in range(args.tasks):
        classes = range((t + 1) * s)
        idx = np.unique(np.concatenate([shard_indices(plan, labels, c, k) for k in classes
                                        for c in plan.holders(k)]))
        x, y = train.select(idx)
        torch.manual_seed(seed)
        model = strategy.make_model(len(classes))
        train_epochs(model, x, y, epochs=args.joint_epochs, batch_size=args.batch_size,
                     optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, weight_decay=1e-5),
                     generator=torch.Generator().manual_seed(seed), device=torch.device("cpu"))
        model.eval()
        xt, yt = strategy.test_data(len(classes))
        with torch.no_grad():
            pred = torch.cat([model(xt[i:i + 1024]).argmax(1) for i in range(0, len(yt), 1024)])
        seen_acc.append(float((pred == yt).float().mean()))
        matrix.append([float((pred[(yt >= j * s) & (yt < (j + 1) * s)] == yt[(yt >= j * s) & (yt < (j + 1) * s)])
                             .float().mean()) for j in range(t + 1)])
        print(f"[glfc-study] joint seed {seed}: task {t + 1}, {len(idx)} images, accuracy {seen_acc[-1]:.4f}",
              flush=True)
    return {"arm": "joint", "method": "joint", "oracle": True, "seed": seed, "setting": setting_of(args),
            "wall-s": round(time.perf_counter() - t0, 1),
            "summary": {"seen-accuracy-at-task-end": seen_acc, "task-accuracy-matrix": matrix, "aia": aia(seen_acc),
                        "forgetting": average_forgetting(matrix), "final-accuracy": seen_acc[-1]},
            "rounds": []}


# ---------------------------------------------------------------------------------------------
# report

def boundaries(setting: dict) -> list[int]:
    """The first round of each task after the first (where a new task's data arrives)."""
    return [t * setting["rounds_per_task"] + 1 for t in range(1, setting["tasks"])]


def detector_findings(rec: dict, oracle: dict | None) -> dict:
    """Where clients declared transitions, against the oracle run of the same seed.

    Both runs sample the same clients each round (the sampler draws from its own seeded generator),
    and the oracle declares a client's transition the first round it is sampled in a new task; so,
    round by round, detections up to the oracle's count are hits, the excess false alarms and the
    shortfall misses. Round 1 counts too: every client's first round is the start of task 1.
    """
    fired = {x["round"]: x["transitions"] for x in rec["rounds"] if x["transitions"]}
    out = {"fired-rounds": fired}
    if oracle is not None:
        truth = {x["round"]: x["transitions"] for x in oracle["rounds"] if x["transitions"]}
        rounds = set(fired) | set(truth)
        out.update({"oracle": sum(truth.values()),
                    "hits": sum(min(fired.get(k, 0), truth.get(k, 0)) for k in rounds),
                    "false-alarms": sum(max(fired.get(k, 0) - truth.get(k, 0), 0) for k in rounds),
                    "missed": sum(max(truth.get(k, 0) - fired.get(k, 0), 0) for k in rounds)})
    return out


def proxy_findings(rec: dict) -> list[dict]:
    """Per task before the last: did the proxy keep that task's last model, or an earlier, better-scored one?"""
    r, out = rec["setting"]["rounds_per_task"], []
    for t in range(rec["setting"]["tasks"] - 1):
        task_rounds = rec["rounds"][t * r:(t + 1) * r]
        best = [x["round"] for x in task_rounds if x.get("proxy-new-best")]
        kept = best[-1] if best else None
        out.append({"task": t + 1, "kept-round": kept, "last-round": (t + 1) * r,
                    "differs": kept is not None and kept != (t + 1) * r,
                    "accuracy-kept": next((x["accuracy"] for x in task_rounds if x["round"] == kept), None),
                    "accuracy-last": task_rounds[-1]["accuracy"] if task_rounds else None})
    return out


def markdown(records: list[dict], setting: dict) -> str:
    by_arm: dict[str, dict[int, dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    T = setting["tasks"]
    lines = [
        "# GLFC family on MNIST + Fashion-MNIST, trained regime, paired seeds",
        "",
        f"{T} tasks × {20 // T} classes (MNIST digits, then Fashion-MNIST), {setting['rounds_per_task']} rounds per "
        f"task (paper: 10 with 30 clients; why 20: `glfc_regime.md`), {setting['initial_clients']} clients + "
        f"{setting['new_clients']} per new task, "
        f"{setting['clients_per_round']} sampled per round, each client 60 % of a task's classes with ≤ "
        f"{setting['max_per_class']} images per class, memory {setting['memory']}, ResNet-18 width {setting['width']}, "
        f"{setting['epochs']} local epochs, batch {setting['batch_size']}, SGD lr {setting['lr']}, proxy "
        f"{setting['proxy_iterations']} L-BFGS steps (paper 250). Test: {setting['eval_per_class']} images per seen "
        "class. Every method of a seed sees the same stream plan and shards. Mean ± standard error over seeds.",
        "",
        "## Accuracy on the seen classes at each task end, AIA and forgetting",
        "",
        "| method | seeds | " + " | ".join(f"task {t + 1}" for t in range(T)) + " | AIA | forgetting | wall s |",
        "|---|---|" + "---|" * (T + 3),
    ]
    order = ["joint", "glfc", "glfc-detect", "glfc-wo-proxy", "glfc-wo-gc", "glfc-wo-rd", "fedavg-icarl", "finetune"]
    for arm in (a for a in order if a in by_arm):
        runs = list(by_arm[arm].values())
        ends = [r["summary"]["seen-accuracy-at-task-end"] for r in runs]
        lines.append(f"| {LABELS[arm]} | {len(runs)} | "
                     + " | ".join(fmt_mean_se([e[t] for e in ends], 3) for t in range(T))
                     + f" | **{fmt_mean_se([r['summary']['aia'] for r in runs], 3)}** | "
                     f"{fmt_mean_se([r['summary']['forgetting'] for r in runs], 3)} | "
                     f"{statistics.fmean(r['wall-s'] for r in runs):.0f} |")
    lines += ["", "Accuracy on each task's classes at the end of the stream (mean over seeds): where forgetting is.",
              "", "| method | " + " | ".join(f"task {t + 1} classes" for t in range(T)) + " |", "|---|" + "---|" * T]
    for arm in (a for a in order if a in by_arm):
        rows = [r["summary"]["task-accuracy-matrix"][-1] for r in by_arm[arm].values()]
        lines.append(f"| {LABELS[arm]} | " + " | ".join(f"{statistics.fmean(row[t] for row in rows):.3f}"
                                                       for t in range(T)) + " |")
    if "joint" in by_arm:
        lines += ["", f"*Joint training*: one model trained centrally at each task end, from scratch, on the union of "
                  f"every client's images of the tasks so far ({setting['joint_epochs']} epochs, same model, batch and "
                  "SGD): what any incremental method could reach with this data."]
    task1 = [r["summary"]["seen-accuracy-at-task-end"][0] for a, rs in by_arm.items() if a != "joint"
             for r in rs.values()]
    if task1:
        lines += ["", f"Task-1 accuracy of the federated global model over all runs: min {min(task1):.3f}, "
                  f"median {statistics.median(task1):.3f} (bar: ≥ {TASK1_BAR})."]
    glfc = by_arm.get("glfc", {})
    rows = []
    for base in BASELINES:
        other = by_arm.get(base, {})
        seeds = sorted(set(glfc) & set(other))
        if not seeds:
            continue
        d_aia = [glfc[s]["summary"]["aia"] - other[s]["summary"]["aia"] for s in seeds]
        d_fgt = [glfc[s]["summary"]["forgetting"] - other[s]["summary"]["forgetting"] for s in seeds]
        rows.append((LABELS[base], len(seeds), fmt_paired(d_aia, 3), emphasis(verdict(d_aia)), fmt_paired(d_fgt, 3),
                     emphasis(verdict(d_fgt, lower_is_better=True))))
    if rows:
        lines += ["", "## GLFC − each baseline and ablation (paired by seed)", "",
                  "The claim in each row is that GLFC is better: a higher AIA, a lower forgetting. It is supported "
                  "when the mean paired difference lies ≥ 2 s.e. on that side of zero, contradicted at ≥ 2 s.e. on "
                  "the other (`bench.kit.verdict`).", "",
                  *table(("GLFC −", "seeds", "Δ AIA", "verdict", "Δ forgetting", "verdict (lower is better)"), rows)]
    if "glfc-detect" in by_arm:
        lines += ["", f"## The entropy detector at τ = {setting['tau']}", "",
                  f"True task boundaries: rounds {', '.join(map(str, boundaries(setting)))} (a client can only "
                  "detect when it is sampled, so a boundary shows up over the task's first rounds).", "",
                  "Both runs of a seed sample the same clients; the oracle run declares each client's "
                  "transition the first round it is sampled in a new task (round 1 included: the start of "
                  "task 1). Round by round, the detector's declarations up to the oracle's count are hits, "
                  "the excess false alarms, the shortfall misses.", "",
                  "| seed | rounds with declared transitions (count) | oracle's transitions | hits | "
                  "missed | false alarms |", "|---|---|---|---|---|---|"]
        for seed, rec in sorted(by_arm["glfc-detect"].items()):
            f = detector_findings(rec, by_arm.get("glfc", {}).get(seed))
            fired = ", ".join(f"{k} ({v})" for k, v in f["fired-rounds"].items()) or "none"
            lines.append(f"| {seed} | {fired} | {f.get('oracle', '–')} | {f.get('hits', '–')} | "
                         f"{f.get('missed', '–')} | {f.get('false-alarms', '–')} |")
    if "glfc" in by_arm:
        lines += ["", "## The proxy's choice of old model", "",
                  "At each task's end the proxy keeps the global model that scored best on its reconstructed set; "
                  "GLFC w/o proxy keeps the task's last global model.", "",
                  "| seed | task | kept round | last round | accuracy kept / last | differs |",
                  "|---|---|---|---|---|---|"]
        differs = 0
        for seed, rec in sorted(by_arm["glfc"].items()):
            for f in proxy_findings(rec):
                differs += int(f["differs"])
                acc = (f"{f['accuracy-kept']:.3f} / {f['accuracy-last']:.3f}" if f["accuracy-kept"] is not None
                       else "–")
                lines.append(f"| {seed} | {f['task']} | {f['kept-round']} | {f['last-round']} | {acc} | "
                             f"{'**yes**' if f['differs'] else 'no'} |")
        lines += ["", f"The proxy's choice differed from the last model in {differs} task end(s)."]
        both = sorted(set(by_arm["glfc"]) & set(by_arm.get("glfc-wo-proxy", {})))
        if both:
            same = [s for s in both if [x["accuracy"] for x in by_arm["glfc"][s]["rounds"]]
                    == [x["accuracy"] for x in by_arm["glfc-wo-proxy"][s]["rounds"]]]
            lines[-1] += (f" GLFC and GLFC w/o proxy have identical per-round accuracies on seed(s) "
                          f"{', '.join(map(str, same)) or 'none'} of {', '.join(map(str, both))}.")
    lines += ["", f"![accuracy vs round]({STEM}.png)", "",
              "Reproduce: `python -m bench.glfc_study` (one file per run in `glfc_study/`; resumes).", ""]
    return "\n".join(lines)


def plot(records: list[dict], setting: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(9, 4))
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        if r["rounds"]:
            by_arm.setdefault(r["arm"], []).append(r)
    for arm, runs in by_arm.items():
        curves = [[x["accuracy"] for x in r["rounds"]] for r in runs]
        plot_band(ax, *seed_band(curves), alpha=0.12, lw=1.2, ls="--" if arm == "glfc-detect" else "-",
                  label=f"{LABELS[arm]} ({len(curves)} seeds)")
    for b in boundaries(setting):
        ax.axvline(b - 0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel("round (dotted: task boundary)")
    ax.set_ylabel("global accuracy on seen classes")
    ax.set_title("mean over seeds, band: seed std", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path, dpi=100)


def write_report(setting: dict, out: Path) -> None:
    records = RUNS.load(setting)
    if not records:
        print("[glfc-study] no finished runs with this setting yet")
        return
    write_json(out / f"{STEM}.json", {"setting": setting, "runs": records})
    (out / f"{STEM}.md").write_text(markdown(records, setting))
    plot(records, setting, out / f"{STEM}.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(["joint", *ARMS]))
    p.add_argument("--seeds", default="0,1,2")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--report", action="store_true", help="only rewrite the report from the finished runs")
    p.add_argument("--dry-run", action="store_true", help="list the runs still to do")
    args = p.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    setting, out = setting_of(args), RESULTS
    if args.report:
        write_report(setting, out)
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a != "joint" and a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm {unknown[0]!r}; arms: joint, {', '.join(ARMS)}")
    def said(rec: dict) -> str:
        s = rec["summary"]
        return (f"task ends {[round(a, 3) for a in s['seen-accuracy-at-task-end']]}, AIA {s['aia']:.4f}, "
                f"forgetting {s['forgetting']:.4f} in {rec['wall-s']:.0f} s")

    def run(arm: str, seed: int) -> dict:
        return run_joint(seed, args) if arm == "joint" else run_method(arm, seed, args)

    return run_study("glfc-study", RUNS, [(a, int(s)) for s in args.seeds.split(",") for a in arms], setting, run,
                     said=said, report=lambda: write_report(setting, out), dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
