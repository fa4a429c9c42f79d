"""How good is the consensus FCCL learns from? Post-hoc measurements on the study's saved models (issue 18, item 5).

FCCL's collaborative step pulls each model's logits on the unlabelled public set towards the clients'
averaged logits (the *consensus*). When its inter-domain gain over SOLO is small, two questions decide
why: does the collaboration actually align the models on the public set, and does the federation hold
knowledge about a domain that its own model lacks? This script answers both from the models each run
of ``bench.fccl_study`` left on disk (``bench/work/fccl-study/<method>-seed<s>/<run>/nodes/``):
every node's ``final-model.safetensors`` (last round) and ``fccl-solo.safetensors`` (the SOLO start,
round 0, identical for every method of a seed).

Per (method, seed), on the public set X0 (as the clients feed it):

- **agreement**: share of X0 on which a model's top class equals the consensus's (mean over models);
- **correlation**: the diagonal of FCCL's cross-correlation matrix — per class, the Pearson
  correlation over X0 between a model's logits and the consensus logits — mean over classes and models
  (1 = the collaborative loss's on-diagonal term is satisfied);

and on each domain's test set:

- **own**: the domain's model; **others**: the mean accuracy of the three other domains' models (the
  inter-domain accuracy); **others' ensemble**: the three other models' averaged softmax — what the
  federation knows about the domain without its own model; **all ensemble**: all four.

Only runs whose work directory still exists are measured (the study keeps one per run; a fresh
checkout has none until the study runs). Writes ``bench/results/fccl_consensus.{json,md}``::

    .venv/bin/python -m bench.fccl_consensus
    .venv/bin/python -m bench.fccl_consensus --report     # the Markdown from the committed JSON
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.fccl import DOMAINS, LABELS, SHORT
from bench.kit import BENCH, RESULTS, read_json, read_summary, run_folders, write_atomic, write_json
from pollen.datasets.domain_tasks import domain_client_data, public_set
from pollen.datasets.tasks import TaskOptions
from pollen.launch.predict import load_personal_model
from pollen.methods.logit_losses import cross_correlation_matrix
from pollen.methods.training import predict_logits

OUT = RESULTS / "fccl_consensus"
WORK = BENCH / "work" / "fccl-study"  # bench.fccl_study's --work default
METHOD_ORDER = ("solo", "fedmd", "feddf", "fccl-wo-con", "fccl")


def run_dirs(work: Path) -> dict[tuple[str, int], Path]:
    """(method, seed) -> the run directory holding ``nodes/partition-*`` for every finished study run."""
    out = {}
    for d in sorted(work.glob("*-seed*")):
        method, _, seed = d.name.rpartition("-seed")
        runs = [r for r in run_folders(d) if (r / "summary.json").is_file() and (r / "nodes").is_dir()]
        if method in METHOD_ORDER and seed.isdigit() and len(runs) == 1:
            out[(method, int(seed))] = runs[0]
    return out


def pearson_diag(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over classes of the correlation over samples between columns of ``a`` and ``b``: the diagonal
    of FCCL's own cross-correlation matrix, whose 1/N with unbiased stds is rescaled to Pearson's r."""
    n = a.shape[0]
    return float(cross_correlation_matrix(a, b).diagonal().mean()) * n / (n - 1)


