"""Flower ClientApp (Message API): validate run and node config, hand the message to the method's client.

Each handler builds the method's ``NumPyClient`` for this node and lets the family's adapter
(``MethodSpec.adapter``: its protocol module's decode) hand it the message as named values; the client
answers with named values, encoded by the protocol too. An exception
here becomes an error reply, which the strategy counts as a failure with its reason.

What the client remembers (``context.state``: private model, teachers, histories) is also kept on
disk under the node's state folder — node config ``state-dir``, by default
``<run folder>/nodes/partition-<i>`` — one folder per training round (``round-NNNN``, as far back as a
kept server checkpoint reaches), written atomically and read back when a restarted SuperNode (or a
resumed run) starts with an empty state: the state from before the round the server asks for, so a
resumed run continues from its checkpoint's round exactly. After the last round the
personal model is saved there as ``final-model.safetensors`` with ``final-model.json``; it never
leaves the node. A small ``node-history`` record counts the rounds this partition trained, across
restarts, so a node that carried on from its folder can be told from one that started afresh.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from pollen.app.checkpoints import FINAL_MODEL, load_records, save_arrays, save_records, write_json
from pollen.app.config import ConfigError, NodeConfig, RunConfig, parse_node_config, validated_run_config
from pollen.app.registry import METHODS
from pollen.app.results import run_directory
from pollen.log import LOGGER
from pollen.models.spec import choose_model
from pollen.privacy.config import PrivacyConfig
from pollen.privacy.distributed import DistributedPrivacy
from pollen.privacy.ledger import LedgerFile
from pollen.protocol.identity import encode_identity_reply
from pollen.protocol.secagg import Refused, Setup
from pollen.secagg.client import SecAggMod


def distributed_privatizer(context: Context, setup: Setup, size: int):
    """This node's side of ``dp-mode = distributed`` (:class:`~pollen.privacy.distributed.DistributedPrivacy`):
    refused unless the server asks for at least the noise this node's own run config says (and its sampling
    probability, ``fraction-fit``); the node draws whether it is sampled, and the release is in its ledger
    before the reply leaves."""
    cfg = validated_run_config(context.run_config)
    node = parse_node_config(context.node_config)
    who = f"partition {node.partition_id}"
    if cfg.dp_mode != "distributed":
        raise Refused(f"{who} refuses: the server asks for distributed DP, this node's dp-mode is {cfg.dp_mode!r}")
    # the ledger lives beside the node's state, where every other DP mode keeps it
    privacy = DistributedPrivacy(PrivacyConfig.of(cfg), cfg.num_server_rounds, cfg.dp_min_honest,
                                 LedgerFile.in_folder(node_state_dir(cfg, node, context.run_id)), who,
                                 sampling=cfg.fraction_fit)
    reason = privacy.refusal(setup.clip_dp, setup.noise_multiplier_dp, setup.min_honest_dp, setup.sampling_dp)
    if reason is not None:
        raise Refused(reason)
    return privacy.take_part(2 * setup.clipping_range / setup.levels, size)


# SecAgg+ stages answered by the mod (with this node's distributed DP); plain messages pass through
app = ClientApp(mods=[SecAggMod(privatizer=distributed_privatizer)])
HISTORY = "node-history"  # context.state key: rounds trained by this partition, restarts included


def node_state_dir(cfg: RunConfig, node: NodeConfig, run_id: int) -> Path:
    if node.state_dir:
        return Path(node.state_dir).expanduser().resolve()
    return run_directory(cfg, run_id) / "nodes" / f"partition-{node.partition_id}"


def _prepare(context: Context, before_round: int | None = None):
    cfg = validated_run_config(context.run_config)  # every message carries it: checked once per process
    node = parse_node_config(context.node_config)
    spec = METHODS[cfg.method]
    if node.data_dir is not None:
        from pollen.datasets.user_tasks import USER_TASKS

        if cfg.task not in USER_TASKS:
            raise ConfigError(f"node config 'data-dir' = {node.data_dir!r} is read only by tasks "
                              f"{', '.join(USER_TASKS)}; the run's task is {cfg.task!r}")
    if spec.adapter is None:
        raise RuntimeError(f"method {cfg.method!r} has no Message-API client adapter")
    folder = node_state_dir(cfg, node, context.run_id)
    if len(context.state) == 0 and load_records(folder, context.state, before_round):
        trained = _rounds_trained(context)
        LOGGER.info("partition %d: state restored from %s (%d round(s) trained before)",
                    node.partition_id, folder, trained)
    # the client is told its folder: what outlives a rollback (the DP ledger) is kept there, not in the state
    return cfg, spec, folder, spec.make_client(cfg, replace(node, state_dir=str(folder)), context)


def _rounds_trained(context: Context) -> int:
    history = context.state.get(HISTORY)
    value = history.get("rounds-trained", 0) if isinstance(history, ConfigRecord) else 0
    return int(value) if isinstance(value, (int, float)) else 0


def _server_round(msg: Message) -> int:
    config = msg.content.get("config")
    value = config.get("server-round", 0) if isinstance(config, ConfigRecord) else 0
    return int(value) if isinstance(value, (int, float)) else 0


def save_final_model(folder: Path, cfg: RunConfig, spec, client, context: Context, server_round: int) -> None:
    """The personal model and what is needed to rebuild it (``pollen.launch.predict`` reads both)."""
    record = context.state.get(spec.personal_model)
    if not isinstance(record, ArrayRecord):
        return
    digest = save_arrays(folder / f"{FINAL_MODEL}.safetensors", {k: a.numpy() for k, a in record.items()})
    kwargs = client.model_kwargs() if hasattr(client, "model_kwargs") else {}
    meta = {
        "method": cfg.method, "task": cfg.task, **choose_model(cfg, client.task, client.node, options=kwargs).to_json(),
        "round": server_round, "partition-id": client.partition_id, "seed": cfg.seed, "sha256": digest,
        "num-partitions": client.node.num_partitions, "config": cfg.to_dict()}
    if client.task.class_names:  # user data: what pollen.launch.predict needs to read this node's own files
        data = client.data
        meta.update({"class-names": list(client.task.class_names), "image-mean": list(data.fmt.mean),
                     "image-std": list(data.fmt.std), "data-dir": client.node.data_dir or cfg.data_dir,
                     "num-train": data.num_train, "num-test": int(len(data.y_test))})
    write_json(folder / f"{FINAL_MODEL}.json", meta)


@app.train()
def train(msg: Message, context: Context) -> Message:
    server_round = _server_round(msg)
    # A resumed run restarts at its checkpoint's round: the state from before that round, not after it.
    cfg, spec, folder, client = _prepare(context, server_round or None)
    content = spec.adapter.train(client, msg.content)
    trained = _rounds_trained(context)
    context.state[HISTORY] = ConfigRecord({"rounds-trained": trained + 1, "last-round": server_round})
    save_records(folder, context.state, server_round, keep_back=cfg.checkpoint_every * cfg.checkpoint_keep)
    if spec.personal_model and server_round >= cfg.num_server_rounds:
        save_final_model(folder, cfg, spec, client, context, server_round)
    return Message(content=content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Answer a strategy's identity query: which partition this node serves. Only the node config is read —
    no run config, state, data or model — so a query costs Flower's message and nothing of Pollen's."""
    return Message(content=encode_identity_reply(parse_node_config(context.node_config).partition_id),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    server_round = _server_round(msg)
    _, spec, _, client = _prepare(context, server_round + 1 if server_round else None)
    return Message(content=spec.adapter.evaluate(client, msg.content), reply_to=msg)
