"""The TLS of the agent link: each end's context, and real handshakes between the two ends on
loopback, including each way a handshake is refused and what each end then says."""

from __future__ import annotations

import functools
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.errors import MachineError
from llmgw.pki.ca import CA, cert_info_from_der
from llmgw.pki.files import (
    NodePaths,
    ca_paths,
    gateway_paths,
    init_ca,
    issue_gateway_to_dir,
    issue_server_cert,
    issue_to_dir,
    load_ca,
    node_paths,
)
from llmgw.pki.tls import client_ssl_context, gateway_ssl_context, send_tls_alert, server_ssl_context
from llmgw.pki.tlsdiag import describe_tls_failure

# -- TLS contexts --------------------------------------------------------------------------


def test_server_context_without_a_server_cert_says_how_to_issue_one(state: Path) -> None:
    with pytest.raises(MachineError) as info:
        server_ssl_context(state)
    assert str(info.value).startswith(f"{ca_paths(state).server_cert} does not exist;")
    assert "llmgw ca server-cert" in str(info.value)


def test_client_context_without_a_certificate_names_the_file(tmp_path: Path) -> None:
    files = node_paths(tmp_path)
    with pytest.raises(MachineError) as info:
        client_ssl_context(files.ca_cert, files.cert, files.key)
    assert str(info.value).startswith(f"{files.ca_cert} does not exist;")
    assert "llmgw ca issue" in str(info.value)


def test_contexts_require_tls12_and_trust_only_the_cluster_ca(state: Path, ca: CA, tmp_path: Path) -> None:
    issue_server_cert(ca, state, ["127.0.0.1"], validity_days=1)
    files = issue_to_dir(ca, "node01", tmp_path / "n", validity_days=1)
    server = server_ssl_context(state)
    client = client_ssl_context(files.ca_cert, files.cert, files.key)
    assert server.verify_mode == client.verify_mode == ssl.CERT_REQUIRED
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.check_hostname
    assert [c["subject"] for c in client.get_ca_certs()] == [((("commonName", "llmgw cluster CA"),),)]


def test_a_context_refuses_a_key_others_can_read(state: Path, ca: CA, tmp_path: Path) -> None:
    files = issue_to_dir(ca, "node01", tmp_path / "n", validity_days=1)
    files.key.chmod(0o644)
    with pytest.raises(MachineError) as info:
        client_ssl_context(files.ca_cert, files.cert, files.key)
    assert f"{files.key} has mode 0644" in str(info.value) and f"`chmod 600 {files.key}`" in str(info.value)
    issue_server_cert(ca, state, ["127.0.0.1"], validity_days=1)
    ca_paths(state).server_key.chmod(0o640)
    with pytest.raises(MachineError, match="server.key has mode 0640"):
        server_ssl_context(state)


def test_a_gateway_context_takes_a_gateway_certificate_and_names_the_fix_for_anything_else(
    ca: CA, tmp_path: Path
) -> None:
    paths = issue_gateway_to_dir(ca, "gw1", tmp_path / "gw", validity_days=1)
    context = gateway_ssl_context(paths.dir)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "llmgw cluster CA"),),)]
    with pytest.raises(MachineError) as info:
        gateway_ssl_context(tmp_path / "empty")
    assert str(info.value).startswith(f"{gateway_paths(tmp_path / 'empty').cert} does not exist;")
    assert "`llmgw ca issue --gateway NAME --out DIR`" in str(info.value)
    # A node's certificate and key where the gateway's go: said before any connection.
    node = issue_to_dir(ca, "node01", tmp_path / "n", validity_days=1)
    node.cert.rename(paths.cert)
    node.key.rename(paths.key)
    with pytest.raises(MachineError) as info:
        gateway_ssl_context(paths.dir)
    assert "(CN=node01) is not a gateway certificate (its role: llmgw-node)" in str(info.value)
    assert "llmgw ca issue --gateway NAME" in str(info.value)


def test_a_certificate_that_is_not_one_is_named_with_the_fix(state: Path, ca: CA, tmp_path: Path) -> None:
    files = issue_to_dir(ca, "node01", tmp_path / "n", validity_days=1)
    files.cert.write_bytes(b"junk")
    with pytest.raises(MachineError) as info:
        client_ssl_context(files.ca_cert, files.cert, files.key)
    assert str(info.value).startswith(f"cannot use {files.cert} with {files.key} (")
    assert "llmgw node add USER@HOST" in str(info.value)


