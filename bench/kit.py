"""The study kit: the one copy of what every benchmark and study under ``bench/`` shares.

How a mean ± standard error is printed, when a paired difference counts as *shown*, how a finished run
is recorded so that a stopped study resumes, and how a table or a seed band is drawn are written here
once, so that two reports can never disagree on how a number or a verdict was made.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import statistics
import tempfile
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
CONF = ROOT / "conf"

# the verdicts a paired difference can get (README and docs/evidence.md quote them); no "|" in them,
# which would split a Markdown table cell
SUPPORTED, CONTRADICTED = "supported", "contradicted"
NOT_SHOWN_FEW = "not shown (fewer than 2 paired seeds)"
NOT_SHOWN_ZERO = "not shown (Δ = 0)"
NOT_SHOWN_SMALL = "not shown (within 2 s.e.)"


def default_data_root() -> str:
    """``POLLEN_DATA_ROOT``, else the shared data folder beside the checkout, where the studies ran."""
    return os.environ.get("POLLEN_DATA_ROOT", str(ROOT.parent / "shared" / "data"))


# ---------------------------------------------------------------------------------------------
# statistics over seeds

def mean_sd(vals: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n − 1); no s.d. from a single value."""
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def pop_sd(vals: Sequence[float]) -> float | None:
    """Population standard deviation (n): the spread of the values themselves, e.g. an accuracy over its last
    rounds or a mean over a fixed set of seeds, where no population is estimated; none for no values."""
    if not vals:
        return None
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))


def mean_se(vals: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample s.d. / √n); no s.e. from a single value."""
    m, sd = mean_sd(vals)
    return m, (None if sd is None else sd / math.sqrt(len(vals)))


def _fmt(vals: Sequence[float], digits: int, signed: bool, spread: Callable, single: str) -> str:
    if not vals:
        return "–"
    m, s = spread(vals)
    head = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return head + single if s is None else f"{head} ± {s:.{digits}f}"


def fmt_mean_sd(vals: Sequence[float], digits: int = 2) -> str:
    """``mean ± s.d.`` over seeds (the spread of a quantity), ``–`` when there is none."""
    return _fmt(vals, digits, False, mean_sd, "")


def fmt_mean_se(vals: Sequence[float], digits: int = 2) -> str:
    """``mean ± s.e.`` over seeds (how well the mean is known), ``–`` when there is none."""
    return _fmt(vals, digits, False, mean_se, "")


def fmt_paired(diffs: Sequence[float], digits: int = 2) -> str:
    """A paired difference as ``+mean ± s.e.``; a single seed says so instead of showing no error."""
    return _fmt(diffs, digits, True, mean_se, " (1 seed)")


def verdict(diffs: Sequence[float], lower_is_better: bool = False) -> str:
    """The one rule that turns paired differences (arm − baseline, one per seed) into a verdict on a claim.

    A claim is *supported* when the mean difference lies at least two standard errors on the claimed
    side of zero and *contradicted* at two on the other side; anything else is *not shown*. Boundaries,
    decided here once: exactly 2 s.e. counts as shown; a mean of exactly 0 is never shown (it is on no
    side), whatever the s.e.; with s.e. = 0 and a mean ≠ 0 (every seed agrees exactly) the sign decides;
    fewer than two paired seeds have no s.e. and never decide. ``lower_is_better`` is for metrics such
    as forgetting or a std, where the claim is a drop.
    """
    if len(diffs) < 2:
        return NOT_SHOWN_FEW
    m, se = mean_se(diffs)
    gain = -m if lower_is_better else m
    if gain == 0:
        return NOT_SHOWN_ZERO
    if abs(gain) >= 2 * se:
        return SUPPORTED if gain > 0 else CONTRADICTED
    return NOT_SHOWN_SMALL


def emphasis(v: str) -> str:
    """A verdict in bold when it decides (the tables that mix verdicts with numbers)."""
    return f"**{v}**" if v in (SUPPORTED, CONTRADICTED) else v


# ---------------------------------------------------------------------------------------------
# results on disk: atomic writes, a locked shared ledger, one file per finished run

def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: a study killed mid-write leaves the old file, never half a one
    (the checkpoints' writer)."""
    from pollen.app.checkpoints import atomic_write

    atomic_write(Path(path), text.encode())


