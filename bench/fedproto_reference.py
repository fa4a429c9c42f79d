"""FedProto's MNIST procedure in one process, without Flower: the yardstick for seed-to-seed spread.

The issue's target numbers come from one run of the official FedProto code at its default seed
(1234). One run says little about the spread a different seed or a different initialisation gives,
so this script replays the official *procedure* — its order of random draws included — in a plain
loop and runs it for several seeds:

* seeds: ``torch.manual_seed``, ``np.random.seed``, ``random.seed`` with the run seed; the split is
  Pollen's ``shot-split = "official"`` draw (same n/k/class draws as the official script);
* models: 20 CNNs built in client order from the global torch RNG, as the official script builds its
  ``local_model_list``; each client is a private model, never averaged;
* each round, each client in order: a new ``DataLoader`` (batch 4, shuffle, drop_last) over its
  samples, a fresh SGD (lr 0.01, momentum 0.5), one epoch of ``NLL + λ·MSE(z, global proto)`` where
  samples without a global proto keep their own embedding as target, prototypes = mean of the
  epoch's training-time embeddings; then the global prototypes = unweighted mean over the clients
  that hold the class;
* after the last round: per client, in eval mode, accuracy of the local classifier and of the nearest
  global prototype among the client's classes (MSE distance). Both with counters reset per client
  (the issue's convention) and with the official code's running counters.

Nothing here is Pollen's federated code: it shares only the data loader, the split and the MNIST
normalisation, so a gap between this and the Flower runs points at the federated implementation,
and a gap between this and the official numbers at the seed.

    python bench/fedproto_reference.py --data-root ../shared/data --ways 3 --seeds 1234 0 1 2 3

Writes ``bench/results/prototypes_reference.json`` (one entry per ways/seed, merged with earlier
entries) and prints a table.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pollen.datasets.partition import n_way_k_shot  # noqa: E402
from pollen.datasets.sources import load_source  # noqa: E402
from pollen.datasets.transforms import MNIST_FORMAT, to_model_input  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
JSON_PATH = RESULTS / "prototypes_reference.json"
MD_PATH = RESULTS / "prototypes_reference.md"
OFFICIAL = {3: (98.85, 98.66), 4: (98.07, 98.03)}  # counters reset per client; seed 1234


class Cnn(nn.Module):
    """The FedProto MNIST CNN with the official layer order (so the init draws come in that order)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        z = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(F.dropout(z, training=self.training)), dim=1), z


class Rows(Dataset):
    """(image, label) rows of in-memory tensors, picked by index, as the official ``DatasetSplit``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, idxs: np.ndarray):
        self.x, self.y, self.idxs = x, y, [int(i) for i in idxs]

    def __len__(self):
        return len(self.idxs)

    def __getitem__(self, item):
        i = self.idxs[item]
        return self.x[i], self.y[i]


def train_client(model: Cnn, loader: DataLoader, global_protos: dict[int, torch.Tensor], ld: float,
                 lr: float) -> dict[int, torch.Tensor]:
    """One local epoch; returns the class means of the training-time embeddings."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for x, y in loader:
        model.zero_grad()
        log_probs, z = model(x)
        loss = F.nll_loss(log_probs, y)
        if global_protos:
            target = z.detach().clone()
            for i, label in enumerate(y.tolist()):
                if label in global_protos:
                    target[i] = global_protos[label]
            loss = loss + ld * F.mse_loss(z, target)
        loss.backward()
        opt.step()
        for i, label in enumerate(y.tolist()):
            sums[label] = sums.get(label, 0) + z[i].detach()
            counts[label] = counts.get(label, 0) + 1
    return {c: sums[c] / counts[c] for c in sums}


@torch.no_grad()
def evaluate(models, loaders, classes, global_protos) -> dict[str, list[float]]:
    out = {"local": [], "proto": [], "local-running": [], "proto-running": []}
    run_correct, run_total = 0, 0
    for model, loader, own in zip(models, loaders, classes):
        model.eval()
        x, y = loader
        log_probs, z = model(x)
        local_correct = int((log_probs.argmax(1) == y).sum())
        run_correct, run_total = run_correct + local_correct, run_total + len(y)
        out["local"].append(local_correct / len(y))
        out["local-running"].append(run_correct / run_total)
        cand = [c for c in own if c in global_protos]
        dist = torch.stack([((z - global_protos[c]) ** 2).mean(1) for c in cand], dim=1)
        pred = torch.as_tensor(cand)[dist.argmin(1)]
        proto_correct = int((pred == y).sum())
        run_correct, run_total = run_correct + proto_correct, run_total + len(y)
        out["proto"].append(proto_correct / len(y))
        out["proto-running"].append(run_correct / run_total)
    return out


