"""Secure aggregation study, utility part: what secure aggregation and distributed DP cost in accuracy, at the
population sizes where client-level noise can average out.

Two settings, each run in one process on the in-process grid (``pollen.testing.run_inprocess``: every node a
real ClientApp with its own state, the strategy's own ``start``, the secure round's full SecAgg+ protocol; no
Ray, no network), one file per finished run under ``bench/results/secagg/utility/`` (a stopped study resumes):

* ``fedproto100-<arm>``: FedProto, MNIST 3-way shots (the privacy study's setting: batch 4, lr 0.01), **100
  clients**, every client every round, ``FEDPROTO_ROUNDS`` rounds. Arms: ``off`` (no secure aggregation, no
  DP, the label-histogram audit on), ``secagg`` (secure aggregation, no DP), ``distributed-eps{8,4,2}``
  (client-level replace-one ε over the run, dp-clip 4, dp-min-honest = half the clients), and the local-DP
  arms ``payload-eps<ε>`` / ``sample-eps<ε>`` (the privacy study's modes at 100 clients, no secure aggregation:
  the server reads each client's noisy release).
* ``fedavg-n<N>-<arm>``: FedAvg, MNIST Dirichlet (α 0.5), N clients of which each draws itself with
  q = ``FEDAVG_Q`` per round (m = q·N expected updates per round), ``FEDAVG_ROUNDS`` rounds, uniform client
  weights (distributed DP does not release sample counts; both arms use them). Arms: ``off`` and
  ``distributed-eps<ε>`` (dp-clip ``FEDAVG_CLIP``, dp-min-honest = N/2). The gap is measured against m.
  ``distributed-z<z>`` gives the noise multiplier instead of ε (the ledger still reports the ε it costs), so
  the best-trained population (N = 100) shows what a noise level costs in accuracy, on the same noise/clip
  axis as the ε arms: ``z0.05`` puts 1.04 × dp-clip of noise on the mean update (what ε = 8 leaves only at
  m ≈ 119), ``z0.114`` 2.38 × (what ε = 8 leaves at N = 500).

Accuracy is the clients' mean accuracy on their own test data at the last evaluation, read as the
experimenter's measurement (``dp-evaluate = unprotected``, outside ε). Shorter than the privacy study (which
ran 100 rounds at 20 clients): the machine's CPU allowed these sizes; each record keeps its setting.

``python -m bench.secagg_utility --cells fedproto100-off ...`` runs cells (default: the priority list
``CELLS``); ``python -m bench.secagg report`` renders them with :func:`utility_lines`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from bench.kit import RESULTS, RunFiles, default_data_root, locked, read_json, run_study, table, write_json

UTILITY_DIR = RESULTS / "secagg" / "utility"
FILES = RunFiles(UTILITY_DIR)
DELTA = 1e-5

FEDPROTO_CLIENTS, FEDPROTO_ROUNDS, FEDPROTO_CLIP = 100, 3, 4.0
FEDPROTO_BASE = {"method": "fedproto", "task": "mnist-shot", "batch-size": 4, "lr": 0.01,
                 "num-server-rounds": FEDPROTO_ROUNDS, "proto-evaluate-every": FEDPROTO_ROUNDS}

FEDAVG_Q, FEDAVG_ROUNDS, FEDAVG_CLIP = 0.1, 5, 1.0
FEDAVG_BASE = {"method": "fedavg", "task": "mnist-dirichlet", "num-server-rounds": FEDAVG_ROUNDS,
               "fraction-fit": FEDAVG_Q, "avg-weighting": "uniform", "fraction-evaluate": 1.0}
SECURE = {"secure-aggregation": True, "secagg-threshold": 0.6}
LOCAL_MODES = ("payload", "sample")  # local DP: each client's release noised on its own

# the order the study runs them (priority first): the done-when pair, FedAvg's gap against m, then the rest
CELLS = ("fedproto100-off", "fedproto100-distributed-eps8",
         "fedavg-n100-off", "fedavg-n100-distributed-eps8", "fedavg-n500-off", "fedavg-n500-distributed-eps8",
         "fedavg-n250-off", "fedavg-n250-distributed-eps8", "fedavg-n100-distributed-z0.05",
         "fedproto100-secagg", "fedproto100-distributed-eps2", "fedproto100-distributed-eps4",
         "fedavg-n1000-off", "fedavg-n100-distributed-z0.114", "fedavg-n500-distributed-eps4",
         "fedavg-n500-distributed-eps2", "fedavg-n100-distributed-eps4", "fedavg-n100-distributed-eps2",
         "fedavg-n1000-distributed-eps8", "fedproto100-payload-eps8", "fedproto100-sample-eps8",
         "fedproto100-payload-eps2", "fedproto100-sample-eps2")


def arm_noise(arm: str) -> tuple[str, float]:
    """``("dp-target-epsilon", ε)`` of a ``distributed-eps<ε>`` arm, ``("dp-noise-multiplier", z)`` of a
    ``distributed-z<z>`` arm."""
    noise = arm.removeprefix("distributed-")
    for prefix, key in (("eps", "dp-target-epsilon"), ("z", "dp-noise-multiplier")):
        value = noise.removeprefix(prefix)
        if arm.startswith("distributed-") and noise.startswith(prefix) and value.replace(".", "", 1).isdigit():
            return key, float(value)
    raise ValueError(f"unknown arm {arm!r}")


def _distributed(arm: str, clip: float, honest: int) -> dict[str, Any]:
    key, value = arm_noise(arm)
    return {**SECURE, "dp-mode": "distributed", key: value, "dp-clip": clip, "dp-min-honest": honest,
            "dp-evaluate": "unprotected"}  # accuracy is the study's measurement, outside ε


def parse_cell(cell: str) -> tuple[str, int, str]:
    """``(family, clients, arm)`` of a cell name."""
    prefix = f"fedproto{FEDPROTO_CLIENTS}-"
    if cell.startswith(prefix):
        return "fedproto", FEDPROTO_CLIENTS, cell.removeprefix(prefix)
    head, _, arm = cell.removeprefix("fedavg-n").partition("-")
    if cell.startswith("fedavg-n") and head.isdigit() and arm:
        return "fedavg", int(head), arm
    raise ValueError(f"unknown cell {cell!r}")


def arm_keys(family: str, clients: int, arm: str) -> dict[str, Any]:
    if arm == "off":
        return {"leak-audit": True} if family == "fedproto" else {}
    if arm == "secagg":
        return dict(SECURE)
    if arm.startswith("distributed-"):
        clip = FEDPROTO_CLIP if family == "fedproto" else FEDAVG_CLIP
        return _distributed(arm, clip, clients // 2)
    mode, _, eps = arm.partition("-eps")
    if family == "fedproto" and mode in LOCAL_MODES and eps:
        return {"leak-audit": True, "dp-evaluate": "unprotected", "dp-mode": mode, "dp-target-epsilon": float(eps)}
    raise ValueError(f"unknown arm {arm!r}")


def is_secure(arm: str) -> bool:
    """Does the FedProto arm aggregate under secure aggregation (the server sees only the sum)? Read off its
    run keys (:func:`arm_keys`)."""
    return bool(arm_keys("fedproto", FEDPROTO_CLIENTS, arm).get("secure-aggregation"))


def epsilon_unit(arm: str) -> str:
    """What one unit of the FedProto DP arm's ε protects, by Pollen's own rule
    (:func:`pollen.privacy.config.release_unit`), as the report writes it: a client, one record, or one
    embedding row given the model."""
    from pollen.privacy.config import release_unit

    return release_unit("prototypes", arm_keys("fedproto", FEDPROTO_CLIENTS, arm)["dp-mode"]).replace("-", " ")


def setting(cell: str) -> dict[str, Any]:
    """What a cell's file must have been run with (a changed base refuses the old file)."""
    family, clients, arm = parse_cell(cell)
    base = FEDPROTO_BASE if family == "fedproto" else FEDAVG_BASE
    return {"run-config": {**base, **arm_keys(family, clients, arm)}, "num-supernodes": clients,
            "runner": "in-process"}


