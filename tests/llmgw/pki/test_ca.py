"""The cluster CA as pure crypto: what a new CA, a server certificate and a node certificate
say, what a signing refuses. No disk: the CA is made in memory, and `llmgw.pki.ca` is shown to
open no file and to import neither the file layout nor trio."""

from __future__ import annotations

import builtins
import io
import ipaddress
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import attrs
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError
from llmgw.pki.ca import (
    CA,
    ROLE_GATEWAY,
    ROLE_NODE,
    WrongKey,
    cert_info,
    cert_info_from_der,
    check_issued_by,
    check_key_of,
    make_csr,
    make_key_and_csr,
    new_ca,
    parse_cert,
)

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=timezone.utc)


def load_pem(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


@pytest.fixture
def ca() -> CA:
    return new_ca(validity_days=3650)


# -- pure ----------------------------------------------------------------------------------


def test_the_ca_module_opens_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"llmgw.pki.ca opened a file: {args}")

    with monkeypatch.context() as patched:
        for target, name in ((builtins, "open"), (io, "open"), (os, "open")):
            patched.setattr(target, name, refuse)
        ca = new_ca(validity_days=1, now=NOW)
        _, csr_pem = make_key_and_csr("node01")
        node_cert = parse_cert(ca.sign_csr(csr_pem, "node01", validity_days=1, now=NOW))
        _, server_pem = ca.server_cert(["127.0.0.1"], validity_days=1, now=NOW)
        check_issued_by(node_cert, ca.cert)
        check_issued_by(parse_cert(server_pem), ca.cert)
        again = CA.from_pem(ca.key_pem(), ca.cert)
    assert again.info() == ca.info() and cert_info(node_cert).common_name == "node01"


def test_the_ca_module_imports_neither_files_nor_trio() -> None:
    code = "import sys, llmgw.pki.ca; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert "llmgw.pki.ca" in loaded
    assert loaded.isdisjoint({"llmgw.pki.files", "llmgw.pki.tls", "llmgw.private", "trio", "ssl"})


# -- the authority -------------------------------------------------------------------------


def test_a_new_ca_is_p256_and_signs_only_leaves() -> None:
    ca = new_ca(validity_days=10, now=NOW)
    info = ca.info()
    assert info.common_name == "llmgw cluster CA" and info.subject == "CN=llmgw cluster CA"
    assert info.is_ca and info.not_after == NOW + timedelta(days=10)
    assert info.not_before < NOW
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", info.fingerprint_sha256)
    cert = ca.cert
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    cert.verify_directly_issued_by(cert)


@pytest.mark.parametrize("name", ["", "x" * 65])
def test_a_ca_name_must_fit_a_common_name(name: str) -> None:
    with pytest.raises(UsageError, match="must be 1 to 64 characters"):
        new_ca(validity_days=1, common_name=name)


def test_a_ca_is_rebuilt_only_from_its_own_key(ca: CA) -> None:
    assert CA.from_pem(ca.key_pem(), ca.cert).cert == ca.cert
    with pytest.raises(WrongKey):
        CA.from_pem(new_ca(validity_days=1).key_pem(), ca.cert)
    rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(WrongKey):
        CA.from_pem(rsa_pem, ca.cert)
    with pytest.raises(ValueError):
        CA.from_pem(b"not a key", ca.cert)


def test_ca_repr_does_not_show_the_key(ca: CA) -> None:
    assert "key" not in repr(ca).replace("CA(", "")


# -- the server certificate ----------------------------------------------------------------


def test_server_cert_covers_exactly_the_given_addresses(ca: CA) -> None:
    key_pem, cert_pem = ca.server_cert(["10.0.0.1", "fd00::1", "llmgw.example.internal"], validity_days=30, now=NOW)
    cert = load_pem(cert_pem)
    info = cert_info(cert)
    assert info.sans == ("10.0.0.1", "fd00::1", "llmgw.example.internal")
    assert info.common_name == "10.0.0.1" and not info.is_ca
    assert info.not_after == NOW + timedelta(days=30)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.1"),
        ipaddress.ip_address("fd00::1"),
    ]
    assert san.get_values_for_type(x509.DNSName) == ["llmgw.example.internal"]
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    cert.verify_directly_issued_by(ca.cert)
    check_key_of(cert, serialization.load_pem_private_key(key_pem, password=None))


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("10.0.0.1:7443", "give it without the port ('10.0.0.1')"),
        ("[fd00::1]:7443", "give it without the port ('fd00::1')"),
        ("bad name", "neither an IP address nor a DNS name"),
        ("-x.example", "neither an IP address nor a DNS name"),
    ],
)
def test_server_cert_refuses_what_is_not_an_address(ca: CA, address: str, says: str) -> None:
    with pytest.raises(UsageError) as info:
        ca.server_cert([address], validity_days=1)
    assert repr(address) in str(info.value) and says in str(info.value)


