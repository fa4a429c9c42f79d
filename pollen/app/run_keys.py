"""Every run key's range and one line of help: the source of ``docs/usage.md`` and of validation.

:func:`check` is the one type-and-range check of every run key (common and method keys alike); the
config and the method families add only checks that involve several keys or the data. Defaults are
not repeated here: they come from :data:`pollen.app.config.DEFAULTS` and each method family's
defaults in the registry. ``docs/gen_usage.py`` joins the three into the page, and
``tests/test_usage_doc.py`` fails when a run key has no entry here, when an entry names a key that no
longer exists, or when a value outside a documented range is accepted.

Range notation: ``int >= 1``, ``int in [1, 256]``, ``float > 0``, ``float >= 0``, ``float in [0, 1]``,
``float in (0, 1]``, ``float in [0, 1)``, ``bool``, ``string``, ``path``, or ``choice`` (the allowed
values then come from the code, see :func:`choices`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# Common keys in the order of the page's sections; method keys are grouped by family automatically.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Run", ("method", "task", "profile", "num-server-rounds", "seed", "device", "torch-threads")),
    ("Paths", ("data-root", "download", "out-dir", "resume-from")),
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
)

# key -> (range, one line of help)
KEYS: dict[str, tuple[str, str]] = {
    # run
    "method": ("choice", "federated method (see the methods table of README.md)"),
    "task": ("choice", "dataset, partition and default model (see docs/data.md)"),
    "profile": ("choice", "`quick` = CPU-sized models (width 0.25 for large backbones), `paper` = the paper's sizes"),
    "num-server-rounds": ("int >= 1", "federated rounds"),
    "seed": ("int >= 0", "seeds data splits, model init, client sampling and every client's RNG"),
    "device": ("choice", "`auto` = CUDA when present, else CPU"),
    "torch-threads": ("int in [1, 256]", "torch threads per client (1 is fastest when clients share cores)"),
    # paths
    "data-root": ("path", "dataset root (absolute); empty = `$POLLEN_DATA_ROOT`"),
    "download": ("bool", "let torchvision download missing datasets (needs internet)"),
    "out-dir": ("path", "results root; empty = `$POLLEN_OUT_DIR`, else `./pollen-runs` of the SuperLink"),
    "resume-from": ("path", "a run folder to continue from its last valid checkpoint (same config)"),
    # sampling and failures
    "fraction-fit": ("float in (0, 1]", "fraction of connected clients trained per round"),
    "fraction-evaluate": ("float in [0, 1]", "fraction of connected clients evaluated per round"),
    "min-available-clients": ("int >= 1", "clients the server waits for before a round"),
    "max-empty-rounds": ("int >= 0", "rounds allowed to train nobody (every reply failed or rejected) before the "
                                     "run fails"),
    "sample-by-partition": ("bool", "ask each node its partition once and sample by partition, so one seed samples "
                                    "the same clients in every run (one query per node before the first sampled "
                                    "round: minutes at 10,000 simulated nodes); false = by node id"),
    # model and local training
    "model": ("choice", "architecture override; empty = the task's default"),
    "model-width": ("float in [0, 16]", "width multiplier; 0 = the profile's"),
    "local-epochs": ("int in [1, 10000]", "local epochs per round"),
    "batch-size": ("int in [1, 1000000]", "local batch size"),
    "lr": ("float in (0, 10]", "local SGD learning rate"),
    "momentum": ("float in [0, 1]", "local SGD momentum"),
    "weight-decay": ("float >= 0", "local SGD weight decay"),
    "max-train-samples": ("int >= 0", "cap on each client's training set; 0 = no cap"),
    # tasks
    "dirichlet-alpha": ("float > 0", "label skew of the `*-dirichlet` tasks (smaller = more skewed)"),
    "shot-ways": ("int >= 1", "N of the N-way K-shot tasks: mean classes per client"),
    "shot-shots": ("int >= 1", "K: mean training samples per class and client"),
    "shot-stdev": ("int >= 0", "spread of N and K across clients (`shot-shots - shot-stdev >= 1`)"),
    "shot-test-per-class": ("int >= 1", "test samples per own class and client"),
    "shot-split": ("choice", "`pollen` = Pollen's seeded split, `official` = FedProto's code's own draw"),
    # your own data
    "data-dir": ("path", "folder with your own data (tasks `image-folder`, `array`); a node's own folder may "
                         "override it"),
    "classes": ("string", "the agreed class names, comma-separated or a file with one per line"),
    "test-fraction": ("float in [0, 0.9]", "share of each client's own data held out for testing"),
    "image-size": ("int in [0, 4096]", "input side in pixels; 0 = detect from the data"),
    "image-channels": ("int in [0, 3]", "input channels: 0 = detect, 1 = grey, 3 = RGB (2 is refused)"),
    "image-mean": ("string", "normalisation mean, 1 or 3 comma-separated numbers; empty = computed"),
    "image-std": ("string", "normalisation std, 1 or 3 comma-separated numbers > 0; empty = computed"),
    "data-split": ("choice", "how the data is split across clients"),
    # weight averaging
    "avg-weighting": ("choice", "FedAvg/FedProx weights clients by training samples or equally"),
    "fedprox-mu": ("float in [0, 10000]", "FedProx proximal coefficient mu (mu/2·‖w − w_global‖²)"),
    # checkpoints
    "checkpoint-every": ("int >= 0", "write a server checkpoint every N rounds; 0 = never"),
    "checkpoint-keep": ("int >= 1", "checkpoints kept (the newest)"),
    # prototypes (fedproto, bd-fedproto)
    "proto-lambda": ("float > 0", "λ (λ_0 for BD-FedProto): weight of the prototype loss L_P"),
    "proto-beta": ("float >= 0", "β: weight of CPA's negative loss L_N (BD-FedProto)"),
    "proto-cpa": ("bool", "BD-FedProto: use CPA's negatives (the global prototypes of classes the client lacks)"),
    "proto-da": ("bool", "BD-FedProto: adapt λ_D each round (DA); false = fixed λ"),
    "proto-da-alpha": ("float in [0, 1]", "DA smoothing α of λ_D"),
    "proto-da-t0": ("float > 0", "DA annealing temperature T_0"),
    "proto-da-kappa": ("float in (0, 1]", "DA temperature decay κ per round"),
    "proto-da-tmin": ("float > 0", "DA minimum temperature"),
    "proto-negative": ("choice", "form of CPA's negative loss: margin hinge or InfoNCE"),
    "proto-tau": ("float > 0", "temperature of the InfoNCE negatives and of the MI monitor"),
    "proto-weighting": ("choice", "server average per class: by class counts, or `uniform` (the official code)"),
    "proto-local-protos": ("choice", "local prototypes from a pass after training, or training-time features "
                                     "(the official code)"),
    "proto-model-heter": ("bool", "FedProto's model-heterogeneous CNNs (18/20/22 channels by client)"),
    "proto-evaluate-every": ("int >= 1", "evaluate every N rounds (and in the last)"),
    "proto-pretrained": ("path", "local ImageNet ResNet-18/34 state dict loaded into every client (all but "
                                 "conv1/bn1/fc); empty = none"),
    # logits (fccl, fccl-wo-con, fedmd, feddf, solo)
    "fccl-public": ("choice", "unlabeled public set; empty = the task's default"),
    "fccl-public-size": ("int >= 0", "public samples N0; 0 = the profile's (quick 1000, paper 5000)"),
    "fccl-public-batch-size": ("int >= 0", "public batch; 0 = the profile's (quick 250, paper 512)"),
    "fccl-public-epochs": ("int >= 0", "epochs of the collaborative step on the public set; 0 = the task's"),
    "fccl-public-augment": ("bool", "augment public images (crop, flip, rotation) as the official code"),
    "fccl-lr": ("float > 0", "Adam learning rate of the logit methods"),
    "fccl-batch-size": ("int >= 1", "private batch size"),
    "fccl-local-epochs": ("string", "local epochs per domain, comma-separated (e.g. `10,10,2,2`); empty = the "
                                    "profile's"),
    "fccl-solo-epochs": ("int >= 0", "SOLO pretraining epochs; 0 = the profile's (quick 30, paper 40)"),
    "fccl-train-sizes": ("string", "private training samples per domain, comma-separated; empty = the task's"),
    "fccl-test-size": ("int >= 0", "test samples per domain; 0 = the profile's (quick 300, paper all)"),
    "fccl-lambda-col": ("float >= 0", "off-diagonal weight of the cross-correlation loss"),
    "fccl-lambda-loc": ("float >= 0", "weight of the local dual-domain distillation"),
    "fccl-eps": ("float >= 0", "added to the standard deviation when standardising logits"),
    "fccl-target": ("choice", "consensus each client aligns to: the mean, or the mean without its own logits"),
    "fccl-average-weights": ("bool", "homogeneous mode (paper Table 3): also average model weights"),
    "fccl-solo-cache": ("path", "folder caching SOLO-pretrained models across runs; empty = no cache"),
    # glfc (glfc, glfc-wo-*, fedavg-icarl, finetune)
    "glfc-tasks": ("int >= 1", "T: tasks in the class-incremental stream"),
    "glfc-classes-per-task": ("int >= 1", "s: new classes per task"),
    "glfc-rounds-per-task": ("int >= 1", "rounds per task (`num-server-rounds` = T × this)"),
    "glfc-initial-clients": ("int >= 1", "clients at the first task"),
    "glfc-new-clients": ("int >= 0", "clients joining at each new task"),
    "glfc-clients-per-round": ("int >= 1", "clients sampled per round among those that exist"),
    "glfc-old-fraction": ("float in [0, 1)", "fraction of existing clients that keep their old classes at a new task"),
    "glfc-class-fraction": ("float in (0, 1]", "fraction of a task's classes a learning client draws"),
    "glfc-duplicate-data": ("bool", "every client gets all images of its classes (the official code); false = "
                                    "disjoint shards"),
    "glfc-max-per-class": ("int >= 0", "cap on a client's images per class; 0 = no cap"),
    "glfc-class-order": ("choice", "classes in label order or shuffled by the seed"),
    "glfc-memory-size": ("int >= 0", "exemplar memory per client (iCaRL herding)"),
    "glfc-tau": ("float > 0", "entropy threshold of the task-transition detector (nats)"),
    "glfc-oracle-boundary": ("bool", "clients know task boundaries instead of detecting them"),
    "glfc-detect-all-clients": ("bool", "every client runs detection every round (the official code); false = "
                                        "sampled clients only"),
    "glfc-lr-schedule": ("choice", "learning rate within a task: cosine, the official code's steps, or constant"),
    "glfc-herding-distinct": ("bool", "herding never picks an image twice"),
    "glfc-perturb-steps": ("int >= 0", "steps perturbing a client's class prototypes before sending gradients"),
    "glfc-perturb-lr": ("float > 0", "learning rate of that perturbation"),
    "glfc-proxy-iterations": ("int >= 1", "proxy server: L-BFGS iterations of gradient inversion"),
    "glfc-proxy-keep": ("int >= 1", "proxy server: iterations whose reconstructions are kept (<= iterations)"),
    "glfc-proxy-lr": ("float > 0", "proxy server: L-BFGS learning rate"),
    "glfc-proxy-reset-per-task": ("bool", "reset the best-old-model score at each task (false = the official code)"),
    "glfc-proxy-chunk": ("int >= 1", "proxy server: gradients inverted per batch"),
    "glfc-eval-per-class": ("int >= 0", "server test images per seen class; 0 = all"),
}

FAMILY_TITLES = {
    "prototypes": "Prototype methods",
    "logits": "Logit methods",
    "glfc": "Class-incremental methods",
}


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a ``choice`` key, read from the code that validates it."""
    from pollen.app import config

    if key == "method":
        from pollen.app.registry import METHODS

        return tuple(sorted(METHODS))
    if key == "task":
        from pollen.datasets.tasks import TASKS

        return tuple(sorted(TASKS))
    if key == "model":
        from pollen.models import MODEL_NAMES

        return ("",) + tuple(MODEL_NAMES)
    simple = {"profile": config.PROFILES, "device": config.DEVICES, "avg-weighting": config.WEIGHTINGS,
              "shot-split": config.SHOT_SPLITS}
    if key in simple:
        return tuple(simple[key])
    if key.startswith("proto-"):
        from pollen.clients.prototypes import LOCAL_PROTO_MODES, NEGATIVE_FORMS
        from pollen.strategies.prototypes import PROTO_WEIGHTINGS

        return {"proto-negative": NEGATIVE_FORMS, "proto-weighting": PROTO_WEIGHTINGS,
                "proto-local-protos": LOCAL_PROTO_MODES}[key]
    if key == "fccl-public":
        from pollen.datasets.public import PUBLIC_SETS

        return ("",) + tuple(PUBLIC_SETS)
    if key == "fccl-target":
        from pollen.app.methods_logits import TARGETS

        return tuple(TARGETS)
    if key == "glfc-lr-schedule":
        from pollen.clients.incremental_losses import LR_SCHEDULES

        return tuple(LR_SCHEDULES)
    if key == "data-split":
        from pollen.datasets.user_tasks import DATA_SPLITS

        return tuple(DATA_SPLITS)
    if key == "glfc-class-order":
        return ("label", "shuffled")
    raise KeyError(f"{key!r} is not a choice key")


def all_defaults() -> dict[str, object]:
    """Every run key the code knows, with its default: the common ones, then each family's."""
    from pollen.app.config import DEFAULTS
    from pollen.app.registry import method_defaults

    return {**DEFAULTS, **method_defaults()}


def range_text(key: str) -> str:
    """The range of ``key`` as shown in the docs (choices spelled out)."""
    kind = KEYS[key][0]
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
    come back as such), else a :class:`~pollen.app.config.ConfigError` naming the key and the range."""
    from pollen.app.config import ConfigError

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")

    rng = parse_range(KEYS[key][0])
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
