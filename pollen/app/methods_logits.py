"""Public-logit methods: FCCL, FCCL w/o CON, FedMD, FedDF and SOLO on domain-per-client tasks.

Homogeneous mode (paper Table 3) is configuration, not a separate method: run every client with the
same backbone (``model = "resnet12"``) and set ``fccl-average-weights = true``; then ``fccl`` is
"FCCL + averaging" (model states are averaged FedAvg-style and loaded before the collaborative step)
and ``solo`` with averaging is FedAvg evaluated per domain.
"""

from __future__ import annotations

from pollen.app.adapters import LOGITS
from pollen.app.config import ConfigError, RunConfig
from pollen.app.registry import MethodSpec, register_method, strategy_options
from pollen.app.run_keys import Key
from pollen.clients.logits import (
    FCCLClient,
    FCCLWithoutConClient,
    FedDFClient,
    FedMDClient,
    SoloClient,
    resolve_settings,
)
from pollen.datasets.domain_tasks import DOMAIN_TASKS, get_domain_task
from pollen.strategies.base import PollenStrategy
from pollen.strategies.logits import LogitAveraging
from pollen.strategies.weights import LocalOnly

TARGETS = ("mean", "leave-one-out")

# The logit family's run keys: default, range, help. 0 / "" = the profile's default (see
# pollen.clients.logits.QUICK / PAPER); pyproject.toml repeats the defaults.
LOGIT_KEYS: dict[str, Key] = {
    "fccl-public": Key("", "choice", "unlabeled public set; empty = the task's default"),
    "fccl-public-size": Key(0, "int >= 0", "public samples N0; 0 = the profile's (quick 1000, paper 5000)"),
    "fccl-public-batch-size": Key(0, "int >= 0", "public batch; 0 = the profile's (quick 250, paper 512)"),
    "fccl-public-epochs": Key(0, "int >= 0", "epochs of the collaborative step on the public set; 0 = the task's"),
    "fccl-public-augment": Key(True, "bool", "augment public images (crop, flip, rotation) as the official code"),
    "fccl-lr": Key(0.001, "float > 0", "Adam learning rate of the logit methods"),
    "fccl-batch-size": Key(32, "int >= 1", "private batch size"),
    "fccl-local-epochs": Key("", "string",
        "local epochs per domain, comma-separated (e.g. `10,10,2,2`); empty = the profile's"),
    "fccl-solo-epochs": Key(0, "int >= 0", "SOLO pretraining epochs; 0 = the profile's (quick 30, paper 40)"),
    "fccl-train-sizes": Key("", "string", "private training samples per domain, comma-separated; empty = the task's"),
    "fccl-test-size": Key(0, "int >= 0", "test samples per domain; 0 = the profile's (quick 300, paper all)"),
    "fccl-lambda-col": Key(0.0051, "float >= 0", "off-diagonal weight of the cross-correlation loss"),
    "fccl-lambda-loc": Key(1.0, "float >= 0", "weight of the local dual-domain distillation"),
    "fccl-eps": Key(1e-06, "float >= 0", "added to the standard deviation when standardising logits"),
    "fccl-target": Key("mean", "choice",
        "consensus each client aligns to: the mean, or the mean without its own logits"),
    "fccl-average-weights": Key(False, "bool", "homogeneous mode (paper Table 3): also average model weights"),
    "fccl-solo-cache": Key("", "path", "folder caching SOLO-pretrained models across runs; empty = no cache"),
}



def _bad(key, value, expected) -> ConfigError:
    return ConfigError(f"run config key '{key}' = {value!r} is invalid: expected {expected}")


def validate(cfg: RunConfig) -> None:
    """The task, and what the ranges of the ``fccl-…`` keys cannot say, before any training."""
    x = cfg.extra
    if cfg.task not in DOMAIN_TASKS:
        raise _bad("task", cfg.task, f"a domain-per-client task for method '{cfg.method}': "
                   + ", ".join(DOMAIN_TASKS))
    try:
        s = resolve_settings(cfg, get_domain_task(cfg.task))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if s.public_batch_size < 2 or s.public_batch_size > s.public_size:
        raise ConfigError(f"run config keys 'fccl-public-batch-size' = {s.public_batch_size} and 'fccl-public-size' "
                          f"= {s.public_size}: need 2 <= batch size <= public size (batches drop the remainder, "
                          "and the cross-correlation needs >= 2 rows)")
    if any(n < 1 for n in s.train_sizes):
        raise _bad("fccl-train-sizes", x["fccl-train-sizes"], "positive sizes")


def make_strategy(cfg: RunConfig) -> PollenStrategy:
    s = resolve_settings(cfg, get_domain_task(cfg.task))
    if cfg.method == "solo" and not s.average_weights:
        return LocalOnly(**strategy_options(cfg))
    return LogitAveraging(num_public=s.public_size, num_classes=get_domain_task(cfg.task).num_classes,
                          average_weights=s.average_weights, **strategy_options(cfg))


for _name, _client, _descr in (
    ("fccl", FCCLClient, "FCCL (Huang et al. 2022): cross-correlation to consensus public logits, "
                         "then CE + KL(previous model) + KL(SOLO model)"),
    ("fccl-wo-con", FCCLWithoutConClient, "FCCL without the local dual-domain distillation (ablation): "
                                          "cross-correlation step, then CE only"),
    ("fedmd", FedMDClient, "FedMD (Li & Wang 2019): L1 to consensus public logits, then CE only"),
    ("feddf", FedDFClient, "FedDF (Lin et al. 2020), heterogeneous: KL to consensus public logits, then CE only"),
    ("solo", SoloClient, "SOLO: each client trains alone (CE) from its pretrained model; with "
                         "fccl-average-weights = true, FedAvg evaluated per domain"),
):
    register_method(MethodSpec(name=_name, family="logits", description=_descr, make_strategy=make_strategy,
                               make_client=_client, adapter=LOGITS,
                               personal_model=_client.NET, keys=LOGIT_KEYS, validate=validate))
