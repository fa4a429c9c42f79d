"""The privacy study: what differential privacy costs each family in accuracy, and what it hides.

Every run is a real ``flwr run`` on a SuperLink this script owns (``pollen.launch.simulate``), with
``leak-audit = true`` so each round also says what the server could read off the replies:

- **FedProto, MNIST** — the README's FedProto command (20 clients, 100 rounds, its own run config, read from
  ``bench/results/readme_commands/fedproto.json``) at ε ∈ {∞, 8, 4, 2, 1} × {``payload``, ``sample``}
  (``dp-target-epsilon``: σ calibrated for the 100 releases); local and prototype accuracy, the label
  histogram's TV distance and class-presence F1 read off the released counts, each with its floor. The
  ε = ∞ arm is ``dp-mode = off``; it must equal the README's committed row to every digit.
- **GLFC** — ``conf/glfc-mnist-fmnist.toml`` shortened to 2 tasks × 5 rounds (the full preset is ~20 minutes a
  run here) at noise multipliers σ ∈ {0, 0.5, 1, 2} under ``payload`` (σ = 0 is ``dp-mode = off``): the
  proxy's reconstructions (PSNR, SSIM, label accuracy, with floors) and AIA.
- **FCCL** — ``conf/fccl-digits-offline.toml`` at ε ∈ {∞, 8, 4} under ``payload``: inter/intra-domain AVG and
  the public-softmax histogram TV.

``dp-clip`` stays at its default 1.0 everywhere (docs/privacy.md: for prototypes and logit rows the signal
to noise ratio does not depend on the clip once most rows are clipped). DP noise is drawn from the OS, so
a private run is not bit-reproducible; seeds pair the data, the models' initialisation and the sampling.

One result file per finished run (``bench/results/privacy/<family>-<arm>-seed<k>.json``), skipped on the next
call, so a stopped study resumes; the report (``bench/results/privacy.{md,json,png}``) is rewritten from
the files each time::

    python -m bench.privacy --seeds 0                    # every arm of seed 0, cheapest families first
    python -m bench.privacy --family fedproto --seeds 1 2
    python -m bench.privacy --report                     # only rewrite the report
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.kit import (
    RESULTS,
    ROOT,
    RunFiles,
    default_data_root,
    fmt_mean_sd,
    preset,
    pyplot,
    read_json,
    read_metrics,
    read_summary,
    run_study,
    save_figure,
    simulate_run,
    table,
    write_atomic,
    write_json,
)

FOLDER = RESULTS / "privacy"
REPORT_MD, REPORT_JSON, REPORT_PNG = RESULTS / "privacy.md", RESULTS / "privacy.json", RESULTS / "privacy.png"
README_FEDPROTO = RESULTS / "readme_commands" / "fedproto.json"
README_FCCL = RESULTS / "readme_commands" / "fccl.json"
FAMILIES = ("fedproto", "glfc", "fccl", "fccl-leak")  # the order a study runs them: cheapest first
FEDPROTO_EPSILONS = (8.0, 4.0, 2.0, 1.0)
FCCL_EPSILONS = (8.0, 4.0)
GLFC_SIGMAS = (0.5, 1.0, 2.0)
# GLFC's preset shortened to what the study can afford (2 tasks of 5 rounds: one task transition, so the
# proxy inverts gradients and old models are kept)
GLFC_SHORT = {"num-server-rounds": 10, "glfc-tasks": 2, "glfc-rounds-per-task": 5}
# FCCL's leak per release, measured in 2 rounds of the preset (a 10-round run takes 40 min to hours on this
# machine): without DP, and at the σ of the 10-round ε-8 budget (client-level, replace-one), so that each
# release carries the noise it carries in the full ε-8 run
FCCL_LEAK_SHORT = {"num-server-rounds": 2}
FCCL_LEAK_EPSILON = 8.0


def command_config(record_path: Path) -> tuple[dict[str, Any], int]:
    """The run config and client count of a README command as recorded (``--run-config "..."``,
    ``--num-supernodes N``): the study's base is exactly what the README's row ran."""
    from pollen.launch import parse_run_config

    words = shlex.split(read_json(record_path)["command"])
    config = parse_run_config(words[words.index("--run-config") + 1])
    nodes = int(words[words.index("--num-supernodes") + 1]) if "--num-supernodes" in words else 0
    return config, nodes


# The study's accuracies are the experimenter's measurement, not a release: the private arms evaluate with
# dp-evaluate = 'unprotected' (recorded in each summary), so accuracy is read as without DP.
MEASURED = {"dp-evaluate": "unprotected"}


def arms(family: str) -> list[tuple[str, dict[str, Any]]]:
    """(arm name, the run keys it adds) for one family, the no-DP arm first."""
    audit = {"leak-audit": True}
    private = {**audit, **MEASURED}
    if family == "fedproto":
        out = [("off", audit)]
        for mode in ("payload", "sample"):
            out += [(f"{mode}-eps{e:g}", {**private, "dp-mode": mode, "dp-target-epsilon": e})
                    for e in FEDPROTO_EPSILONS]
        return out
    if family == "glfc":  # GLFC evaluates on the server: no client evaluation to decide on
        return [("sigma0", audit)] + [(f"sigma{s:g}", {**audit, "dp-mode": "payload", "dp-noise-multiplier": s})
                                      for s in GLFC_SIGMAS]
    if family == "fccl":
        return [("off", audit)] + [(f"payload-eps{e:g}", {**private, "dp-mode": "payload", "dp-target-epsilon": e})
                                   for e in FCCL_EPSILONS]
    if family == "fccl-leak":
        sigma = fccl_leak_sigma()
        return [("off", audit), (f"sigma{sigma:g}", {**private, "dp-mode": "payload", "dp-noise-multiplier": sigma})]
    raise ValueError(family)


def fccl_leak_sigma() -> float:
    """σ of the full FCCL preset's ε-8 budget (its rounds, δ 1e-5, client-level replace-one), to 4 digits."""
    from pollen.privacy.accounting import calibrate_noise_multiplier

    rounds = int(preset("fccl-digits-offline")["num-server-rounds"])
    return round(calibrate_noise_multiplier(FCCL_LEAK_EPSILON, 1e-5, rounds, neighbour="replace-one"), 4)


