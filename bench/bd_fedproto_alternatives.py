"""BD-FedProto's documented alternatives, chosen on held-out seeds and reported on fresh ones (issue 17, item 2).

When neither CPA nor DA helps in the main study (``bench.bd_fedproto_study``), the reconstruction's
documented alternatives get one fair chance, on the hardest cell (Fashion-MNIST, 5-way):

1. **select**: FedProto, BD-FedProto (defaults: hinge negatives, β = 0.5, α = 0.5 — the paper's best
   α = β = 0.5 *is* the default) and each alternative below on the selection seeds 100-102;
2. **choose**, by a rule fixed before any run: the arm with the largest mean paired Δ local accuracy
   to FedProto on the selection seeds (ties: Δ proto);
3. **confirm**: FedProto and the chosen arm on the fresh seeds 200-204, which took no part in the choice.
   Only these numbers are reported as the chosen setting's effect.

Same training as the main study (20 clients, 100 shots, 50 rounds, …); every run is a real
``flwr run`` through the main study's worker. The committed study evaluates every 5 rounds
(``--evaluate-every 5``: 10 evaluation rounds instead of 50): the choice and the confirmation read the last round,
which is always evaluated, and training does not depend on the evaluation period. Results:
``bench/results/bd_fedproto_alternatives.json`` (one entry per run, resumable; a file never mixes two
settings) and ``.md``::

    nohup .venv/bin/python -m bench.bd_fedproto_alternatives --data-root ../shared/data --evaluate-every 5 \
        > /tmp/bd_alt.log 2>&1 &
    .venv/bin/python -m bench.bd_fedproto_alternatives --report
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.bd_fedproto_study import arm_of, entry_key, load_results, metric, paired, study_setting
from bench.bd_fedproto_study import run_config as study_run_config
from bench.kit import (
    CONTRADICTED,
    RESULTS,
    ROOT,
    SUPPORTED,
    check_setting,
    default_data_root,
    fmt_mean_sd,
    fmt_paired,
    verdict,
    write_atomic,
)

RESULTS_PATH = RESULTS / "bd_fedproto_alternatives.json"
DATASET, WAYS = "fmnist-shot", 5
SELECT_SEEDS = (100, 101, 102)
CONFIRM_SEEDS = (200, 201, 202, 203, 204)
# arm -> (method, extra run config); the variant stored with each run is the arm's name
CANDIDATES: dict[str, tuple[str, dict]] = {
    "bd-fedproto": ("bd-fedproto", {}),
    "infonce": ("bd-fedproto", {"proto-negative": "infonce"}),
    "beta-0.25": ("bd-fedproto", {"proto-beta": 0.25}),
    "beta-1": ("bd-fedproto", {"proto-beta": 1.0}),
    "da-kappa-0.99": ("bd-fedproto", {"proto-da-kappa": 0.99}),  # slower annealing of DA's temperature
}
ARMS = {"fedproto": ("fedproto", {}), **CANDIDATES}


def variant_of(arm: str) -> str:
    return "default" if arm in ("fedproto", "bd-fedproto") else arm


def run_config(arm: str, seed: int, args: argparse.Namespace, out_dir: Path) -> dict:
    method, extra = ARMS[arm]
    return {**study_run_config(DATASET, WAYS, method, seed, args, out_dir), **extra}


def cell_key(arm: str, seed: int) -> tuple:
    return (DATASET, WAYS, ARMS[arm][0], variant_of(arm), seed)


def by_arm(results: dict, seeds: tuple[int, ...]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for e in results.get("runs", []):
        if e["seed"] in seeds:
            out.setdefault(arm_of(e), {})[e["seed"]] = e
    return out


def mean_diff(base: dict, other: dict, what: str) -> float | None:
    d = paired(base, other, what)
    return statistics.fmean(d) if d else None


def choose(results: dict) -> str | None:
    """The rule fixed in advance: best mean paired Δ local (then Δ proto) on all selection seeds."""
    arms = by_arm(results, SELECT_SEEDS)
    base = arms.get("fedproto", {})
    if set(base) != set(SELECT_SEEDS):
        return None
    scored = []
    for arm in CANDIDATES:
        g = arms.get(arm, {})
        if set(g) != set(SELECT_SEEDS):
            return None  # not every candidate has every selection seed yet
        scored.append((mean_diff(base, g, "accuracy"), mean_diff(base, g, "proto-accuracy"), arm))
    return max(scored)[2]


def run_cell(arm: str, seed: int, args: argparse.Namespace, stop: dict) -> bool:
    """One run through the main study's worker (its own process session); False if it failed."""
    label = f"{DATASET}:{WAYS}:{arm}:{seed}"
    run_dir = Path(args.work_dir) / f"alt-{arm}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"label": label, "variant": variant_of(arm), "clients": args.clients,
            "config": run_config(arm, seed, args, run_dir / "runs"), "out-dir": str(run_dir / "runs"),
            "results": str(args.results), "setting": study_setting(args), "timeout": args.timeout, "echo": True}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    print(f"[alternatives] start {label} (log {run_dir / 'worker.log'})", flush=True)
    with open(run_dir / "worker.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.bd_fedproto_study", "--worker",
                                 str(run_dir / "spec.json")], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    while proc.poll() is None:
        if stop["signal"] is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            return False
        time.sleep(2)
    lines = (run_dir / "worker.log").read_text(errors="replace").splitlines()
    print(next((ln for ln in reversed(lines) if ln.startswith("[study]")), f"[alternatives] {label} exit "
               f"{proc.returncode}").replace("[study]", "[alternatives]"), flush=True)
    return proc.returncode == 0


