"""Flower ClientApp: validate run and node config, hand the message to the method's client."""

from __future__ import annotations

from flwr.client import Client, ClientApp
from flwr.common import Context

from pollen.app.config import parse_node_config, parse_run_config
from pollen.app.registry import METHODS


def client_fn(context: Context) -> Client:
    cfg = parse_run_config(context.run_config)
    node = parse_node_config(context.node_config)
    return METHODS[cfg.method].make_client(cfg, node, context).to_client()


app = ClientApp(client_fn=client_fn)
