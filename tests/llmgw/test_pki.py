"""The cluster CA: what it writes and with which modes, what it signs, and real TLS handshakes
between the two ends of the agent link, including each way a handshake is refused."""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import ssl
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw import pki
from llmgw.errors import MachineError, UsageError

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=timezone.utc)
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load_pem(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    pki.init_ca(d, validity_days=3650)
    return d


@pytest.fixture
def ca(state: Path) -> pki.CA:
    return pki.load_ca(state)


# -- the authority -------------------------------------------------------------------------


def test_init_writes_a_p256_ca_with_private_modes(tmp_path: Path) -> None:
    info = pki.init_ca(tmp_path / "s", validity_days=10, now=NOW)
    paths = pki.ca_paths(tmp_path / "s")
    assert (paths.ca_key, paths.ca_cert) == (tmp_path / "s/ca/ca.key", tmp_path / "s/ca/ca.crt")
    assert mode(paths.dir) == 0o700
    assert mode(paths.ca_key) == 0o600
    assert sorted(p.name for p in paths.dir.iterdir()) == ["ca.crt", "ca.key"]  # no temporary files left
    assert info.common_name == "llmgw cluster CA" and info.subject == "CN=llmgw cluster CA"
    assert info.is_ca and info.not_after == NOW + timedelta(days=10)
    assert info.not_before < NOW
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", info.fingerprint_sha256)

    cert = pki.load_cert(paths.ca_cert)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    cert.verify_directly_issued_by(cert)


def test_init_refuses_to_replace_a_ca(state: Path) -> None:
    before = pki.ca_paths(state).ca_key.read_bytes()
    with pytest.raises(UsageError) as info:
        pki.init_ca(state, validity_days=10)
    assert str(pki.ca_paths(state).ca_key) in str(info.value)
    assert "orphan every node certificate" in str(info.value)
    assert pki.ca_paths(state).ca_key.read_bytes() == before


def test_load_ca_without_one_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(MachineError) as info:
        pki.load_ca(tmp_path)
    assert (
        str(info.value)
        == f"no certificate authority in {tmp_path}; create one with `llmgw ca init --state-dir {tmp_path}`"
    )


def test_load_ca_refuses_a_key_others_can_read(state: Path) -> None:
    key = pki.ca_paths(state).ca_key
    key.chmod(0o640)
    with pytest.raises(MachineError) as info:
        pki.load_ca(state)
    assert f"{key} has mode 0640" in str(info.value)
    assert f"`chmod 600 {key}`" in str(info.value)


@pytest.mark.skipif(AS_ROOT, reason="root reads any file")
def test_load_ca_that_cannot_be_read_suggests_sudo(state: Path) -> None:
    pki.ca_paths(state).ca_key.chmod(0o000)
    with pytest.raises(MachineError, match="permission denied; .*sudo"):
        pki.load_ca(state)


def test_load_ca_refuses_a_key_of_another_ca(state: Path, tmp_path: Path) -> None:
    pki.init_ca(tmp_path / "other", validity_days=10)
    key = pki.ca_paths(state).ca_key
    key.write_bytes(pki.ca_paths(tmp_path / "other").ca_key.read_bytes())
    with pytest.raises(MachineError, match="is not the key of"):
        pki.load_ca(state)


def test_ca_repr_does_not_show_the_key(ca: pki.CA) -> None:
    assert "key" not in repr(ca).replace("CA(", "")


# -- the server certificate ----------------------------------------------------------------


def test_server_cert_covers_exactly_the_given_ipv4_ipv6_and_dns_names(state: Path, ca: pki.CA) -> None:
    info = ca.issue_server_cert(state, ["10.0.0.1", "fd00::1", "llmgw.example.internal"], validity_days=30, now=NOW)
    paths = pki.ca_paths(state)
    assert mode(paths.server_key) == 0o600
    assert info.sans == ("10.0.0.1", "fd00::1", "llmgw.example.internal")
    assert info.common_name == "10.0.0.1" and not info.is_ca
    assert info.not_after == NOW + timedelta(days=30)
    cert = pki.load_cert(paths.server_cert)
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


def test_reissuing_the_server_cert_makes_a_new_key(state: Path, ca: pki.CA) -> None:
    key = pki.ca_paths(state).server_key
    ca.issue_server_cert(state, ["localhost"], validity_days=1)
    first = key.read_bytes()
    info = ca.issue_server_cert(state, ["127.0.0.1"], validity_days=1)
    assert key.read_bytes() != first
    assert info.sans == ("127.0.0.1",)


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("10.0.0.1:7443", "give it without the port ('10.0.0.1')"),
        ("[fd00::1]:7443", "give it without the port ('fd00::1')"),
        ("bad name", "neither an IP address nor a DNS name"),
        ("-x.example", "neither an IP address nor a DNS name"),
    ],
)
def test_server_cert_refuses_what_is_not_an_address(state: Path, ca: pki.CA, address: str, says: str) -> None:
    with pytest.raises(UsageError) as info:
        ca.issue_server_cert(state, [address], validity_days=1)
    assert repr(address) in str(info.value) and says in str(info.value)
    assert not pki.ca_paths(state).server_cert.exists()


