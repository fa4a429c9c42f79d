"""Every run key's range and one line of help: the source of ``docs/usage.md`` and of validation.

:func:`check` is the one type-and-range check of every run key (common and method keys alike); the
config and the method families add only checks that involve several keys or the data. Each key is
declared once, as a :class:`Key` (default, range, help): the common keys here, a method family's keys
in its module (``PROTO_KEYS``, ``LOGIT_KEYS``, ``GLFC_KEYS``, derived from the typed settings classes of
:mod:`pollen.methods`). ``docs/gen_usage.py`` writes the page
from them, and
``tests/test_usage_doc.py`` fails when a run key has no entry here, when an entry names a key that no
longer exists, or when a value outside a documented range is accepted.

Range notation: ``int >= 1``, ``int in [1, 256]``, ``float > 0``, ``float >= 0``, ``float in [0, 1]``,
``float in (0, 1]``, ``float in [0, 1)``, ``bool``, ``string``, ``path``, or ``choice`` (the key's
declaration then names its allowed values, ``choices=``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from pollen.app.errors import ConfigError
from pollen.methods.settings import Choices
from pollen.privacy.config import MODES as DP_MODES
from pollen.protocol.screening import PayloadBounds
from pollen.strategies.aggregation import AGGREGATIONS, DEFAULT_TRIM_FRACTION
from pollen.strategies.weights import WEIGHTINGS

_BOUNDS = PayloadBounds()  # the payload bounds' defaults are declared once, there

# Common keys in the order of the page's sections; method keys are grouped by family automatically.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Run", ("method", "task", "profile", "num-server-rounds", "seed", "device", "torch-threads")),
    ("Paths", ("data-root", "download", "out-dir", "run-name", "resume-from")),
    ("Sampling and failures", ("fraction-fit", "fraction-evaluate", "min-available-clients", "max-empty-rounds",
                                "sample-by-partition")),
    ("Model and local training", ("model", "model-width", "local-epochs", "batch-size", "lr", "momentum",
                                  "weight-decay", "max-train-samples")),
    ("Tasks", ("dirichlet-alpha", "shot-ways", "shot-shots", "shot-stdev", "shot-test-per-class", "shot-split")),
    ("Your own data (tasks image-folder, array; see docs/data.md)",
     ("data-dir", "classes", "test-fraction", "image-size", "image-channels", "image-mean", "image-std",
      "data-split")),
    ("Weight averaging (fedavg, fedprox)", ("avg-weighting", "fedprox-mu")),
    ("Checkpoints", ("checkpoint-every", "checkpoint-keep")),
    ("Hostile nodes (docs/strategies.md)", ("aggregation", "trim-fraction", "max-update-norm", "max-logit-abs",
                                            "max-grad-norm", "partition-pins")),
    ("Differential privacy (docs/privacy.md)", ("dp-mode", "dp-clip", "dp-noise-multiplier", "dp-target-epsilon",
                                                "dp-delta", "dp-max-epsilon", "leak-audit")),
)

class Key(NamedTuple):
    """One run key, declared once: its default, its range (the notation above; :func:`check` enforces
    it), one line of help for ``docs/usage.md`` and, for a ``choice`` key, its allowed values (a
    sequence, or a function for a registry that is filled later). Method keys are declared by their
    family module (:func:`pollen.methods.settings.setting`)."""

    default: Any
    range: str
    help: str
    choices: Choices | None = None


def _methods() -> list[str]:
    from pollen.app.method_spec import METHODS

    return sorted(METHODS)


def _tasks() -> list[str]:
    from pollen.datasets.tasks import TASKS

    return sorted(TASKS)


def _models() -> list[str]:
    from pollen.models.catalog import MODEL_NAMES  # the names without torch (the launcher checks this key)

    return ["", *MODEL_NAMES]


def _data_splits() -> tuple[str, ...]:
    from pollen.datasets.user_tasks import DATA_SPLITS

    return DATA_SPLITS


# Every common run key: default, range, one line of help. pyproject.toml repeats the defaults (a test
# keeps them equal).
COMMON: dict[str, Key] = {
    "method": Key("fedavg", "choice", "federated method (see the methods table of README.md)",
                  choices=_methods),
    "task": Key("uci-dirichlet", "choice", "dataset, partition and default model (see docs/data.md)",
                choices=_tasks),
    "profile": Key("quick", "choice",
        "`quick` = CPU-sized models (width 0.25 for large backbones), `paper` = the paper's sizes",
        choices=("quick", "paper")),
    "num-server-rounds": Key(10, "int in [1, 1000000]", "federated rounds"),
    "seed": Key(0, "int in [0, 4294967295]", "seeds data splits, model init, client sampling and every client's RNG"),
    "data-root": Key("", "path", "dataset root (absolute); empty = `$POLLEN_DATA_ROOT`"),
    "download": Key(False, "bool", "let torchvision download missing datasets (needs internet)"),
    "out-dir": Key("", "path", "results root; empty = `$POLLEN_OUT_DIR`, else `./pollen-runs` of the SuperLink"),
    "fraction-fit": Key(1.0, "float in (0, 1]", "fraction of connected clients trained per round"),
    "fraction-evaluate": Key(1.0, "float in [0, 1]", "fraction of connected clients evaluated per round"),
    "min-available-clients": Key(2, "int in [1, 1000000]", "clients the server waits for before a round"),
    "device": Key("auto", "choice", "`auto` = CUDA when present, else CPU", choices=("auto", "cpu", "cuda")),
    "torch-threads": Key(1, "int in [1, 256]", "torch threads per client (1 is fastest when clients share cores)"),
    "model": Key("", "choice", "architecture override; empty = the task's default", choices=_models),
    "model-width": Key(0.0, "float in [0, 16]", "width multiplier; 0 = the profile's"),
    "local-epochs": Key(1, "int in [1, 10000]", "local epochs per round"),
    "batch-size": Key(32, "int in [1, 1000000]", "local batch size"),
    "lr": Key(0.05, "float in (0, 10]", "local SGD learning rate"),
    "momentum": Key(0.5, "float in [0, 1]", "local SGD momentum"),
    "weight-decay": Key(0.0, "float in [0, 10]", "local SGD weight decay"),
    "max-train-samples": Key(0, "int in [0, 1000000000]", "cap on each client's training set; 0 = no cap"),
    "dirichlet-alpha": Key(0.5, "float in (0, 1000000]",
        "label skew of the `*-dirichlet` tasks (smaller = more skewed)"),
    "shot-ways": Key(3, "int in [1, 100000]", "N of the N-way K-shot tasks: mean classes per client"),
    "shot-shots": Key(100, "int in [1, 1000000]", "K: mean training samples per class and client"),
    "shot-stdev": Key(2, "int in [0, 1000000]", "spread of N and K across clients (`shot-shots - shot-stdev >= 1`)"),
    "shot-test-per-class": Key(40, "int in [1, 1000000]", "test samples per own class and client"),
    "shot-split": Key("pollen", "choice", "`pollen` = Pollen's seeded split, `official` = FedProto's code's own draw",
                      choices=("pollen", "official")),
    "data-dir": Key("", "path",
        "folder with your own data (tasks `image-folder`, `array`); a node's own folder may override it"),
    "classes": Key("", "string", "the agreed class names, comma-separated or a file with one per line"),
    "test-fraction": Key(0.2, "float in [0, 0.9]", "share of each client's own data held out for testing"),
    "image-size": Key(0, "int in [0, 4096]", "input side in pixels; 0 = detect from the data"),
    "image-channels": Key(0, "int in [0, 3]", "input channels: 0 = detect, 1 = grey, 3 = RGB (2 is refused)"),
    "image-mean": Key("", "string", "normalisation mean, 1 or 3 comma-separated numbers; empty = computed"),
    "image-std": Key("", "string", "normalisation std, 1 or 3 comma-separated numbers > 0; empty = computed"),
    "data-split": Key("iid", "choice", "how the data is split across clients", choices=_data_splits),
    "avg-weighting": Key("samples", "choice", "FedAvg/FedProx weights clients by training samples or equally",
                         choices=WEIGHTINGS),
    "fedprox-mu": Key(0.01, "float in [0, 10000]", "FedProx proximal coefficient mu (mu/2·‖w − w_global‖²)"),
    "max-empty-rounds": Key(0, "int in [0, 1000000]",
        "rounds allowed to train nobody (every reply failed or rejected) before the run fails"),
    "sample-by-partition": Key(True, "bool",
        "ask each node its partition once and sample by partition, so one seed samples the same clients in every run "
        "(simulation: the engine's assignment, no query, checked against each node's replies, every node asked "
        "if one contradicts it; a deployment: one query per node before the first sampled round); false = by node id"),
    "checkpoint-every": Key(1, "int in [0, 1000000]", "write a server checkpoint every N rounds; 0 = never"),
    "checkpoint-keep": Key(2, "int in [1, 1000000]", "checkpoints kept (the newest)"),
    "resume-from": Key("", "path", "a run folder to continue from its last valid checkpoint (same config)"),
    "aggregation": Key("mean", "choice",
        "how accepted client values combine: `mean` (the method's weighted mean), or coordinate-wise and "
        "unweighted `median` / `trimmed-mean`, which a minority of hostile clients cannot drag far",
        choices=AGGREGATIONS),
    "trim-fraction": Key(DEFAULT_TRIM_FRACTION, "float in [0, 0.5)",
        "`trimmed-mean`: share of the smallest and of the largest client values dropped at each coordinate"),
    "max-update-norm": Key(_BOUNDS.max_update_norm, "float in (0, 1000000000000]",
        "weights, GLFC and homogeneous-logit models: a reply moving further than this × the broadcast model's "
        "norm (at least 1) is refused"),
    "max-logit-abs": Key(_BOUNDS.max_logit_abs, "float in (0, 1000000000000]",
        "logit methods: a reply with a logit beyond ± this is refused"),
    "max-grad-norm": Key(_BOUNDS.max_grad_norm, "float in (0, 1000000000000]",
        "GLFC: a prototype-gradient set with an L2 norm above this is refused before the proxy sees it"),
    "partition-pins": Key("", "string",
        "operator-pinned partitions, `partition:node-id` comma-separated (e.g. `0:4312,1:9876`): a pinned "
        "partition is served by that node only; empty = none (two nodes claiming one partition quarantine it)"),
    "run-name": Key("", "string",
        "the run folder's name under `out-dir`; the launcher sets `YYYYMMDD-HHMMSS-<method>-<task>`; "
        "empty = the run id"),
    "dp-mode": Key("off", "choice",
        "`payload` = clip and noise what each client releases (unit: a row of the release, see docs/privacy.md), "
        "`sample` = DP-SGD (unit: one record), `off` = no noise", choices=DP_MODES),
    "dp-clip": Key(1.0, "float in (0, 1000000]", "L2 clip of what a release depends on (an embedding, a model update)"),
    "dp-noise-multiplier": Key(0.0, "float in [0, 1000000]",
        "σ: noise std over the release's L2 sensitivity; 0 = calibrate it from `dp-target-epsilon`"),
    "dp-target-epsilon": Key(0.0, "float in [0, 1000]",
        "ε each client may spend over `num-server-rounds` releases (σ calibrated before round 1); 0 = use σ"),
    "dp-delta": Key(1e-5, "float in (0, 0.1]", "δ of every client's (ε, δ) guarantee"),
    "dp-max-epsilon": Key(0.0, "float in [0, 1000000]",
        "a client stops releasing before its ε would pass this (its replies become errors); 0 = no cap"),
    "leak-audit": Key(False, "bool",
        "simulations: each round reports what the server could learn from the clients' releases, against the "
        "truth (`leak-*` metrics, docs/privacy.md; GLFC clients send their true images for it); the figures "
        "themselves reveal the clients' data"),
}

# Keys that may differ between an interrupted run and its resumption: where things are and how fast,
# never what is computed. Any other changed key is refused, by the launcher before anything starts.
RESUMABLE_CHANGES = frozenset({"resume-from", "out-dir", "run-name", "num-server-rounds", "data-root", "device",
                               "torch-threads"})


def keys() -> dict[str, Key]:
    """Every run key: the common ones, then each registered method family's."""
    from pollen.app.method_spec import METHODS

    out = dict(COMMON)
    for spec in METHODS.values():
        out.update(spec.keys)
    return out

