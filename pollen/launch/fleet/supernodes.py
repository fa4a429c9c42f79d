"""SuperNodes of a real fleet: the ``flower-supernode`` command line, starting one, registering its
key with an authenticating SuperLink, and waiting until enough are online. Used by
:class:`~pollen.launch.fleet.federation.Fleet`; the SuperLink (:mod:`pollen.launch.superlinks`), the process
tree (:mod:`pollen.launch.processes`) and ``flwr`` calls (:mod:`pollen.launch.submit`) are the launcher's."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pollen.launch.processes import ProcessTree
from pollen.launch.submit import flwr_call, json_tail
from pollen.launch.superlinks import flower_bin, flower_env, free_port


def supernode_args(superlink_address: str, *, port: int, node_config: str = "",
                   root_certificates: str | Path | None = None,
                   auth_private_key: str | Path | None = None) -> list[str]:
    """The ``flower-supernode`` command line: insecure unless a root certificate is given."""
    args = [flower_bin("flower-supernode"), "--superlink", superlink_address, "--port", str(port)]
    if root_certificates is None:
        if auth_private_key is not None:
            raise ValueError("auth_private_key needs TLS: pass root_certificates as well")
        args.append("--insecure")
    else:
        args += ["--root-certificates", str(root_certificates)]
    if auth_private_key is not None:
        args += ["--auth-supernode-private-key", str(auth_private_key)]
    if node_config:
        args += ["--node-config", node_config]
    return args


def start_supernode(flwr_home: Path, superlink_address: str, log_path: Path, *, node_config: str = "",
                    port: int | None = None, root_certificates: str | Path | None = None,
                    auth_private_key: str | Path | None = None,
                    extra_env: dict[str, str] | None = None,
                    tree: ProcessTree | None = None) -> subprocess.Popen:
    """Start one ``flower-supernode`` in its own process group (stopped with ``stop_process``).

    Every ClientApp it runs is a child in that group, so stopping the group leaves nothing behind;
    with ``tree`` it is also a root of that launch's tree. ``extra_env`` is how a SuperNode gets its GPU
    (``CUDA_VISIBLE_DEVICES``).
    """
    flwr_home = flwr_home.resolve()
    env = flower_env(flwr_home, tree=tree)
    env.update(extra_env or {})
    args = supernode_args(superlink_address, port=port or free_port(), node_config=node_config,
                          root_certificates=root_certificates, auth_private_key=auth_private_key)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, cwd=flwr_home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if tree is not None:
        tree.add_root(proc.pid)
    return proc


def list_supernodes(connection: str, flwr_home: Path, watch: Callable[[], None] | None = None) -> list[dict]:
    """``flwr supernode ls`` as dicts with ``node-id`` and ``status`` (registered/online/offline/...)."""
    env = flower_env(flwr_home.resolve())
    out = json_tail(flwr_call(["supernode", "ls", connection, "--format", "json"], env, timeout=60,
                                            watch=watch))
    return list(out.get("nodes") or [])


def register_supernode(connection: str, flwr_home: Path, public_key: str | Path) -> int:
    """Register a SuperNode's public key with a SuperLink that runs ``--enable-supernode-auth``."""
    env = flower_env(flwr_home.resolve())
    out = json_tail(flwr_call(["supernode", "register", str(public_key), connection, "--format", "json"],
                                            env, timeout=60))
    if not out.get("success", False) or "node-id" not in out:
        raise RuntimeError(f"flwr supernode register {public_key} failed: {out}")
    return int(out["node-id"])


# What a SuperNode logs once the SuperLink has given it its node id (Flower's start_client_internal).
NODE_ID_LINE = "SuperNode ID: "


def logs_with_node_id(logs: Sequence[Path]) -> int:
    """How many of these SuperNode logs say the node has its id from the SuperLink."""
    found = 0
    for path in logs:
        try:
            found += NODE_ID_LINE in Path(path).read_text(errors="replace")
        except OSError:
            continue
    return found


def wait_for_supernodes(connection: str, flwr_home: Path, count: int, *, timeout: float = 120.0,
                        procs: Sequence[subprocess.Popen] = (), logs: Sequence[Path] = (),
                        watch: Callable[[], None] | None = None) -> list[str]:
    """Block until ``count`` SuperNodes are online; returns their node ids.

    Submitting before then lets round 1 start with whichever nodes happen to be connected. Fails early
    when one of ``procs`` (the SuperNodes being waited for) exits, or when ``watch`` raises (a dead
    SuperLink). ``flwr supernode ls`` decides, but each call starts the ``flwr`` CLI (a second or more of
    CPU, taken from the SuperNodes starting meanwhile): with ``logs`` (the SuperNodes' log files) it is
    first called once ``count`` of them say their node got its id, which a 0.2 s poll of the files sees.
    """
    deadline = time.monotonic() + timeout
    online: list[str] = []
    while time.monotonic() < deadline:
        if watch is not None:
            watch()
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"SuperNode pid {dead[0].pid} exited with code {dead[0].returncode} "
                               "before coming online (see its log)")
        if logs and logs_with_node_id(logs) < count:
            time.sleep(0.2)
            continue
        online = [str(n["node-id"]) for n in list_supernodes(connection, flwr_home, watch=watch)
                  if n.get("status") == "online"]
        if len(online) >= count:
            return online
        time.sleep(1.0)
    raise TimeoutError(f"only {len(online)} of {count} SuperNodes online after {timeout:.0f}s")
