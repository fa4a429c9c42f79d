"""BD-FedProto against FedProto: a paired, multi-seed, resumable study (issue 17).

Cells: dataset (``mnist-shot``, and ``fmnist-shot`` when that task is registered) × n-way (3, 4, 5)
× arm, where the arms are FedProto, BD-FedProto, and at n = 5 the ablations *CPA-only*
(``bd-fedproto`` with ``proto-da=false``) and *DA-only* (``proto-cpa=false``). Every run is a real
``flwr run`` on a SuperLink of its own (``pollen.launch.simulate``, one SuperNode per client).
The client split depends only on the seed and the task options, so the arms of one seed train on
the same split: differences are paired by seed.

Setting (FedProto's MNIST setup): 20 clients, N-way K-shot, K = 100, stdev 2, 40 test samples per
own class, batch 4, SGD lr 0.01 momentum 0.5, one local epoch, 50 rounds, evaluation every round
(``--evaluate-every 5`` to halve the cost; the stability over the last 10 rounds then has 2 points).

One entry per finished run is appended (under a file lock, written atomically) to
``bench/results/bd_fedproto_study.json``, keyed by (dataset, n, method, variant, seed); a run
already there is skipped, so the study can be stopped (Ctrl-C / SIGTERM stop every process it
started) and continued later. The Markdown and plots are rewritten from the JSON::

    python -m bench.bd_fedproto_study --dry-run                     # what would run
    nohup python -m bench.bd_fedproto_study --parallel 2 > /tmp/bd_study.log 2>&1 &
    python -m bench.bd_fedproto_study --only 'mnist-shot:5' 'fmnist-shot:*:fedproto'
    python -m bench.bd_fedproto_study --report                      # Markdown + plots only

``--only`` takes patterns ``dataset:n:arm:seed`` (shell wildcards per field, missing trailing fields
match anything); arms: fedproto, bd-fedproto, cpa-only, da-only.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.kit import (
    RESULTS,
    ROOT,
    append_entry,
    check_setting,
    default_data_root,
    fmt_mean_sd,
    fmt_paired,
    mean_sd,
    pop_sd,
    preset,
    pyplot,
    read_json,
    read_metrics,
    save_figure,
    verdict,
    write_atomic,
)
from bench.prototypes import BD_RECONSTRUCTED, read_run

RESULTS_PATH = RESULTS / "bd_fedproto_study.json"
DATASETS = ("mnist-shot", "fmnist-shot")
WAYS = (3, 4, 5)
# arm -> (method, variant, extra run config)
ARMS: dict[str, tuple[str, str, dict]] = {
    "fedproto": ("fedproto", "default", {}),
    "bd-fedproto": ("bd-fedproto", "default", {}),
    "cpa-only": ("bd-fedproto", "cpa-only", {"proto-da": False}),
    "da-only": ("bd-fedproto", "da-only", {"proto-cpa": False}),
}
ABLATION_WAYS = (5,)
TARGET_SEEDS = {3: 3, 4: 5, 5: 5}  # issue 17: >= 3 seeds at n = 3, >= 5 at n = 4, 5 and the ablations
DEFAULT_SEEDS = {n: list(range(k)) for n, k in TARGET_SEEDS.items()}
ARM_STYLE = {"fedproto": ("tab:blue", "-"), "bd-fedproto": ("tab:red", "-"),
             "cpa-only": ("tab:green", "--"), "da-only": ("tab:purple", "--")}
LOSS_PARTS = ("loss-ce", "loss-proto", "loss-neg", "margin")  # per-round fit metrics kept in each entry
LAST = 10  # the paper's stability: std of the client-mean accuracy over the last LAST rounds


# ---------------------------------------------------------------------------------------------
# plan

def arm_of(entry: dict) -> str:
    return entry["method"] if entry.get("variant", "default") == "default" else entry["variant"]


def registered_tasks() -> set[str]:
    from pollen.datasets.tasks import TASKS

    return set(TASKS)


# the FedProto MNIST setting every cell shares, read from the presets (conf/<method>-mnist-n<n>.toml)
SHARED_KEYS = {"shots": "shot-shots", "stdev": "shot-stdev", "test-per-class": "shot-test-per-class",
               "batch-size": "batch-size", "lr": "lr", "momentum": "momentum", "local-epochs": "local-epochs"}


def cell_preset(arm: str, ways: int) -> dict:
    """The preset a cell starts from: its method's MNIST preset for n-way (the ablations are BD-FedProto's)."""
    return preset(f"{ARMS[arm][0]}-mnist-n{ways}")


def study_setting(args: argparse.Namespace) -> dict:
    """What every run of one results file must share (a file never mixes two settings): the presets' shared
    FedProto setting (the same in every preset the study uses: tested) and the study's own options."""
    base = cell_preset("fedproto", WAYS[0])
    return {"clients": args.clients, "rounds": args.rounds,
            **{name: base[key] for name, key in SHARED_KEYS.items()}, "evaluate-every": args.evaluate_every}


