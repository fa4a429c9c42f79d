"""The logit family's run keys, profiles and methods (:class:`Recipe`), without torch.

:class:`LogitOptions` declares the ``fccl-…`` keys and :func:`resolve_settings` fills in the profile's and
the task's values; the registry, the launcher's checks and the numpy-only logit ServerApp read these,
and importing :mod:`pollen.methods.logits` (the round: torch) for them would make those processes pay
torch's import (issue 30: start-up cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

from pollen.datasets.public import PUBLIC_CHOICES
from pollen.settings import setting

if TYPE_CHECKING:
    from pollen.datasets.spec import TaskSpec

COLLABORATIVE = ("col", "l1", "kl")
TARGETS = ("mean", "leave-one-out")

# Profile defaults for the keys whose value 0 / "" means "let the profile decide".
Profile = TypedDict("Profile", {"public-size": int, "public-batch-size": int, "solo-epochs": int, "train-cap": int,
                                "test-size": int, "local-epochs": NotRequired[tuple[int, ...]]})
QUICK: Profile = {"public-size": 1000, "public-batch-size": 250, "solo-epochs": 30, "train-cap": 500, "test-size": 300,
         "local-epochs": (10, 10, 2, 2)}
PAPER: Profile = {"public-size": 5000, "public-batch-size": 512, "solo-epochs": 40, "train-cap": 0, "test-size": 0}
# Per-domain local epochs of the paper profile: Digits [FCCL code]; Office-Home [ours] (not in the spec).
PAPER_LOCAL_EPOCHS = {"digits": (40, 35, 3, 4), "digits-offline": (40, 35, 3, 4), "office-home": (20, 20, 20, 20)}
PAPER_PUBLIC_EPOCHS = {"digits": 1, "digits-offline": 1, "office-home": 2}
# Your own domains (no fixed domains, so one value for every node) [ours]: both profiles.
USER_LOCAL_EPOCHS, USER_PUBLIC_EPOCHS = 2, 1

# context.state key of a client's trained model (its personal model, saved at the end of a run).
NET_KEY = "fccl-net"


@dataclass(frozen=True)
class Recipe:
    """What a method does in the two phases of a round."""

    collaborative: str | None  # "col" (FCCL), "l1" (FedMD), "kl" (FedDF) or None (SOLO)
    distill_local: bool  # CE + KL(prev) + KL(SOLO) (FCCL) or CE only

    def __post_init__(self):
        if self.collaborative not in (None, *COLLABORATIVE):
            raise ValueError(f"collaborative must be None or one of {COLLABORATIVE}, got {self.collaborative!r}")


# The family's methods: what each does in the two phases of a round.
FCCL = Recipe(collaborative="col", distill_local=True)  # cross-correlation, then CE + KL(prev) + KL(SOLO)
FCCL_WITHOUT_CON = Recipe(collaborative="col", distill_local=False)  # ablation: cross-correlation, then CE
FEDMD = Recipe(collaborative="l1", distill_local=False)  # L1 to the consensus logits, then CE
FEDDF = Recipe(collaborative="kl", distill_local=False)  # KL(σ(consensus) ‖ σ(logits)), then CE
SOLO = Recipe(collaborative=None, distill_local=False)  # the pretrained model alone, CE; nothing sent


@dataclass(frozen=True)
class LogitOptions:
    """The logit family's run keys (``fccl-…``) as given, each declared once: default, range, help.
    0 / "" mean "the profile's value" (``QUICK`` / ``PAPER``); :func:`resolve_settings` fills them in."""

    public: str = setting("fccl-public", "", "choice", "unlabeled public set; empty = the task's default",
                          choices=("", *PUBLIC_CHOICES))
    public_dir: str = setting("fccl-public-dir", "", "path",
                              "public set `folder`: the folder of unlabeled images, the same on every node "
                              "(node config `public-dir` overrides it)")
    public_size: int = setting("fccl-public-size", 0, "int >= 0",
                               "public samples N0; 0 = the profile's (quick 1000, paper 5000)")
    public_batch_size: int = setting("fccl-public-batch-size", 0, "int >= 0",
                                     "public batch; 0 = the profile's (quick 250, paper 512)")
    public_epochs: int = setting("fccl-public-epochs", 0, "int >= 0",
                                 "epochs of the collaborative step on the public set; 0 = the task's")
    public_augment: bool = setting("fccl-public-augment", True, "bool",
                                   "augment public images (crop, flip, rotation) as the official code")
    lr: float = setting("fccl-lr", 0.001, "float > 0", "Adam learning rate of the logit methods")
    batch_size: int = setting("fccl-batch-size", 32, "int >= 1", "private batch size")
    local_epochs: str = setting("fccl-local-epochs", "", "string",
                                "local epochs per domain, comma-separated (e.g. `10,10,2,2`); empty = the profile's")
    solo_epochs: int = setting("fccl-solo-epochs", 0, "int >= 0",
                               "SOLO pretraining epochs; 0 = the profile's (quick 30, paper 40)")
    train_sizes: str = setting("fccl-train-sizes", "", "string",
                               "private training samples per domain, comma-separated; empty = the task's")
    test_size: int = setting("fccl-test-size", 0, "int >= 0",
                             "test samples per domain; 0 = the profile's (quick 300, paper all)")
    lambda_col: float = setting("fccl-lambda-col", 0.0051, "float >= 0",
                                "off-diagonal weight of the cross-correlation loss")
    lambda_loc: float = setting("fccl-lambda-loc", 1.0, "float >= 0", "weight of the local dual-domain distillation")
    eps: float = setting("fccl-eps", 1e-06, "float >= 0", "added to the standard deviation when standardising logits")
    target: str = setting("fccl-target", "mean", "choice",
                          "consensus each client aligns to: the mean, or the mean without its own logits",
                          choices=TARGETS)
    average_weights: bool = setting("fccl-average-weights", False, "bool",
                                    "homogeneous mode (paper Table 3): also average model weights")
    solo_cache: str = setting("fccl-solo-cache", "", "path",
                              "folder caching SOLO-pretrained models across runs; empty = no cache")


@dataclass(frozen=True)
class LogitSettings:
    """The ``fccl-…`` run keys resolved against the profile and the task."""

    public: str
    public_dir: str
    public_size: int
    public_batch_size: int
    public_epochs: int
    public_augment: bool
    lr: float
    batch_size: int
    local_epochs: tuple[int, ...]
    solo_epochs: int
    train_sizes: tuple[int, ...]
    test_size: int
    lambda_col: float
    lambda_loc: float
    eps: float
    target: str
    average_weights: bool
    solo_cache: str


def _int_list(text: str, key: str, length: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError as err:
        raise ValueError(f"run config key '{key}' = {text!r}: expected {length} comma-separated integers") from err
    if len(values) == 1:
        values = values * length
    if len(values) != length or any(v < 0 for v in values):
        raise ValueError(f"run config key '{key}' = {text!r}: expected 1 or {length} non-negative integers")
    return values


def resolve_settings(o: LogitOptions, profile: str, task: TaskSpec) -> LogitSettings:
    """The options with 0 / "" replaced by the profile's (``quick`` or ``paper``) or the task's value.

    A task without fixed domains (your own, ``image-domains``) takes one epoch count for every node
    and all of each node's images (``train_sizes`` empty; cap them with ``max-train-samples``).
    """
    domains = task.domain_facts()
    k = len(domains.names) or 1
    prof = QUICK if profile == "quick" else PAPER
    if o.local_epochs:
        local = _int_list(o.local_epochs, "fccl-local-epochs", k)
    elif not domains.names:
        local = (USER_LOCAL_EPOCHS,)
    elif profile == "quick":
        local = QUICK["local-epochs"][:k]
    else:
        local = PAPER_LOCAL_EPOCHS[task.name]
    if not domains.names:
        if o.train_sizes:
            raise ValueError(f"run config key 'fccl-train-sizes' is for the built-in domain tasks; task "
                             f"{task.name!r} trains on every image of each node's folder (cap them with "
                             "'max-train-samples')")
        if o.test_size:
            raise ValueError(f"run config key 'fccl-test-size' is for the built-in domain tasks; task "
                             f"{task.name!r} tests on every test image of each node's folder")
        sizes: tuple[int, ...] = ()
    elif o.train_sizes:
        sizes = _int_list(o.train_sizes, "fccl-train-sizes", k)
    else:
        cap = prof["train-cap"]
        sizes = tuple(min(s, cap) if cap else s for s in domains.train_sizes)
    return LogitSettings(
        public=o.public or domains.public_default, public_dir=o.public_dir,
        public_size=o.public_size or prof["public-size"],
        public_batch_size=o.public_batch_size or prof["public-batch-size"],
        public_epochs=o.public_epochs or PAPER_PUBLIC_EPOCHS.get(task.name, USER_PUBLIC_EPOCHS),
        public_augment=o.public_augment, lr=o.lr, batch_size=o.batch_size, local_epochs=local,
        solo_epochs=o.solo_epochs or prof["solo-epochs"], train_sizes=sizes,
        test_size=o.test_size or prof["test-size"], lambda_col=o.lambda_col, lambda_loc=o.lambda_loc,
        eps=o.eps, target=o.target, average_weights=o.average_weights, solo_cache=o.solo_cache,
    )
