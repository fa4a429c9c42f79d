"""Flower ClientApp (Message API): validate run and node config, hand the message to the method's client.

Each handler builds the method's ``NumPyClient`` for this node and lets the family's adapter
(:mod:`pollen.app.adapters`) translate named records to the client's arrays and back. An exception
here becomes an error reply, which the strategy counts as a failure with its reason.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from pollen.app.config import parse_node_config, parse_run_config
from pollen.app.registry import METHODS

app = ClientApp()


def _client(context: Context):
    cfg = parse_run_config(context.run_config)
    node = parse_node_config(context.node_config)
    spec = METHODS[cfg.method]
    return spec.adapter, spec.make_client(cfg, node, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    adapter, client = _client(context)
    return Message(content=adapter.train(client, msg.content), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    adapter, client = _client(context)
    return Message(content=adapter.evaluate(client, msg.content), reply_to=msg)