FAMILY_TITLES = {
    "prototypes": "Prototype methods",
    "logits": "Logit methods",
    "glfc": "Class-incremental methods",
}


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a ``choice`` key, as its declaration names them."""
    spec = keys()[key]
    if spec.choices is None:
        raise KeyError(f"{key!r} is not a choice key")
    found = spec.choices() if callable(spec.choices) else spec.choices
    return tuple(found)


def all_defaults() -> dict[str, object]:
    """Every run key the code knows, with its default: the common ones, then each family's."""
    return {key: spec.default for key, spec in keys().items()}


def range_text(key: str) -> str:
    """The range of ``key`` as shown in the docs (choices spelled out)."""
    kind = keys()[key].range
    if kind != "choice":
        return kind
    return " \\| ".join(f"`{v!r}`" if v else '`""`' for v in choices(key)).replace("'", '"')


# --- the one validator ----------------------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class Range:
    """A parsed range: ``kind`` is int, float, bool, string, path or choice; bounds for numbers."""

    kind: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def expected(self) -> str:
        """How an error message names the range: ``an integer >= 1``, ``a number in (0, 1]``."""
        noun = "an integer" if self.kind == "int" else "a number"
        low = _plain(self.low)
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {low}"
        return (f"{noun} in {'(' if self.low_open else '['}{low}, {_plain(self.high)}"
                f"{')' if self.high_open else ']'}")