# -- real handshakes on loopback -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Cluster:
    state: Path
    ca_cert: Path
    node: NodePaths
    expired: NodePaths
    foreign: NodePaths


@pytest.fixture
def cluster(tmp_path: Path, state: Path, ca: CA) -> Cluster:
    issue_server_cert(ca, state, ["127.0.0.1"], validity_days=30)
    init_ca(tmp_path / "other", validity_days=30)
    other = load_ca(tmp_path / "other")
    long_ago = datetime.now(timezone.utc) - timedelta(days=30)
    return Cluster(
        state=state,
        ca_cert=ca_paths(state).ca_cert,
        node=issue_to_dir(ca, "node01", tmp_path / "node01", validity_days=30),
        expired=issue_to_dir(ca, "node02", tmp_path / "node02", validity_days=1, now=long_ago),
        foreign=issue_to_dir(other, "node03", tmp_path / "node03", validity_days=30),
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
            server_saw.append(f"ok {cert_info_from_der(stream.getpeercert(binary_form=True)).common_name}")
        except trio.BrokenResourceError as exc:
            server_saw.append(str(describe_tls_failure(exc, side="server")))
            await send_tls_alert(stream)
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
                client_saw = f"ok {cert_info_from_der(stream.getpeercert(binary_form=True)).common_name}"
                await stream.aclose()
            except trio.BrokenResourceError as exc:
                client_saw = str(describe_tls_failure(exc, side="client"))
                await send_tls_alert(stream)
            await served.wait()
            nursery.cancel_scope.cancel()
    return client_saw, server_saw[0]


def client_for(cluster: Cluster, files: NodePaths) -> ssl.SSLContext:
    return client_ssl_context(cluster.ca_cert, files.cert, files.key)


@pytest.mark.trio
async def test_a_node_certificate_from_the_cluster_ca_is_accepted(cluster: Cluster) -> None:
    client, server = await handshake(server_ssl_context(cluster.state), client_for(cluster, cluster.node))
    assert (client, server) == ("ok 127.0.0.1", "ok node01")


@pytest.mark.trio
@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
async def test_a_node_certificate_from_another_ca_is_refused(cluster: Cluster, tls12: bool) -> None:
    server_ctx = server_ssl_context(cluster.state)
    if tls12:
        server_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    client, server = await handshake(server_ctx, client_for(cluster, cluster.foreign))
    assert server.startswith(
        "the connecting node's certificate was not issued by this cluster's CA (unable to get local issuer certificate)"
    )
    assert client.startswith("the control plane does not trust the CA that issued this node's certificate")


@pytest.mark.trio
async def test_an_expired_node_certificate_is_refused(cluster: Cluster) -> None:
    client, server = await handshake(server_ssl_context(cluster.state), client_for(cluster, cluster.expired))
    assert server.startswith("the connecting node's certificate has expired (certificate has expired); renew it")
    assert client == (
        "the control plane refused this node's certificate as expired; renew it from the control plane with "
        "`llmgw node add USER@HOST --reissue`"
    )


@pytest.mark.trio
async def test_a_client_without_a_certificate_is_refused(cluster: Cluster) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cluster.ca_cert)
    client, server = await handshake(server_ssl_context(cluster.state), bare)
    assert server.startswith("a client connected without a certificate")
    assert client.startswith("the control plane requires a node certificate and this agent sent none")


@pytest.mark.trio
async def test_dialling_an_address_the_server_certificate_does_not_cover(cluster: Cluster) -> None:
    # The certificate says 127.0.0.1; 127.0.0.2 reaches the same machine (all of 127/8 is loopback on Linux).
    client, server = await handshake(
        server_ssl_context(cluster.state), client_for(cluster, cluster.node), host="127.0.0.2"
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
    client_ctx = client_ssl_context(foreign_ca, cluster.foreign.cert, cluster.foreign.key)
    client, server = await handshake(server_ssl_context(cluster.state), client_ctx)
    assert client.startswith("the control plane's certificate was not issued by this cluster's CA")
    assert server.startswith("the connecting node does not trust the CA that issued this control plane's certificate")
