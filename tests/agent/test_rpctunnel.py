"""The tunnel that carries llama.cpp's RPC between the agents of one replica (`agent.rpctunnel`),
on real sockets on 127.0.0.1 with real TLS and certificates of a test CA: bytes both ways
through both ends, who is admitted (the serving node alone; not another node, a gateway, a peer
without a certificate or of another CA), what the serving node is told when a helper cannot be
reached and why, and how a relayed connection's end is told.

The stand-in rpc-server is a trio listener that echoes or closes; the waits are bounded by
short connect deadlines (monkeypatched) on the real clock, since the sockets are real."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent import rpctunnel
from agent.peers import peer_client_ssl_context, peer_ssl_context
from agent.rpctunnel import Helper, HelperUnreachable, TunnelClient, TunnelServer, relay
from llmgw.pki.ca import new_ca
from llmgw.pki.files import NodePaths, issue_gateway_to_dir, issue_to_dir, load_cert

pytestmark = pytest.mark.trio

HOST = "127.0.0.1"
WITHIN_S = 20.0


@attrs.frozen(kw_only=True)
class Pki:
    serving: NodePaths  # node-0: rank 0, the serving node
    helper: NodePaths  # node-1: the helper whose rpc-server is tunnelled
    other: NodePaths  # node-2: a node of the cluster, not this replica's serving node
    stranger: NodePaths  # node-0 again, of another CA
    gateway: Path  # a gateway's pki directory (gateway.crt, gateway.key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = new_ca(validity_days=3)
    root = tmp_path_factory.mktemp("pki")
    gateway = issue_gateway_to_dir(ca, "gw1", root / "gw1", validity_days=3)
    return Pki(
        serving=issue_to_dir(ca, "node-0", root / "node-0", validity_days=3),
        helper=issue_to_dir(ca, "node-1", root / "node-1", validity_days=3),
        other=issue_to_dir(ca, "node-2", root / "node-2", validity_days=3),
        stranger=issue_to_dir(new_ca(validity_days=3), "node-0", root / "stranger", validity_days=3),
        gateway=gateway.dir,
    )


class RpcStandIn:
    """Where the rpc-server would be: echoes what comes, or (`close_after`) closes after that
    many bytes; counts its connections."""

    def __init__(self) -> None:
        self.accepted = 0
        self.close_after: int | None = None
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        seen = 0
        async with stream:
            try:
                while data := await stream.receive_some(1 << 16):
                    seen += len(data)
                    if self.close_after is not None and seen >= self.close_after:
                        return
                    await stream.send_all(data)
            except trio.BrokenResourceError:
                return


def client_of(paths: NodePaths, helper: Helper) -> TunnelClient:
    return TunnelClient([helper], peer_client_ssl_context(paths.cert, paths.key), load_cert(paths.ca_cert))


async def helper_tunnel(nursery: trio.Nursery, pki: Pki, rpc: RpcStandIn, *, admits: str = "node-0") -> Helper:
    await nursery.start(rpc.serve)
    server = TunnelServer(peer_ssl_context(pki.helper), admits=admits, target=(HOST, rpc.port))
    port = await nursery.start(server.serve, HOST, 0)
    return Helper(node="node-1", address=HOST, port=port)


async def through(port: int, payload: bytes) -> bytes:
    """`payload` sent to 127.0.0.1:`port` (the serving node's local end) as llama-server would,
    and as much read back."""
    stream = await trio.open_tcp_stream(HOST, port)
    got = bytearray()
    async with stream:

        async def send() -> None:
            view = memoryview(payload)
            for at in range(0, len(view), 1 << 20):
                await stream.send_all(view[at : at + (1 << 20)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while len(got) < len(payload):
                data = await stream.receive_some(1 << 20)
                if not data:
                    break
                got += data
    return bytes(got)


async def test_bytes_go_both_ways_through_both_ends_unchanged(nursery: trio.Nursery, pki: Pki) -> None:
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    client = client_of(pki.serving, helper)
    (port,) = await nursery.start(client.serve)
    payload = os.urandom(24 << 20)  # larger than any socket buffer: the relay must read and write at once
    with trio.fail_after(WITHIN_S):
        got = await through(port, payload)
        small = await through(port, b"\x0e" + bytes(8))  # an RPC command's first bytes alone
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    assert small == b"\x0e" + bytes(8)
    assert rpc.accepted == 2


async def test_the_serving_node_reaches_its_helper(nursery: trio.Nursery, pki: Pki) -> None:
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    with trio.fail_after(WITHIN_S):
        await client_of(pki.serving, helper).reach(helper)


@pytest.mark.parametrize("who", ["other", "stranger", "gateway"])
async def test_anyone_but_the_serving_node_is_refused_before_the_rpc_server(
    nursery: trio.Nursery, pki: Pki, who: str
) -> None:
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    if who == "gateway":
        cert, key, ca = pki.gateway / "gateway.crt", pki.gateway / "gateway.key", pki.serving.ca_cert
    else:
        paths: NodePaths = getattr(pki, who)
        cert, key, ca = paths.cert, paths.key, pki.serving.ca_cert  # it checks the helper as a cluster node would
    client = TunnelClient([helper], peer_client_ssl_context(cert, key), load_cert(ca))
    with trio.fail_after(WITHIN_S):
        # Its handshake may complete (TLS 1.3 sends the client's certificate after the server's
        # Finished): the server closes without relaying a byte either way.
        try:
            stream = await client.dial(helper)
        except HelperUnreachable as exc:
            assert "refused the TLS handshake" in str(exc) and "node-1" in str(exc), exc
        else:
            async with stream:
                try:
                    await stream.send_all(b"\x0e" + bytes(32))
                    assert await stream.receive_some(100) == b""
                except trio.BrokenResourceError:
                    pass
    assert rpc.accepted == 0


async def test_a_peer_without_a_certificate_is_refused(nursery: trio.Nursery, pki: Pki) -> None:
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.verify_mode = ssl.CERT_NONE
    client = TunnelClient([helper], bare, load_cert(pki.serving.ca_cert))
    with trio.fail_after(WITHIN_S):
        try:
            stream = await client.dial(helper)
        except HelperUnreachable as exc:
            assert "refused the TLS handshake" in str(exc), exc
        else:
            async with stream:
                with pytest.raises(trio.BrokenResourceError):
                    await stream.send_all(b"x")
                    await stream.receive_some(100)
    assert rpc.accepted == 0


async def test_a_server_that_is_not_the_helper_is_not_relayed_to(nursery: trio.Nursery, pki: Pki) -> None:
    """node-2's port where node-1's should be: the serving node names what it found."""
    rpc = RpcStandIn()
    await nursery.start(rpc.serve)
    impostor = TunnelServer(peer_ssl_context(pki.other), admits="node-0", target=(HOST, rpc.port))
    port = await nursery.start(impostor.serve, HOST, 0)
    helper = Helper(node="node-1", address=HOST, port=port)
    with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable) as caught:
        await client_of(pki.serving, helper).reach(helper)
    assert "is not that node: it is 'node-2'" in str(caught.value) and f"{HOST}:{port}" in str(caught.value)


async def test_unreachable_helpers_are_named_with_what_failed(
    nursery: trio.Nursery, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpctunnel, "CONNECT_TIMEOUT_S", 0.3)
    # Nothing listens: refused.
    closed = trio.socket.socket()
    await closed.bind((HOST, 0))
    free = closed.getsockname()[1]
    closed.close()
    nobody = Helper(node="node-1", address=HOST, port=free)
    with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable) as refused:
        await client_of(pki.serving, nobody).reach(nobody)
    assert "helper node node-1 at 127.0.0.1" in str(refused.value) and "connection refused" in str(refused.value)
    # No address known for it.
    unnamed = Helper(node="node-1", address="", port=free)
    with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable, match="the control plane named no address"):
        await client_of(pki.serving, unnamed).reach(unnamed)
    # A listener that never answers the handshake: timed out.
    mute = trio.socket.socket()
    await mute.bind((HOST, 0))
    mute.listen(8)
    silent = Helper(node="node-1", address=HOST, port=mute.getsockname()[1])
    try:
        with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable) as slow:
            await client_of(pki.serving, silent).reach(silent)
    finally:
        mute.close()
    assert "no answer within 0.3 s" in str(slow.value)


async def test_waiting_for_a_helper_that_comes_late_and_for_one_that_never_does(
    nursery: trio.Nursery, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpctunnel, "CONNECT_TIMEOUT_S", 0.5)
    rpc = RpcStandIn()
    await nursery.start(rpc.serve)
    server = TunnelServer(peer_ssl_context(pki.helper), admits="node-0", target=(HOST, rpc.port))
    probe = trio.socket.socket()
    await probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    helper = Helper(node="node-1", address=HOST, port=port)
    client = client_of(pki.serving, helper)
    said: list[str] = []
    started = trio.Event()

    def on_wait(text: str) -> None:
        said.append(text)
        started.set()

    async def late() -> None:
        await started.wait()  # after the first refusal: the helper's rpc-server has started now
        await nursery.start(server.serve, HOST, port)

    nursery.start_soon(late)
    with trio.fail_after(WITHIN_S):
        await client.wait_reachable(within_s=10, on_wait=on_wait, retry_s=0.05)
    assert said and said[0].startswith("waiting for helper nodes: helper node node-1") and "refused" in said[0]
    # One that never comes: the member fails naming it.
    gone = Helper(node="node-7", address=HOST, port=port + 1 if port < 65535 else port - 1)
    with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable) as caught:
        await client_of(pki.serving, gone).wait_reachable(within_s=0.3, retry_s=0.05)
    assert "helper nodes not reached within 0.3 s: helper node node-7" in str(caught.value)


async def test_a_helper_that_ends_a_connection_is_lost_and_the_serving_node_ending_one_is_not(
    nursery: trio.Nursery, pki: Pki
) -> None:
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    client = client_of(pki.serving, helper)
    (port,) = await nursery.start(client.serve)
    with trio.fail_after(WITHIN_S):
        # llama-server ends its connection: nothing lost.
        assert await through(port, b"hello") == b"hello"
        assert client.lost_how == ""
        # The rpc-server ends one (it exited): the serving node hears of it, the helper named.
        rpc.close_after = 3
        lost = client.lost.next()
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            await stream.send_all(b"abcdef")
            assert await stream.receive_some(100) == b""  # closed through the tunnel
        await lost.wait()
    assert "helper node node-1" in client.lost_how and "ended on its side" in client.lost_how


@pytest.mark.parametrize("closing", ["a", "b"])
async def test_relay_tells_which_side_ended_first(closing: str) -> None:
    a_near, a_far = trio.testing.memory_stream_pair()
    b_near, b_far = trio.testing.memory_stream_pair()
    result: list[rpctunnel.Ended] = []

    async def run() -> None:
        result.append(await relay(a_far, b_far))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await a_near.send_all(b"to b")
        assert await b_near.receive_some(100) == b"to b"
        await b_near.send_all(b"to a")
        assert await a_near.receive_some(100) == b"to a"
        await (a_near if closing == "a" else b_near).aclose()
    assert result == [rpctunnel.Ended(closing, "eof")]


async def test_a_tunnel_connection_whose_peer_vanishes_is_ended_by_the_kernel(nursery: trio.Nursery, pki: Pki) -> None:
    """Keepalive probes and a user timeout on the tunnel's sockets: a peer gone without a FIN
    (powered off, cut off) does not hold the helper's one-client rpc-server for ever."""
    rpc = RpcStandIn()
    helper = await helper_tunnel(nursery, pki, rpc)
    with trio.fail_after(WITHIN_S):
        stream = await client_of(pki.serving, helper).dial(helper)
    async with stream:
        raw = stream.transport_stream
        assert isinstance(raw, trio.SocketStream)
        assert raw.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == rpctunnel.SILENT_S * 1000
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == rpctunnel.SILENT_S // 2


async def test_helpers_are_waited_for_together_and_one_still_dialling_at_the_end_is_named(
    nursery: trio.Nursery, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper that answers nothing (its first dial still under way when the wait ends) delays
    neither the wait's end nor the other helper's check, and is named all the same."""
    monkeypatch.setattr(rpctunnel, "CONNECT_TIMEOUT_S", 5.0)
    rpc = RpcStandIn()
    good = await helper_tunnel(nursery, pki, rpc)
    mute = trio.socket.socket()
    await mute.bind((HOST, 0))
    mute.listen(8)
    silent = Helper(node="node-3", address=HOST, port=mute.getsockname()[1])
    client = TunnelClient(
        [silent, good], peer_client_ssl_context(pki.serving.cert, pki.serving.key), load_cert(pki.serving.ca_cert)
    )
    try:
        started = trio.current_time()
        with trio.fail_after(WITHIN_S), pytest.raises(HelperUnreachable) as caught:
            await client.wait_reachable(within_s=0.5)
        assert trio.current_time() - started < 2.0  # not the 5 s of the silent one's dial
    finally:
        mute.close()
    assert (
        str(caught.value)
        == f"helper nodes not reached within 0.5 s: helper node node-3 at {HOST}:{silent.port}: no answer yet"
    )
    assert rpc.accepted == 1  # the good one was reached meanwhile