def test_server_cert_needs_an_address(state: Path, ca: pki.CA) -> None:
    with pytest.raises(UsageError, match="--san ADDRESS"):
        ca.issue_server_cert(state, [], validity_days=1)


# -- node certificates ---------------------------------------------------------------------


def test_sign_csr_names_the_node_whatever_the_request_says(ca: pki.CA) -> None:
    _, csr = pki.make_key_and_csr("someone-else")
    cert = load_pem(ca.sign_csr(csr, "node01", validity_days=365, now=NOW))
    info = pki.cert_info(cert)
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


def test_two_certificates_never_share_a_serial(ca: pki.CA) -> None:
    _, csr = pki.make_key_and_csr("node01")
    serials = {load_pem(ca.sign_csr(csr, "node01", validity_days=1)).serial_number for _ in range(5)}
    assert len(serials) == 5


def test_sign_csr_refuses_a_request_altered_after_signing(ca: pki.CA) -> None:
    _, csr_pem = pki.make_key_and_csr("node01")
    der = x509.load_pem_x509_csr(csr_pem).public_bytes(serialization.Encoding.DER)
    tampered = x509.load_der_x509_csr(der.replace(b"node01", b"node02"))
    with pytest.raises(UsageError, match="bad signature: it was altered"):
        ca.sign_csr(tampered.public_bytes(serialization.Encoding.PEM), "node02", validity_days=1)


def test_sign_csr_refuses_what_is_not_a_request(ca: pki.CA) -> None:
    with pytest.raises(UsageError, match="not a PEM certificate signing request"):
        ca.sign_csr(ca.cert_pem(), "node01", validity_days=1)


@pytest.mark.parametrize("node_id", ["", "-node", "node 1", "nöde", "node01\n", "a" * 64, "node/01"])
def test_sign_csr_refuses_a_bad_node_id(ca: pki.CA, node_id: str) -> None:
    _, csr = pki.make_key_and_csr("node01")
    with pytest.raises(UsageError) as info:
        ca.sign_csr(csr, node_id, validity_days=1)
    assert str(info.value).startswith(f"node id {node_id!r} may use only letters, digits")


def test_longest_node_id_is_accepted(ca: pki.CA) -> None:
    _, csr = pki.make_key_and_csr("n")
    assert pki.cert_info(load_pem(ca.sign_csr(csr, "a" * 63, validity_days=1))).common_name == "a" * 63


def test_a_request_from_a_key_made_elsewhere_is_signed_for_that_key(ca: pki.CA) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    cert = load_pem(ca.sign_csr(pki.make_csr(key_pem, "node07"), "node07", validity_days=1))
    assert cert.public_key() == key.public_key()