def _plain(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def parse_range(spec: str) -> Range:
    """``"int in [1, 256]"`` -> Range("int", 1, False, 256, False); raises ValueError on bad notation."""
    if spec in ("bool", "string", "path", "choice"):
        return Range(spec)
    m = re.fullmatch(rf"(int|float) (>=|>) ({_NUMBER})", spec)
    if m:
        return Range(m[1], float(m[3]), m[2] == ">")
    m = re.fullmatch(rf"(int|float) in ([\[(])({_NUMBER}), ({_NUMBER})([\])])", spec)
    if m:
        return Range(m[1], float(m[3]), m[2] == "(", float(m[4]), m[5] == ")")
    raise ValueError(f"not a range: {spec!r}")


def check(key: str, value: Any) -> Any:
    """``value`` of run key ``key`` if it is of the key's type and within its range (ints and floats
    come back as such), else a :class:`~pollen.app.errors.ConfigError` naming the key and the range."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")

    rng = parse_range(keys()[key].range)
    if rng.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if rng.kind in ("string", "path"):
        if not isinstance(value, str):
            raise bad("a path (string)" if rng.kind == "path" else "a string")
        return value
    if rng.kind == "choice":
        allowed = choices(key)
        if not isinstance(value, str) or value not in allowed:
            shown = ", ".join(v for v in allowed if v)
            raise bad(("empty or one of " if "" in allowed else "one of ") + shown)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad("an integer" if rng.kind == "int" else "a number")
    if not math.isfinite(value):
        raise bad("a finite number")
    if rng.kind == "int" and int(value) != value:
        raise bad("an integer")
    if not rng.admits(value):
        raise bad(rng.expected())
    return int(value) if rng.kind == "int" else float(value)
