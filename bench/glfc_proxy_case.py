"""The case GLFC's proxy exists for: a task whose last global model degraded. Does the proxy keep a better one?

GLFC keeps as its old model the global model that scored best on the proxy's reconstructed set; GLFC w/o
proxy keeps the task's last global model. When training goes well the two are the same model
(``glfc_methods.md``). Here the last round of task 1 degrades the model the way a real federation
can: only one client is online in that round, so the new global model is that client's update alone,
trained on 3 of the 5 classes (``--degrade-epochs`` local epochs, by default the study's own).

The learning-rate schedule decides whether that can happen. Under Pollen's default cosine decay within
a task the rate of a task's last round is below 1 % of the base rate, so no last-round update moves the
model (the record with ``lr_schedule = cosine`` in the JSON). The official code's step schedule
(``glfc-lr-schedule='code'``, the default here) keeps the base rate, as in the paper's runs, and there
the lone client's update degrades the model. Everything else is the study's setting
(``bench.glfc_study``), run through the real strategy and ClientApp handlers (``bench.glfc``'s
in-process grid) up to the end of task 2.

Reported per seed and arm: the accuracy of the last task-1 model and of the one before it, the proxy's
scores of both, the round and accuracy of the old model the arm keeps, and the accuracy on task 1's
classes at the end of task 2 (what distilling from a better old model should protect). Writes
``bench/results/glfc_proxy_case.{json,md}``; finished (arm, seed) pairs are skipped::

    POLLEN_DATA_ROOT=../shared/data .venv/bin/python -m bench.glfc_proxy_case --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.glfc_study import DEFAULTS, bench_args
from bench.kit import RESULTS, default_data_root, fmt_paired, read_json, write_atomic, write_json

OUT = RESULTS / "glfc_proxy_case.json"
ARMS = ("glfc", "glfc-wo-proxy")
ONLINE = 0  # the one partition that answers in task 1's last round
LR_SCHEDULE = "code"  # the official step schedule: the rate does not decay within a task


def setting_of(args: argparse.Namespace) -> dict:
    return {**{k: getattr(args, k) for k in DEFAULTS}, "degrade_epochs": args.degrade_epochs,
            "lr_schedule": args.lr_schedule}


def run(arm: str, seed: int, args: argparse.Namespace) -> dict:
    import torch

    from bench.glfc import method_config, run_inprocess

    torch.set_num_threads(1)
    r = args.rounds_per_task
    rc = {**method_config(arm, bench_args(args, seed, oracle=True)), "glfc-lr-schedule": args.lr_schedule}
    t0 = time.perf_counter()
    rounds = run_inprocess(rc, offline=lambda rnd, pid: rnd == r and pid != ONLINE, stop_after=2 * r,
                           overrides=lambda rnd, pid: {"local-epochs": args.degrade_epochs} if rnd == r else None)
    per_round = [{"round": x["round"], "accuracy": x["server-evaluate"]["accuracy"],
                  "task0-accuracy": x["server-evaluate"].get("task0-accuracy"),
                  "accepted": int(x["fit"].get("accepted", 0)),
                  "proxy-new-best": x["fit"].get("proxy-new-best"),
                  "proxy-monitor-accuracy": x["fit"].get("proxy-monitor-accuracy")} for x in rounds]
    task1 = per_round[:r]
    if arm == "glfc":
        kept = max((x["round"] for x in task1 if x["proxy-new-best"]), default=None)
    else:
        kept = r  # w/o proxy: the task's last global model
    kept_acc = next((x["accuracy"] for x in task1 if x["round"] == kept), None)
    return {"arm": arm, "seed": seed, "setting": setting_of(args),
            "wall-s": round(time.perf_counter() - t0, 1), "rounds": per_round,
            "before-last-accuracy": task1[-2]["accuracy"], "last-accuracy": task1[-1]["accuracy"],
            "kept-round": kept, "kept-accuracy": kept_acc,
            "task1-accuracy-end-of-task2": per_round[-1]["task0-accuracy"],
            "seen-accuracy-end-of-task2": per_round[-1]["accuracy"]}


def proxy_scores(rec: dict, rounds_per_task: int) -> str:
    """The proxy's score (accuracy on its reconstructed set) of the last two task-1 models, GLFC arm only."""
    if rec["arm"] != "glfc":
        return "–"
    by_round = {x["round"]: x.get("proxy-monitor-accuracy") for x in rec["rounds"]}
    vals = [by_round.get(rounds_per_task - 1), by_round.get(rounds_per_task)]
    return " / ".join("–" if v is None else f"{v:.3f}" for v in vals)


