"""The common run keys: every key that is not one method family's, declared once, section by section.

Each section is a frozen settings class whose fields are :func:`~pollen.settings.keys.setting`
declarations, exactly as a family declares its own keys (``pollen/methods/<family>_settings.py``);
:class:`~pollen.settings.run_config.RunConfig` is all sections in one flat value, and ``docs/usage.md``
shows one table per section, titled by the section's ``TITLE``. The choice lists that belong to a key
(``AGGREGATIONS``, ``WEIGHTINGS``, ``DP_MODES``, ``DATA_SPLITS``) are declared here with it; the layers
that act on them import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pollen.settings.keys import Registered, setting

# How accepted client values combine (pollen.strategies.aggregation).
AGGREGATIONS = ("mean", "median", "trimmed-mean")
# How FedAvg/FedProx weigh clients (pollen.strategies.weights).
WEIGHTINGS = ("samples", "uniform")
# Differential privacy (pollen.privacy): none, per release, DP-SGD, noise shared across a secure sum.
DP_MODES = ("off", "payload", "sample", "distributed")
DP_EVALUATIONS = ("refuse", "noised", "unprotected")  # dp-evaluate: client evaluation under DP
# How a user-data task's folder is split across partitions (pollen.datasets.user_tasks).
DATA_SPLITS = ("iid", "dirichlet")
# Where the ServerApp streams a run (pollen.app.tracking).
TRACKERS = ("none", "tensorboard", "mlflow")
# The models' width under each profile when ``model-width = 0`` (pollen.models.catalog.model_width).
PROFILES = ("quick", "paper")


@dataclass(frozen=True)
class RunKeys:
    TITLE: ClassVar[str] = "Run"

    method: str = setting("method", "fedavg", "choice", "federated method (see the methods table of README.md)",
                          choices=Registered("the registered methods"))
    task: str = setting("task", "uci-dirichlet", "choice", "dataset, partition and default model (see docs/data.md)",
                        choices=Registered("the registered tasks"))
    profile: str = setting(
        "profile", "quick", "choice",
        "`quick` = CPU-sized models (width 0.25 for large backbones), `paper` = the paper's sizes", choices=PROFILES)
    num_server_rounds: int = setting("num-server-rounds", 10, "int in [1, 1000000]", "federated rounds")
    seed: int = setting("seed", 0, "int in [0, 4294967295]",
                        "seeds data splits, model init, client sampling and every client's RNG")
    device: str = setting("device", "auto", "choice", "`auto` = CUDA when present, else CPU",
                          choices=("auto", "cpu", "cuda"))
    torch_threads: int = setting("torch-threads", 1, "int in [1, 256]",
                                 "torch threads per client (1 is fastest when clients share cores)")


@dataclass(frozen=True)
class PathKeys:
    TITLE: ClassVar[str] = "Paths"

    data_root: str | None = setting("data-root", "", "path", "dataset root (absolute); empty = `$POLLEN_DATA_ROOT`")
    download: bool = setting("download", False, "bool", "let torchvision download missing datasets (needs internet)")
    out_dir: str = setting("out-dir", "", "path",
                           "results root; empty = `$POLLEN_OUT_DIR`, else `./runs` of the SuperLink")
    run_name: str = setting("run-name", "", "string",
                            "the run folder's name under `out-dir`; the launcher sets "
                            "`YYYYMMDD-HHMMSS-<method>-<task>`; empty = the run id")
    resume_from: str = setting("resume-from", "", "path",
                               "a run folder to continue from its last valid checkpoint (same config)")


@dataclass(frozen=True)
class SamplingKeys:
    TITLE: ClassVar[str] = "Sampling and failures"

    fraction_fit: float = setting("fraction-fit", 1.0, "float in (0, 1]",
                                  "fraction of connected clients trained per round")
    fraction_evaluate: float = setting("fraction-evaluate", 1.0, "float in [0, 1]",
                                       "fraction of connected clients evaluated per round")
    min_available_clients: int = setting("min-available-clients", 2, "int in [1, 1000000]",
                                         "clients the server waits for before a round")
    min_train_clients: int = setting(
        "min-train-clients", 1, "int in [1, 1000000]",
        "clients sampled for training at least, and replies a round needs by its deadline to aggregate")
    max_empty_rounds: int = setting(
        "max-empty-rounds", 0, "int in [0, 1000000]",
        "rounds allowed to train nobody (every reply failed or rejected) before the run fails")
    sample_by_partition: bool = setting(
        "sample-by-partition", True, "bool",
        "ask each node its partition once and sample by partition, so one seed samples the same clients in every run "
        "(simulation: the engine's assignment, no query, checked against each node's replies, every node asked "
        "if one contradicts it; a deployment: one query per node before the first sampled round); false = by node id")


@dataclass(frozen=True)
class TrainingKeys:
    TITLE: ClassVar[str] = "Model and local training"

    model: str | None = setting("model", "", "choice", "architecture override; empty = the task's default",
                                choices=Registered("the model names"))
    model_width: float = setting("model-width", 0.0, "float in [0, 16]", "width multiplier; 0 = the profile's")
    local_epochs: int = setting("local-epochs", 1, "int in [1, 10000]", "local epochs per round")
    batch_size: int = setting("batch-size", 32, "int in [1, 1000000]", "local batch size")
    lr: float = setting("lr", 0.05, "float in (0, 10]", "local SGD learning rate")
    momentum: float = setting("momentum", 0.5, "float in [0, 1]", "local SGD momentum")
    weight_decay: float = setting("weight-decay", 0.0, "float in [0, 10]", "local SGD weight decay")
    max_train_samples: int = setting("max-train-samples", 0, "int in [0, 1000000000]",
                                     "cap on each client's training set; 0 = no cap")


@dataclass(frozen=True)
class TaskKeys:
    TITLE: ClassVar[str] = "Tasks"

    dirichlet_alpha: float = setting("dirichlet-alpha", 0.5, "float in (0, 1000000]",
                                     "label skew of the `*-dirichlet` tasks (smaller = more skewed)")
    shot_ways: int = setting("shot-ways", 3, "int in [1, 100000]",
                             "N of the N-way K-shot tasks: mean classes per client")
    shot_shots: int = setting("shot-shots", 100, "int in [1, 1000000]",
                              "K: mean training samples per class and client")
    shot_stdev: int = setting("shot-stdev", 2, "int in [0, 1000000]",
                              "spread of N and K across clients (`shot-shots - shot-stdev >= 1`)")
    shot_test_per_class: int = setting("shot-test-per-class", 40, "int in [1, 1000000]",
                                       "test samples per own class and client")
    shot_split: str = setting("shot-split", "pollen", "choice",
                              "`pollen` = Pollen's seeded split, `official` = FedProto's code's own draw",
                              choices=("pollen", "official"))


@dataclass(frozen=True)
class UserDataKeys:
    TITLE: ClassVar[str] = "Your own data (tasks image-folder, array; see docs/data.md)"

    data_dir: str = setting("data-dir", "", "path",
                            "folder with your own data (tasks `image-folder`, `array`); a node's own folder may "
                            "override it")
    classes: str = setting("classes", "", "string",
                           "the agreed class names, comma-separated or a file with one per line")
    test_fraction: float = setting("test-fraction", 0.2, "float in [0, 0.9]",
                                   "share of each client's own data held out for testing")
    image_size: int = setting("image-size", 0, "int in [0, 4096]", "input side in pixels; 0 = detect from the data")
    image_channels: int = setting("image-channels", 0, "int in [0, 3]",
                                  "input channels: 0 = detect, 1 = grey, 3 = RGB (2 is refused)")
    image_mean: str = setting("image-mean", "", "string",
                              "normalisation mean, 1 or 3 comma-separated numbers; empty = computed")
    image_std: str = setting("image-std", "", "string",
                             "normalisation std, 1 or 3 comma-separated numbers > 0; empty = computed")
    data_split: str = setting("data-split", "iid", "choice", "how the data is split across clients",
                              choices=DATA_SPLITS)


@dataclass(frozen=True)
class WeightKeys:
    TITLE: ClassVar[str] = "Weight averaging (fedavg, fedprox)"

    avg_weighting: str = setting("avg-weighting", "samples", "choice",
                                 "FedAvg/FedProx weights clients by training samples or equally", choices=WEIGHTINGS)
    fedprox_mu: float = setting("fedprox-mu", 0.01, "float in [0, 10000]",
                                "FedProx proximal coefficient mu (mu/2·‖w − w_global‖²)")


@dataclass(frozen=True)
class CheckpointKeys:
    TITLE: ClassVar[str] = "Checkpoints"

    checkpoint_every: int = setting("checkpoint-every", 1, "int in [0, 1000000]",
                                    "write a server checkpoint every N rounds; 0 = never")
    checkpoint_keep: int = setting("checkpoint-keep", 2, "int in [1, 1000000]", "checkpoints kept (the newest)")


@dataclass(frozen=True)
class HostileKeys:
    TITLE: ClassVar[str] = "Hostile nodes (docs/strategies.md)"

    aggregation: str = setting(
        "aggregation", "mean", "choice",
        "how accepted client values combine: `mean` (the method's weighted mean), or coordinate-wise and "
        "unweighted `median` / `trimmed-mean`, which a minority of hostile clients cannot drag far",
        choices=AGGREGATIONS)
    trim_fraction: float = setting(
        "trim-fraction", 0.2, "float in [0, 0.5)",
        "`trimmed-mean`: share of the smallest and of the largest client values dropped at each coordinate")
    outlier_factor: float = setting(
        "outlier-factor", 5.0, "float in [0, 1000000]",
        "a train reply whose size (update norm, prototype or logit size, gradient-set norm) is more than this × "
        "the round's median is refused, naming node, partition and ratio; 0 = off (docs/strategies.md)")
    max_update_norm: float = setting(
        "max-update-norm", 10000.0, "float in (0, 1000000000000]",
        "weights, GLFC and homogeneous-logit models: a reply moving further than this × the broadcast model's "
        "norm (at least 1) is refused")
    max_logit_abs: float = setting("max-logit-abs", 10000.0, "float in (0, 1000000000000]",
                                   "logit methods: a reply with a logit beyond ± this is refused")
    max_grad_norm: float = setting(
        "max-grad-norm", 10000.0, "float in (0, 1000000000000]",
        "GLFC: a prototype-gradient set with an L2 norm above this is refused before the proxy sees it")
    partition_pins: str = setting(
        "partition-pins", "", "string",
        "operator-pinned partitions, `partition:node-id` comma-separated (e.g. `0:4312,1:9876`): a pinned "
        "partition is served by that node only; empty = none (two nodes claiming one partition quarantine it)")


@dataclass(frozen=True)
class PrivacyKeys:
    TITLE: ClassVar[str] = "Differential privacy (docs/privacy.md)"

    dp_mode: str = setting(
        "dp-mode", "off", "choice",
        "`payload` = clip and noise what each client releases (unit: the client's data, replace-one; prototypes: "
        "one embedding row given the model, docs/privacy.md), `sample` = DP-SGD (unit: one record), "
        "`distributed` = under secure aggregation each client clips its contribution and adds its share of the "
        "sum's noise (unit: one client, replace-one), `off` = no noise",
        choices=DP_MODES)
    dp_clip: float = setting("dp-clip", 1.0, "float in (0, 1000000]",
                             "L2 clip of what a release depends on (an embedding, a model update)")
    dp_noise_multiplier: float = setting(
        "dp-noise-multiplier", 0.0, "float in [0, 1000000]",
        "σ: noise std over the release's L2 sensitivity; 0 = calibrate it from `dp-target-epsilon`")
    dp_target_epsilon: float = setting(
        "dp-target-epsilon", 0.0, "float in [0, 1000]",
        "ε each client may spend over `num-server-rounds` releases (σ calibrated before round 1); 0 = use σ")
    dp_delta: float = setting("dp-delta", 1e-5, "float in (0, 0.1]", "δ of every client's (ε, δ) guarantee")
    dp_max_epsilon: float = setting(
        "dp-max-epsilon", 0.0, "float in [0, 1000000]",
        "a client stops releasing before its ε (every release it ever made, resumes included) would pass this "
        "(its replies become errors); 0 = `dp-target-epsilon` when set, else no cap")
    dp_evaluate: str = setting(
        "dp-evaluate", "refuse", "choice",
        "private runs whose clients evaluate (`fraction-evaluate` > 0): `refuse` = refused before start (set "
        "`fraction-evaluate` = 0 or choose), `noised` = an evaluate reply releases only its accuracies, noised "
        "and accounted in the ledger (σ covers the evaluations too), `unprotected` = evaluate replies leave as "
        "they are, outside ε (summary.json records it)", choices=DP_EVALUATIONS)
    leak_audit: bool = setting(
        "leak-audit", False, "bool",
        "simulations: each round reports what the server could learn from the clients' releases, against the "
        "truth (`leak-*` metrics, docs/privacy.md; GLFC clients send their true images for it); the figures "
        "themselves reveal the clients' data")


@dataclass(frozen=True)
class SecureAggregationKeys:
    TITLE: ClassVar[str] = "Secure aggregation (docs/secure-aggregation.md)"

    secure_aggregation: bool = setting(
        "secure-aggregation", False, "bool",
        "SecAgg+: the server learns only the sum of each round's train replies (weights, prototypes, logits), "
        "never one client's; needs `aggregation = mean`; GLFC cannot (its proxy needs each client's gradients)")
    secagg_neighbours: int = setting(
        "secagg-neighbours", 16, "int in [2, 1000000]",
        "nodes each node shares its secrets with (a k-regular graph, rounded up to even; all others in a round "
        "of fewer nodes): client cost grows with it, dropouts are recovered per neighbourhood")
    secagg_threshold: float = setting(
        "secagg-threshold", 0.6, "float in (0.5, 1]",
        "share of a node's neighbourhood (itself included) needed to rebuild its secrets: more tolerates fewer "
        "dropouts and needs more colluding clients")
    secagg_clipping_range: float = setting(
        "secagg-clipping-range", 8.0, "float in (0, 1000000]",
        "every summed value is clipped to ± this (the most a malicious client can move one coordinate, times "
        "its weight)")
    secagg_quantization: int = setting(
        "secagg-quantization", 4194304, "int in [2, 1099511627776]",
        "steps the clipping range is split into: rounding error at most clipping range / this per value")
    secagg_modulus_bits: int = setting(
        "secagg-modulus-bits", 64, "int in [8, 64]",
        "masked vectors are integers modulo 2^this (uint32 on the wire up to 32): a round whose sum could wrap "
        "(nodes × the largest example count × quantization / 2 >= 2^(bits-1)) is refused")
    dp_min_honest: int = setting(
        "dp-min-honest", 0, "int in [0, 1000000]",
        "dp-mode = distributed: the honest clients (adding their noise, keeping it secret) the guarantee counts "
        "on in every round; each adds 1/this of the sum's noise variance and a round with fewer survivors is "
        "not unmasked; 0 = not set (refused with distributed)")


@dataclass(frozen=True)
class NetworkKeys:
    TITLE: ClassVar[str] = "Stragglers and dropouts (docs/stragglers.md)"

    client_dropout: float = setting(
        "client-dropout", 0.0, "float in [0, 1)",
        "simulation: the probability that a sampled client drops out of a round (drawn from the seed per round and "
        "client; it gets no instruction, does no work and never answers)")
    client_slow_fraction: float = setting(
        "client-slow-fraction", 0.0, "float in [0, 1]",
        "simulation: the share of clients that are slow (chosen once from the seed), each `client-slowdown` × slower")
    client_slowdown: float = setting("client-slowdown", 4.0, "float in [1, 1000]",
                                     "simulation: how many times longer a slow client takes")
    client_time_spread: float = setting(
        "client-time-spread", 0.0, "float in [0, 10]",
        "simulation: σ of each client's lognormal time factor per round (mean 1; 0 = none)")
    client_sample_time: float = setting(
        "client-sample-time", 0.001, "float in (0, 1000]",
        "simulation: simulated seconds a client of normal speed takes per training example and local epoch")
    round_timeout: float = setting(
        "round-timeout", 0.0, "float in [0, 1000000]",
        "deadline for training replies in seconds (simulated in simulation, wall-clock on a fleet): the round "
        "aggregates what arrived if at least `min-train-clients` did; 0 = wait for every reply")


@dataclass(frozen=True)
class TrackingKeys:
    TITLE: ClassVar[str] = "Tracking (docs/tracking.md)"

    tracking: str = setting(
        "tracking", "none", "choice",
        "stream the run to a tracker from the ServerApp (nodes need no access): `tensorboard` or `mlflow` "
        "(extra `pollen-fl[tracking]`); a tracker that fails is a WARNING, the run goes on", choices=TRACKERS)
    tracking_uri: str = setting(
        "tracking-uri", "", "string",
        "TensorBoard: the log folder, one subfolder per run (empty = the run folder's `tensorboard/`); MLflow: "
        "the tracking URI (empty = `$MLFLOW_TRACKING_URI`, else the file store `<out-dir>/mlruns`)")


# The sections in the order of docs/usage.md (and of pyproject.toml's table).
SECTIONS: tuple[type, ...] = (RunKeys, PathKeys, SamplingKeys, TrainingKeys, TaskKeys, UserDataKeys, WeightKeys,
                              CheckpointKeys, HostileKeys, NetworkKeys, TrackingKeys, PrivacyKeys,
                              SecureAggregationKeys)

# Keys that may differ between an interrupted run and its resumption: where things are and how fast,
# never what is computed. Any other changed key is refused, by the launcher before anything starts.
RESUMABLE_CHANGES = frozenset({"resume-from", "out-dir", "run-name", "num-server-rounds", "data-root", "device",
                               "torch-threads", "tracking", "tracking-uri"})
