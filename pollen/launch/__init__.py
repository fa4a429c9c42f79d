"""The ``pollen`` command and what it drives: SuperLink, ``flwr run``, Ray (private or an existing
cluster), the process tree, run folders and their lock, fleets, ``pollen predict``.

Operations, not the Flower app: the app (:mod:`pollen.app`) never imports this package. What other code
(``bench/``, tests, another project's scripts) may use is the small API below, importable from here;
everything else is the commands' own business:

- compose the run config: :func:`compose_run_config` (checked against the app's keys before anything
  starts), :func:`parse_run_config` / :func:`format_run_config` (as Flower reads and writes ``k=v`` pairs),
  :func:`app_run_config`, :func:`default_app_dir`, :func:`default_out_dir`;
- start a SuperLink: :func:`superlink` (a context manager), :func:`flower_env`, :func:`free_port`;
- submit: :func:`submit_and_wait` (``flwr run`` + the log + the final status) → :class:`RunOutcome`;
- simulate: :func:`simulate` (a whole simulation run on an owned SuperLink, everything stopped after);
- resume: :func:`resume_config` (the run config that continues a run folder);
- the processes and errors around them: :func:`stop_process`, :class:`ProcessTree`, :func:`signals_raise`,
  :class:`LaunchConfigError`, :class:`SuperLinkDied`, :class:`LaunchInterrupted`, the exit codes.

Names are imported when first used, so ``pollen runs`` and ``pollen --help`` stay quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pollen.launch.compose import (
        DEFAULT_SUPERNODES,
        PROJECT_ROOT,
        app_run_config,
        compose_run_config,
        default_app_dir,
        default_out_dir,
        format_run_config,
        parse_run_config,
    )
    from pollen.launch.errors import (
        EXIT_COMPLETED,
        EXIT_NOT_COMPLETED,
        EXIT_SUPERLINK_DIED,
        EXIT_TIMEOUT,
        EXIT_USAGE,
        LaunchConfigError,
        LaunchError,
        LaunchInterrupted,
        SuperLinkDied,
        signal_name,
        signals_raise,
    )
    from pollen.launch.processes import ProcessTree, stop_process
    from pollen.launch.resume import resume_config
    from pollen.launch.simulation import simulate
    from pollen.launch.submit import DEFAULT_TIMEOUT_S, RunOutcome, submit_and_wait
    from pollen.launch.superlinks import flower_env, free_port, superlink

__all__ = [
    "DEFAULT_SUPERNODES", "DEFAULT_TIMEOUT_S", "EXIT_COMPLETED", "EXIT_NOT_COMPLETED", "EXIT_SUPERLINK_DIED",
    "EXIT_TIMEOUT", "EXIT_USAGE", "PROJECT_ROOT", "LaunchConfigError", "LaunchError", "LaunchInterrupted",
    "ProcessTree", "RunOutcome", "SuperLinkDied", "app_run_config", "compose_run_config", "default_app_dir",
    "default_out_dir", "flower_env", "format_run_config", "free_port", "parse_run_config", "resume_config",
    "signal_name", "signals_raise", "simulate", "stop_process", "submit_and_wait", "superlink",
]
# where the names above live, cheapest first (each is imported only when one of its names is asked for)
_MODULES = ("errors", "compose", "processes", "superlinks", "submit", "resume", "simulation")


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module in _MODULES:
            found = importlib.import_module(f"pollen.launch.{module}")
            if hasattr(found, name):
                return getattr(found, name)
    raise AttributeError(f"module 'pollen.launch' has no attribute {name!r}")
