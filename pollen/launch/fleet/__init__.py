"""Fleets: a SuperLink and real SuperNode processes on this machine (``pollen fleet``), with TLS, node
authentication and the certificates they need.

- :mod:`~pollen.launch.fleet.plan`: the node plan and the run config a fleet submits, checked first;
- :mod:`~pollen.launch.fleet.federation`: :class:`Fleet`, the SuperLink and SuperNodes it owns;
- :mod:`~pollen.launch.fleet.supernodes`: one ``flower-supernode``: its command line, key, start, wait;
- :mod:`~pollen.launch.fleet.certs`: a CA, the SuperLink's certificate and node keys, in Python;
- :mod:`~pollen.launch.fleet.cli`: the ``pollen fleet`` command.
"""

from __future__ import annotations

from pollen.launch.fleet.federation import Fleet, SuperNode
from pollen.launch.fleet.plan import NodeSpec, compose_run_config, format_config, parse_config_string, plan_nodes

__all__ = ["Fleet", "NodeSpec", "SuperNode", "compose_run_config", "format_config", "parse_config_string",
           "plan_nodes"]
