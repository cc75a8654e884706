"""Mutual TLS: a cluster CA, certificates that carry a name and a role, and credentials.

Every party of a cluster -- the coordinator, each stage, each training client, each
operator -- holds a certificate signed by the cluster's CA. The certificate's subject says
who it is (common name) and what it may do (organizational unit: ``coordinator``,
``stage``, ``client`` or ``admin``); ``elasticpipe.security.authz`` allows each RPC to a fixed set
of roles. Five commands set up a cluster::

    elasticpipe certs init certs/                                        # certs/ca.pem, ca.key
    elasticpipe certs issue certs/ --name coordinator --role coordinator --host 10.0.0.1
    elasticpipe certs issue certs/ --name gpu-1 --role stage --host 10.0.0.11
    elasticpipe certs issue certs/ --name trainer --role client
    elasticpipe certs issue certs/ --name alice --role admin

A server presents its certificate to every caller and requires the caller's; the ``--host``
names and addresses go into its subject alternative names, which callers check.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticpipe.errors import InvalidRequest

ROLES = ("coordinator", "stage", "client", "admin")
ENV_CERT, ENV_KEY, ENV_CA = "ELASTICPIPE_TLS_CERT", "ELASTICPIPE_TLS_KEY", "ELASTICPIPE_TLS_CA"
VALID_DAYS = 3650
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class TLS:
    """Where a party's certificate, key and the cluster's CA are (PEM files)."""

    cert: str
    key: str
    ca: str

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return (
                Path(self.cert).read_bytes(),
                Path(self.key).read_bytes(),
                Path(self.ca).read_bytes(),
            )
        except OSError as exc:
            raise InvalidRequest(f"cannot read TLS material: {exc}") from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        """Presents this party's certificate; requires and checks every caller's."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Checks the server against the CA; presents this party's certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    @property
    def identity(self) -> tuple[str, str]:
        """(name, role) of this party's own certificate."""
        return identity_of(Path(self.cert).read_bytes())

    @classmethod
    def from_env(cls) -> TLS | None:
        """TLS from ``ELASTICPIPE_TLS_CERT/KEY/CA`` (all three, or None).

        Raises:
            InvalidRequest: only some of the three are set.
        """
        values = [os.environ.get(name, "") for name in (ENV_CERT, ENV_KEY, ENV_CA)]
        if not any(values):
            return None
        if not all(values):
            raise InvalidRequest(f"set all of {ENV_CERT}, {ENV_KEY} and {ENV_CA}, or none")
        return cls(*values)

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> TLS | None:
        """TLS from command-line flags, else from the environment.

        Raises:
            InvalidRequest: only some of the three flags are given.
        """
        given = [v for v in (cert, key, ca) if v]
        if not given:
            return cls.from_env()
        if len(given) != 3:
            raise InvalidRequest("give all of --tls-cert, --tls-key and --tls-ca, or none")
        assert cert and key and ca
        return cls(cert, key, ca)


def name_matches(certified: str, claimed: str) -> bool:
    """Whether a certificate's name covers a claimed stage name: the same, or for a
    family (``prefix*``) any name with that prefix."""
    if certified.endswith("*"):
        return claimed.startswith(certified[:-1]) and len(claimed) > len(certified) - 1
    return certified == claimed


def identity_of(pem: bytes) -> tuple[str, str]:
    """(name, role) of a PEM certificate (common name, organizational unit)."""
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return (str(names[0].value) if names else "", str(roles[0].value) if roles else "")


def _write(path: Path, data: bytes, private: bool) -> None:
    if path.exists():
        raise InvalidRequest(f"{path} exists already: remove it first, nothing was changed")
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def init_ca(folder: str | os.PathLike[str], name: str = "elasticpipe-ca") -> Path:
    """Creates a cluster CA: ``folder/ca.pem`` and ``folder/ca.key`` (keep it secret).

    Raises:
        InvalidRequest: the files exist already.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(out / "ca.key", _key_pem(key), private=True)
    _write(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out / "ca.pem"


def issue(
    folder: str | os.PathLike[str],
    name: str,
    role: str,
    hosts: tuple[str, ...] = (),
    file_name: str = "",
) -> tuple[Path, Path]:
    """Issues ``folder/FILE_NAME.pem`` and ``folder/FILE_NAME.key`` signed by the folder's CA.

    Args:
        folder: where ``ca.pem`` and ``ca.key`` are.
        name: the party's name (a stage's ``--name``: the coordinator binds them). A name
            ending in ``*`` is a family: one certificate shared by the stages whose names
            start with the rest (a StatefulSet's ``stage-0``, ``stage-1``...).
        file_name: the files' base name (default: ``name``; required for a family).
        role: coordinator, stage, client or admin.
        hosts: DNS names and IP addresses the party is reached at (servers); loopback
            is always included.

    Raises:
        InvalidRequest: an unknown role, a bad name, no CA, or files that exist.
    """
    if role not in ROLES:
        raise InvalidRequest(f"unknown role {role!r} (choose from {', '.join(ROLES)})")
    if not name or any(c in name for c in "/\\\0") or name in ("ca",) or "*" in name[:-1]:
        raise InvalidRequest(f"bad certificate name {name!r} ('*' only at the end)")
    out_name = file_name or name
    if "*" in out_name or any(c in out_name for c in "/\\\0") or out_name == "ca":
        raise InvalidRequest(f"bad file name {out_name!r}: give --out NAME for a family")
    out = Path(folder)
    try:
        ca_cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    except OSError as exc:
        raise InvalidRequest(
            f"no CA in {out}: run 'elasticpipe certs init {out}' first ({exc})"
        ) from exc
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in dict.fromkeys((*DEFAULT_HOSTS, *hosts)):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_path, cert_path = out / f"{out_name}.key", out / f"{out_name}.pem"
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path, key_path