TERM_ROUNDS = (2, 10, 25, 50)


def mean_at(runs: list[dict], key: str, rnd: int) -> float | None:
    """Mean over runs of curve ``key`` at round ``rnd`` (runs without it, or with None there, left out)."""
    vals = [e["curves"][key][e["curves"]["round"].index(rnd)] for e in runs
            if key in e["curves"] and rnd in e["curves"]["round"]]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def _fmt(v: float | None, spec: str = ".4f") -> str:
    return "–" if v is None else format(v, spec)


def terms_section(results: dict) -> list[str]:
    """How much CPA and DA act: the client-mean L_P and L_N, CPA's margin and λ_D at a few rounds (mean over
    every run of an arm that recorded them)."""
    rows = []
    for arm in ARMS:
        runs = [e for e in results.get("runs", []) if arm_of(e) == arm and "loss-proto" in e.get("curves", {})]
        if not runs:
            continue
        cells = []
        for rnd in TERM_ROUNDS:
            lp, ln, m, lam = (mean_at(runs, key, rnd) for key in ("loss-proto", "loss-neg", "margin", "lambda"))
            cells.append(f"{_fmt(lp)} / {_fmt(ln)} / {_fmt(m)} / {_fmt(lam, '.3f')}")
        rows.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["## How much CPA and DA act", "",
            "Per round: L_P / L_N / margin m / λ_D — client means of the epoch-mean training terms (L_N is the "
            "unweighted negative loss, before β·λ_D), the server's margin and DA's λ_D; mean over the arm's runs "
            "that recorded them. An L_N of 0 means no embedding came within the margin of another class's "
            "prototype, so CPA had no gradient.", "",
            "| arm | runs | " + " | ".join(f"round {r}" for r in TERM_ROUNDS) + " |",
            "|---|---|" + "---|" * len(TERM_ROUNDS), *rows, ""]