def _final(rounds: list[dict], key: str) -> tuple[int | None, dict]:
    """The last round whose evaluation has ``key``, and that evaluation."""
    for r in reversed(rounds):
        if key in r["evaluate"]:
            return r["round"], r["evaluate"]
    return None, {}


def run_cell(cell: str, seed: int, data_root: str) -> dict[str, Any]:
    from pollen.testing import run_inprocess

    family, clients, arm = parse_cell(cell)
    config = setting(cell)
    run_config = {**config["run-config"], "seed": seed, "data-root": data_root}
    load, wall, cpu = os.getloadavg()[0], time.monotonic(), time.process_time()
    rounds = run_inprocess(run_config, clients, echo=False)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    at, evaluate = _final(rounds, "accuracy-client-mean")
    last = rounds[-1]
    return {"family": family, "clients": clients, "arm": arm, "seed": seed, "setting": config,
            "wall-s": round(wall, 1), "cpu-s": round(cpu, 1), "load-1min-at-start": round(load, 2),
            "rounds": len(rounds), "evaluated-at": at, "evaluate": evaluate, "fit": last["fit"],
            "failures-total": sum(r["failures"] for r in rounds),
            "rejected-total": sum(len(r["rejected"]) if isinstance(r["rejected"], (list, dict)) else int(r["rejected"])
                                  for r in rounds),
            "secure-aggregation": {k: v for k, v in last["secure-aggregation"].items() if k != "stages"},
            "curves": {"round": [r["round"] for r in rounds],
                       "accuracy-client-mean": [r["evaluate"].get("accuracy-client-mean") for r in rounds],
                       "dp-epsilon": [r["fit"].get("dp-epsilon") for r in rounds],
                       "classes-present": [r["fit"].get("classes-present") for r in rounds],
                       "leak-hist-tv": [r["fit"].get("leak-hist-tv-client-mean") for r in rounds]}}