def base_config(family: str) -> tuple[dict[str, Any], int]:
    """The family's run config without seed and paths, and its number of SuperNodes."""
    if family == "fedproto":
        return command_config(README_FEDPROTO)
    if family == "glfc":
        return {**preset("glfc-mnist-fmnist"), **GLFC_SHORT}, 10
    if family == "fccl":
        return preset("fccl-digits-offline"), 4
    if family == "fccl-leak":
        return {**preset("fccl-digits-offline"), **FCCL_LEAK_SHORT}, 4
    raise ValueError(family)


def setting(family: str, arm_keys: dict[str, Any]) -> dict[str, Any]:
    """What a result file must have been run with (a changed base refuses the old files). ``dp-evaluate =
    unprotected`` is left out: it is what every private run did before the key existed."""
    config, nodes = base_config(family)
    keys = {k: v for k, v in arm_keys.items() if k not in MEASURED}
    return {"run-config": {**config, **keys}, "num-supernodes": nodes}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()


CURVE_PREFIXES = ("leak-", "dp-epsilon")


def read_run(run_dir: Path) -> dict[str, Any]:
    """The figures the report needs: the final evaluation, the privacy block and per-round curves of the
    accuracy, ε and leak figures (means over clients, floors included)."""
    summary = read_summary(run_dir)
    rounds = read_metrics(run_dir)
    final = summary["final"]
    curves: dict[str, list] = {"round": [r["round"] for r in rounds]}
    keys = sorted({k for r in rounds for k in r.get("fit", {})
                   if k.startswith(CURVE_PREFIXES) and not k.endswith("-client-std")})
    for k in keys:
        curves[f"fit/{k}"] = [r.get("fit", {}).get(k) for r in rounds]
    ev_keys = sorted({k for r in rounds for k in {**r.get("evaluate", {}), **r.get("server-evaluate", {})}
                      if k in ("accuracy-client-mean", "proto-accuracy-client-mean", "inter-accuracy-client-mean",
                               "intra-accuracy-client-mean", "aia", "accuracy")})
    for k in ev_keys:
        curves[f"evaluate/{k}"] = [{**r.get("evaluate", {}), **r.get("server-evaluate", {})}.get(k) for r in rounds]
    return {"status": summary["status"], "rounds": summary["rounds"], "app-wall-time-s": summary["wall-time-s"],
            "rejected-total": summary["rejected-total"], "failures-total": summary["failures-total"],
            "evaluate": {**final.get("evaluate", {}), **final.get("server-evaluate", {})},
            "privacy": summary.get("privacy", {}), "curves": curves}


