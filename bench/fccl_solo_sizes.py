"""Which private training sizes let every offline-Digits domain learn? SOLO accuracy per size and seed.

FCCL is judged against SOLO (each client trained alone); a comparison only means something when
SOLO works. This trains each domain's SOLO model exactly as a Pollen client does (the same
``LogitRound.pretrain_solo``: seeded init, CE, Adam, ``fccl-solo-epochs``), for the sizes and seeds
asked, and reports the intra-domain test accuracy. The models land in the SOLO cache that
``bench.fccl_study`` reads, so a size chosen here is not trained twice.

One record per (domain, size, seed) in ``bench/results/fccl_solo_sizes.json``; records already
there are skipped, so the sweep resumes. Run::

    POLLEN_DATA_ROOT=../shared/data .venv/bin/python -m bench.fccl_solo_sizes \
        --sizes mnist=150,300 uci=80 mnistm=1000,2000 syn=1000,1800 --seeds 0,1,2
    .venv/bin/python -m bench.fccl_solo_sizes --report       # the Markdown from the committed JSON
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.kit import BENCH, RESULTS, default_data_root, read_json, write_atomic, write_json

TASK = "digits-offline"
BAND = 0.65  # the bar: every domain's SOLO within the paper's band (paper: 70-75 %)


def solo_accuracy(domain: str, size: int, seed: int, args) -> dict:
    """Pretrain (or load from the cache) one domain's SOLO model; its intra-domain test accuracy."""
    import torch

    from pollen.datasets.domain_tasks import domain_client_data
    from pollen.datasets.tasks import TaskOptions, get_task
    from pollen.methods.logit_settings import FCCL, LogitOptions, resolve_settings
    from pollen.methods.logits import LogitRound, domain_accuracies, solo_cache_file
    from pollen.models import build_model, to_channels_last

    torch.set_num_threads(1)
    task = get_task(TASK, "domains")
    domains = task.domain_facts().names
    pid = domains.index(domain)
    sizes = [1] * len(domains)
    sizes[pid] = size
    options = LogitOptions(train_sizes=",".join(map(str, sizes)), test_size=args.test_size,
                           solo_epochs=args.solo_epochs, solo_cache=str(args.cache))
    settings = resolve_settings(options, "quick", task)
    data = domain_client_data(TASK, TaskOptions(data_root=args.data_root, seed=seed), pid, len(domains),
                              settings.train_sizes, settings.test_size)
    model_name = task.model_for(pid)
    device = torch.device("cpu")

    def new_model():
        return to_channels_last(build_model(model_name, task.num_classes, in_channels=task.fmt.channels,
                                            image_size=task.fmt.size, width=args.width))

    cache = solo_cache_file(str(args.cache), TASK, pid, model_name, args.width, seed, settings, size, 0)
    cached = os.path.exists(cache)
    core = LogitRound(FCCL, settings, None, data, lambda: None, task.num_classes, task.top_k, device, new_model,
                      seed, pid, cache)
    t0 = time.perf_counter()
    model = core.pretrain_solo()
    wall = time.perf_counter() - t0
    model.eval()
    acc = domain_accuracies(model, data, device)
    return {"domain": domain, "size": size, "seed": seed, "model": model_name, "width": args.width,
            "solo-epochs": settings.solo_epochs, "test-size": settings.test_size,
            "intra-accuracy": acc["intra-accuracy"], "inter-accuracy": acc.get("inter-accuracy"),
            "train-s": round(wall, 1), "from-cache": cached}


def write_markdown(records: list[dict], path: Path) -> None:
    lines = ["# SOLO intra-domain accuracy by private training size (offline Digits)", "",
             "Each domain's model trained alone exactly as a Pollen client pretrains SOLO (CE, Adam 1e-3, batch 32). "
             f"A size is usable when every seed reaches {BAND:.0%} (the paper's SOLO: 70-75 %).", "",
             "| domain | model | width | size | epochs | seeds | intra accuracy per seed | mean | min ≥ band |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["domain"], r["model"], r["width"], r["size"], r["solo-epochs"]), []).append(r)
    for (domain, model, width, size, epochs), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        accs = [r["intra-accuracy"] for r in rs]
        lines.append(f"| {domain} | {model} | {width} | {size} | {epochs} | {len(rs)} | "
                     + ", ".join(f"{a:.3f}" for a in accs)
                     + f" | {sum(accs) / len(accs):.3f} | {'yes' if min(accs) >= BAND else 'no'} |")
    lines += ["", f"Test set: {records[0]['test-size'] if records else '?'} images per domain. "
              "Reproduce: `python -m bench.fccl_solo_sizes` (see its docstring).", ""]
    write_atomic(path, "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["mnist=150,300", "uci=80", "mnistm=1000,2000", "syn=1000,1800"],
                   help="domain=size[,size…] per domain")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--solo-epochs", type=int, default=30)
    p.add_argument("--test-size", type=int, default=300)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--cache", type=Path, default=BENCH / "work" / "fccl-study" / "solo-cache")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report", action="store_true", help="only rewrite the Markdown from the results JSON")
    args = p.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    out_json = args.out / "fccl_solo_sizes.json"
    records = read_json(out_json, [])
    if args.report:
        write_markdown(records, args.out / "fccl_solo_sizes.md")
        return 0
    done = {(r["domain"], r["size"], r["seed"], r["width"], r["solo-epochs"], r["test-size"]) for r in records}
    seeds = [int(s) for s in args.seeds.split(",")]
    for spec in args.sizes:
        domain, _, sizes = spec.partition("=")
        for size in (int(s) for s in sizes.split(",")):
            for seed in seeds:
                if (domain, size, seed, args.width, args.solo_epochs, args.test_size) in done:
                    continue
                rec = solo_accuracy(domain, size, seed, args)
                records.append(rec)
                print(f"[solo-sizes] {domain} size {size} seed {seed}: intra {rec['intra-accuracy']:.3f} "
                      f"({rec['train-s']:.0f} s{', cached' if rec['from-cache'] else ''})", flush=True)
                write_json(out_json, records)
                write_markdown(records, args.out / "fccl_solo_sizes.md")
    write_markdown(records, args.out / "fccl_solo_sizes.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