def run_config(dataset: str, ways: int, arm: str, seed: int, args: argparse.Namespace, out_dir: Path) -> dict:
    """The cell's preset; the study overrides only the dataset, rounds, seed, paths, the evaluation cadence
    and the ablation's switch."""
    _method, _variant, extra = ARMS[arm]
    return {**cell_preset(arm, ways), "task": dataset, "num-server-rounds": args.rounds, "seed": seed,
            "data-root": args.data_root, "out-dir": str(out_dir), "proto-evaluate-every": args.evaluate_every,
            **extra}


def plan(args: argparse.Namespace, tasks: set[str]) -> tuple[list[tuple], list[str]]:
    """All (dataset, n, arm, seed) the study wants, in run order, and notes on what cannot run."""
    cells, notes = [], []
    seeds_for = {n: (args.seeds_n3 if n == 3 and args.seeds_n3 is not None else
                     args.seeds if args.seeds is not None else DEFAULT_SEEDS[n]) for n in WAYS}
    datasets = []
    for dataset in args.datasets:
        if dataset in tasks:
            datasets.append(dataset)
        else:
            notes.append(f"task {dataset!r} is not registered in pollen/datasets/tasks.py: its cells are skipped")
    # seed-major, so a study stopped anywhere has whole pairs on every dataset and n
    for seed in sorted({s for n in args.ways for s in seeds_for[n]}):
        for dataset in datasets:
            for n in args.ways:
                if seed not in seeds_for[n]:
                    continue
                for arm in ARMS:
                    if arm in ("cpa-only", "da-only") and n not in ABLATION_WAYS:
                        continue
                    if arm not in args.arms:
                        continue
                    cells.append((dataset, n, arm, seed))
    return [c for c in cells if selected(c, args.only)], notes


def selected(cell: tuple, patterns: list[str] | None) -> bool:
    if not patterns:
        return True
    fields = [str(x) for x in cell]
    for pattern in patterns:
        for alt in pattern.split(","):
            parts = alt.strip().split(":")
            if all(fnmatch.fnmatchcase(f, p or "*") for f, p in zip(fields, parts)):
                return True
    return False


def entry_key(e: dict) -> tuple:
    return (e["dataset"], e["ways"], e["method"], e.get("variant", "default"), e["seed"])


def cell_key(cell: tuple) -> tuple:
    dataset, n, arm, seed = cell
    method, variant, _ = ARMS[arm]
    return (dataset, n, method, variant, seed)


# ---------------------------------------------------------------------------------------------
# results file: one entry per finished run, shared by parallel workers (bench.kit.append_entry)

def load_results(path: Path) -> dict:
    return read_json(path, {"runs": []})


# ---------------------------------------------------------------------------------------------
# one run (in a worker process, so two can run at once and a signal stops each one's tree)

def run_entry(run_dir: Path, rounds: int) -> dict:
    """bench/prototypes.py's reading of a run, in %, plus per-client finals, λ_D from fit-clients and
    the last-rounds stability."""
    base = read_run(run_dir)
    curves = base.pop("curves")
    recs = read_metrics(run_dir)
    pct = lambda v: None if v is None else 100.0 * v  # noqa: E731
    out = {k: v for k, v in base.items()}
    c = {"round": curves["round"],
         "accuracy": [pct(v) for v in curves["accuracy-client-mean"]],
         "proto-accuracy": [pct(v) for v in curves["proto-accuracy-client-mean"]],
         "accuracy-client-std": [pct(r["evaluate"].get("accuracy-client-std")) for r in recs],
         "proto-accuracy-client-std": [pct(r["evaluate"].get("proto-accuracy-client-std")) for r in recs],
         "mi": curves["mi-client-mean"], "mi-classifier": curves["mi-classifier-client-mean"],
         "train-loss": curves["train-loss"], "round-wall-time-s": curves["round-wall-time-s"]}
    lam = []
    for r in recs:  # λ_D: metric "lambda" of each client's fit reply, mean over clients per round
        vals = [float(m["lambda"]) for m in (r.get("fit-clients") or {}).values() if m.get("lambda") is not None]
        lam.append(sum(vals) / len(vals) if vals else None)
    c["lambda"] = lam
    c["lambda-client-std"] = curves["lambda-client-std"]
    # the training terms (client means of each epoch-mean part) and CPA's margin: how much CPA and DA act
    for key in LOSS_PARTS:
        c[key] = [(r.get("fit") or {}).get(f"{key}-client-mean", (r.get("fit") or {}).get(key)) for r in recs]
    out["curves"] = c
    final_clients = {}
    last = recs[-1]["evaluate-clients"] if recs else {}
    for name, m in last.items():
        final_clients[name] = {k: pct(m.get(k)) for k in ("accuracy", "proto-accuracy") if m.get(k) is not None}
    out["clients-final"] = final_clients
    out["stability"] = {}
    for key in ("accuracy", "proto-accuracy"):
        pts = [y for x, y in zip(c["round"], c[key]) if y is not None and x > rounds - LAST]
        out["stability"][key] = {"last-rounds-std": pop_sd(pts), "points": len(pts)}
    return out