def test_the_node_keeps_its_key_across_requests(tmp_path: Path, ca: pki.CA) -> None:
    first = pki.write_node_key_and_csr(tmp_path / "agent", "node01")
    assert first == pki.node_paths(tmp_path / "agent")
    assert first.key == tmp_path / "agent/pki/node.key" and first.csr == tmp_path / "agent/pki/node.csr"
    assert mode(first.dir) == 0o700 and mode(first.key) == 0o600
    key = first.key.read_bytes()
    again = pki.write_node_key_and_csr(tmp_path / "agent", "node01")
    assert again.key.read_bytes() == key
    cert_pem = ca.sign_csr(again.csr.read_bytes(), "node01", validity_days=1)
    node_key = serialization.load_pem_private_key(key, password=None)
    assert load_pem(cert_pem).public_key() == node_key.public_key()

    installed = pki.install_node_cert(tmp_path / "agent", cert_pem, ca.cert_pem())
    assert installed.cert.read_bytes() == cert_pem and installed.ca_cert.read_bytes() == ca.cert_pem()


def test_install_refuses_a_certificate_for_another_key(tmp_path: Path, ca: pki.CA) -> None:
    pki.write_node_key_and_csr(tmp_path / "agent", "node01")
    _, other_csr = pki.make_key_and_csr("node01")
    with pytest.raises(UsageError, match="is not for the key in"):
        pki.install_node_cert(tmp_path / "agent", ca.sign_csr(other_csr, "node01", validity_days=1), ca.cert_pem())


def test_an_already_expired_certificate_via_now(ca: pki.CA) -> None:
    _, csr = pki.make_key_and_csr("node01")
    info = pki.cert_info(load_pem(ca.sign_csr(csr, "node01", validity_days=1, now=NOW - timedelta(days=30))))
    assert info.not_after < NOW and not info.valid_at(NOW)
    assert info.valid_at(NOW - timedelta(days=30))


def test_validity_must_be_a_day_or_more(ca: pki.CA) -> None:
    _, csr = pki.make_key_and_csr("node01")
    with pytest.raises(UsageError, match="at least 1 day, got 0"):
        ca.sign_csr(csr, "node01", validity_days=0)


def test_issue_to_dir_writes_key_cert_and_ca_flat(tmp_path: Path, ca: pki.CA) -> None:
    out = tmp_path / "out"
    paths = pki.issue_to_dir(ca, "node04", out, validity_days=7)
    assert (paths.key, paths.cert, paths.ca_cert) == (out / "node.key", out / "node.crt", out / "ca.crt")
    assert mode(out) == 0o700 and mode(paths.key) == 0o600
    cert = pki.load_cert(paths.cert)
    assert pki.cert_info(cert).common_name == "node04"
    assert paths.ca_cert.read_bytes() == ca.cert_pem()
    key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
    assert cert.public_key() == key.public_key()
    with pytest.raises(UsageError, match="node.key already exists"):
        pki.issue_to_dir(ca, "node04", out, validity_days=7)
    assert serialization.load_pem_private_key(paths.key.read_bytes(), password=None).public_key() == key.public_key()


def test_cert_info_from_der_matches_cert_info(state: Path, ca: pki.CA) -> None:
    ca.issue_server_cert(state, ["127.0.0.1", "::1"], validity_days=1)
    cert = pki.load_cert(pki.ca_paths(state).server_cert)
    assert pki.cert_info_from_der(cert.public_bytes(serialization.Encoding.DER)) == pki.cert_info(cert)
    assert attrs.asdict(pki.cert_info(cert))["sans"] == ("127.0.0.1", "::1")


# -- TLS contexts --------------------------------------------------------------------------


def test_server_context_without_a_server_cert_says_how_to_issue_one(state: Path) -> None:
    with pytest.raises(MachineError) as info:
        pki.server_ssl_context(state)
    assert str(info.value).startswith(f"{pki.ca_paths(state).server_cert} does not exist;")
    assert "llmgw ca server-cert" in str(info.value)


def test_client_context_without_a_certificate_names_the_file(tmp_path: Path) -> None:
    files = pki.node_paths(tmp_path)
    with pytest.raises(MachineError) as info:
        pki.client_ssl_context(files.ca_cert, files.cert, files.key)
    assert str(info.value).startswith(f"{files.ca_cert} does not exist;")
    assert "llmgw ca issue" in str(info.value)