def test_server_cert_needs_an_address(ca: CA) -> None:
    with pytest.raises(UsageError, match="--san ADDRESS"):
        ca.server_cert([], validity_days=1)


# -- node certificates ---------------------------------------------------------------------


def test_sign_csr_names_the_node_whatever_the_request_says(ca: CA) -> None:
    _, csr = make_key_and_csr("someone-else")
    cert = load_pem(ca.sign_csr(csr, "node01", validity_days=365, now=NOW))
    info = cert_info(cert)
    assert info.common_name == "node01" and info.subject == "CN=node01"
    assert info.issuer == "CN=llmgw cluster CA"
    assert 0 < info.serial < 2**159
    assert info.not_after == NOW + timedelta(days=365) and info.sans == ()
    ext = cert.extensions
    assert ext.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    assert ext.get_extension_for_class(x509.BasicConstraints).value.ca is False
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    assert ext.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski
    cert.verify_directly_issued_by(ca.cert)


def test_two_certificates_never_share_a_serial(ca: CA) -> None:
    _, csr = make_key_and_csr("node01")
    serials = {load_pem(ca.sign_csr(csr, "node01", validity_days=1)).serial_number for _ in range(5)}
    assert len(serials) == 5


def test_sign_csr_refuses_a_request_altered_after_signing(ca: CA) -> None:
    _, csr_pem = make_key_and_csr("node01")
    der = x509.load_pem_x509_csr(csr_pem).public_bytes(serialization.Encoding.DER)
    tampered = x509.load_der_x509_csr(der.replace(b"node01", b"node02"))
    with pytest.raises(UsageError, match="bad signature: it was altered"):
        ca.sign_csr(tampered.public_bytes(serialization.Encoding.PEM), "node02", validity_days=1)


def test_sign_csr_refuses_what_is_not_a_request(ca: CA) -> None:
    with pytest.raises(UsageError, match="not a PEM certificate signing request"):
        ca.sign_csr(ca.cert_pem(), "node01", validity_days=1)


@pytest.mark.parametrize("node_id", ["", "-node", "node 1", "nöde", "node01\n", "a" * 64, "node/01"])
def test_sign_csr_refuses_a_bad_node_id(ca: CA, node_id: str) -> None:
    _, csr = make_key_and_csr("node01")
    with pytest.raises(UsageError) as info:
        ca.sign_csr(csr, node_id, validity_days=1)
    assert str(info.value).startswith(f"node id {node_id!r} may use only letters, digits")


def test_longest_node_id_is_accepted(ca: CA) -> None:
    _, csr = make_key_and_csr("n")
    assert cert_info(load_pem(ca.sign_csr(csr, "a" * 63, validity_days=1))).common_name == "a" * 63


def test_a_request_from_a_key_made_elsewhere_is_signed_for_that_key(ca: CA) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    cert = load_pem(ca.sign_csr(make_csr(key_pem, "node07"), "node07", validity_days=1))
    assert cert.public_key() == key.public_key()


def test_a_certificate_is_checked_against_its_key_and_its_issuer(ca: CA) -> None:
    key_pem, csr = make_key_and_csr("node01")
    cert = load_pem(ca.sign_csr(csr, "node01", validity_days=1))
    check_key_of(cert, serialization.load_pem_private_key(key_pem, password=None))
    check_issued_by(cert, ca.cert)
    other_key, _ = make_key_and_csr("node01")
    with pytest.raises(WrongKey):
        check_key_of(cert, serialization.load_pem_private_key(other_key, password=None))
    with pytest.raises(ValueError):
        check_issued_by(cert, new_ca(validity_days=1).cert)