def utility_main(cells: list[str], seeds: list[int], data_root: str | None = None) -> int:
    root = data_root or default_data_root()
    cells = cells or list(CELLS)
    for cell in cells:
        parse_cell(cell)  # refuse a misspelt cell before anything runs

    def said(rec: dict) -> str:
        ev = rec["evaluate"]
        acc = 100 * ev.get("accuracy-client-mean", float("nan"))
        return f"accuracy {acc:.2f} %, ε {rec['fit'].get('dp-epsilon')}, wall {rec['wall-s']:.0f} s"

    return run_study("secagg-utility", FILES, [(c, s) for s in seeds for c in cells], setting,
                     lambda cell, seed: run_cell(cell, seed, root), said=said)


# ---------------------------------------------------------------------------------------------
# the report's utility sections

NOISE_FILE = RESULTS / "secagg" / "noise-multipliers.json"


def noise_multiplier(eps: float, q: float, rounds: int) -> float:
    """z that ``dp-target-epsilon`` = ``eps`` calibrates to at q over ``rounds`` (δ 1e-5), as a run computes it
    (``pollen.privacy.distributed.calibrate``). A sampled calibration composes a dozen PLDs (minutes of CPU on
    the shared machine), so each figure is kept in ``NOISE_FILE`` once computed and the reports read it from
    there (``tests/test_secagg_utility.py`` recomputes the committed ones)."""
    from pollen.privacy.distributed import calibrate

    key = f"eps={eps:g} delta={DELTA:g} q={q:g} rounds={rounds}"
    table = read_json(NOISE_FILE, {})
    if key not in table:
        z = calibrate(eps, DELTA, q, rounds)
        with locked(NOISE_FILE):  # merged under the lock: study processes may compute others meanwhile
            table = read_json(NOISE_FILE, {})
            table.setdefault(key, z)
            write_json(NOISE_FILE, table, sort_keys=True)
    return float(table[key])


def mean_noise_ratio(z: float, m: float, dim: int, honest_share: float = 0.5) -> float:
    """The expected L2 norm of the noise on the mean update, in units of dp-clip: the sum carries noise of std
    z·Δ·sqrt(N/h) per coordinate (every one of the N clients adds its share z·Δ/√h; h = N/2 gives z·Δ·√2),
    the mean divides by m = q·N, and a d-vector's norm is √d times that (Δ ≈ dp-clip in steps: the rounding
    term is 1e-5 of it at the study's grid)."""
    return z * math.sqrt(1.0 / honest_share) * math.sqrt(dim) / m


def _load() -> list[dict]:
    return [r for r in FILES.load() if "clients" in r]


def _acc(r: dict | None) -> float | None:
    return None if r is None else r["evaluate"].get("accuracy-client-mean")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def _runs_by(runs: list[dict]) -> dict[tuple[str, int, str, int], dict]:
    return {(r["family"], r["clients"], r["arm"], r["seed"]): r for r in runs}