def measure(run: Path, which: str) -> dict:
    """The models of ``run`` at ``which`` ('final' = last round, 'solo' = round 0) against the consensus."""
    nodes = sorted((run / "nodes").glob("partition-*"), key=lambda p: int(p.name.split("-")[1]))
    models, data = [], []
    for node in nodes:
        loaded = load_personal_model(node / "final-model.safetensors", None, {})
        if which == "solo":
            loaded.model.load_state_dict(load_file(str(node / "fccl-solo.safetensors")))
        cfg, pid = loaded.cfg, int(loaded.info["partition-id"])
        sizes = tuple(int(s) for s in str(cfg.extra["fccl-train-sizes"]).split(","))
        opts = TaskOptions(data_root=cfg.data_root, download=False, seed=cfg.seed,
                           max_train_samples=cfg.max_train_samples)
        cd = domain_client_data(cfg.task, opts, pid, len(nodes), sizes, int(cfg.extra["fccl-test-size"]))
        models.append(loaded.model.eval())
        data.append(cd)
    cfg = loaded.cfg
    device = torch.device("cpu")
    x0 = public_set(str(cfg.extra["fccl-public"]), cfg.data_root, int(cfg.extra["fccl-public-size"]), cfg.seed,
                    data[0].fmt).inputs
    with torch.no_grad():
        public = [predict_logits(m, x0, device, 500) for m in models]
    consensus = torch.stack(public).mean(0)
    top = consensus.argmax(1)
    agreement = [float((z.argmax(1) == top).float().mean()) for z in public]
    correlation = [pearson_diag(z, consensus) for z in public]
    tests = {d.domain: (d.x_test, d.y_test) for d in data}
    per_domain = {}
    for i, d in enumerate(data):
        x, y = tests[d.domain]
        with torch.no_grad():
            probs = [torch.softmax(predict_logits(m, x, device, 500), 1) for m in models]
        acc = [float((p.argmax(1) == y).float().mean()) for p in probs]
        others = [j for j in range(len(models)) if j != i]
        per_domain[d.domain] = {
            "own": acc[i], "others": statistics.fmean(acc[j] for j in others),
            "best-other": max(acc[j] for j in others),
            "others-ensemble": float((torch.stack([probs[j] for j in others]).mean(0).argmax(1) == y).float().mean()),
            "all-ensemble": float((torch.stack(probs).mean(0).argmax(1) == y).float().mean()),
        }
    return {"agreement": statistics.fmean(agreement), "correlation": statistics.fmean(correlation),
            "agreement-per-model": agreement, "correlation-per-model": correlation, "domains": per_domain}


def pct(v: float) -> str:
    return f"{100 * v:.1f}"


def markdown(results: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in results})
    lines = ["# FCCL: how good is the consensus? (post-hoc, the study's saved models)", "",
             "From `bench.fccl_study`'s runs whose models are still on disk (seeds measured: "
             f"{', '.join(map(str, seeds))}); round 0 is the SOLO start every method of a seed shares. "
             "Public set: the study's X0 (Fashion-MNIST, 1,000 images). Definitions: `bench/fccl_consensus.py`.",
             "",
             "## Alignment on the public set", "",
             "| method | seed | round | agreement with the consensus's top class | per-class logit correlation |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {r['seed']} | {r['round']} | "
                     f"{pct(r['agreement'])} % | {r['correlation']:.3f} |")
    lines += ["", "## What the federation knows about each domain (test accuracy, %)", "",
              "*own*: the domain's model; *others*: mean of the three other models (inter-domain accuracy); "
              "*best other*: the best of them; *others' ens.*: their averaged softmax; *all ens.*: all four.", "",
              "| method | seed | round | domain | own | others | best other | others' ens. | all ens. |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for dom in DOMAINS:
            v = r["domains"].get(dom)
            if v:
                lines.append(f"| {LABELS.get(r['method'], r['method'])} | {r['seed']} | {r['round']} | {SHORT[dom]} | "
                             f"{pct(v['own'])} | {pct(v['others'])} | {pct(v['best-other'])} | "
                             f"{pct(v['others-ensemble'])} | {pct(v['all-ensemble'])} |")
    lines += ["", "Reproduce: `python -m bench.fccl_study` (keeps each run's models under `bench/work/fccl-study/`), "
              "then `python -m bench.fccl_consensus`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--results", type=Path, default=OUT)
    p.add_argument("--report", action="store_true", help="only rewrite the Markdown from the results JSON")
    args = p.parse_args(argv)
    if args.report:
        write_atomic(args.results.with_suffix(".md"), markdown(read_json(args.results.with_suffix(".json"))["runs"]))
        return 0
    torch.set_num_threads(1)
    found = run_dirs(args.work)
    if not found:
        print(f"[consensus] no finished study run with models under {args.work}", file=sys.stderr)
        return 1
    results, solo_done = [], set()
    for method, seed in sorted(found, key=lambda k: (k[1], METHOD_ORDER.index(k[0]))):
        run = found[(method, seed)]
        if seed not in solo_done:
            print(f"[consensus] seed {seed}: SOLO start (round 0) from {run}", flush=True)
            results.append({"method": "solo-start", "seed": seed, "round": 0, **measure(run, "solo")})
            solo_done.add(seed)
        print(f"[consensus] {method} seed {seed}: last round", flush=True)
        rounds = int(read_summary(run)["rounds"])
        results.append({"method": method, "seed": seed, "round": rounds, **measure(run, "final")})
    write_json(args.results.with_suffix(".json"), {"runs": results})
    write_atomic(args.results.with_suffix(".md"), markdown(results))
    print(f"[consensus] wrote {args.results.with_suffix('.md')}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
