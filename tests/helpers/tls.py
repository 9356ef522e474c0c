"""Private keys and certificates made on the spot, for the tests that serve HTTPS: a server's self-signed one,
and a client's signed by a CA of the test's own (client certificates, --ssl-ca-certs)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any


def _issue(directory: Path, name: str, san: Any, issuer: tuple[Any, Any] | None = None,
           prefix: str = "") -> tuple[Path, Path]:
    """A new key and its certificate for `name` (self-signed, or signed by `issuer`: its (key, cert)),
    written to directory/{prefix}key.pem and directory/{prefix}cert.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer_name = (key, subject) if issuer is None else (issuer[0], issuer[1].subject)
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(signer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .sign(signer_key, hashes.SHA256()))
    keyfile, certfile = directory / f"{prefix}key.pem", directory / f"{prefix}cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return keyfile, certfile


def self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A private key and a self-signed certificate for `host` (PEM files); returns (keyfile, certfile)."""
    from cryptography import x509

    return _issue(directory, host, x509.IPAddress(ipaddress.ip_address(host)))


def client_certificate(directory: Path, ca_keyfile: Path, ca_certfile: Path) -> tuple[Path, Path]:
    """A client's private key and certificate, signed by the CA of `ca_keyfile` and `ca_certfile` (as
    self_signed made them); returns (keyfile, certfile)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_key = serialization.load_pem_private_key(ca_keyfile.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_certfile.read_bytes())
    return _issue(directory, "client", x509.DNSName("client.example"), issuer=(ca_key, ca_cert),
                  prefix="client-")
