"""Pollen's logger: a child of Flower's (``flwr.pollen``), so that in any Flower app — Pollen's or
another project's — its WARNINGs reach Flower's console handler with their level, next to Flower's own
lines, and are captured wherever Flower's logs are."""

import logging

import flwr.common.logger  # noqa: F401  (installs Flower's console handler on the "flwr" logger)

LOGGER = logging.getLogger("flwr.pollen")