def test_contexts_require_tls12_and_trust_only_the_cluster_ca(state: Path, ca: pki.CA, tmp_path: Path) -> None:
    ca.issue_server_cert(state, ["127.0.0.1"], validity_days=1)
    files = pki.issue_to_dir(ca, "node01", tmp_path / "n", validity_days=1)
    server = pki.server_ssl_context(state)
    client = pki.client_ssl_context(files.ca_cert, files.cert, files.key)
    assert server.verify_mode == client.verify_mode == ssl.CERT_REQUIRED
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.check_hostname
    assert [c["subject"] for c in client.get_ca_certs()] == [((("commonName", "llmgw cluster CA"),),)]


# -- describe_tls_failure without sockets --------------------------------------------------


def verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
    err = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    err.verify_code, err.verify_message, err.reason = code, message, "CERTIFICATE_VERIFY_FAILED"
    return err


def alert(reason: str) -> ssl.SSLError:
    err = ssl.SSLError(1, reason.lower())
    err.reason = reason
    return err


@pytest.mark.trio
async def test_describe_finds_the_ssl_error_behind_trio_and_exception_groups() -> None:
    async def handshake_fails() -> None:
        try:
            raise verify_error(10, "certificate has expired")
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError from exc  # what trio.SSLStream raises

    async def unrelated() -> None:
        raise ValueError("unrelated")

    with pytest.RaisesGroup(trio.BrokenResourceError, ValueError) as group:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unrelated)
            nursery.start_soon(handshake_fails)
    assert pki.describe_tls_failure(group.value, side="server") == (
        "the connecting node's certificate has expired (certificate has expired); renew it with "
        "`llmgw node add USER@HOST --reissue`"
    )


@pytest.mark.parametrize(
    "exc",
    [ConnectionRefusedError(111, "refused"), trio.BrokenResourceError(), alert("UNEXPECTED_EOF_WHILE_READING")],
)
def test_describe_says_nothing_about_what_is_not_a_certificate_problem(exc: BaseException) -> None:
    assert pki.describe_tls_failure(exc) is None


def test_describe_names_the_other_end_when_the_side_is_not_given() -> None:
    text = pki.describe_tls_failure(verify_error(20, "unable to get local issuer certificate"))
    assert text is not None and text.startswith("the other end's certificate was not issued by this cluster's CA")


def test_describe_handshake_failure_alert_is_tls12s_missing_certificate() -> None:
    text = pki.describe_tls_failure(alert("SSLV3_ALERT_HANDSHAKE_FAILURE"), side="client")
    assert text is not None and "presented no node certificate" in text


# -- real handshakes on loopback -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Cluster:
    state: Path
    ca_cert: Path
    node: pki.NodePaths
    expired: pki.NodePaths
    foreign: pki.NodePaths


@pytest.fixture
def cluster(tmp_path: Path, state: Path, ca: pki.CA) -> Cluster:
    ca.issue_server_cert(state, ["127.0.0.1"], validity_days=30)
    pki.init_ca(tmp_path / "other", validity_days=30)
    other = pki.load_ca(tmp_path / "other")
    long_ago = datetime.now(timezone.utc) - timedelta(days=30)
    return Cluster(
        state=state,
        ca_cert=pki.ca_paths(state).ca_cert,
        node=pki.issue_to_dir(ca, "node01", tmp_path / "node01", validity_days=30),
        expired=pki.issue_to_dir(ca, "node02", tmp_path / "node02", validity_days=1, now=long_ago),
        foreign=pki.issue_to_dir(other, "node03", tmp_path / "node03", validity_days=30),
    )


