"""TLS certificates and SuperNode keys for SuperLinks and SuperNodes on separate machines (deploy/README.md
says which file goes to which machine); the files are made by :mod:`pollen.launch.fleet.certs`, as for
``pollen fleet --tls``::

    python -m deploy.certs server --out certs --host superlink.lab.example --host 10.0.0.5
    python -m deploy.certs node --out keys --name supernode_0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python deploy/certs.py`: make `pollen` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pollen.launch.fleet.certs import CertError, write_node_key, write_server_credentials  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TLS certificates and SuperNode keys for a Pollen fleet")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("server", help="CA (created once, then reused) and the SuperLink's certificate")
    srv.add_argument("--out", type=Path, required=True, help="folder for ca.crt, ca.key, server.pem, server.key")
    srv.add_argument("--host", action="append", default=[],
                     help="extra DNS name or IP the SuperLink is reached by (repeatable); "
                          "localhost, 127.0.0.1 and ::1 are always included")
    srv.add_argument("--days", type=int, default=365)
    srv.add_argument("--force", action="store_true", help="overwrite an existing server certificate")
    node = sub.add_parser("node", help="one SuperNode key pair <name> / <name>.pub (OpenSSH ECDSA P-384)")
    node.add_argument("--out", type=Path, required=True)
    node.add_argument("--name", action="append", required=True, help="key file name (repeatable)")
    node.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "server":
            creds = write_server_credentials(args.out, args.host, days=args.days, force=args.force)
            for label, path in (("CA certificate", creds.ca_cert), ("CA key (keep private)", creds.ca_key),
                                ("server certificate", creds.server_cert), ("server key", creds.server_key)):
                print(f"{label}: {path}")
        else:
            for name in args.name:
                key = write_node_key(args.out, name, force=args.force)
                print(f"{name}: private {key.private_key}  public {key.public_key}")
    except CertError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
