"""The PKI's files: where the CA, the server certificate and a node's key and certificate are
written, with which modes, what is never replaced, and how a bad or unreadable file is refused."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw.errors import MachineError, UsageError
from llmgw.pki.ca import CA, ROLE_GATEWAY, cert_info, make_key_and_csr
from llmgw.pki.files import (
    ca_paths,
    init_ca,
    install_node_cert,
    issue_gateway_to_dir,
    issue_server_cert,
    issue_to_dir,
    load_ca,
    load_cert,
    node_paths,
    write_cert,
    write_gateway_key_and_csr,
    write_node_key_and_csr,
)

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=timezone.utc)
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load_pem(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


# -- the authority -------------------------------------------------------------------------


def test_init_writes_a_ca_with_private_modes(tmp_path: Path) -> None:
    info = init_ca(tmp_path / "s", validity_days=10, now=NOW)
    paths = ca_paths(tmp_path / "s")
    assert (paths.ca_key, paths.ca_cert) == (tmp_path / "s/ca/ca.key", tmp_path / "s/ca/ca.crt")
    assert mode(tmp_path / "s") == 0o700 and mode(paths.dir) == 0o700
    assert mode(paths.ca_key) == 0o600 and mode(paths.ca_cert) == 0o644
    assert sorted(p.name for p in paths.dir.iterdir()) == ["ca.crt", "ca.key"]  # no temporary files left
    assert info.is_ca and info.not_after == NOW + timedelta(days=10)
    assert cert_info(load_cert(paths.ca_cert)) == info
    assert load_ca(tmp_path / "s").info() == info


def test_init_refuses_to_replace_a_ca(state: Path) -> None:
    before = ca_paths(state).ca_key.read_bytes()
    with pytest.raises(UsageError) as info:
        init_ca(state, validity_days=10)
    assert str(ca_paths(state).ca_key) in str(info.value)
    assert "orphan every node certificate" in str(info.value)
    assert ca_paths(state).ca_key.read_bytes() == before


def test_init_with_a_bad_name_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="must be 1 to 64 characters"):
        init_ca(tmp_path / "s", validity_days=10, common_name="")
    assert not (tmp_path / "s").exists()


def test_load_ca_without_one_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(MachineError) as info:
        load_ca(tmp_path)
    assert (
        str(info.value)
        == f"no certificate authority in {tmp_path}; create one with `llmgw ca init --state-dir {tmp_path}`"
    )


def test_load_ca_without_its_key_says_to_restore_it(state: Path) -> None:
    ca_paths(state).ca_key.unlink()
    with pytest.raises(MachineError, match="is missing .* restore it from a backup"):
        load_ca(state)


def test_load_ca_refuses_a_key_others_can_read(state: Path) -> None:
    key = ca_paths(state).ca_key
    key.chmod(0o640)
    with pytest.raises(MachineError) as info:
        load_ca(state)
    assert f"{key} has mode 0640" in str(info.value)
    assert f"`chmod 600 {key}`" in str(info.value)


@pytest.mark.skipif(AS_ROOT, reason="root reads any file")
def test_load_ca_that_cannot_be_read_suggests_sudo(state: Path) -> None:
    ca_paths(state).ca_key.chmod(0o000)
    with pytest.raises(MachineError, match="permission denied; .*sudo"):
        load_ca(state)


def test_load_ca_refuses_a_key_of_another_ca(state: Path, tmp_path: Path) -> None:
    init_ca(tmp_path / "other", validity_days=10)
    key = ca_paths(state).ca_key
    key.write_bytes(ca_paths(tmp_path / "other").ca_key.read_bytes())
    with pytest.raises(MachineError, match="is not the key of"):
        load_ca(state)


def test_load_ca_refuses_what_is_not_a_key(state: Path) -> None:
    key = ca_paths(state).ca_key
    key.write_bytes(b"not a key\n")
    with pytest.raises(MachineError, match=f"{key} is not an unencrypted PEM private key .*restore it from a backup"):
        load_ca(state)


def test_load_cert_names_a_file_that_is_not_a_certificate(tmp_path: Path) -> None:
    (tmp_path / "x.crt").write_bytes(b"junk")
    with pytest.raises(MachineError, match="x.crt is not a PEM certificate"):
        load_cert(tmp_path / "x.crt")
    with pytest.raises(MachineError, match="y.crt does not exist; this file is written by `llmgw ca init`"):
        load_cert(tmp_path / "y.crt")


# -- the server certificate ----------------------------------------------------------------


def test_server_cert_is_written_with_a_private_key(state: Path, ca: CA) -> None:
    info = issue_server_cert(ca, state, ["10.0.0.1", "fd00::1", "llmgw.example.internal"], validity_days=30, now=NOW)
    paths = ca_paths(state)
    assert mode(paths.server_key) == 0o600 and mode(paths.server_cert) == 0o644
    assert info.sans == ("10.0.0.1", "fd00::1", "llmgw.example.internal")
    assert info.not_after == NOW + timedelta(days=30)
    cert = load_cert(paths.server_cert)
    assert cert_info(cert) == info
    cert.verify_directly_issued_by(ca.cert)
    key = serialization.load_pem_private_key(paths.server_key.read_bytes(), password=None)
    assert cert.public_key() == key.public_key()


def test_reissuing_the_server_cert_makes_a_new_key(state: Path, ca: CA) -> None:
    key = ca_paths(state).server_key
    issue_server_cert(ca, state, ["localhost"], validity_days=1)
    first = key.read_bytes()
    info = issue_server_cert(ca, state, ["127.0.0.1"], validity_days=1)
    assert key.read_bytes() != first
    assert info.sans == ("127.0.0.1",)


@pytest.mark.parametrize("sans", [["10.0.0.1:7443"], ["bad name"], []])
def test_a_refused_server_cert_writes_nothing(state: Path, ca: CA, sans: list[str]) -> None:
    with pytest.raises(UsageError):
        issue_server_cert(ca, state, sans, validity_days=1)
    assert not ca_paths(state).server_cert.exists() and not ca_paths(state).server_key.exists()


# -- node certificates ---------------------------------------------------------------------


def test_the_node_keeps_its_key_across_requests(tmp_path: Path, ca: CA) -> None:
    first = write_node_key_and_csr(tmp_path / "agent", "node01")
    assert first == node_paths(tmp_path / "agent")
    assert first.key == tmp_path / "agent/pki/node.key" and first.csr == tmp_path / "agent/pki/node.csr"
    assert mode(first.dir) == 0o700 and mode(first.key) == 0o600
    key = first.key.read_bytes()
    again = write_node_key_and_csr(tmp_path / "agent", "node01")
    assert again.key.read_bytes() == key
    cert_pem = ca.sign_csr(again.csr.read_bytes(), "node01", validity_days=1)
    node_key = serialization.load_pem_private_key(key, password=None)
    assert load_pem(cert_pem).public_key() == node_key.public_key()

    installed = install_node_cert(tmp_path / "agent", cert_pem, ca.cert_pem())
    assert installed.cert.read_bytes() == cert_pem and installed.ca_cert.read_bytes() == ca.cert_pem()


def test_a_node_key_that_is_not_a_key_is_named(tmp_path: Path) -> None:
    paths = write_node_key_and_csr(tmp_path / "agent", "node01")
    paths.key.write_bytes(b"junk")
    with pytest.raises(MachineError, match="node.key is not a PEM private key .*delete it to make a new one"):
        write_node_key_and_csr(tmp_path / "agent", "node01")


def test_install_refuses_a_certificate_for_another_key(tmp_path: Path, ca: CA) -> None:
    write_node_key_and_csr(tmp_path / "agent", "node01")
    _, other_csr = make_key_and_csr("node01")
    with pytest.raises(UsageError, match="is not for the key in"):
        install_node_cert(tmp_path / "agent", ca.sign_csr(other_csr, "node01", validity_days=1), ca.cert_pem())
    assert not node_paths(tmp_path / "agent").cert.exists()


def test_install_refuses_a_certificate_of_another_ca(tmp_path: Path, ca: CA) -> None:
    paths = write_node_key_and_csr(tmp_path / "agent", "node01")
    cert_pem = ca.sign_csr(paths.csr.read_bytes(), "node01", validity_days=1)
    init_ca(tmp_path / "other", validity_days=1)
    other = load_ca(tmp_path / "other")
    with pytest.raises(UsageError, match="was not issued by the CA certificate given with it"):
        install_node_cert(tmp_path / "agent", cert_pem, other.cert_pem())
    assert not paths.cert.exists()


def test_install_without_a_key_says_to_make_one(tmp_path: Path, ca: CA) -> None:
    _, csr = make_key_and_csr("node01")
    with pytest.raises(MachineError, match="node.key does not exist; make the node's key and request"):
        install_node_cert(tmp_path / "agent", ca.sign_csr(csr, "node01", validity_days=1), ca.cert_pem())


def test_issue_to_dir_writes_key_cert_and_ca_flat(tmp_path: Path, ca: CA) -> None:
    out = tmp_path / "out"
    paths = issue_to_dir(ca, "node04", out, validity_days=7)
    assert (paths.key, paths.cert, paths.ca_cert) == (out / "node.key", out / "node.crt", out / "ca.crt")
    assert mode(out) == 0o700 and mode(paths.key) == 0o600
    cert = load_cert(paths.cert)
    assert cert_info(cert).common_name == "node04"
    assert paths.ca_cert.read_bytes() == ca.cert_pem()
    key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
    assert cert.public_key() == key.public_key()
    with pytest.raises(UsageError, match="node.key already exists"):
        issue_to_dir(ca, "node04", out, validity_days=7)
    assert serialization.load_pem_private_key(paths.key.read_bytes(), password=None).public_key() == key.public_key()


def test_write_cert_is_public(tmp_path: Path, ca: CA) -> None:
    write_cert(tmp_path / "node.crt", ca.cert_pem())
    assert mode(tmp_path / "node.crt") == 0o644 and (tmp_path / "node.crt").read_bytes() == ca.cert_pem()


def test_issue_gateway_to_dir_writes_its_key_cert_and_ca_and_never_replaces_the_key(tmp_path: Path, ca: CA) -> None:
    out = tmp_path / "gw"
    paths = issue_gateway_to_dir(ca, "gw1", out, validity_days=7)
    assert (paths.key, paths.cert, paths.ca_cert) == (out / "gateway.key", out / "gateway.crt", out / "ca.crt")
    assert mode(out) == 0o700 and mode(paths.key) == 0o600 and mode(paths.cert) == 0o644
    cert = load_cert(paths.cert)
    assert (cert_info(cert).common_name, cert_info(cert).role) == ("gw1", ROLE_GATEWAY)
    assert paths.ca_cert.read_bytes() == ca.cert_pem()
    key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
    assert cert.public_key() == key.public_key()
    with pytest.raises(UsageError, match="gateway.key already exists"):
        issue_gateway_to_dir(ca, "gw1", out, validity_days=7)
    assert serialization.load_pem_private_key(paths.key.read_bytes(), password=None).public_key() == key.public_key()


def test_a_gateway_makes_its_key_once_and_asks_for_a_certificate_for_it(tmp_path: Path, ca: CA) -> None:
    # What `llmgw gateway csr` does on the gateway's machine for `llmgw gateway add`.
    first = write_gateway_key_and_csr(tmp_path / "pki", "gw1")
    assert (first.key, first.csr) == (tmp_path / "pki/gateway.key", tmp_path / "pki/gateway.csr")
    assert mode(first.dir) == 0o700 and mode(first.key) == 0o600 and mode(first.csr) == 0o644
    key = first.key.read_bytes()
    again = write_gateway_key_and_csr(tmp_path / "pki", "gw1")
    assert again.key.read_bytes() == key  # kept: the gateway's identity changes only when someone deletes it
    cert = load_pem(ca.sign_gateway_csr(again.csr.read_bytes(), "gw1", validity_days=1))
    assert cert.public_key() == serialization.load_pem_private_key(key, password=None).public_key()
    assert cert_info(cert).role == ROLE_GATEWAY
    first.key.write_bytes(b"junk")
    with pytest.raises(MachineError, match="gateway.key is not a PEM private key .*delete it to make a new one"):
        write_gateway_key_and_csr(tmp_path / "pki", "gw1")
    with pytest.raises(UsageError, match="gateway name 'gw/1'"):
        write_gateway_key_and_csr(tmp_path / "other", "gw/1")
    assert not (tmp_path / "other").exists()