def write_json(path: Path, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


def read_json(path: Path, default: Any = None) -> Any:
    """The file's JSON, or ``default`` when it does not exist yet (a study's first run)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else default


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock per results file, so two study processes never interleave their writes. The lock
    file lives in the temp folder, never in the repository."""
    tag = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"pollen-bench-{tag}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def append_entry(path: Path, entry: dict, key: Callable[[dict], Any], header: Mapping[str, Any]) -> bool:
    """Add one finished run to a results file shared by parallel workers: under its lock, written atomically,
    ``header`` filled in on the first run. False when a run with the same ``key`` is there: the first stays."""
    with locked(path):
        results = read_json(path, {"runs": []})
        for k, v in header.items():
            results.setdefault(k, v)
        if any(key(e) == key(entry) for e in results["runs"]):
            return False
        results["runs"].append(entry)
        write_json(path, results)
        return True


def check_setting(path: Path, setting: Mapping[str, Any]) -> None:
    """Refuse to add runs of another setting to a results file: one report never mixes two settings."""
    have = (read_json(path) or {}).get("setting")
    if have is not None and have != setting:
        diff = {k: (have.get(k), v) for k, v in setting.items() if have.get(k) != v}
        raise SystemExit(f"{path} holds runs of another setting (file vs now: {diff}); "
                         "use --results for a separate file")


class RunFiles:
    """One JSON file per finished run, ``<arm>-seed<k>.json`` in ``folder``: a study stopped anywhere
    resumes by skipping the runs whose file exists, and a file made with another setting is refused
    rather than mixed into the report."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, arm: str, seed: int) -> Path:
        return self.folder / f"{arm}-seed{seed}.json"

    def finished(self, arm: str, seed: int, setting: Mapping[str, Any]) -> bool:
        path = self.path(arm, seed)
        if not path.exists():
            return False
        have = json.loads(path.read_text())["setting"]
        if have != setting:
            raise SystemExit(f"{path} was run with another setting ({have}); move it away or run with that setting")
        return True

    def todo(self, cells: Iterable[tuple[str, int]], setting: Mapping[str, Any]) -> list[tuple[str, int]]:
        """The (arm, seed) cells still to run, in the order given."""
        return [(arm, seed) for arm, seed in cells if not self.finished(arm, seed, setting)]

    def save(self, arm: str, seed: int, record: dict) -> None:
        write_json(self.path(arm, seed), record)

    def load(self, setting: Mapping[str, Any] | None = None) -> list[dict]:
        """Every finished run (of ``setting`` when given), in file-name order."""
        records = [json.loads(p.read_text()) for p in sorted(self.folder.glob("*-seed*.json"))]
        return records if setting is None else [r for r in records if r["setting"] == setting]


# ---------------------------------------------------------------------------------------------
# the study loop: one run per (arm, seed) cell, each through the launcher, each kept as it finishes

def simulate_run(label: str, **options: Any):
    """One run through :func:`pollen.launch.simulate` (``options`` are its keyword arguments); a run that did
    not complete stops the study, naming ``label``, the reason and the end of the run's log."""
    from pollen.launch import simulate

    outcome = simulate(**options)
    if not outcome.completed:
        raise SystemExit(f"{label}: run {outcome.run_id} ended {outcome.status}: {outcome.failure_reason}\n"
                         f"{outcome.log[-3000:]}")
    return outcome


def run_study(label: str, files: RunFiles, cells: Iterable[tuple[str, int]],
              setting: Mapping[str, Any] | Callable[[str], Mapping[str, Any]], run: Callable[[str, int], dict], *,
              said: Callable[[dict], str] | None = None, report: Callable[[], None] | None = None,
              dry_run: bool = False) -> int:
    """Run every (arm, seed) cell that ``files`` does not hold yet with ``run(arm, seed)`` → its record, save
    each record as soon as it exists (a study stopped anywhere resumes where it stopped), say
    ``said(record)`` and rewrite the report after each run and once at the end. ``setting`` is the study's
    setting, or a function of the arm for studies whose arms differ in setting. Returns the exit code."""
    setting_of = setting if callable(setting) else (lambda _arm: setting)
    todo = [(arm, seed) for arm, seed in cells if not files.finished(arm, seed, setting_of(arm))]
    print(f"[{label}] {len(todo)} runs to do: " + ", ".join(f"{arm}/{seed}" for arm, seed in todo), flush=True)
    if dry_run:
        return 0
    for arm, seed in todo:
        if files.finished(arm, seed, setting_of(arm)):  # another worker (other seeds) finished it meanwhile
            continue
        print(f"[{label}] start {arm} seed {seed}", flush=True)
        record = run(arm, seed)
        files.save(arm, seed, record)
        if said is not None:
            print(f"[{label}] {arm} seed {seed}: {said(record)}", flush=True)
        if report is not None:
            report()
    if report is not None:
        report()
    return 0


# ---------------------------------------------------------------------------------------------
# run folders and presets

def run_folders(out_dir: Path) -> list[Path]:
    """The run folders under a results root (each with its ``metrics.jsonl``), oldest first; links such as
    the launcher's ``latest`` are left out, so each run counts once."""
    runs = [p.parent for p in Path(out_dir).glob("*/metrics.jsonl") if not p.parent.is_symlink()]
    return sorted(runs, key=lambda r: ((r / "metrics.jsonl").stat().st_mtime, r.name))


def read_metrics(run_dir: Path) -> list[dict]:
    """A Pollen run folder's ``metrics.jsonl``: one record per round, as the ServerApp wrote it."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict:
    """A Pollen run folder's ``summary.json`` (status, final metrics, totals)."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def preset(name: str) -> dict[str, Any]:
    """The run keys of ``conf/<name>.toml``: a study starts from the preset of the experiment it reproduces
    and overrides only what it varies (seed, output, the arm)."""
    with open(CONF / f"{name}.toml", "rb") as fh:
        return tomllib.load(fh)


# ---------------------------------------------------------------------------------------------
# Markdown and plots

def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table's lines: header, rule, one line per row (each cell as ``str``)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def pyplot():
    """matplotlib's pyplot on the Agg backend: studies write PNGs, often on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def seed_band(curves: Sequence[Sequence[float]]) -> tuple[list[int], list[float], list[float]]:
    """Per-round curves of several seeds as rounds 1…n (n: the shortest curve), their mean and their s.d.
    over seeds (0 for a single seed)."""
    n = min(len(c) for c in curves)
    mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
    sd = [statistics.stdev(c[i] for c in curves) if len(curves) > 1 else 0.0 for i in range(n)]
    return list(range(1, n + 1)), mean, sd


def plot_band(ax, xs: Sequence[float], mean: Sequence[float], sd: Sequence[float], *, alpha: float = 0.15,
              band: Mapping[str, Any] | None = None, **style):
    """A mean curve with a ± s.d. band in the curve's colour; returns the line."""
    (line,) = ax.plot(xs, mean, **style)
    ax.fill_between(xs, [m - s for m, s in zip(mean, sd, strict=True)], [m + s for m, s in zip(mean, sd, strict=True)],
                    color=line.get_color(), alpha=alpha, **(band or {}))
    return line