def run_one(family: str, arm: str, keys: dict[str, Any], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    config, nodes = base_config(family)
    out_dir = args.work_dir / "runs"
    run_config = {**config, **keys, "seed": seed, "data-root": args.data_root, "out-dir": str(out_dir)}
    load = os.getloadavg()[0]
    started = time.monotonic()
    outcome = simulate_run(f"{family} {arm} seed {seed}", flwr_home=args.work_dir / "flwr", num_supernodes=nodes,
                           run_config=run_config, timeout=6 * 3600, echo=False)
    wall = time.monotonic() - started
    return {"family": family, "arm": arm, "seed": seed, "setting": setting(family, keys), "commit": _commit(),
            "wall-s": round(wall, 1), "load-1min-at-start": round(load, 2),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **read_run(outcome.results_dir)}


# ---------------------------------------------------------------------------------------------
# the report

def _last(curve: list | None) -> float | None:
    vals = [v for v in (curve or []) if isinstance(v, (int, float))]
    return vals[-1] if vals else None


def _mean(curve: list | None) -> float | None:
    vals = [v for v in (curve or []) if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def _cell(records: list[dict], get, digits: int = 2, scale: float = 1.0) -> str:
    vals = [v * scale for v in (get(r) for r in records) if v is not None]
    return fmt_mean_sd(vals, digits) if vals else "—"


def _pct(key: str):
    return lambda r: r["evaluate"].get(key)


def _fit_mean(key: str):
    """A per-round fit figure averaged over the rounds that report it (one release each)."""
    return lambda r: _mean(r["curves"].get(f"fit/{key}"))


def _eps(r: dict) -> float | None:
    """The run's final ε as recorded, whatever its unit (payload prototypes: per row given the model)."""
    p = r["privacy"]
    return p.get("dp-epsilon-max") if p.get("dp-epsilon-max") is not None else p.get("dp-epsilon-row-given-model-max")


def _terms(r: dict) -> tuple[str, str]:
    """(dp-unit, dp-neighbour) of a run's ε: recorded since the runs name them; before, by family and mode,
    as Pollen accounted them then (a client's dataset under add/remove)."""
    p = r["privacy"]
    if "dp-unit" in p:
        return p["dp-unit"], p["dp-neighbour"]
    mode = r["setting"]["run-config"].get("dp-mode", "off")
    if mode == "off":
        return "—", "—"
    if r["family"] == "fedproto":
        return ("row-given-model" if mode == "payload" else "record"), "add-remove"
    return "client", "add-remove"


def _client_replace_one(r: dict) -> float | None:
    """A client-level run's ε under replace-one. Recorded by runs that name their neighbour; for runs made
    before, recomputed from the recorded plan: σ (given, or calibrated for the target under add/remove as
    then) and the number of releases n whose add/remove ε is the recorded one (checked to 1e-6), then the
    same releases under replace-one (the Gaussian of σ/2)."""
    from pollen.privacy.accounting import Release, calibrate_noise_multiplier, composed_epsilon

    unit, neighbour = _terms(r)
    if unit != "client":
        return None
    if neighbour == "replace-one":
        return r["privacy"].get("dp-epsilon-max")
    rc, recorded = r["setting"]["run-config"], r["privacy"]["dp-epsilon-max"]
    delta, rounds = float(rc.get("dp-delta", 1e-5)), int(rc["num-server-rounds"])
    sigma = float(rc.get("dp-noise-multiplier") or 0.0) or calibrate_noise_multiplier(
        float(rc["dp-target-epsilon"]), delta, rounds)
    for n in range(1, rounds + 1):
        if math.isclose(composed_epsilon([Release(sigma, 1.0, n, "client", "add-remove")], delta), recorded,
                        rel_tol=1e-6):
            return composed_epsilon([Release(sigma, 1.0, n, "client", "replace-one")], delta)
    return None


def _replace_one_cell(group: list[dict]) -> str:
    """The replace-one ε cell: as the runs recorded it, or marked ``(recomputed)`` for runs made before
    Pollen recorded a client's dataset as replaced (their σ and release count, :func:`_client_replace_one`)."""
    cell = _cell(group, _client_replace_one)
    old = any(_terms(r)[0] == "client" and "dp-unit" not in r["privacy"] for r in group)
    return f"{cell} (recomputed)" if old and cell != "—" else cell


def _commits(group: list[dict]) -> str:
    return ", ".join(sorted({r["commit"][:7] for r in group}))


# The leak figures each family reports: (curve key, name, +1 when higher means more leaked, -1 when lower
# does). Prototype and logit figures are per client (the round's mean over clients), GLFC's the server's.
LEAKS = {"fedproto": (("leak-hist-tv-client-mean", "histogram TV", -1),
                      ("leak-presence-f1-client-mean", "presence F1", +1)),
         "glfc": (("leak-psnr", "proxy PSNR dB", +1), ("leak-ssim", "proxy SSIM", +1),
                  ("leak-label-acc", "proxy label acc.", +1)),
         "fccl": (("leak-record-label-acc-client-mean", "record labels", +1),),
         "fccl-leak": (("leak-record-label-acc-client-mean", "record labels", +1),)}
CLEARLY = 2.0  # a leak is clear when the mean gain over the floor exceeds this many s.d. of one release's gain


def _floor_key(key: str) -> str:
    return key.replace("-client-mean", "-floor-client-mean") if key.endswith("-client-mean") else f"{key}-floor"


def release_gains(group: list[dict], key: str, sign: int) -> list[float]:
    """What each release gains over its floor (``sign`` × (score − floor)), pooled over the runs' rounds
    that report both: positive = the server learns more than without the release."""
    out = []
    for r in group:
        scores, floors = r["curves"].get(f"fit/{key}", []), r["curves"].get(f"fit/{_floor_key(key)}", [])
        out += [sign * (a - b) for a, b in zip(scores, floors)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a - b)]
    return out


def leak_verdict(gains: list[float]) -> str:
    """``clear leak`` when the mean gain over the floor exceeds CLEARLY s.d. of the per-release gains
    (seeds and rounds pooled; with no spread, any positive gain), ``at the floor`` within that band,
    ``below the floor`` under it."""
    if not gains:
        return "—"
    mean = sum(gains) / len(gains)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)) if len(gains) > 1 else 0.0
    if mean > CLEARLY * sd and mean > 0:
        return "clear leak"
    return "below the floor" if mean < -CLEARLY * sd else "at the floor"


