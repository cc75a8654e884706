"""Certificates: names and roles inside, families of stage names, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from elasticpipe.errors import InvalidRequest
from elasticpipe.security import tls


def test_issued_certificates_carry_name_role_and_hosts(tmp_path: Path) -> None:
    tls.init_ca(tmp_path)
    cert, key = tls.issue(tmp_path, "gpu-1", "stage", ("10.0.0.5", "gpu-1.example"))
    assert tls.identity_of(cert.read_bytes()) == ("gpu-1", "stage")
    assert key.stat().st_mode & 0o777 == 0o600
    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert "gpu-1.example" in names.get_values_for_type(x509.DNSName)
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} >= {"10.0.0.5", "127.0.0.1"}
    with pytest.raises(InvalidRequest, match="exists already"):
        tls.issue(tmp_path, "gpu-1", "stage")
    with pytest.raises(InvalidRequest, match="unknown role 'root'"):
        tls.issue(tmp_path, "x", "root")


def test_a_family_certificate_covers_names_with_its_prefix(tmp_path: Path) -> None:
    tls.init_ca(tmp_path)
    cert, _ = tls.issue(tmp_path, "pool-*", "stage", file_name="pool")
    assert cert.name == "pool.pem" and tls.identity_of(cert.read_bytes())[0] == "pool-*"
    assert tls.name_matches("pool-*", "pool-0") and tls.name_matches("pool-*", "pool-17")
    assert not tls.name_matches("pool-*", "pool-") and not tls.name_matches("pool-*", "gpu-1")
    assert tls.name_matches("gpu-1", "gpu-1") and not tls.name_matches("gpu-1", "gpu-10")
    with pytest.raises(InvalidRequest, match="--out"):
        tls.issue(tmp_path, "other-*", "stage")
    with pytest.raises(InvalidRequest, match="only at the end"):
        tls.issue(tmp_path, "a*b", "stage", file_name="ab")
