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

None of Pollen's federated code runs here: the script shares with Pollen the data loader, the split,
the CNN and the two pure functions L_P and the MSE distance (each tested against independent
computations), while private state, per-round loaders, prototype aggregation and evaluation are its
own. A gap between this and the Flower runs points at the federated implementation, a gap between
this and the official numbers at the seed.

    python -m bench.fedproto_reference --data-root ../shared/data --ways 3 --seeds 1234 0 1 2 3

Writes ``bench/results/prototypes_reference.json`` (one entry per ways/seed, merged with earlier
entries) and prints a table.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from bench.kit import RESULTS, locked, read_json, table, write_atomic, write_json
from bench.prototypes import OFFICIAL  # the official run's numbers
from pollen.datasets.partition import n_way_k_shot
from pollen.datasets.sources import load_source
from pollen.datasets.transforms import MNIST_FORMAT, to_model_input
from pollen.methods.prototype_losses import prototype_loss, squared_distances
from pollen.models.small import CNNMnist

JSON_PATH = RESULTS / "prototypes_reference.json"
MD_PATH = RESULTS / "prototypes_reference.md"


class Rows(Dataset):
    """(image, label) rows of in-memory tensors, picked by index, as the official ``DatasetSplit``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, idxs: np.ndarray):
        self.x, self.y, self.idxs = x, y, [int(i) for i in idxs]

    def __len__(self):
        return len(self.idxs)

    def __getitem__(self, item):
        i = self.idxs[item]
        return self.x[i], self.y[i]


def train_client(model: CNNMnist, loader: DataLoader, protos: torch.Tensor, present: torch.Tensor, ld: float,
                 lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One local epoch; returns (C×d class means of the training-time embeddings, C bool: class seen)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    sums = torch.zeros_like(protos)
    counts = torch.zeros(len(protos), dtype=torch.long)
    for x, y in loader:
        model.zero_grad()
        z = model.features(x)
        loss = F.cross_entropy(model.classify(z), y)
        if present.any():  # round 1 has no global prototypes: L_S alone
            loss = loss + ld * prototype_loss(z, y, protos, present)
        loss.backward()
        opt.step()
        sums.index_add_(0, y, z.detach())
        counts += torch.bincount(y, minlength=len(protos))
    return sums / counts.clamp_min(1).unsqueeze(1), counts > 0


@torch.no_grad()
def evaluate(models, tests, classes, protos: torch.Tensor, present: torch.Tensor) -> dict[str, list[float]]:
    out = {"local": [], "proto": [], "local-running": [], "proto-running": []}
    run_correct, run_total = 0, 0
    for model, (x, y), own in zip(models, tests, classes):
        model.eval()
        z = model.features(x)
        local_correct = int((model.classify(z).argmax(1) == y).sum())
        run_correct, run_total = run_correct + local_correct, run_total + len(y)
        out["local"].append(local_correct / len(y))
        out["local-running"].append(run_correct / run_total)
        cand = torch.as_tensor([c for c in own if present[c]])
        pred = cand[squared_distances(z, protos[cand]).argmin(1)]
        proto_correct = int((pred == y).sum())
        run_correct, run_total = run_correct + proto_correct, run_total + len(y)
        out["proto"].append(proto_correct / len(y))
        out["proto-running"].append(run_correct / run_total)
    return out


def run(ways: int, seed: int, rounds: int, data_root: str, ld: float = 1.0, lr: float = 0.01,
        num_clients: int = 20, shots: int = 100, stdev: int = 2, progress_every: int = 10) -> dict:
    """One run; a ``[ref] … round k/K`` line every ``progress_every`` rounds (1: every round, the per-round
    marker ``bench/overhead.py`` reads the CPU counter at; printing draws no random numbers)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    train, test = load_source("mnist", data_root, "train"), load_source("mnist", data_root, "test")
    x_train, x_test = to_model_input(train.images, MNIST_FORMAT), to_model_input(test.images, MNIST_FORMAT)
    y_train, y_test = train.labels.long(), test.labels.long()
    splits = n_way_k_shot(y_train.numpy(), y_test.numpy(), num_clients, ways, shots, stdev, 40, 10, seed,
                          official_k_high=shots + stdev - 1)
    models = [CNNMnist(num_classes=10) for _ in range(num_clients)]  # in client order, from the global RNG
    protos = torch.zeros(10, CNNMnist.EMBED_DIM)
    present = torch.zeros(10, dtype=torch.bool)
    start = time.perf_counter()
    for rnd in range(rounds):
        means, held = [], []
        for model, split in zip(models, splits):
            loader = DataLoader(Rows(x_train, y_train, split.train), batch_size=4, shuffle=True, drop_last=True)
            m, h = train_client(model, loader, protos, present, ld, lr)
            means.append(m)
            held.append(h)
        # unweighted mean over the clients that hold each class, in client order
        means_k, held_k = torch.stack(means), torch.stack(held)
        present = held_k.any(0)
        protos = torch.stack([means_k[held_k[:, c], c].mean(0) if present[c] else torch.zeros_like(protos[c])
                              for c in range(len(protos))])
        if (rnd + 1) % progress_every == 0:
            print(f"[ref] ways {ways} seed {seed}: round {rnd + 1}/{rounds}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    wall = time.perf_counter() - start
    tests = [(x_test[s.test], y_test[s.test]) for s in splits]
    acc = evaluate(models, tests, [list(s.classes) for s in splits], protos, present)
    return {"ways": ways, "seed": seed, "rounds": rounds, "threads": torch.get_num_threads(),
            "local-mean": 100 * float(np.mean(acc["local"])), "local-std": 100 * float(np.std(acc["local"])),
            "proto-mean": 100 * float(np.mean(acc["proto"])), "proto-std": 100 * float(np.std(acc["proto"])),
            "local-running-mean": 100 * float(np.mean(acc["local-running"])),
            "proto-running-mean": 100 * float(np.mean(acc["proto-running"])),
            "per-client-local": acc["local"], "per-client-proto": acc["proto"], "wall-time-s": wall}


def markdown(rows: list[dict]) -> str:
    lines = ["# FedProto's procedure without Flower (bench/fedproto_reference.py)", "",
             "The official FedProto MNIST procedure replayed in one process (its order of random draws, its "
             "split, private CNNs, training-time prototypes, unweighted aggregation) for several seeds; accuracy "
             "in %, mean ± std over 20 clients, counters reset per client, 100 rounds. *running*: the official "
             "code's never-reset counters. Official run (seed 1234): n = 3 98.85 / 98.66, n = 4 98.07 / 98.03.", "",
             *table(("ways", "seed", "local", "proto", "local (running)", "proto (running)", "wall s"), ())]
    for r in sorted(rows, key=lambda r: (r["ways"], r["seed"])):
        lines.append(f"| {r['ways']} | {r['seed']} | {r['local-mean']:.2f} ± {r['local-std']:.2f} | "
                     f"{r['proto-mean']:.2f} ± {r['proto-std']:.2f} | {r['local-running-mean']:.2f} | "
                     f"{r['proto-running-mean']:.2f} | {r['wall-time-s']:.0f} |")
    lines += ["", *table(("ways", "seeds", "local mean", "proto mean", "seed-to-seed std (local / proto)", "official",
                          "Δ to official"), ())]
    for ways in sorted({r["ways"] for r in rows}):
        group = [r for r in rows if r["ways"] == ways and r["rounds"] == 100]
        if not group:
            continue
        loc = np.array([r["local-mean"] for r in group])
        pro = np.array([r["proto-mean"] for r in group])
        off = (OFFICIAL[ways]["accuracy"][0], OFFICIAL[ways]["proto-accuracy"][0]) if ways in OFFICIAL else None
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
    for ways in ([] if args.table_only else args.ways):
        for seed in args.seeds:
            result = run(ways, seed, args.rounds, args.data_root)
            with locked(JSON_PATH):  # parallel invocations merge rows
                rows = read_json(JSON_PATH, [])
                rows = [r for r in rows if (r["ways"], r["seed"], r["rounds"]) != (ways, seed, args.rounds)]
                write_json(JSON_PATH, rows + [result])
            print(f"[ref] ways {ways} seed {seed}: local {result['local-mean']:.2f} ± {result['local-std']:.2f}, "
                  f"proto {result['proto-mean']:.2f} ± {result['proto-std']:.2f} "
                  f"({result['wall-time-s']:.0f} s)", flush=True)
    write_atomic(MD_PATH, markdown(read_json(JSON_PATH, [])))
    print(MD_PATH.read_text())


if __name__ == "__main__":
    main()