def test_an_already_expired_certificate_via_now(ca: CA) -> None:
    _, csr = make_key_and_csr("node01")
    info = cert_info(load_pem(ca.sign_csr(csr, "node01", validity_days=1, now=NOW - timedelta(days=30))))
    assert info.not_after < NOW and not info.valid_at(NOW)
    assert info.valid_at(NOW - timedelta(days=30))


def test_validity_must_be_a_day_or_more(ca: CA) -> None:
    _, csr = make_key_and_csr("node01")
    with pytest.raises(UsageError, match="at least 1 day, got 0"):
        ca.sign_csr(csr, "node01", validity_days=0)


def test_cert_info_from_der_matches_cert_info(ca: CA) -> None:
    _, cert_pem = ca.server_cert(["127.0.0.1", "::1"], validity_days=1)
    cert = load_pem(cert_pem)
    assert cert_info_from_der(cert.public_bytes(serialization.Encoding.DER)) == cert_info(cert)
    assert attrs.asdict(cert_info(cert))["sans"] == ("127.0.0.1", "::1")


# -- roles ---------------------------------------------------------------------------------


def test_a_gateway_certificate_carries_the_gateway_role_and_a_node_one_none(ca: CA) -> None:
    key_pem, cert_pem = ca.gateway_cert("gw1", validity_days=30, now=NOW)
    cert = load_pem(cert_pem)
    info = cert_info(cert)
    assert info.common_name == "gw1" and info.role == ROLE_GATEWAY
    assert info.not_after == NOW + timedelta(days=30)
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    check_key_of(cert, serialization.load_pem_private_key(key_pem, password=None))
    check_issued_by(cert, ca.cert)
    # A node certificate, as issued before roles existed and still: no OU, the node role.
    _, csr = make_key_and_csr("gw1")
    node = cert_info(load_pem(ca.sign_csr(csr, "gw1", validity_days=1)))
    assert node.subject == "CN=gw1" and node.role == ROLE_NODE


def test_a_node_request_asking_for_the_gateway_role_gets_a_node_certificate(ca: CA) -> None:
    # The CA writes the subject itself: whatever a request says, `sign_csr` makes a node's.
    key = serialization.load_pem_private_key(make_key_and_csr("n")[0], password=None)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "gw1"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLE_GATEWAY),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    cert = load_pem(ca.sign_csr(csr.public_bytes(serialization.Encoding.PEM), "gw1", validity_days=1))
    assert cert_info(cert).role == ROLE_NODE


@pytest.mark.parametrize("name", ["", "-gw", "gw 1", "gw/1", "a" * 64])
def test_a_gateway_name_follows_the_node_id_grammar(ca: CA, name: str) -> None:
    with pytest.raises(UsageError) as info:
        ca.gateway_cert(name, validity_days=1)
    assert str(info.value).startswith(f"gateway name {name!r} may use only letters, digits")


def test_a_gateway_request_gets_the_gateway_role_and_the_given_name_for_its_own_key(ca: CA) -> None:
    # `llmgw gateway add`: the key is made on the gateway's machine; only its request comes here.
    key_pem, csr = make_key_and_csr("whatever-it-asks")
    cert = load_pem(ca.sign_gateway_csr(csr, "gw1", validity_days=30, now=NOW))
    info = cert_info(cert)
    assert (info.subject, info.role) == (f"OU={ROLE_GATEWAY},CN=gw1", ROLE_GATEWAY)
    assert info.not_after == NOW + timedelta(days=30)
    check_key_of(cert, serialization.load_pem_private_key(key_pem, password=None))
    check_issued_by(cert, ca.cert)
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    with pytest.raises(UsageError, match="not a PEM certificate signing request.*`llmgw gateway csr`"):
        ca.sign_gateway_csr(b"junk", "gw1", validity_days=1)
    with pytest.raises(UsageError, match="gateway name 'gw 1' may use only"):
        ca.sign_gateway_csr(csr, "gw 1", validity_days=1)
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    small = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(weak, hashes.SHA256())
    with pytest.raises(
        UsageError, match="request for gateway 'gw1' holds a RSAPublicKey key.*on the gateway's machine"
    ):
        ca.sign_gateway_csr(small.public_bytes(serialization.Encoding.PEM), "gw1", validity_days=1)