def fedproto_rows(runs: list[dict]) -> list[list[str]]:
    by = _runs_by(runs)
    rows = []
    for r in sorted((r for r in runs if r["family"] == "fedproto"), key=lambda r: (r["seed"], r["arm"] != "off",
                                                                                r["arm"])):
        base = by.get(("fedproto", r["clients"], "off", r["seed"]))
        gap = None if base is None or base is r or _acc(r) is None else 100 * (_acc(r) - _acc(base))
        ev, secure = r["evaluate"], is_secure(r["arm"])
        tv = [v for v in r["curves"]["leak-hist-tv"] if v is not None]
        floor = r["fit"].get("leak-hist-tv-floor-client-mean")
        readable = (f"sum of {r['clients']} only" if secure else
                    f"TV {tv[-1]:.3f} (prior {floor:.3f})" if tv and floor is not None else "—")
        present = [v for v in r["curves"]["classes-present"] if v is not None]
        eps = r["fit"].get("dp-epsilon")
        rows.append([r["arm"], "yes" if secure else "no", _pct(_acc(r)), "" if gap is None else f"{gap:+.2f}",
                     _pct(ev.get("proto-accuracy-client-mean")) if "proto-accuracy-client-mean" in ev
                     else "no class kept", str(max(present)) if present else "—",
                     f"{eps:.3g} ({epsilon_unit(r['arm'])})" if isinstance(eps, (int, float)) else "—", readable,
                     str(r["seed"]),
                     f"{r['wall-s']:.0f}"])
    return rows


CHANCE = 0.1  # MNIST's ten classes: a model the noise has erased


def _arm_noise_z(arm: str) -> tuple[float | None, float]:
    """``(target ε or None, z)`` of a FedAvg DP arm: z calibrated as the run calibrates it, or given."""
    key, value = arm_noise(arm)
    if key == "dp-noise-multiplier":
        return None, value
    return value, noise_multiplier(value, FEDAVG_Q, FEDAVG_ROUNDS)


def fedavg_points(runs: list[dict], dim: int) -> list[dict[str, Any]]:
    """Each FedAvg DP run beside the no-DP run of its population and seed, with the computed noise on the mean
    update (in dp-clip units) it ran under; most noise first."""
    by = _runs_by(runs)
    points = []
    for r in (r for r in runs if r["family"] == "fedavg" and r["arm"] != "off"):
        base = by.get(("fedavg", r["clients"], "off", r["seed"]))
        eps, z = _arm_noise_z(r["arm"])
        m = FEDAVG_Q * r["clients"]
        dp, off = _acc(r), _acc(base)
        points.append({"clients": r["clients"], "m": m, "arm": r["arm"], "seed": r["seed"], "target-epsilon": eps,
                       "z": z, "noise-over-clip": mean_noise_ratio(z, m, dim), "accuracy": dp,
                       "accuracy-no-dp": off, "gap-points": None if dp is None or off is None else 100 * (dp - off),
                       "lift-kept": None if dp is None or off is None or off <= CHANCE
                       else (dp - CHANCE) / (off - CHANCE),
                       "epsilon-spent": r["fit"].get("dp-epsilon"), "cost": _cost(r),
                       "cost-no-dp": None if base is None else _cost(base)})
    return sorted(points, key=lambda p: (-p["noise-over-clip"], p["clients"], p["seed"]))


def _cost(r: dict) -> dict[str, float]:
    return {"cpu-s": r["cpu-s"], "wall-s": r["wall-s"], "load": r["load-1min-at-start"]}


def _cost_cell(c: dict[str, float]) -> str:
    return f"{c['cpu-s']:.0f} ({c['wall-s']:.0f}, {c['load']:.0f})"