def verdict_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for family in FAMILIES:
        for arm, group in _group(records, family).items():
            for key, name, sign in LEAKS[family]:
                gains = release_gains(group, key, sign)
                if not gains:
                    continue
                mean = sum(gains) / len(gains)
                sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)) if len(gains) > 1 else 0.0
                rows.append([family, arm, name, _cell(group, _fit_mean(key), 3),
                             _cell(group, _fit_mean(_floor_key(key)), 3), f"{mean:+.3f}", f"{sd:.3f}",
                             str(len(gains)), leak_verdict(gains), _seeds(group)])
    return rows


def _group(records: list[dict], family: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for arm, _ in arms(family):
        got = [r for r in records if r["family"] == family and r["arm"] == arm]
        if got:
            out[arm] = got
    return out


def _seeds(group: list[dict]) -> str:
    return ", ".join(str(r["seed"]) for r in sorted(group, key=lambda r: r["seed"]))


def _off_check(records: list[dict]) -> list[str]:
    """Does ``dp-mode = off`` (with the leak audit on) give the README's committed FedProto row, to every digit?"""
    readme = read_json(README_FEDPROTO)
    ours = [r for r in records if r["family"] == "fedproto" and r["arm"] == "off" and r["seed"] == 0]
    if not ours or readme is None:
        return []
    want = readme["summary"]["final"]["evaluate"]
    got = ours[0]["evaluate"]
    keys = ("accuracy-client-mean", "accuracy-client-std", "proto-accuracy-client-mean", "proto-accuracy-client-std")
    same = all(want.get(k) == got.get(k) for k in keys)
    shown = ", ".join(f"{k} {got.get(k)!r}" + ("" if want.get(k) == got.get(k) else f" (README row {want.get(k)!r})")
                      for k in keys)
    return [f"`dp-mode = off` with the leak audit on, seed 0, against the README's committed FedProto row "
            f"(`bench/results/readme_commands/fedproto.json`, commit {readme['commit']}): "
            f"**{'equal to every digit' if same else 'DIFFERENT'}** ({shown}).", ""]



FCCL_COLUMNS = ["unit", "neighbour", "ε spent", "ε replace-one", "inter AVG %", "intra AVG %", "record labels",
                "labels floor", "wall s", "seeds", "run at"]


def _fccl_row(label: str, group: list[dict]) -> list:
    """One FCCL cell's row under ``FCCL_COLUMNS``, after its arm's ``label``."""
    unit, neighbour = _terms(group[0])
    return [label, unit, neighbour, _cell(group, _eps), _replace_one_cell(group),
            _cell(group, _pct("inter-accuracy-client-mean"), scale=100),
            _cell(group, _pct("intra-accuracy-client-mean"), scale=100),
            _cell(group, _fit_mean("leak-record-label-acc-client-mean"), 3),
            _cell(group, _fit_mean("leak-record-label-acc-floor-client-mean"), 3),
            _cell(group, lambda r: r["wall-s"], 0), _seeds(group), _commits(group)]

def markdown(records: list[dict]) -> str:
    lines = ["# Privacy study: accuracy and measured leakage under differential privacy", "",
             "Written by `python -m bench.privacy` from `bench/results/privacy/*.json` (one file per run). Every run "
             "is a `flwr run` with `leak-audit = true`; `dp-clip` 1.0, `dp-delta` 1e-5. Figures are mean ± s.d. over "
             "the seeds listed (one seed: the value). *ε spent*: `summary.json`'s `privacy.dp-epsilon-max` (for "
             "payload prototypes `dp-epsilon-row-given-model-max`), the worst-off client's ε after the last round, "
             "for its *unit* and *neighbour* (docs/privacy.md: `record` and `client` figures are guarantees; "
             "`row-given-model` is one embedding row given a model trained without DP, no record- or client-level "
             "guarantee). *ε replace-one*: a client's dataset replaced by any other, as the run recorded it; "
             "*(recomputed)* marks runs made before Pollen recorded it, recomputed from the run's σ and releases "
             "(their add/remove ε, the figure then recorded, reproduced to 1e-6). *run at*: the commit each run "
             "ran at. Leak figures are per release (each round's mean over clients, averaged over the rounds), "
             "with the score of a server that guesses as well as it can without the release (*floor*); a release "
             "leaks what it gains over its floor. What each figure and floor means: "
             "[docs/privacy.md](../../docs/privacy.md#measured-leakage).", "",
             "Rows run at eb2b59a or 507789b predate the honest floors and the recorded neighbour (issue 40); they "
             "are kept where a rerun did not fit in this machine's time: FedProto's (its leak figures and floors "
             "are unchanged since, and payload rows are `row-given-model` / add-remove, sample rows `record` / "
             "add-remove, as runs record them now) and FCCL's 10-round accuracy runs (no record-label attack "
             "then: —; replace-one ε recomputed). GLFC was rerun with the new floors (seeds 0–1; its rows name the "
             "issue branch's commits before its rebase onto main: 1164127, 92e4594 and add6002 are be2eb3d, 904fac3 "
             "and 5b2d5cc on main). FCCL's record-label attack is measured by its own per-release arms (`fccl-leak`, "
             "the preset's first 2 rounds, at 7f5d20e and 30bb24e, whose pollen/ is the same).", ""]
    fp = _group(records, "fedproto")
    if fp:
        cfg, nodes = base_config("fedproto")
        lines += ["## FedProto, MNIST (the README's command)", "",
                  f"{nodes} clients, {cfg.get('num-server-rounds')} rounds, run config `"
                  + " ".join(f"{k}={v!r}" for k, v in cfg.items()) + "`; ε targets over all rounds "
                  "(`dp-target-epsilon`). `payload` protects one embedding row given the model, `sample` one "
                  "training record (DP-SGD plus the same prototype release).", ""]
        rows = []
        for arm, group in fp.items():
            mode, _, eps = arm.partition("-eps")
            unit, neighbour = _terms(group[0])
            rows.append([mode if mode != "off" else "off (no DP)", eps or "∞", unit, neighbour,
                         _cell(group, _eps),
                         _cell(group, _pct("accuracy-client-mean"), scale=100),
                         _cell(group, _pct("proto-accuracy-client-mean"), scale=100),
                         _cell(group, _fit_mean("leak-hist-tv-client-mean"), 3),
                         _cell(group, _fit_mean("leak-hist-tv-floor-client-mean"), 3),
                         _cell(group, _fit_mean("leak-presence-f1-client-mean"), 3),
                         _cell(group, _fit_mean("leak-presence-f1-floor-client-mean"), 3),
                         _cell(group, lambda r: r["wall-s"], 0), _seeds(group), _commits(group)])
        lines += table(["dp-mode", "target ε", "unit", "neighbour", "ε spent", "local acc. %", "proto acc. %",
                        "histogram TV", "TV floor", "presence F1", "F1 floor", "wall s", "seeds", "run at"], rows)
        lines += ["", *_off_check(records)]
    gl = _group(records, "glfc")
    if gl:
        cfg, nodes = base_config("glfc")
        lines += ["## GLFC, MNIST + Fashion-MNIST (the preset, shortened)", "",
                  f"`conf/glfc-mnist-fmnist.toml` with {GLFC_SHORT} ({nodes} SuperNodes): one task transition, so the "
                  "proxy inverts the new task's gradients. σ is `dp-noise-multiplier` under `payload` (0: `dp-mode = "
                  "off`); the model update and each gradient set are clipped to 1 and get noise σ·√(1 + K). Proxy "
                  "figures are the server's, averaged over the rounds that carried gradient sets.", ""]
        rows = []
        for arm, group in gl.items():
            unit, neighbour = _terms(group[0])
            rows.append([arm.removeprefix("sigma"), unit, neighbour, _cell(group, _eps),
                         _replace_one_cell(group),
                         _cell(group, lambda r: r["evaluate"].get("aia"), 3),
                         _cell(group, lambda r: r["evaluate"].get("forgetting"), 3),
                         _cell(group, _fit_mean("leak-psnr"), 1), _cell(group, _fit_mean("leak-psnr-floor"), 1),
                         _cell(group, _fit_mean("leak-ssim"), 3), _cell(group, _fit_mean("leak-ssim-floor"), 3),
                         _cell(group, _fit_mean("leak-label-acc"), 3),
                         _cell(group, _fit_mean("leak-label-acc-floor"), 3),
                         _cell(group, lambda r: r["wall-s"], 0), _seeds(group), _commits(group)])
        lines += table(["σ", "unit", "neighbour", "ε spent", "ε replace-one", "AIA", "forgetting", "proxy PSNR dB",
                        "PSNR floor", "SSIM", "SSIM floor",
                        "label acc.", "label floor", "wall s", "seeds", "run at"], rows)
        lines += [""]
    fc = _group(records, "fccl")
    if fc:
        lines += ["## FCCL, offline Digits (the preset)", "",
                  "`conf/fccl-digits-offline.toml` (4 clients, one domain each, 10 rounds); each public-sample logit "
                  "row clipped to 1, noise σ·√N0 (N0 = 1,000 public samples). *Record labels*: the share of a "
                  "client's training records whose label a server reads through a ridge surrogate of the client's "
                  "model fitted on the public set and its released logits; floor: the client's most frequent "
                  "label's share. Runs before the attack existed show —.", ""]
        rows = [_fccl_row(arm.removeprefix("payload-eps") if arm != "off" else "∞ (off)", group)
                for arm, group in fc.items()]
        lines += table(["target ε", *FCCL_COLUMNS], rows)
        lines += [""]
    fl = _group(records, "fccl-leak")
    if fl:
        lines += ["## FCCL's logit leak per release (the preset, 2 rounds)", "",
                  "`conf/fccl-digits-offline.toml` with "
                  + ", ".join(f"`{k} = {v}`" for k, v in FCCL_LEAK_SHORT.items())
                  + " (a full run takes 40 min to hours on this machine): "
                  f"without DP, and at σ {fccl_leak_sigma():g}, the σ of the full 10-round preset's ε-"
                  f"{FCCL_LEAK_EPSILON:g} budget (client-level, replace-one), so that each release carries the noise "
                  "it carries in a full ε-8 run; ε spent is that of these 2 releases. Accuracies are after 2 rounds.",
                  ""]
        rows = [_fccl_row(arm.removeprefix("sigma") if arm != "off" else "0 (off)", group) for arm, group in fl.items()]
        lines += table(["σ", *FCCL_COLUMNS], rows)
        lines += [""]
    verdicts = verdict_rows(records)
    if verdicts:
        lines += ["## Leak against floor, per release", "",
                  "*Gain*: a release's score minus its floor (for TV, floor minus score), averaged over every "
                  "release of the cell (rounds × seeds; prototype and logit figures are the round's mean over "
                  "clients); *s.d.*: the spread of one release's gain. A *clear leak*: the mean gain exceeds "
                  f"{CLEARLY:g} s.d. (no spread: any positive gain); *at the floor*: within ±{CLEARLY:g} s.d.; "
                  "*below the floor*: under it.", ""]
        lines += table(["family", "arm", "leak figure", "score", "floor", "gain", "s.d.", "releases", "verdict",
                        "seeds"], verdicts)
        lines += [""]
    missing = [f"{f} {a}" for f in FAMILIES for a, _ in arms(f) if not _group(records, f).get(a)]
    if missing:
        lines += ["## Not run yet", "", "No result file for: " + ", ".join(missing) + ".", ""]
    lines += ["Runs: " + "; ".join(f"{r['family']} {r['arm']} seed {r['seed']} at {r['commit']} "
                                   f"({r['wall-s']:.0f} s, load {r['load-1min-at-start']})"
                                   for r in sorted(records, key=lambda r: r['finished'])) + ".", ""]
    return "\n".join(lines)


INF_X = 16.0  # where ε = ∞ (no DP) is drawn on the plots' log axis


def fedproto_points(records: list[dict], mode: str, get) -> list[tuple[float, float]]:
    """(target ε, mean over seeds of ``get(run)``) for one DP mode's FedProto arms plus the no-DP arm."""
    pts = []
    for arm, group in _group(records, "fedproto").items():
        m, _, eps = arm.partition("-eps")
        vals = [v for v in map(get, group) if v is not None]
        if m in (mode, "off") and vals:
            pts.append((float(eps) if eps else INF_X, sum(vals) / len(vals)))
    return sorted(pts)


def plot(records: list[dict]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    for mode, marker in (("payload", "o"), ("sample", "s")):
        for key, style in (("accuracy-client-mean", "-"), ("proto-accuracy-client-mean", "--")):
            pts = fedproto_points(records, mode,
                                  lambda r, k=key: 100 * r["evaluate"][k] if k in r["evaluate"] else None)
            if pts:
                ax.plot(*zip(*pts), style, marker=marker,
                        label=f"{mode}, {'local' if key.startswith('accuracy') else 'proto'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε over 100 rounds (rightmost: no DP)")
    ax.set_ylabel("test accuracy %")
    ax.set_title("FedProto MNIST: accuracy")
    ax.legend(fontsize=8)
    ax = axes[1]
    for mode, marker in (("payload", "o"), ("sample", "s")):
        pts = fedproto_points(records, mode, _fit_mean("leak-hist-tv-client-mean"))
        if pts:
            ax.plot(*zip(*pts), "-", marker=marker, label=f"{mode}: histogram TV")
    floor = fedproto_points(records, "payload", _fit_mean("leak-hist-tv-floor-client-mean"))
    if floor:
        ax.axhline(sum(y for _, y in floor) / len(floor), color="grey", ls=":", label="floor (uniform guess)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε (rightmost: no DP)")
    ax.set_ylabel("TV distance, per release (lower = more leaked)")
    ax.set_title("FedProto: label histogram from counts")
    ax.legend(fontsize=8)
    ax = axes[2]
    pts, aia = [], []
    for arm, group in _group(records, "glfc").items():
        s = float(arm.removeprefix("sigma"))
        ps = [v for v in map(_fit_mean("leak-psnr"), group) if v is not None]
        if ps:
            pts.append((s, sum(ps) / len(ps)))
        aia.append((s, sum(r["evaluate"].get("aia", math.nan) for r in group) / len(group)))
    floors = [(float(arm.removeprefix("sigma")), v) for arm, group in _group(records, "glfc").items()
              for v in map(_fit_mean("leak-psnr-floor"), group) if v is not None]
    if pts:
        ax.plot(*zip(*sorted(pts)), "-o", label="proxy PSNR (dB)")
        if floors:
            ax.axhline(sum(v for _, v in floors) / len(floors), color="grey", ls=":", label="floor (class mean)")
        ax.set_ylabel("PSNR dB")
        twin = ax.twinx()
        twin.plot(*zip(*sorted(aia)), "--s", color="C1", label="AIA")
        twin.set_ylabel("AIA")
        twin.legend(loc="upper center", fontsize=8)
    ax.set_xlabel("noise multiplier σ")
    ax.set_title("GLFC: gradient inversion vs noise")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    fccl = _group(records, "fccl")
    for key, style in (("inter-accuracy-client-mean", "-o"), ("intra-accuracy-client-mean", "--s")):
        pts = sorted((INF_X if arm == "off" else float(arm.removeprefix("payload-eps")),
                      100 * sum(r["evaluate"][key] for r in group) / len(group)) for arm, group in fccl.items())
        if pts:
            ax.plot(*zip(*pts), style, label=key.split("-")[0] + " AVG")
    leak = sorted((INF_X if arm == "off" else float(arm.removeprefix("payload-eps")), v)
                  for arm, group in fccl.items()
                  for v in [_mean([_fit_mean("leak-record-label-acc-client-mean")(r) for r in group])] if v is not None)
    if leak:
        twin = ax.twinx()
        twin.plot(*zip(*leak), ":^", color="C3", label="record labels read")
        twin.set_ylabel("share of record labels read")
        twin.legend(loc="lower center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε over 10 rounds (rightmost: no DP)")
    ax.set_ylabel("test accuracy %")
    ax.set_title("FCCL offline Digits: payload")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, REPORT_PNG, 110)


def report(files: RunFiles) -> None:
    records = files.load()
    write_atomic(REPORT_MD, markdown(records))
    write_json(REPORT_JSON, {"runs": [{k: v for k, v in r.items() if k != "curves"} for r in records]})
    if records:
        plot(records)
    print(f"[privacy] {len(records)} run(s) -> {REPORT_MD.relative_to(ROOT)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=default_data_root())
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms (e.g. off payload-eps8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pollen-bench-privacy"),
                        help="FLWR_HOME and the runs' own output folders")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the result files")
    args = parser.parse_args(argv)
    args.data_root = str(Path(args.data_root).resolve())
    files = RunFiles(FOLDER)
    FOLDER.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(files)
        return 0
    plan = {f"{family}-{arm}": (family, arm, keys) for family in args.family for arm, keys in arms(family)
            if not args.arms or arm in args.arms}
    return run_study("privacy", files, [(name, seed) for seed in args.seeds for name in plan],
                     lambda name: setting(plan[name][0], plan[name][2]),
                     lambda name, seed: run_one(*plan[name], seed, args),
                     said=lambda record: f"{record['wall-s']:.0f} s, ε spent "
                                         f"{record['privacy'].get('dp-epsilon-max', '∞')}",
                     report=lambda: report(files))


if __name__ == "__main__":
    sys.exit(main())