def worker(spec_path: Path) -> int:
    from pollen.launch import LaunchInterrupted, signals_raise, simulate

    spec = json.loads(spec_path.read_text())
    started = time.monotonic()
    with signals_raise():
        try:
            outcome = simulate(num_supernodes=spec["clients"], run_config=spec["config"],
                               timeout=spec["timeout"], echo=spec["echo"])
        except LaunchInterrupted as err:
            print(f"[study] interrupted ({err}); every process of the run stopped", flush=True)
            return 130
    wall = time.monotonic() - started
    if not outcome.completed:
        print(f"[study] run FAILED ({outcome.status}: {outcome.failure_reason}):\n{outcome.log[-3000:]}", flush=True)
        return 1
    run_dir = outcome.results_dir  # the launcher names run folders; never rebuild the name
    cfg = spec["config"]
    entry = {"dataset": cfg["task"], "ways": cfg["shot-ways"], "method": cfg["method"], "variant": spec["variant"],
             "seed": cfg["seed"], "rounds": cfg["num-server-rounds"], "clients": spec["clients"],
             "evaluate-every": cfg["proto-evaluate-every"], "run-id": str(outcome.run_id),
             "run-dir": str(run_dir), "wall-time-s": round(wall, 1), "config": cfg,
             "finished-at": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_entry(run_dir, cfg["num-server-rounds"])}
    added = append_entry(Path(spec["results"]), entry, entry_key,
                         {"setting": spec["setting"], "bd-fedproto-reconstructed": BD_RECONSTRUCTED})
    acc, pro = entry.get("accuracy", {}), entry.get("proto-accuracy", {})
    print(f"[study] {spec['label']}: local {acc.get('mean', float('nan')):.2f} ± {acc.get('std', float('nan')):.2f}, "
          f"proto {pro.get('mean', float('nan')):.2f} ± {pro.get('std', float('nan')):.2f} in {wall:.0f} s "
          f"({wall / cfg['num-server-rounds']:.1f} s/round incl. start-up)"
          + ("" if added else " — already recorded by another process, this one dropped"), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# scheduler

def label(cell: tuple) -> str:
    return ":".join(str(x) for x in cell)


def run_study(args: argparse.Namespace) -> int:
    setting = study_setting(args)
    check_setting(args.results, setting)
    cells, notes = plan(args, registered_tasks())
    for note in notes:
        print(f"[study] note: {note}", flush=True)
    done = {entry_key(e) for e in load_results(args.results)["runs"]}
    todo = [c for c in cells if cell_key(c) not in done]
    print(f"[study] {len(cells)} runs selected, {len(cells) - len(todo)} already in {args.results}, "
          f"{len(todo)} to run ({args.parallel} at a time)", flush=True)
    if args.dry_run:
        for c in cells:
            print(f"  {'done' if cell_key(c) in done else 'todo'}  {label(c)}")
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    running: dict[int, tuple[subprocess.Popen, tuple, float, Path]] = {}
    failed: list[str] = []
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    queue = list(todo)
    try:
        while (queue or running) and stop["signal"] is None:
            while queue and len(running) < args.parallel and stop["signal"] is None:
                cell = queue.pop(0)
                if cell_key(cell) in {entry_key(e) for e in load_results(args.results)["runs"]}:
                    continue  # another process finished it meanwhile
                dataset, n, arm, seed = cell
                run_dir = work / f"{dataset}-n{n}-{arm}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
                run_dir.mkdir(parents=True, exist_ok=True)
                spec = {"label": label(cell), "variant": ARMS[arm][1], "clients": args.clients,
                        "config": run_config(dataset, n, arm, seed, args, run_dir / "runs"),
                        "out-dir": str(run_dir / "runs"), "results": str(args.results), "setting": setting,
                        "timeout": args.timeout, "echo": args.echo}
                spec_path = run_dir / "spec.json"
                spec_path.write_text(json.dumps(spec, indent=1))
                log = open(run_dir / "worker.log", "w")
                proc = subprocess.Popen([sys.executable, "-m", "bench.bd_fedproto_study", "--worker", str(spec_path)],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        start_new_session=True)  # a terminal's Ctrl-C reaches only us
                log.close()
                running[proc.pid] = (proc, cell, time.monotonic(), run_dir / "worker.log")
                print(f"[study] start {label(cell)} (pid {proc.pid}, log {run_dir / 'worker.log'})", flush=True)
            time.sleep(2)
            for pid, (proc, cell, t0, tail) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[pid]
                lines = tail.read_text(errors="replace").splitlines()
                if proc.returncode == 0:
                    print(next((ln for ln in reversed(lines) if ln.startswith("[study]")),
                               f"[study] {label(cell)} done"), flush=True)
                    if args.rewrite_report:
                        write_report(args.results, plots=False)
                else:
                    failed.append(label(cell))
                    print(f"[study] {label(cell)} FAILED (exit {proc.returncode}) after "
                          f"{time.monotonic() - t0:.0f} s; log {tail}:\n" + "\n".join(lines[-30:]), flush=True)
    finally:
        for pid, (proc, cell, _t0, _log) in running.items():  # stop our own workers, each by its pid
            if proc.poll() is None:
                print(f"[study] stopping {label(cell)} (pid {pid})", flush=True)
                proc.send_signal(signal.SIGTERM)
        for proc, _cell, _t0, _log in running.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.results.exists():
        write_report(args.results, plots=True)
    if stop["signal"] is not None:
        print(f"[study] stopped by signal {stop['signal']}; finished runs are in {args.results}", flush=True)
        return 128 + int(stop["signal"])
    if failed:
        print(f"[study] {len(failed)} runs failed: {', '.join(failed)}", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# report

def metric(e: dict, what: str) -> float | None:
    """accuracy / proto-accuracy (final client mean), *-client-std, *-last-std."""
    if what.endswith("-client-std"):
        v = e.get(what[: -len("-client-std")])
        return None if v is None else v["std"]
    if what.endswith("-last-std"):
        return (e.get("stability", {}).get(what[: -len("-last-std")]) or {}).get("last-rounds-std")
    v = e.get(what)
    return None if v is None else v["mean"]


def groups_of(runs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(dataset, n, arm) -> {seed: entry}"""
    out: dict[tuple, dict[int, dict]] = {}
    for e in runs:
        out.setdefault((e["dataset"], e["ways"], arm_of(e)), {})[e["seed"]] = e
    return out


def paired(base: dict[int, dict], other: dict[int, dict], what: str) -> list[float]:
    out = []
    for seed in sorted(set(base) & set(other)):
        a, b = metric(other[seed], what), metric(base[seed], what)
        if a is not None and b is not None:
            out.append(a - b)
    return out


def mean_curve(entries: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """Rounds, mean and s.d. over seeds (s.d. 0 with one seed) of a per-round curve."""
    by_round: dict[int, list[float]] = {}
    for e in entries:
        c = e["curves"]
        for x, y in zip(c["round"], c.get(key) or []):
            if y is not None:
                by_round.setdefault(x, []).append(y)
    xs = sorted(by_round)
    stats = [mean_sd(by_round[x]) for x in xs]
    return xs, [m for m, _ in stats], [sd or 0.0 for _, sd in stats]


def plateau_round(entries: list[dict], key: str = "accuracy", tol: float = 0.25) -> int | None:
    """First round whose seed-mean accuracy is within ``tol`` points of the mean of the last LAST rounds."""
    xs, ys, _ = mean_curve(entries, key)
    if not xs:
        return None
    tail = [y for x, y in zip(xs, ys) if x > xs[-1] - LAST]
    level = statistics.fmean(tail)
    return next((x for x, y in zip(xs, ys) if y >= level - tol), None)


def claims_section(groups: dict[tuple, dict[int, dict]], datasets: list[str]) -> list[str]:
    """One row per claim of the paper and cell, with the paired difference and the rule's verdict."""
    rows = []

    def row(claim: str, d: str, n: int, a: str, b: str, what: str, lower: bool) -> None:
        ga, gb = groups.get((d, n, a)), groups.get((d, n, b))
        if not ga or not gb:
            return
        diffs = paired(gb, ga, what)
        mark = "" if len(diffs) >= TARGET_SEEDS[n] else "*"
        rows.append(f"| {claim} | {d} | {n} | {a} − {b} | {what} | {len(diffs)}{mark} | {fmt_paired(diffs)} "
                    f"| {verdict(diffs, lower)} |")

    for d in datasets:
        for n in WAYS:
            for what in ("accuracy", "proto-accuracy"):
                row("more accurate than FedProto", d, n, "bd-fedproto", "fedproto", what, False)
    for d in datasets:
        for n in WAYS:
            for what in ("accuracy-client-std", "accuracy-last-std"):
                row("more stable than FedProto", d, n, "bd-fedproto", "fedproto", what, True)
    for d in datasets:
        for n in ABLATION_WAYS:
            for what in ("accuracy", "proto-accuracy"):
                row("CPA helps at 4/5-way (CPA added to DA)", d, n, "bd-fedproto", "da-only", what, False)
                row("CPA helps at 4/5-way (CPA alone)", d, n, "cpa-only", "fedproto", what, False)
    for d in datasets:
        for what, lower in (("accuracy", True), ("accuracy-last-std", True)):
            row("3-way: trades accuracy for stability", d, 3, "bd-fedproto", "fedproto", what, lower)
    if not rows:
        return []
    return ["## The paper's claims", "",
            "Each claim is checked cell by cell on the paired differences (arm − baseline, same seed, mean ± "
            "standard error). Rule, fixed before the runs (`bench.kit.verdict`): *supported* when the mean lies ≥ "
            "2 s.e. on the claimed side of zero, *contradicted* when ≥ 2 s.e. on the other side, *not shown* in "
            "between. "
            "Stability metrics: lower is better (client std = std over clients of the final local accuracy; "
            f"last std = std of the client-mean local accuracy over the last {LAST} rounds). For *3-way: trades "
            "accuracy for stability* the accuracy row asks for a *lower* accuracy and the stability row for a "
            "lower std: the claim holds only if both rows are supported. At n = 4 no ablation was run, so CPA at "
            "4-way is seen only through BD-FedProto − FedProto. `*` = fewer paired seeds than the target.", "",
            "| claim | dataset | n | contrast | metric | paired seeds | Δ ± s.e. | verdict |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def plot_paths(results_path: Path) -> dict[str, Path]:
    stem, parent = results_path.stem, results_path.parent
    return {"accuracy-mnist-shot": parent / f"{stem}_accuracy_mnist.png",
            "accuracy-fmnist-shot": parent / f"{stem}_accuracy_fmnist.png",
            "lambda": parent / f"{stem}_lambda.png", "mi": parent / f"{stem}_mi.png"}


def markdown(results: dict, results_path: Path) -> str:
    runs = results.get("runs", [])
    s = results.get("setting", {})
    groups = groups_of(runs)
    datasets = [d for d in DATASETS if any(k[0] == d for k in groups)]
    tasks = registered_tasks()
    lines = [
        "# BD-FedProto vs FedProto: paired multi-seed study (issue 17)", "",
        f"{s.get('clients', '?')} clients (one Flower SuperNode each, real `flwr run` simulations), N-way "
        f"{s.get('shots', '?')}-shot (stdev {s.get('stdev', '?')}, {s.get('test-per-class', '?')} test samples per "
        f"own class), batch {s.get('batch-size', '?')}, SGD lr {s.get('lr', '?')} momentum {s.get('momentum', '?')}, "
        f"{s.get('local-epochs', '?')} local epoch, {s.get('rounds', '?')} rounds, evaluation every "
        f"{s.get('evaluate-every', '?')} round(s) (`proto-evaluate-every`). Accuracy in %. *Local*: each client's "
        "own classifier on its own classes' test samples; *proto*: nearest global prototype among the client's "
        "classes. Per run: the mean over clients at the last round; the tables then give mean ± s.d. **over "
        "seeds**. The split depends only on the seed and the task options, so the arms of one seed share it: "
        "Δ = arm − FedProto is computed seed by seed and reported as mean ± **standard error over seeds** "
        "(paired). *CPA-only* = BD-FedProto with `proto-da=false`, *DA-only* = with `proto-cpa=false`.", "",
        f"Stability (the paper's sense): *client std* = std over clients of the final accuracy (mean over "
        f"seeds); *round std* = std over the last {LAST} rounds of the client-mean accuracy (evaluated rounds "
        f"only; mean over seeds).", "",
        f"Generated from `{results_path.name}` ({len(runs)} runs) by `python -m bench.bd_fedproto_study --report`.",
        ""]
    missing = [d for d in DATASETS if d not in tasks]
    if missing:
        lines += [f"Not run: {', '.join(missing)} — no such task is registered in `pollen/datasets/tasks.py`.", ""]
    if not runs:
        return "\n".join(lines + ["No runs yet.", ""])

    lines += ["## Accuracy", "",
              "| dataset | n | arm | seeds (target) | local | proto | Δ local vs FedProto | Δ proto vs FedProto "
              "| paired seeds |", "|---|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for n in WAYS:
            base = groups.get((d, n, "fedproto"), {})
            for arm in ARMS:
                g = groups.get((d, n, arm))
                if not g:
                    continue
                target = TARGET_SEEDS[n]
                seeds = f"{len(g)} ({target})" + ("" if len(g) >= target else " **incomplete**")
                vals = {w: [v for v in (metric(e, w) for e in g.values()) if v is not None]
                        for w in ("accuracy", "proto-accuracy")}
                if arm == "fedproto":
                    dl = dp = "–"
                    npair = "–"
                else:
                    dl, dp = fmt_paired(paired(base, g, "accuracy")), fmt_paired(paired(base, g, "proto-accuracy"))
                    npair = str(len(set(base) & set(g)))
                lines.append(f"| {d} | {n} | {arm} | {seeds} | {fmt_mean_sd(vals['accuracy'])} | "
                             f"{fmt_mean_sd(vals['proto-accuracy'])} | {dl} | {dp} | {npair} |")
    lines += ["", "## Stability", "",
              "Lower is more stable. Δ = arm − FedProto, paired by seed, ± standard error.", "",
              "| dataset | n | arm | seeds | client std local / proto | round std (last "
              f"{LAST}) local / proto | Δ client std local / proto | Δ round std local / proto |",
              "|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for n in WAYS:
            base = groups.get((d, n, "fedproto"), {})
            for arm in ARMS:
                g = groups.get((d, n, arm))
                if not g:
                    continue

                cols = []
                for suffix in ("client-std", "last-std"):  # mean ± s.d. over seeds, local / proto
                    cols.append(" / ".join(fmt_mean_sd([v for v in (metric(e, f"{k}-{suffix}") for e in g.values())
                                                   if v is not None]) for k in ("accuracy", "proto-accuracy")))
                for suffix in ("client-std", "last-std"):  # paired Δ to FedProto ± standard error
                    cols.append(" / ".join("–" if arm == "fedproto" else fmt_paired(paired(base, g, f"{k}-{suffix}"))
                                           for k in ("accuracy", "proto-accuracy")))
                mark = "" if len(g) >= TARGET_SEEDS[n] else "*"
                lines.append(f"| {d} | {n} | {arm} | {len(g)}{mark} | " + " | ".join(cols) + " |")
    lines += ["", "`*` = fewer seeds than the target (3 at n = 3, 5 at n = 4 and 5).", ""]
    contrasts = [("cpa-only", "fedproto", "CPA alone"), ("da-only", "fedproto", "DA alone"),
                 ("bd-fedproto", "da-only", "CPA added to DA"), ("bd-fedproto", "cpa-only", "DA added to CPA")]
    abl = []
    for d in datasets:
        for n in ABLATION_WAYS:
            for a, b, what in contrasts:
                ga, gb = groups.get((d, n, a)), groups.get((d, n, b))
                if not ga or not gb:
                    continue
                cols = [fmt_paired(paired(gb, ga, w)) for w in
                        ("accuracy", "proto-accuracy", "accuracy-last-std", "proto-accuracy-last-std")]
                abl.append(f"| {d} | {n} | {a} − {b} ({what}) | {len(set(ga) & set(gb))} | " + " | ".join(cols) + " |")
    if abl:
        lines += ["## Ablations", "", "Paired by seed, mean ± standard error.", "",
                  "| dataset | n | contrast | paired seeds | Δ local | Δ proto | Δ round std local "
                  "| Δ round std proto |",
                  "|---|---|---|---|---|---|---|---|", *abl, ""]
    lines += claims_section(groups, datasets)
    lines += [
              "## Convergence", "",
              "Plateau round: the first round at which the seed-mean local accuracy is within 0.25 points of its "
              f"mean over the last {LAST} rounds.", "",
              "Time: *s/round* = median round time from round 2 on (mean over runs); *round 1* = the first round "
              "(data loading, actor start-up); *run* = the whole `flwr run` incl. SuperLink start and teardown.", "",
              "| dataset | n | arm | plateau round (local) | plateau round (proto) | s/round | round 1 s | run s |",
              "|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for n in WAYS:
            for arm in ARMS:
                g = groups.get((d, n, arm))
                if not g:
                    continue
                es = list(g.values())
                t = [e["curves"]["round-wall-time-s"] for e in es]
                steady = [statistics.median(c[1:]) for c in t if len(c) > 1]
                lines.append(f"| {d} | {n} | {arm} | {plateau_round(es) or '–'} | "
                             f"{plateau_round(es, 'proto-accuracy') or '–'} | "
                             f"{statistics.fmean(steady) if steady else float('nan'):.1f} | "
                             f"{statistics.fmean([c[0] for c in t]):.0f} | "
                             f"{statistics.fmean([e['wall-time-s'] for e in es]):.0f} |")
    plots = plot_paths(results_path)
    lines += ["", "## Plots", ""]
    for d in datasets:
        lines.append(f"- `{plots['accuracy-' + d].name}`: {d}, client-mean accuracy vs round per arm (line = mean "
                     "over seeds, band = s.d. over seeds), local (top) and proto (bottom), one column per n.")
    lines += [f"- `{plots['lambda'].name}`: DA's λ_D (client mean of the fit metric `lambda`, λ_0 = 1) per round, "
              "mean ± s.d. over seeds.",
              f"- `{plots['mi'].name}`: MI monitor per round (prototype softmax `mi`, solid; classifier "
              "`mi-classifier`, dotted), mean over seeds; only evaluated rounds carry MI.", "",
              "## Runs", "",
              "| dataset | n | arm | seed | local | proto | round std local / proto | wall s | s/round | run id |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(runs, key=lambda e: (DATASETS.index(e["dataset"]) if e["dataset"] in DATASETS else 9,
                                         e["ways"], list(ARMS).index(arm_of(e)), e["seed"])):
        acc = {k: "–" if k not in e else f"{e[k]['mean']:.2f} ± {e[k]['std']:.2f}"
               for k in ("accuracy", "proto-accuracy")}
        st = [metric(e, f"{k}-last-std") for k in ("accuracy", "proto-accuracy")]
        st_s = " / ".join("–" if v is None else f"{v:.2f}" for v in st)
        lines.append(f"| {e['dataset']} | {e['ways']} | {arm_of(e)} | {e['seed']} | {acc['accuracy']} | "
                     f"{acc['proto-accuracy']} | {st_s} | {e['wall-time-s']:.0f} | "
                     f"{e['wall-time-s'] / e['rounds']:.1f} | {e['run-id']} |")
    lines += ["", f"BD-FedProto: {results.get('bd-fedproto-reconstructed', BD_RECONSTRUCTED)}", ""]
    return "\n".join(lines)


def plot(results: dict, results_path: Path) -> list[Path]:
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    groups = groups_of(results.get("runs", []))
    paths = plot_paths(results_path)
    written = []
    datasets = [d for d in DATASETS if any(k[0] == d for k in groups)]

    def band(ax, entries, key, arm, style="-", alpha=0.15, lab=None):
        xs, ys, sds = mean_curve(entries, key)
        if not xs:
            return
        color, _ = ARM_STYLE[arm]
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.plot(xs, ys, color=color, ls=style, lw=1.3, marker="." if len(xs) < 15 else None,
                label=lab or f"{arm} ({len(entries)} seeds)")
        if len(entries) > 1:
            ax.fill_between(xs, [y - s for y, s in zip(ys, sds)], [y + s for y, s in zip(ys, sds)],
                            color=color, alpha=alpha, lw=0)

    for d in datasets:
        ways = [n for n in WAYS if any(k[0] == d and k[1] == n for k in groups)]
        fig, axes = plt.subplots(2, len(ways), figsize=(4.6 * len(ways), 7), squeeze=False)
        for j, n in enumerate(ways):
            for i, key in enumerate(("accuracy", "proto-accuracy")):
                ax = axes[i][j]
                for arm in ARMS:
                    g = groups.get((d, n, arm))
                    if g:
                        band(ax, list(g.values()), key, arm, ARM_STYLE[arm][1])
                ax.set_title(f"{d}, n = {n}: {'local classifier' if i == 0 else 'nearest prototype'}", fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel("client-mean accuracy (%)")
                ax.grid(alpha=0.3)
                # zoom on the plateau: the lowest late value minus a margin, so the arms can be told apart
                late = [y for arm in ARMS for g in [groups.get((d, n, arm))] if g
                        for x, y in zip(*mean_curve(list(g.values()), key)[:2]) if x >= 5]
                if late:
                    ax.set_ylim(max(0.0, min(late) - 2.0), min(100.0, max(late) + 0.5))
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{d}: accuracy vs round\nmean over seeds, band = s.d. over seeds, y zoomed to rounds ≥ 5",
                     fontsize=9)
        save_figure(fig, paths[f"accuracy-{d}"], dpi=90)
        written.append(paths[f"accuracy-{d}"])

    cells = [(d, n) for d in datasets for n in WAYS if any(k[:2] == (d, n) for k in groups)]
    if cells:
        cols = min(3, len(cells))
        rows = math.ceil(len(cells) / cols)
        for what in ("lambda", "mi"):
            fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
            for idx, (d, n) in enumerate(cells):
                ax = axes[idx // cols][idx % cols]
                for arm in ARMS:
                    g = groups.get((d, n, arm))
                    if not g:
                        continue
                    if what == "lambda":
                        if arm != "fedproto":
                            band(ax, list(g.values()), "lambda", arm, ARM_STYLE[arm][1])
                    else:
                        band(ax, list(g.values()), "mi", arm, "-", lab=f"{arm} mi")
                        band(ax, list(g.values()), "mi-classifier", arm, ":", alpha=0.0, lab=f"{arm} mi-classifier")
                ax.set_title(f"{d}, n = {n}", fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel("λ_D (λ_0 = 1)" if what == "lambda" else "normalised MI")
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
            for idx in range(len(cells), rows * cols):
                axes[idx // cols][idx % cols].axis("off")
            fig.suptitle("DA: λ_D per round (client mean)\nmean ± s.d. over seeds" if what == "lambda"
                         else "MI monitor per round (client mean)\nmean over seeds (band: s.d., mi only)", fontsize=9)
            save_figure(fig, paths[what], dpi=90)
            written.append(paths[what])
    return written


def write_report(results_path: Path, plots: bool = True) -> Path:
    results = load_results(results_path)
    md_path = results_path.with_suffix(".md")
    write_atomic(md_path, markdown(results, results_path) + "\n")
    if plots:
        plot(results, results_path)
    return md_path


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default=default_data_root(),
                        help="folder with MNIST/raw and FashionMNIST/raw (default: $POLLEN_DATA_ROOT, else "
                             "../shared/data)")
    parser.add_argument("--results", type=Path, default=RESULTS_PATH,
                        help="results JSON; the Markdown (.md) and the plots (<stem>_*.png) go beside it")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--ways", type=int, nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds for every n (default: 0 1 2 at n = 3, 0 1 2 3 4 at n = 4, 5)")
    parser.add_argument("--seeds-n3", type=int, nargs="+", default=None, help="seeds at n = 3 (overrides --seeds)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="keep runs matching any pattern dataset:n:arm:seed (wildcards; e.g. 'mnist-shot:5', "
                             "'*:*:cpa-only', 'fmnist-shot:4:*:0')")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--evaluate-every", type=int, default=1, choices=(1, 5),
                        help="proto-evaluate-every (and the rounds MI is computed on); 1 = the stability has 10 points")
    parser.add_argument("--parallel", type=int, default=1, choices=(1, 2), help="simulations at once")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pollen-bd-study"),
                        help="per-run folders: the run's results (metrics.jsonl, summary.json), worker log")
    parser.add_argument("--quiet", dest="echo", action="store_false",
                        help="keep each run's Flower log (a line per round) out of its worker log")
    parser.add_argument("--no-rewrite-report", dest="rewrite_report", action="store_false",
                        help="do not rewrite the Markdown after each run (plots are drawn at the end)")
    parser.add_argument("--dry-run", action="store_true", help="list what would run, run nothing")
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown and plots from the JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    args.results = args.results.resolve()
    args.data_root = str(Path(args.data_root).resolve())
    if args.report:
        if not args.results.exists():
            print(f"no results at {args.results}", file=sys.stderr)
            return 1
        md = write_report(args.results, plots=True)
        print(f"[study] wrote {md} and {', '.join(p.name for p in plot_paths(args.results).values() if p.exists())}")
        return 0
    return run_study(args)


if __name__ == "__main__":
    sys.exit(main())