def fedavg_rows(runs: list[dict], dim: int) -> list[list[str]]:
    rows = []
    for p in fedavg_points(runs, dim):
        eps = p["epsilon-spent"]
        rows.append([str(p["clients"]), f"{p['m']:g}", "z given" if p["target-epsilon"] is None
                     else f"{p['target-epsilon']:g}", f"{p['z']:.3g}", f"{p['noise-over-clip']:.2f}",
                     _pct(p["accuracy-no-dp"]), _pct(p["accuracy"]),
                     "not run" if p["gap-points"] is None else f"{p['gap-points']:+.2f}",
                     "" if p["lift-kept"] is None else f"{100 * p['lift-kept']:.0f} %",
                     f"{eps:.3g}" if isinstance(eps, (int, float)) else "—", str(p["seed"]),
                     _cost_cell(p["cost"]) + ("" if p["cost-no-dp"] is None else f" / {_cost_cell(p['cost-no-dp'])}")])
    by = _runs_by(runs)
    for r in sorted((r for r in runs if r["family"] == "fedavg" and r["arm"] == "off"),
                    key=lambda r: (r["clients"], r["seed"])):
        if not any(k[0] == "fedavg" and k[1] == r["clients"] and k[2] != "off" and k[3] == r["seed"] for k in by):
            rows.append([str(r["clients"]), f"{FEDAVG_Q * r['clients']:g}", "—", "—", "—", _pct(_acc(r)), "not run",
                         "", "", "", str(r["seed"]), _cost_cell(_cost(r))])
    return rows


def model_dim() -> int:
    """The float coordinates of FedAvg's model in this setting (the length of a client's contribution); built
    from the method's initial model, no data read."""
    from pollen.app.config import validated_run_config
    from pollen.app.registry import METHODS

    arrays = METHODS["fedavg"].initial_arrays(validated_run_config(FEDAVG_BASE))
    return int(sum(a.numpy().size for a in arrays.values() if a.numpy().dtype.kind == "f"))


EPSILONS = (8.0, 4.0, 2.0)


def clients_for(eps: float, ratio: float, dim: int) -> float:
    """The clients per round m at which ε's noise on the mean update is ``ratio`` × dp-clip (this setting's q
    and rounds): the noise falls as 1/m."""
    return mean_noise_ratio(noise_multiplier(eps, FEDAVG_Q, FEDAVG_ROUNDS), 1.0, dim) / ratio


USEFUL_LIFT = 2 / 3  # the report's reading of "useful": at least two thirds of the no-DP lift over chance kept


def useful_rows(dim: int) -> list[list[str]]:
    """Computed: the clients per round m at which the noise on FedAvg's mean update is a given share of
    dp-clip, by ε (this setting's rounds and q)."""
    rows = []
    for eps in EPSILONS:
        z = noise_multiplier(eps, FEDAVG_Q, FEDAVG_ROUNDS)
        rows.append([f"{eps:g}", f"{z:.3f}"] + [f"{m:,.0f} (N = {m / FEDAVG_Q:,.0f})"
                                                for m in (clients_for(eps, t, dim) for t in (1.0, 0.3, 0.1))])
    return rows


def _where(eps: float, ratio: float, dim: int) -> str:
    m = clients_for(eps, ratio, dim)
    return f"{m:,.0f} (N = {m / FEDAVG_Q:,.0f})"


def _label(p: dict) -> str:
    return f"ε = {p['target-epsilon']:g}" if p["target-epsilon"] is not None else f"z = {p['z']:g}"


def _seeds_said(points: list[dict]) -> str:
    """How many seeds the points have: one for all, or which cells have more."""
    seeds: dict[tuple[int, str], set[int]] = {}
    for p in points:
        seeds.setdefault((p["clients"], p["arm"]), set()).add(p["seed"])
    if all(len(v) == 1 for v in seeds.values()):
        return f"one seed per cell (seed {', '.join(sorted({str(p['seed']) for p in points}))})"
    more = [f"N = {n} {arm}" for (n, arm), v in sorted(seeds.items()) if len(v) > 1]
    return f"seeds {', '.join(sorted({str(p['seed']) for p in points}))} for {', '.join(more)}, one seed elsewhere"