def markdown(results: dict) -> str:
    lines = ["# BD-FedProto's alternatives: chosen on held-out seeds, reported on fresh seeds", "",
             f"{DATASET}, {WAYS}-way, the main study's setting (`bd_fedproto_study.md`). Selection seeds "
             f"{', '.join(map(str, SELECT_SEEDS))}; rule fixed in advance: the largest mean paired Δ local accuracy "
             f"to FedProto (ties: Δ proto). Confirmation seeds {', '.join(map(str, CONFIRM_SEEDS))}, unused by the "
             "choice. Accuracy in %, per run the client mean at the last round; mean ± s.d. over seeds, Δ = arm − "
             "FedProto paired by seed ± standard error."
             + (f" Evaluated every {every} rounds (training does not depend on it; the round std over the last 10 "
                f"rounds then has {max(1, 10 // every)} points)." if (every := results.get("setting", {}).get(
                    "evaluate-every", 1)) > 1 else ""), ""]
    for title, seeds in (("Selection (held-out seeds)", SELECT_SEEDS), ("Confirmation (fresh seeds)", CONFIRM_SEEDS)):
        arms = by_arm(results, seeds)
        if not arms:
            continue
        base = arms.get("fedproto", {})
        lines += [f"## {title}", "",
                  "| arm | run keys | seeds | local | proto | Δ local | Δ proto | Δ round std local |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm in ARMS:
            g = arms.get(arm)
            if not g:
                continue
            keys = ", ".join(f"`{k}={v}`" for k, v in ARMS[arm][1].items()) or "defaults"
            vals = {w: [v for v in (metric(e, w) for e in g.values()) if v is not None]
                    for w in ("accuracy", "proto-accuracy")}
            deltas = ["–"] * 3 if arm == "fedproto" else [
                fmt_paired(paired(base, g, w)) for w in ("accuracy", "proto-accuracy", "accuracy-last-std")]
            lines.append(f"| {arm} | {keys} | {len(g)} | {fmt_mean_sd(vals['accuracy'])} | "
                         f"{fmt_mean_sd(vals['proto-accuracy'])} | " + " | ".join(deltas) + " |")
        lines.append("")
    lines += terms_section(results)
    chosen = choose(results)
    lines.append(f"Chosen arm: **{chosen}**." if chosen else "Chosen arm: not yet (the selection is incomplete).")
    if chosen:
        arms = by_arm(results, CONFIRM_SEEDS)
        d = paired(arms.get("fedproto", {}), arms.get(chosen, {}), "accuracy")
        if len(d) >= 2:
            words = {SUPPORTED: "better than", CONTRADICTED: "worse than"}
            word = words.get(verdict(d), "not distinguishable from")
            lines.append(f"On the fresh seeds ({len(d)} of {len(CONFIRM_SEEDS)}), {chosen} is {word} FedProto in "
                         f"local accuracy: Δ {fmt_paired(d)} (2 s.e. rule).")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--results", type=Path, default=RESULTS_PATH)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--evaluate-every", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3 * 3600)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/pollen-bd-study"))
    p.add_argument("--report", action="store_true", help="only rewrite the Markdown")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.results = args.results.resolve()
    args.data_root = str(Path(args.data_root).resolve())
    md_path = args.results.with_suffix(".md")
    if args.report:
        write_atomic(md_path, markdown(load_results(args.results)))
        return 0
    check_setting(args.results, study_setting(args))
    stop = {"signal": None}
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, _f: stop.__setitem__("signal", signum))
    for phase in ("select", "confirm"):
        results = load_results(args.results)
        done = {entry_key(e) for e in results["runs"]}
        if phase == "select":
            cells = [(arm, seed) for seed in SELECT_SEEDS for arm in ARMS]
        else:
            chosen = choose(results)
            if chosen is None:
                print("[alternatives] selection incomplete: no confirmation yet", flush=True)
                break
            print(f"[alternatives] chosen by the selection rule: {chosen}", flush=True)
            cells = [(arm, seed) for seed in CONFIRM_SEEDS for arm in ("fedproto", chosen)]
        todo = [c for c in cells if cell_key(*c) not in done]
        print(f"[alternatives] {phase}: {len(cells) - len(todo)} of {len(cells)} runs done", flush=True)
        if args.dry_run:
            for arm, seed in todo:
                print(f"  todo {arm} seed {seed}")
            continue
        for arm, seed in todo:
            if stop["signal"] is not None or not run_cell(arm, seed, args, stop):
                break
            write_atomic(md_path, markdown(load_results(args.results)))
        if stop["signal"] is not None:
            return 128 + int(stop["signal"])
    if args.results.exists():
        write_atomic(md_path, markdown(load_results(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
