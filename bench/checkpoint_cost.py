"""What keeping the trained state costs: checkpoint and node-state size and write time per round,
as a fraction of the round's wall time.

Two settings, each run for real through Pollen's ServerApp and ClientApp (served in this process by the
in-process grid of ``pollen.testing``, so timings exclude Ray start-up but include all client work):

* FedProto MNIST (cnn_mnist, n = 3, K = 100, 20 clients, batch 4, lr 0.01): the benchmark's setting;
* FedAvg with ResNet-18 (width 1.0) on MNIST, 3 clients, 300 training images each.

For each round the server checkpoint (``checkpoints/round-NNNN.*``) and every node's state folder are
timed by wrapping the writers; the round wall time comes from ``metrics.jsonl``. Results:
``bench/results/checkpoint_cost.{json,md}``::

    python -m bench.checkpoint_cost --data-root ../shared/data
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.kit import RESULTS, read_json, read_metrics, write_atomic, write_json

SETTINGS = {
    "fedproto-mnist": ({"method": "fedproto", "task": "mnist-shot", "shot-ways": 3, "shot-shots": 100,
                        "shot-stdev": 2, "batch-size": 4, "lr": 0.01, "momentum": 0.5,
                        "proto-evaluate-every": 10}, 20),
    "fedavg-resnet18": ({"method": "fedavg", "task": "mnist-dirichlet", "model": "resnet18", "model-width": 1.0,
                         "max-train-samples": 300, "batch-size": 32, "fraction-evaluate": 0.0}, 3),
}


def measure(name: str, rounds: int, data_root: str) -> dict:
    import torch
    from flwr.app import Context, RecordDict

    import pollen.app.checkpoints as ckpt
    import pollen.app.client_app as client_app_module
    import pollen.app.server_app as server_app_module
    from pollen.testing import InProcessGrid, clientapp_node

    torch.set_num_threads(1)
    config, clients = SETTINGS[name]
    timings = {"checkpoint-s": [], "node-state-s": []}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            timings[key].append(time.perf_counter() - t0)
            return out
        return wrapper

    server_app_module.write_checkpoint = timed(ckpt.write_checkpoint, "checkpoint-s")
    client_app_module.save_records = timed(ckpt.save_records, "node-state-s")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rc = {**config, "num-server-rounds": rounds, "seed": 0, "data-root": data_root, "out-dir": str(tmp)}
        grid = InProcessGrid({100 + p: clientapp_node(client_app_module.app, rc, p, clients,
                                                      state_dir=str(tmp / "nodes" / str(p))) for p in range(clients)})
        t0 = time.perf_counter()
        server_app_module.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
        wall = time.perf_counter() - t0
        run = tmp / "1"
        lines = read_metrics(run)
        round_s = [r["wall-time-s"] for r in lines]
        ckpt_files = sorted((run / "checkpoints").glob("*.safetensors"))
        ckpt_bytes = ckpt_files[-1].stat().st_size if ckpt_files else 0
        node_bytes = sum(f.stat().st_size for f in (tmp / "nodes" / "0").glob("*") if f.is_file())
    per_round_nodes = [sum(timings["node-state-s"][i:i + clients]) for i in range(0, len(timings["node-state-s"]),
                                                                                  clients)]
    steady = slice(1, None)  # round 1 includes data loading and model builds
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "setting": name, "config": config, "clients": clients, "rounds": rounds, "wall-s": round(wall, 2),
        "round-s": round_s, "checkpoint-s": timings["checkpoint-s"], "node-state-s-per-round": per_round_nodes,
        "checkpoint-bytes": ckpt_bytes,
        "node-state-bytes-per-node": node_bytes,
        "checkpoint-fraction": mean(timings["checkpoint-s"][steady]) / mean(round_s[steady]),
        "node-state-fraction": mean(per_round_nodes[steady]) / mean(round_s[steady]),
    }


def markdown(results: list[dict]) -> str:
    rounds = results[0]["rounds"] if results else "?"
    lines = ["# What keeping the trained state costs", "",
             f"{rounds} rounds per setting, in-process (no Ray), 1 torch thread, 2-core machine; steady "
             "rounds (2+) averaged. Node state = every node's state folder, written after each training round "
             "(all nodes of the round summed, as one process serves them here).", "",
             "| setting | clients | round s | checkpoint KB | checkpoint ms | % of round | node state KB/node | "
             "node state ms/round | % of round |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        steady_round = sum(r["round-s"][1:]) / max(1, len(r["round-s"]) - 1)
        ck = sum(r["checkpoint-s"][1:]) / max(1, len(r["checkpoint-s"]) - 1)
        ns = sum(r["node-state-s-per-round"][1:]) / max(1, len(r["node-state-s-per-round"]) - 1)
        lines.append(f"| {r['setting']} | {r['clients']} | {steady_round:.2f} | {r['checkpoint-bytes'] / 1024:.1f} | "
                     f"{ck * 1000:.1f} | {100 * r['checkpoint-fraction']:.2f} % | "
                     f"{r['node-state-bytes-per-node'] / 1024:.1f} | {ns * 1000:.1f} | "
                     f"{100 * r['node-state-fraction']:.2f} % |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", help="folder with the datasets (not needed with --report)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--report", action="store_true", help="only rewrite the Markdown from the results JSON")
    args = parser.parse_args()
    if args.report:
        results = read_json(RESULTS / "checkpoint_cost.json")
    else:
        if args.data_root is None:
            parser.error("--data-root is required to measure")
        results = [measure(name, args.rounds, args.data_root) for name in SETTINGS]
        write_json(RESULTS / "checkpoint_cost.json", results, indent=2)
    write_atomic(RESULTS / "checkpoint_cost.md", markdown(results))
    print(markdown(results), end="")


if __name__ == "__main__":
    main()