def fedavg_cells(points: list[dict]) -> list[dict[str, Any]]:
    """The seed-paired points of each cell (population, arm) together: the mean gap and lift kept over its
    seeds, and their range; most noise first."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for p in points:
        if p["lift-kept"] is not None:
            cells.setdefault((p["clients"], p["arm"]), []).append(p)
    out = []
    for same in cells.values():
        gaps, lifts = [p["gap-points"] for p in same], [p["lift-kept"] for p in same]
        out.append({k: same[0][k] for k in ("clients", "m", "arm", "target-epsilon", "z", "noise-over-clip")}
                   | {"seeds": sorted(p["seed"] for p in same), "gap-points": sum(gaps) / len(gaps),
                      "gap-range": (min(gaps), max(gaps)), "lift-kept": sum(lifts) / len(lifts),
                      "lift-range": (min(lifts), max(lifts))})
    return sorted(out, key=lambda c: (-c["noise-over-clip"], c["clients"]))


def _spread(mean: float, low: float, high: float, scale: float, fmt: str, unit: str = "") -> str:
    said = f"{scale * mean:{fmt}}{unit}"
    return said if low == high else f"{said} [{scale * low:{fmt}}, {scale * high:{fmt}}]"


def measured_rows(cells: list[dict], dim: int) -> list[list[str]]:
    """Each measured cell's noise, what it cost over its seeds, and the clients per round at which each ε
    reaches that noise (the computed line through the cell)."""
    return [[f"{c['noise-over-clip']:.2f}", f"N = {c['clients']}, {_label(c)}", ", ".join(map(str, c["seeds"])),
             _spread(c["gap-points"], *c["gap-range"], 1, "+.1f"), _spread(c["lift-kept"], *c["lift-range"], 100, ".0f",
                                                                           " %")]
            + [_where(eps, c["noise-over-clip"], dim) for eps in EPSILONS] for c in cells]


def _reading(cells: list[dict], dim: int) -> list[str]:
    """Where a useful ε starts by the measured cells' mean lift kept (:data:`USEFUL_LIFT`) and the computed
    line."""
    if not cells:
        return []
    useful = [c for c in cells if c["lift-kept"] >= USEFUL_LIFT]
    head = (f"**Where a useful ε starts** ({FEDAVG_ROUNDS} rounds; each cell's mean over its seeds). Reading "
            f"*useful* as keeping at least {100 * USEFUL_LIFT:.0f} % of the no-DP lift over chance (a reading, not a "
            "standard): ")
    if not useful:
        least = min(c["noise-over-clip"] for c in cells)
        return ["", head + f"no measured cell is; below the least noise measured, {least:.2f} × clip, is where to "
                "measure next."]
    edge = max(useful, key=lambda c: c["noise-over-clip"])
    below = [c for c in cells if c["noise-over-clip"] <= edge["noise-over-clip"]]
    above = [c for c in cells if c["noise-over-clip"] > edge["noise-over-clip"]]
    text = (f"the noisiest useful cell is {edge['noise-over-clip']:.2f} × clip (N = {edge['clients']}, "
            f"{_label(edge)}, {100 * edge['lift-kept']:.0f} % kept)")
    failed = [c for c in below if c["lift-kept"] < USEFUL_LIFT]
    if failed:
        text += "; not every cell with less noise was: " + ", ".join(
            f"{c['noise-over-clip']:.2f} × at N = {c['clients']} kept {100 * c['lift-kept']:.0f} %" for c in failed)
    elif len(below) > 1:
        low = min(c["lift-range"][0] for c in below)
        text += f"; every cell at that noise or less kept at least {100 * min(c['lift-kept'] for c in below):.0f} % " \
                f"on average (its seeds: at least {100 * low:.0f} %)"
    if above:
        text += ("; more noise kept " + ", ".join(f"{100 * c['lift-kept']:.0f} % ({c['noise-over-clip']:.2f} ×)"
                                                  for c in sorted(above, key=lambda c: c["noise-over-clip"])))
    text += (". By the computed line each ε puts that little noise on the mean from m = "
             + ", ".join(f"{_where(eps, edge['noise-over-clip'], dim)} at ε = {eps:g}" for eps in EPSILONS)
             + ". The DP noise is drawn from the operating system, so even one seed's point is not repeatable to "
             "the digit; the ranges in brackets are the spread over a cell's seeds.")
    return ["", head + text]


def fedavg_plot(points: list[dict], dim: int, path) -> None:
    """Left: the computed noise on the mean update against m, by ε, with the measured cells and their mean gaps.
    Right: the share of the no-DP arm's lift over chance each DP run (each seed) kept, against that noise."""
    from bench.kit import pyplot, save_figure

    measured = [p for p in points if p["accuracy"] is not None]
    if not measured:
        return
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    ms = [10 ** (k / 20) for k in range(0, 81)]  # m from 1 to 10^4
    colour = dict(zip(EPSILONS, ("C0", "C1", "C2")))
    for eps, style in zip(EPSILONS, ("-", "--", ":")):
        z = noise_multiplier(eps, FEDAVG_Q, FEDAVG_ROUNDS)
        left.plot(ms, [mean_noise_ratio(z, m, dim) for m in ms], style, color=colour[eps],
                  label=f"ε = {eps:g} (computed)")
    for level in (1.0, 0.3):
        left.axhline(level, color="grey", lw=0.6, ls=":")

    def style(p: dict) -> dict:
        return {"marker": "o", "color": colour.get(p["target-epsilon"], "k")} if p["target-epsilon"] is not None \
            else {"marker": "s", "color": "k"}

    for c in fedavg_cells(measured):
        left.plot(c["m"], c["noise-over-clip"], ls="none", **style(c))
        left.annotate(f"{c['gap-points']:+.0f} pt", (c["m"], c["noise-over-clip"]), textcoords="offset points",
                      xytext=(5, 0), fontsize=7)
    left.set_xscale("log"), left.set_yscale("log")
    left.set_xlabel("clients per round m = q·N"), left.set_ylabel("noise on the mean update / dp-clip")
    left.set_title(f"FedAvg, {FEDAVG_ROUNDS} rounds, q = {FEDAVG_Q:g}: computed noise, measured mean gap", fontsize=9)
    left.legend(fontsize=8)
    kept = [p for p in measured if p["lift-kept"] is not None]
    named = set()
    for p in kept:
        x, y = p["noise-over-clip"], 100 * p["lift-kept"]
        right.plot(x, y, ls="none", **style(p))
        if (p["clients"], p["arm"]) not in named:
            named.add((p["clients"], p["arm"]))
            right.annotate(f"N = {p['clients']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    right.axhline(100, color="grey", lw=0.6, ls=":"), right.axhline(0, color="grey", lw=0.6, ls=":")
    right.set_xscale("log"), right.set_xlabel("noise on the mean update / dp-clip")
    right.set_ylabel("lift kept % (DP − chance) / (no DP − chance)")
    right.set_title("each seed, paired with its no-DP run (squares: z given)", fontsize=9)
    save_figure(fig, path, 110)


def utility_lines() -> list[str]:
    """The report's sections on the 100-client FedProto runs and FedAvg's gap against clients per round."""
    runs = _load()
    if not runs:
        return ["", "No 100-client utility run yet (`python -m bench.secagg_utility`)."]
    dim = model_dim()
    lines = ["", "# Privacy and utility at 100+ clients (in-process runs, seed-paired)", "",
             "`python -m bench.secagg_utility` (`bench/secagg_utility.py`; its docstring says what runs): each run in "
             "one process on the in-process grid, the full SecAgg+ protocol every round, one file per run under "
             "`bench/results/secagg/utility/`. Accuracy: the clients' mean accuracy on their own test data at the "
             "last evaluation; gap: the arm minus the no-DP arm of the same population and seed (points). Wall "
             "times are on a 2-core machine shared with other work.", "",
             f"## FedProto, MNIST 3-way shots, {FEDPROTO_CLIENTS} clients, {FEDPROTO_ROUNDS} rounds, every client "
             "every round", "",
             f"Batch 4, lr 0.01 (the privacy study's setting, {FEDPROTO_ROUNDS} rounds instead of 100). Distributed "
             f"arms: client-level replace-one ε over the run, dp-clip {FEDPROTO_CLIP:g}, dp-min-honest "
             f"{FEDPROTO_CLIENTS // 2}. *Classes kept*: the most global prototypes that passed the presence rule in "
             "one round (10 = all). Local-DP arms (`payload-eps*`, `sample-eps*`: the privacy study's modes, no secure "
             "aggregation) spend their ε per embedding row given the model or per record (docs/privacy.md); the "
             "distributed arms per client. *One client's histogram*: without secure aggregation the audit's total "
             "variation from the truth of the server's best guess from one client's reply (the prior guess in "
             "brackets); with it the server holds only the sum of all clients' contributions.", ""]
    lines += table(["arm", "secure aggregation", "local acc. %", "gap (points)", "proto acc. %", "classes kept",
                    "ε spent", "one client's histogram", "seed", "wall s"], fedproto_rows(runs))
    points = fedavg_points(runs, dim)
    lines += ["", "## FedAvg, MNIST Dirichlet (α 0.5): the gap against clients per round", "",
              f"Each of N clients draws itself with q = {FEDAVG_Q:g} per round (m = q·N expected updates), "
              f"{FEDAVG_ROUNDS} rounds, cnn_mnist ({dim:,} floats), uniform client weights in both "
              f"arms, dp-clip {FEDAVG_CLIP:g}, dp-min-honest N/2. z: the noise multiplier ε calibrates to at q and "
              "these rounds (δ 1e-5), or the one a `distributed-z` arm gives (its ε spent is then what that noise "
              "costs: no privacy worth the name; the arm is there to measure what this noise does to accuracy at "
              "the population that trains best). *Noise / clip*: the expected L2 norm of the noise on the mean "
              "update in units of dp-clip, √2·z·√d / m — the arithmetic the measured gap is set against (every "
              "client adds its share, so the sum's noise does not grow with N while the signal grows as m). "
              "*Lift kept*: (DP acc. − 10 %) / (no-DP acc. − 10 %), the share of what the no-DP arm gains over "
              "chance (ten classes) that the DP arm keeps. The no-DP accuracy itself falls with N here (the same "
              "data over more, smaller clients in the same 5 rounds): the gap is read per N and against the "
              f"lift. Cells: {_seeds_said(points) if points else 'no DP run yet'}, {FEDAVG_ROUNDS} rounds (the "
              "machine's time); where a cell has one seed, its seed-to-seed spread is not measured. "
              "Rows: most noise first. Cost: the run's process CPU, its wall time and the machine's 1-min load "
              "average at its start, DP arm / no-DP arm (every one of the N clients runs the SecAgg+ stages each "
              "round under secret sampling, the no-DP arm trains m).", ""]
    lines += table(["N", "m = q·N", "ε target", "z", "noise / clip on the mean", "no-DP acc. %", "DP acc. %",
                    "gap (points)", "lift kept", "ε spent", "seed", "CPU-s (wall s, load)"], fedavg_rows(runs, dim))
    lines += ["", "Computed, not measured: the clients per round m (and population N = m/q) at which the noise "
              "on the mean update falls to 1, 0.3 and 0.1 × dp-clip in this setting:", ""]
    lines += table(["ε", "z", "noise = 1 × clip", "noise = 0.3 × clip", "noise = 0.1 × clip"], useful_rows(dim))
    cells = fedavg_cells(points)
    if cells:
        lines += ["", "The measured cells on the computed line: each cell's noise, what it cost (mean over its seeds, "
                  "[min, max] when it has more than one), and the clients per round m (population N) at which each ε "
                  "puts that noise on the mean:", ""]
        lines += table(["noise / clip", "measured at", "seeds", "gap (points)", "lift kept"]
                       + [f"ε = {eps:g} reaches it at m =" for eps in EPSILONS], measured_rows(cells, dim))
    lines += _reading(cells, dim)
    lines += ["", "![FedAvg: noise on the mean update against m, and accuracy against that noise]"
              "(secagg_fedavg.png)"] if points else []
    return lines


def write_fedavg_plot(path) -> None:
    runs = _load()
    if any(r["family"] == "fedavg" and r["arm"] != "off" for r in runs):
        dim = model_dim()
        fedavg_plot(fedavg_points(runs, dim), dim, path)


def utility_summary() -> list[dict[str, Any]]:
    return [{k: r[k] for k in ("family", "clients", "arm", "seed", "evaluate", "wall-s", "rounds")}
            | {"epsilon": r["fit"].get("dp-epsilon")} for r in _load()]


def fedavg_summary() -> list[dict[str, Any]]:
    """The FedAvg points of the report (``secagg.json``: ``fedavg-gap``)."""
    runs = _load()
    return fedavg_points(runs, model_dim()) if any(r["family"] == "fedavg" for r in runs) else []


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="*", default=[], help=f"default: {' '.join(CELLS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--data-root", default=default_data_root())
    args = parser.parse_args(argv)
    return utility_main(args.cells, args.seeds, args.data_root)


if __name__ == "__main__":
    raise SystemExit(main())
