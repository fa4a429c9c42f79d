"""The fleet's certificates (:mod:`pollen.launch.fleet.certs`, and ``deploy/certs.py``, the script that writes
them for separate machines): the certificates must pass a real TLS handshake, and the node keys must load with the
very functions flwr uses (`flower-supernode` and `flwr supernode register`)."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deploy import certs as script
from pollen.launch.fleet import certs


def _sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ext.get_values_for_type(x509.DNSName), [str(ip) for ip in ext.get_values_for_type(x509.IPAddress)]


def test_subject_alt_names_defaults_hosts_and_dedup():
    names = certs.subject_alt_names(["link.lab.example", "10.0.0.5", "LOCALHOST", "[fe80::1]", "10.0.0.5"])
    dns = [n.value for n in names if isinstance(n, x509.DNSName)]
    ips = [str(n.value) for n in names if isinstance(n, x509.IPAddress)]
    assert dns == ["localhost", "link.lab.example"]
    assert ips == ["127.0.0.1", "::1", "10.0.0.5", "fe80::1"]


@pytest.mark.parametrize("bad", ["https://link", "link:9092", "two words", "", "-lead.example"])
def test_subject_alt_names_rejects_urls_ports_and_junk(bad):
    with pytest.raises(certs.CertError, match="DNS name or IP"):
        certs.subject_alt_names([bad])


def test_server_certificate_is_signed_by_ca_with_requested_sans(tmp_path):
    creds = certs.write_server_credentials(tmp_path, ["superlink.example", "192.168.1.7"])
    ca = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    dns, ips = _sans(server)
    assert dns == ["localhost", "superlink.example"]
    assert set(ips) == {"127.0.0.1", "::1", "192.168.1.7"}
    for key_path in (creds.ca_key, creds.server_key):
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    key = serialization.load_pem_private_key(creds.server_key.read_bytes(), password=None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()


def _handshake(creds: certs.ServerCredentials, server_name: str) -> str:
    """Serve one TLS connection with the server certificate; connect trusting only the CA."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(creds.server_cert), str(creds.server_key))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve():
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(tls.recv(16).upper())
        except (ssl.SSLError, OSError) as err:  # the client refused the certificate
            errors.append(err)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(creds.ca_cert))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=server_name) as tls:
                tls.sendall(b"pollen")
                return tls.recv(16).decode()
    finally:
        thread.join(timeout=10)
        listener.close()


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "superlink.example"])
def test_real_tls_handshake_accepts_every_san(tmp_path, name):
    creds = certs.write_server_credentials(tmp_path, ["superlink.example"])
    assert _handshake(creds, name) == "POLLEN"


def test_real_tls_handshake_rejects_a_name_not_in_the_certificate(tmp_path):
    creds = certs.write_server_credentials(tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(creds, "elsewhere.example")


def test_existing_ca_is_reused_and_files_are_not_silently_overwritten(tmp_path):
    first = certs.write_server_credentials(tmp_path)
    ca_bytes = first.ca_cert.read_bytes()
    with pytest.raises(certs.CertError, match="refusing to overwrite"):
        certs.write_server_credentials(tmp_path, ["new.example"])
    second = certs.write_server_credentials(tmp_path, ["new.example"], force=True)
    assert second.ca_cert.read_bytes() == ca_bytes  # SuperNodes keep trusting the same ca.crt
    dns, _ = _sans(x509.load_pem_x509_certificate(second.server_cert.read_bytes()))
    assert "new.example" in dns


def test_node_keys_load_with_flwrs_own_loaders(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    node = certs.write_node_key(tmp_path / "keys", "supernode_0")
    private = serialization.load_ssh_private_key(node.private_key.read_bytes(), None)  # flower-supernode
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert node.private_key.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    assert stat.S_IMODE(node.private_key.stat().st_mode) == 0o600
    registered = try_load_public_key(node.public_key)  # flwr supernode register
    assert registered == public_key_to_bytes(private.public_key())
    assert node.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_node_keys_differ_and_names_are_checked(tmp_path):
    _, nodes = certs.write_fleet_credentials(tmp_path, 3)
    assert [n.name for n in nodes] == ["supernode_0", "supernode_1", "supernode_2"]
    assert len({n.public_key.read_bytes().split()[1] for n in nodes}) == 3
    for bad in ("../escape", "has space", ".hidden", ""):
        with pytest.raises(certs.CertError, match="plain file name"):
            certs.write_node_key(tmp_path, bad)
    with pytest.raises(certs.CertError, match="num_nodes"):
        certs.write_fleet_credentials(tmp_path / "x", 0)


def test_command_line_writes_server_and_node_files(tmp_path, capsys):
    assert script.main(["server", "--out", str(tmp_path / "c"), "--host", "10.1.2.3"]) == 0
    assert script.main(["node", "--out", str(tmp_path / "k"), "--name", "a", "--name", "b"]) == 0
    assert {p.name for p in (tmp_path / "c").iterdir()} == {"ca.crt", "ca.key", "server.pem", "server.key"}
    assert {p.name for p in (tmp_path / "k").iterdir()} == {"a", "a.pub", "b", "b.pub"}
    _, ips = _sans(x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes()))
    assert ipaddress.ip_address("10.1.2.3") in {ipaddress.ip_address(i) for i in ips}
    assert script.main(["node", "--out", str(tmp_path / "k"), "--name", "a"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