def report(records: list[dict], others: list[dict], rounds_per_task: int, eval_per_class: int, degrade_epochs: int,
           lr_schedule: str) -> str:
    lines = ["# GLFC's proxy when the last model of a task degrades", "",
             f"The study's setting ({rounds_per_task} rounds per task, `glfc_methods.md`); in round "
             f"{rounds_per_task}, the last of task 1, only partition {ONLINE} is online and it trains "
             f"{degrade_epochs} local epochs, so the new global model is its update alone (3 of the 5 classes). "
             f"Learning-rate schedule within a task: `glfc-lr-schedule='{lr_schedule}'` (both arms). "
             "GLFC keeps as old model the global model with the best score on the proxy's reconstructed set "
             "(ties go to the newer model); GLFC w/o proxy keeps the last one. Accuracies on the 5 classes of "
             f"task 1 ({5 * eval_per_class:,} test images) unless said otherwise.", "",
             "| seed | arm | task 1, round before last | task 1, last round | proxy score, round before last / last | "
             "old model kept: round (accuracy) | task-1 classes at the end of task 2 | "
             "all 10 seen classes at the end of task 2 |",
             "|---|---|---|---|---|---|---|---|"]
    for rec in sorted(records, key=lambda x: (x["seed"], ARMS.index(x["arm"]))):
        kept = "–" if rec["kept-round"] is None else f"{rec['kept-round']} ({rec['kept-accuracy']:.3f})"
        lines.append(f"| {rec['seed']} | {rec['arm']} | {rec['before-last-accuracy']:.3f} | "
                     f"{rec['last-accuracy']:.3f} | {proxy_scores(rec, rounds_per_task)} | {kept} | "
                     f"{rec['task1-accuracy-end-of-task2']:.3f} | {rec['seen-accuracy-end-of-task2']:.3f} |")
    by = {(x["arm"], x["seed"]): x for x in records}
    seeds = sorted({s for a, s in by if ("glfc", s) in by and ("glfc-wo-proxy", s) in by})
    if seeds:
        key = "task1-accuracy-end-of-task2"
        diffs = [by[("glfc", s)][key] - by[("glfc-wo-proxy", s)][key] for s in seeds]
        degraded = [s for s in seeds if by[("glfc", s)]["last-accuracy"] < by[("glfc", s)]["before-last-accuracy"]]
        picks = sum(1 for s in seeds if (by[("glfc", s)]["kept-round"] or 0) < rounds_per_task)
        lines += ["", f"The last task-1 model was worse than the one before it on {len(degraded)} of {len(seeds)} "
                  f"seed(s); the proxy kept an earlier model than the last one on {picks} of {len(seeds)} seed(s). "
                  "Task-1 accuracy at the end of task 2, GLFC − GLFC w/o proxy, per seed: "
                  + ", ".join(f"{d:+.3f}" for d in diffs)
                  + (f" (mean ± s.e. {fmt_paired(diffs, 3)})" if len(diffs) > 1 else "") + "."]
        ties = [s for s in seeds if s in degraded and by[("glfc", s)]["kept-round"] == rounds_per_task]
        if ties:
            lines += ["", "Where the proxy kept the degraded last model (seed(s) " + ", ".join(map(str, ties))
                      + "), it scored it as high as the model before it (ties go to the newer model): its "
                      "reconstructed set could not tell them apart."]
    if others:
        lines += ["", "Other settings in the JSON (task 1 only: the arms differ after it):", "",
                  "| seed | arm | lr schedule | lone node's epochs | task 1, round before last | last round |",
                  "|---|---|---|---|---|---|"]
        for rec in sorted(others, key=lambda x: (x["seed"], x["arm"])):
            st = rec["setting"]
            lines.append(f"| {rec['seed']} | {rec['arm']} | {st.get('lr_schedule', 'cosine')} | "
                         f"{st.get('degrade_epochs', st['epochs'])} | {rec['before-last-accuracy']:.3f} | "
                         f"{rec['last-accuracy']:.3f} |")
    lines += ["", "Reproduce: `python -m bench.glfc_proxy_case`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--degrade-epochs", type=int, default=DEFAULTS["epochs"],
                   help="local epochs of the one online node in task 1's last round (default: the study's)")
    p.add_argument("--lr-schedule", default=LR_SCHEDULE, choices=("code", "cosine", "constant"),
                   help="glfc-lr-schedule of both arms")
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--report", action="store_true")
    args = p.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    setting = setting_of(args)
    report_args = (args.rounds_per_task, args.eval_per_class, args.degrade_epochs, args.lr_schedule)
    stored = read_json(OUT, [])
    others = [r for r in stored if r["setting"] != setting]  # kept in the file, left out of this report
    records = [r for r in stored if r["setting"] == setting]
    if not args.report:
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in ARMS:
                if any(r["arm"] == arm and r["seed"] == seed for r in records):
                    continue
                print(f"[proxy-case] {arm} seed {seed}", flush=True)
                records.append(run(arm, seed, args))
                write_json(OUT, others + records)
                write_atomic(OUT.with_suffix(".md"), report(records, others, *report_args))
    write_atomic(OUT.with_suffix(".md"), report(records, others, *report_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
