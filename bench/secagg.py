"""Secure aggregation study: what SecAgg+ costs per round, against plain Pollen and Flower's own SecAgg+.

Cost (``python -m bench.secagg cost``): one FedAvg round of N sampled clients, each replying with a
vector of ``size`` float32 values and its example count, in one process on the in-process grid (no Ray,
no network: what is measured is the protocol, not Flower's transport), three arms side by side:

* ``plain``: Pollen's ``WeightAveraging`` (sampling, screening, the weighted mean), clients reply in clear;
* ``pollen``: Pollen's SecAgg+ (``SecAggPlus`` driver, ``secagg_mod`` on real ClientApps);
* ``flower``: Flower's own SecAgg+ (its legacy ``SecAggPlusWorkflow`` with a legacy ``FedAvg``, clients a
  legacy ``ClientApp`` with ``secaggplus_mod``), the same N, vector, neighbours (its ``num_shares`` =
  neighbours + 1) and threshold.

Dropouts: the given share of the clients stops answering at the masked-input stage (after sharing their
keys: the dearest case, their pairwise masks must be rebuilt); plain drops them from its only stage.
Each cell records bytes each way (array bytes, byte strings and 8 per number of every message), the
server's CPU (the process's CPU minus what the clients' handlers used), the clients' CPU (per client,
mean) and the wall time. Cells are paired by seed (same data, same dropped clients) and interleaved
arm by arm; one file per finished cell under ``bench/results/secagg/cost/``, so a stopped study resumes.

Utility (``python -m bench.secagg utility``): the privacy study's FedProto setting (``bench/privacy.py``:
MNIST 3-way shots, 20 clients, 100 rounds, seed-paired) with ``secure-aggregation = true`` and
``dp-mode = distributed`` at client-level replace-one ε ∈ {8, 4, 2} (``dp-min-honest`` = half the
clients), one file per run under ``bench/results/secagg/utility/``; its no-DP and local-DP arms are the
privacy study's committed runs (same base config and seed). The 100-client FedProto runs and FedAvg's gap
against clients per round are ``bench/secagg_utility.py`` (``python -m bench.secagg_utility``, in-process).

``python -m bench.secagg report`` writes ``bench/results/secagg.{md,json,png}`` from the files there.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.kit import RESULTS, default_data_root, write_json

COST_DIR = RESULTS / "secagg" / "cost"
ARMS = ("plain", "pollen", "flower")
SPARSE_NEIGHBOURS, THRESHOLD = 16, 0.6  # threshold 0.6: a complete graph survives 30 % dropouts
CLIPPING_RANGE, LEVELS = 8.0, 1 << 22


def content_bytes(content) -> int:
    """What a message carries: array bytes, byte strings, and 8 bytes per number (one rule for every arm)."""
    total = 0
    for record in content.array_records.values():
        total += sum(len(a.data) for a in record.values())
    for record in list(content.config_records.values()) + list(content.metric_records.values()):
        for value in record.values():
            if isinstance(value, (bytes, str)):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in value)
            else:
                total += 8
    return total


class MeteredGrid:
    """The in-process grid with a meter: bytes each way, the handlers' CPU, and dropped nodes that stop
    answering at one stage (``drop_stage`` = the value of the stage record, or ``"train"`` for plain)."""

    def __init__(self, handlers: dict, drop: set[int], drop_stage: str | None):
        from pollen.testing import set_task_identity

        set_task_identity()
        self.handlers, self.drop, self.drop_stage = handlers, drop, drop_stage
        self.down = self.up = 0
        self.client_cpu = 0.0

    def get_node_ids(self):
        return list(self.handlers)

    def _stage(self, msg) -> str:
        for name in ("secagg", "secaggplus_configs"):
            if name in msg.content.config_records:
                return str(msg.content.config_records[name].get("stage"))
        return "train"

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import ConfigRecord, Message, RecordDict

        from pollen.testing import error_reply

        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.down += content_bytes(msg.content)
            if node in self.drop and self._stage(msg) == self.drop_stage:
                continue
            # each node gets its own copy of the message's config records, as over a real transport (Flower's
            # workflow sends one shared record to every node, and its mod pops keys from it)
            content = RecordDict({k: ConfigRecord(dict(v)) if isinstance(v, ConfigRecord) else v
                                  for k, v in msg.content.items()})
            msg = Message(content=content, dst_node_id=node, message_type=msg.metadata.message_type,
                          group_id=msg.metadata.group_id)
            cpu = time.process_time()
            reply = self.handlers[node](msg)
            if isinstance(reply, Exception):
                reply = error_reply(msg, reply)
            self.client_cpu += time.process_time() - cpu
            if not reply.has_error():
                self.up += content_bytes(reply.content)
            out.append(reply)
        return out


def _vectors(n: int, size: int, seed: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng([seed, n, size])
    return ([rng.uniform(-1, 1, size).astype(np.float32) for _ in range(n)],
            [int(x) for x in rng.integers(20, 200, n)])


def _dropped(n: int, share: float, seed: int) -> set[int]:
    count = int(round(share * n))
    rng = np.random.default_rng([seed, n, 7])
    return {1000 + int(i) for i in rng.choice(n, size=count, replace=False)}


def _nodes(app, n: int) -> dict:
    from pollen.testing import clientapp_node

    return {1000 + i: clientapp_node(app, {}, i, n, node_id=1000 + i) for i in range(n)}


def _pollen_app(vectors, counts, mod: bool):
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from pollen.protocol.records import reply_content
    from pollen.secagg import secagg_mod

    app = ClientApp(mods=[secagg_mod] if mod else [])

    @app.train()
    def train(msg, context):
        pid = context.node_id - 1000
        return Message(reply_content({"x": vectors[pid]}, counts[pid], {"partition-id": pid}), reply_to=msg)

    return app


def _neighbours(graph: str, n: int) -> int:
    return SPARSE_NEIGHBOURS if graph == "sparse" else max(2, n - 1)


def run_plain(n, vectors, counts, drop, graph) -> tuple[MeteredGrid, dict]:
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from pollen.strategies import WeightAveraging

    grid = MeteredGrid(_nodes(_pollen_app(vectors, counts, False), n), drop, "train")
    strategy = WeightAveraging(min_available_nodes=n, min_train_nodes=1, fraction_evaluate=0.0)
    arrays = ArrayRecord({"x": Array(np.zeros_like(vectors[0]))})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    replies = grid.send_and_receive(messages)
    result, _ = strategy.aggregate_train(1, replies)
    return grid, {"mean": result["x"].numpy() if result is not None else None}


def run_pollen(n, vectors, counts, drop, graph) -> tuple[MeteredGrid, dict]:
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from pollen.secagg import SecAggConfig, SecAggPlus, mean_of_sums

    grid = MeteredGrid(_nodes(_pollen_app(vectors, counts, True), n), drop, "collect")
    arrays = ArrayRecord({"x": Array(np.zeros_like(vectors[0]))})
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})})
    driver = SecAggPlus(SecAggConfig(neighbours=_neighbours(graph, n), threshold=THRESHOLD,
                                     clipping_range=CLIPPING_RANGE, levels=LEVELS, max_weight=1000))
    result = driver.aggregate(grid, dict.fromkeys(grid.handlers, content), server_round=1)
    return grid, {"mean": mean_of_sums("weights", result.sums)["x"], "threshold": driver.config.shares_needed(n),
                  "shares": driver.config.degree(n) + 1, "survivors": len(result.survivors)}


def run_flower(n, vectors, counts, drop, graph) -> tuple[MeteredGrid, dict]:
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import ServerConfig
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    from pollen.secagg import SecAggConfig

    class Client(NumPyClient):
        def __init__(self, pid):
            self.pid = pid

        def fit(self, parameters, config):
            return [vectors[self.pid]], counts[self.pid], {}

    app = ClientApp(client_fn=lambda ctx: Client(int(ctx.node_config["partition-id"])).to_client(),
                    mods=[secaggplus_mod])
    grid = MeteredGrid(_nodes(app, n), drop, "collect_masked_vectors")
    cfg = SecAggConfig(neighbours=_neighbours(graph, n), threshold=THRESHOLD)
    shares, t = cfg.degree(n) + 1, cfg.shares_needed(n)
    # Flower counts num_shares with the node itself and wants it > 2; its threshold must be below it
    workflow = SecAggPlusWorkflow(num_shares=shares if shares < n else 1.0,
                                  reconstruction_threshold=t if shares < n else t / n,
                                  clipping_range=CLIPPING_RANGE, quantization_range=LEVELS, max_weight=1000)
    manager = SimpleClientManager()
    for node in grid.handlers:
        manager.register(GridClientProxy(node, grid, 1))  # type: ignore[arg-type]
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n)
    base = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, config=ServerConfig(num_rounds=1), strategy=strategy, client_manager=manager)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: 1})
    from flwr.common import ndarrays_to_parameters

    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([np.zeros_like(vectors[0])]), True)
    workflow(grid, context)  # type: ignore[arg-type]
    params = compat.arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
    from flwr.common import parameters_to_ndarrays

    return grid, {"mean": parameters_to_ndarrays(params)[0], "threshold": t, "shares": shares}


RUNNERS = {"plain": run_plain, "pollen": run_pollen, "flower": run_flower}


def cell_name(arm: str, n: int, size: int, dropout: float, graph: str, seed: int) -> str:
    return f"{arm}-{graph}-n{n}-d{size}-drop{int(round(100 * dropout))}-seed{seed}"


def run_cell(arm: str, n: int, size: int, dropout: float, seed: int, graph: str = "sparse") -> dict[str, Any]:
    vectors, counts = _vectors(n, size, seed)
    drop = _dropped(n, dropout, seed)
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    error = None
    try:
        grid, out = RUNNERS[arm](n, vectors, counts, drop, graph)
    except Exception as err:  # a failed round is a result too
        grid, out, error = None, {}, f"{type(err).__name__}: {err}"
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    kept = [i for i in range(n) if 1000 + i not in drop]
    expected = sum(counts[i] * vectors[i].astype(np.float64) for i in kept) / sum(counts[i] for i in kept)
    mean = out.pop("mean", None)
    record = {"arm": arm, "n": n, "size": size, "dropout": dropout, "seed": seed, "graph": graph,
              "neighbours": min(_neighbours(graph, n), n - 1), "threshold-share": THRESHOLD, "error": error,
              "wall-s": wall, "cpu-s": cpu, **{k: v for k, v in out.items()}}
    if grid is not None:
        record.update({"bytes-down": grid.down, "bytes-up": grid.up, "client-cpu-s": grid.client_cpu / n,
                       "server-cpu-s": cpu - grid.client_cpu})
    if mean is not None:
        record["max-abs-error"] = float(np.max(np.abs(np.asarray(mean, dtype=np.float64) - expected)))
    return record


def machine() -> dict[str, Any]:
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "load-1min": os.getloadavg()[0], "commit": commit or None}


def warm_up() -> None:
    """One tiny cell per arm first: imports and first-call costs never land in a measured cell."""
    for arm in ARMS:
        run_cell(arm, 4, 100, 0.0, 0, "complete")


def cost_main(args) -> None:
    COST_DIR.mkdir(parents=True, exist_ok=True)
    warm_up()
    cells = [(n, size, dropout, seed) for seed in args.seeds for size in args.size for n in args.n
             for dropout in args.dropout]
    for n, size, dropout, seed in cells:
        for arm in args.arms:  # interleaved: the arms of one cell run back to back
            path = COST_DIR / f"{cell_name(arm, n, size, dropout, args.graph, seed)}.json"
            if path.exists():
                continue
            rec = run_cell(arm, n, size, dropout, seed, args.graph)
            rec["machine"] = machine()
            write_json(path, rec)
            shown = rec.get("error") or f"wall {rec['wall-s']:.2f}s server {rec['server-cpu-s']:.2f} " \
                                       f"client {rec['client-cpu-s']:.3f} CPU-s"
            print(f"{path.stem}: {shown}", flush=True)


UTILITY_DIR = RESULTS / "secagg" / "utility"
UTILITY_EPSILONS = (8.0, 4.0, 2.0)
DP_CLIP = 4.0


def utility_arms() -> list[tuple[str, dict[str, Any]]]:
    from bench.privacy import base_config

    _, nodes = base_config("fedproto")
    base = {"secure-aggregation": True, "secagg-threshold": 0.6}
    return [("secagg", base)] + [(f"distributed-eps{e:g}", {**base, "dp-mode": "distributed", "dp-target-epsilon": e,
                                                          "dp-clip": DP_CLIP, "dp-min-honest": nodes // 2,
                                                          # accuracy is the study's measurement, outside ε
                                                          "dp-evaluate": "unprotected"})
                                 for e in UTILITY_EPSILONS]


def utility_main(args) -> None:
    from bench.privacy import base_config, read_run
    from bench.privacy import setting as privacy_setting
    from pollen.launch import simulate

    UTILITY_DIR.mkdir(parents=True, exist_ok=True)
    config, nodes = base_config("fedproto")
    config = {k: v for k, v in config.items() if k != "leak-audit"}  # the audit reads one client's release
    for seed in args.seeds:
        for arm, keys in utility_arms():
            if args.arms and arm not in args.arms:
                continue
            path = UTILITY_DIR / f"fedproto-{arm}-seed{seed}.json"
            if path.exists():
                continue
            work = Path(tempfile.mkdtemp(prefix="pollen-secagg-utility-"))
            run_config = {**config, **keys, "seed": seed, "data-root": args.data_root, "out-dir": str(work / "runs")}
            load, started = os.getloadavg()[0], time.monotonic()
            outcome = simulate(flwr_home=work / "flwr", num_supernodes=nodes, run_config=run_config,
                               timeout=8 * 3600, echo=False)
            if not outcome.completed:
                raise SystemExit(f"{arm} seed {seed} did not complete ({outcome.status}):\n{outcome.log[-3000:]}")
            record = {"family": "fedproto", "arm": arm, "seed": seed, "setting": privacy_setting("fedproto", keys),
                      "wall-s": round(time.monotonic() - started, 1), "load-1min-at-start": round(load, 2),
                      **read_run(outcome.results_dir)}
            write_json(path, record)
            print(f"{path.stem}: {record['evaluate'].get('accuracy-client-mean')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cost = sub.add_parser("cost", help="per-round cost cells (resumable)")
    cost.add_argument("--n", type=int, nargs="+", default=[10, 50, 100, 200])
    cost.add_argument("--size", type=lambda s: int(float(s)), nargs="+", default=[10_000, 100_000, 1_000_000])
    cost.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    cost.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    cost.add_argument("--seeds", type=int, nargs="+", default=[0])
    cost.add_argument("--graph", choices=("sparse", "complete"), default="sparse",
                      help=f"sparse: {SPARSE_NEIGHBOURS} neighbours per node; complete: all others")
    util = sub.add_parser("utility", help="FedProto under secure aggregation and distributed DP (resumable)")
    util.add_argument("--seeds", type=int, nargs="+", default=[0])
    util.add_argument("--arms", nargs="*", default=[])
    util.add_argument("--data-root", default=default_data_root())
    sub.add_parser("report", help="write bench/results/secagg.{md,json,png}")
    args = parser.parse_args(argv)
    if args.what == "cost":
        cost_main(args)
    elif args.what == "utility":
        utility_main(args)
    else:
        from bench.secagg_report import write_report

        write_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())