async def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, host: str = "127.0.0.1") -> tuple[str, str]:
    """Connect, exchange one byte, and report what each end saw: 'ok <peer CN>' or its diagnosis.

    Under TLS 1.3 the client's handshake completes before the server has judged the client's
    certificate, so the client learns of a refusal only from the alert on its first receive."""
    server_saw: list[str] = []
    served = trio.Event()

    async def handler(stream: trio.SSLStream) -> None:
        try:
            await stream.do_handshake()
            await stream.send_all(await stream.receive_some(1))
            server_saw.append(f"ok {pki.cert_info_from_der(stream.getpeercert(binary_form=True)).common_name}")
        except trio.BrokenResourceError as exc:
            server_saw.append(str(pki.describe_tls_failure(exc, side="server")))
            await pki.send_tls_alert(stream)
        finally:
            served.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            serve = functools.partial(trio.serve_ssl_over_tcp, handler, 0, server_ctx, host=host)
            listeners = await nursery.start(serve)
            port = listeners[0].transport_listener.socket.getsockname()[1]
            stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=client_ctx)
            try:
                await stream.do_handshake()
                await stream.send_all(b"x")
                assert await stream.receive_some(1) == b"x"
                client_saw = f"ok {pki.cert_info_from_der(stream.getpeercert(binary_form=True)).common_name}"
                await stream.aclose()
            except trio.BrokenResourceError as exc:
                client_saw = str(pki.describe_tls_failure(exc, side="client"))
                await pki.send_tls_alert(stream)
            await served.wait()
            nursery.cancel_scope.cancel()
    return client_saw, server_saw[0]


def client_for(cluster: Cluster, files: pki.NodePaths) -> ssl.SSLContext:
    return pki.client_ssl_context(cluster.ca_cert, files.cert, files.key)


@pytest.mark.trio
async def test_a_node_certificate_from_the_cluster_ca_is_accepted(cluster: Cluster) -> None:
    client, server = await handshake(pki.server_ssl_context(cluster.state), client_for(cluster, cluster.node))
    assert (client, server) == ("ok 127.0.0.1", "ok node01")


@pytest.mark.trio
@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
async def test_a_node_certificate_from_another_ca_is_refused(cluster: Cluster, tls12: bool) -> None:
    server_ctx = pki.server_ssl_context(cluster.state)
    if tls12:
        server_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    client, server = await handshake(server_ctx, client_for(cluster, cluster.foreign))
    assert server.startswith(
        "the connecting node's certificate was not issued by this cluster's CA (unable to get local issuer certificate)"
    )
    assert client.startswith("the control plane does not trust the CA that issued this node's certificate")


@pytest.mark.trio
async def test_an_expired_node_certificate_is_refused(cluster: Cluster) -> None:
    client, server = await handshake(pki.server_ssl_context(cluster.state), client_for(cluster, cluster.expired))
    assert server.startswith("the connecting node's certificate has expired (certificate has expired); renew it")
    assert client == (
        "the control plane refused this node's certificate as expired; renew it from the control plane with "
        "`llmgw node add USER@HOST --reissue`"
    )


@pytest.mark.trio
async def test_a_client_without_a_certificate_is_refused(cluster: Cluster) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cluster.ca_cert)
    client, server = await handshake(pki.server_ssl_context(cluster.state), bare)
    assert server.startswith("a client connected without a certificate")
    assert client.startswith("the control plane requires a node certificate and this agent sent none")


@pytest.mark.trio
async def test_dialling_an_address_the_server_certificate_does_not_cover(cluster: Cluster) -> None:
    # The certificate says 127.0.0.1; 127.0.0.2 reaches the same machine (all of 127/8 is loopback on Linux).
    client, server = await handshake(
        pki.server_ssl_context(cluster.state), client_for(cluster, cluster.node), host="127.0.0.2"
    )
    assert client.startswith(
        "the control plane's certificate does not cover the address this node dialled "
        "(IP address mismatch, certificate is not valid for '127.0.0.2'); on the control plane add it with "
        "`llmgw ca server-cert --san ADDRESS ...`"
    )
    assert server.startswith("the connecting node refused this control plane's certificate (bad certificate)")


@pytest.mark.trio
async def test_a_control_plane_of_another_cluster_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    foreign_ca = tmp_path / "other/ca/ca.crt"
    client_ctx = pki.client_ssl_context(foreign_ca, cluster.foreign.cert, cluster.foreign.key)
    client, server = await handshake(pki.server_ssl_context(cluster.state), client_ctx)
    assert client.startswith("the control plane's certificate was not issued by this cluster's CA")
    assert server.startswith("the connecting node does not trust the CA that issued this control plane's certificate")
