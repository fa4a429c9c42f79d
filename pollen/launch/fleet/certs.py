"""TLS certificates and SuperNode authentication keys for a Pollen fleet, with no tools besides Python.

Flower's own recipe shells out to ``openssl`` and ``ssh-keygen``; this module does the same with the
``cryptography`` package that ``flwr`` already depends on, so it works on any machine that can run
the app. It writes:

* ``ca.crt`` / ``ca.key`` — a private certificate authority (stays on the machine that issues certs);
* ``server.pem`` / ``server.key`` — the SuperLink's certificate, signed by the CA, valid for
  ``localhost``, ``127.0.0.1``, ``::1`` and every ``--host`` given (the names and addresses the
  SuperNodes and the ``flwr`` CLI dial);
* ``<name>`` / ``<name>.pub`` — one ECDSA P-384 key pair per SuperNode, in OpenSSH format, exactly
  what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` load.

``pollen fleet --tls`` writes them for a local fleet; ``python -m deploy.certs`` (a checkout's certificate
script) writes them for SuperLinks and SuperNodes on separate machines (deploy/README.md).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names the SuperLink is always reachable by on its own machine (and in a local fleet).
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
# P-384 is what Flower's docs use for node keys and one of the NIST curves `flwr` accepts.
CURVE = ec.SECP384R1
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?:\*\.)?{_LABEL}(?:\.{_LABEL})*$")


class CertError(ValueError):
    """A host name, key name or existing file that cannot be used."""


@dataclass(frozen=True)
class ServerCredentials:
    """Paths the SuperLink (ssl flags) and its clients (root certificate) need."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's key pair: the private key stays on the node, the public key is registered."""

    name: str
    private_key: Path
    public_key: Path


def subject_alt_names(hosts: Sequence[str] = ()) -> list[x509.GeneralName]:
    """SAN entries for the default names plus ``hosts``: IP literals as IP addresses, the rest as DNS.

    Order is kept and duplicates dropped, so the certificate lists exactly what was asked for.
    """
    entries: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in (*DEFAULT_HOSTS, *hosts):
        host = raw.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # "[::1]" as written in URLs
        if not (_is_ip(host) or _DNS_NAME.match(host)):
            raise CertError(f"host {raw!r} is not a DNS name or IP address (give it without port or scheme)")
        key = host.lower()
        if key in seen:
            continue
        seen.add(key)
        if _is_ip(host):
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        else:
            entries.append(x509.DNSName(host))
    return entries


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)


def _refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise CertError(f"refusing to overwrite {', '.join(existing)} (pass force=True / --force)")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "Pollen fleet CA", days: int = 365
            ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA that may sign server certificates only (path length 0)."""
    key = ec.generate_private_key(CURVE())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA384()))
    return cert, key


def make_server_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: Sequence[str] = (),
                     days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A TLS server certificate for the SuperLink, signed by the CA, with SANs for every host."""
    key = ec.generate_private_key(CURVE())
    sans = subject_alt_names(hosts)
    first = sans[0].value
    now = _now()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(first))]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=True,
                                         key_cert_sign=False, crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return cert, key


def write_server_credentials(out_dir: Path, hosts: Sequence[str] = (), *, days: int = 365,
                             force: bool = False) -> ServerCredentials:
    """CA (reused when ``ca.crt``/``ca.key`` exist) plus a fresh server certificate for ``hosts``.

    Reusing the CA means adding a host later only reissues ``server.pem``; the SuperNodes keep the
    ``ca.crt`` they already have.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    creds = ServerCredentials(out_dir / "ca.crt", out_dir / "ca.key", out_dir / "server.pem", out_dir / "server.key")
    if creds.ca_cert.exists() and creds.ca_key.exists():
        ca_cert = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(creds.ca_key.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise CertError(f"{creds.ca_key} is not an EC private key; remove ca.crt/ca.key to start over")
    else:
        _refuse_overwrite([creds.ca_cert, creds.ca_key], force)
        ca_cert, ca_key = make_ca(days=days)
        creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        _write_private(creds.ca_key, _pem_key(ca_key))
    _refuse_overwrite([creds.server_cert, creds.server_key], force)
    cert, key = make_server_cert(ca_cert, ca_key, hosts, days=days)
    creds.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(creds.server_key, _pem_key(key))
    return creds


def write_node_key(out_dir: Path, name: str, *, force: bool = False) -> NodeKey:
    """An ECDSA P-384 key pair in OpenSSH format (what ``ssh-keygen -t ecdsa -b 384`` writes)."""
    if not name or name.startswith(".") or any(c in name for c in "/\\ \t"):
        raise CertError(f"node key name {name!r} must be a plain file name (no slashes, spaces or leading dot)")
    out_dir = Path(out_dir)
    node = NodeKey(name, out_dir / name, out_dir / f"{name}.pub")
    _refuse_overwrite([node.private_key, node.public_key], force)
    key = ec.generate_private_key(CURVE())
    _write_private(node.private_key, key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.OpenSSH,
                                                       serialization.NoEncryption()))
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    node.public_key.write_bytes(public + f" {name}\n".encode())
    return node


def write_fleet_credentials(out_dir: Path, num_nodes: int, hosts: Sequence[str] = (), *,
                            node_prefix: str = "supernode_", force: bool = False
                            ) -> tuple[ServerCredentials, list[NodeKey]]:
    """Everything a one-machine TLS fleet needs: server credentials and ``num_nodes`` node keys."""
    if num_nodes < 1:
        raise CertError(f"num_nodes = {num_nodes} is invalid: expected an integer >= 1")
    out_dir = Path(out_dir)
    server = write_server_credentials(out_dir, hosts, force=force)
    nodes = [write_node_key(out_dir / "keys", f"{node_prefix}{i}", force=force) for i in range(num_nodes)]
    return server, nodes