def run(ways: int, seed: int, rounds: int, data_root: str, ld: float = 1.0, lr: float = 0.01,
        num_clients: int = 20, shots: int = 100, stdev: int = 2) -> dict:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    train, test = load_source("mnist", data_root, "train"), load_source("mnist", data_root, "test")
    x_train, x_test = to_model_input(train.images, MNIST_FORMAT), to_model_input(test.images, MNIST_FORMAT)
    y_train, y_test = train.labels.long(), test.labels.long()
    splits = n_way_k_shot(y_train.numpy(), y_test.numpy(), num_clients, ways, shots, stdev, 40, 10, seed,
                          official_k_high=shots + stdev - 1)
    models = [Cnn() for _ in range(num_clients)]
    global_protos: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    for rnd in range(rounds):
        local = []
        for model, split in zip(models, splits):
            loader = DataLoader(Rows(x_train, y_train, split.train), batch_size=4, shuffle=True, drop_last=True)
            local.append(train_client(model, loader, global_protos, ld, lr))
        held: dict[int, list[torch.Tensor]] = {}
        for protos in local:
            for c, p in protos.items():
                held.setdefault(c, []).append(p)
        global_protos = {c: torch.stack(ps).mean(0) for c, ps in held.items()}
        if (rnd + 1) % 10 == 0:
            print(f"[ref] ways {ways} seed {seed}: round {rnd + 1}/{rounds}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    wall = time.perf_counter() - start
    tests = [(x_test[s.test], y_test[s.test]) for s in splits]
    acc = evaluate(models, tests, [list(s.classes) for s in splits], global_protos)
    return {"ways": ways, "seed": seed, "rounds": rounds, "threads": torch.get_num_threads(),
            "local-mean": 100 * float(np.mean(acc["local"])), "local-std": 100 * float(np.std(acc["local"])),
            "proto-mean": 100 * float(np.mean(acc["proto"])), "proto-std": 100 * float(np.std(acc["proto"])),
            "local-running-mean": 100 * float(np.mean(acc["local-running"])),
            "proto-running-mean": 100 * float(np.mean(acc["proto-running"])),
            "per-client-local": acc["local"], "per-client-proto": acc["proto"], "wall-time-s": wall}


def table(rows: list[dict]) -> str:
    lines = ["# FedProto's procedure without Flower (bench/fedproto_reference.py)", "",
             "The official FedProto MNIST procedure replayed in one process (its order of random draws, its "
             "split, private CNNs, training-time prototypes, unweighted aggregation) for several seeds; accuracy "
             "in %, mean ± std over 20 clients, counters reset per client, 100 rounds. *running*: the official "
             "code's never-reset counters. Official run (seed 1234): n = 3 98.85 / 98.66, n = 4 98.07 / 98.03.", "",
             "| ways | seed | local | proto | local (running) | proto (running) | wall s |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["ways"], r["seed"])):
        lines.append(f"| {r['ways']} | {r['seed']} | {r['local-mean']:.2f} ± {r['local-std']:.2f} | "
                     f"{r['proto-mean']:.2f} ± {r['proto-std']:.2f} | {r['local-running-mean']:.2f} | "
                     f"{r['proto-running-mean']:.2f} | {r['wall-time-s']:.0f} |")
    lines += ["", "| ways | seeds | local mean | proto mean | seed-to-seed std (local / proto) | official | Δ to official |",
              "|---|---|---|---|---|---|---|"]
    for ways in sorted({r["ways"] for r in rows}):
        group = [r for r in rows if r["ways"] == ways and r["rounds"] == 100]
        if not group:
            continue
        loc = np.array([r["local-mean"] for r in group])
        pro = np.array([r["proto-mean"] for r in group])
        off = OFFICIAL.get(ways)
        sd = f"{loc.std():.2f} / {pro.std():.2f}" if len(group) > 1 else "–"
        lines.append(f"| {ways} | {len(group)} | {loc.mean():.2f} | {pro.mean():.2f} | {sd} | "
                     + (f"{off[0]:.2f} / {off[1]:.2f} | {loc.mean() - off[0]:+.2f} / {pro.mean() - off[1]:+.2f} |"
                        if off else "– | – |"))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--ways", type=int, nargs="+", default=[3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(exist_ok=True)
    for ways in ([] if args.table_only else args.ways):
        for seed in args.seeds:
            result = run(ways, seed, args.rounds, args.data_root)
            with open(RESULTS / ".prototypes_reference.lock", "w") as lock:  # parallel invocations merge rows
                fcntl.flock(lock, fcntl.LOCK_EX)
                rows = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else []
                rows = [r for r in rows if (r["ways"], r["seed"], r["rounds"]) != (ways, seed, args.rounds)]
                JSON_PATH.write_text(json.dumps(rows + [result], indent=1))
            print(f"[ref] ways {ways} seed {seed}: local {result['local-mean']:.2f} ± {result['local-std']:.2f}, "
                  f"proto {result['proto-mean']:.2f} ± {result['proto-std']:.2f} "
                  f"({result['wall-time-s']:.0f} s)", flush=True)
    rows = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else []
    MD_PATH.write_text(table(rows))
    print(MD_PATH.read_text())


if __name__ == "__main__":
    main()
