"""Hostile peers against a helper's llama.cpp RPC tunnel (`agent.rpctunnel.TunnelServer`), on
real sockets on loopback with real TLS: a FIN or an RST at many bytes of the TLS handshake and of
what follows it, garbage instead of TLS or inside it, a stalled handshake, thousands of bare
connections, a port full of silent ones, peers with the wrong certificate (another node, a
gateway, another CA, none) that send RPC commands anyway.

Behind the tunnel stands an echo server in place of ggml-rpc-server, counting its connections.
After each test, `assert_serving`: the serving node (node-0, through its `TunnelClient`, as
llama-server would use it) gets its bytes through and back unchanged; no hostile peer's
connection ever reached the rpc-server (it saw the serving node's alone); every connection has
ended; nothing was logged at error level. Deadlines are shortened by monkeypatching; each peer
is bounded by its sockets' timeouts."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from agent import rpctunnel
from agent.peers import peer_client_ssl_context, peer_ssl_context
from agent.rpctunnel import MAX_CONNECTIONS, Helper, TunnelClient, TunnelServer
from llmgw.pki.ca import new_ca
from llmgw.pki.files import NodePaths, issue_gateway_to_dir, issue_to_dir, load_cert
from llmgw.wakeup import Wakeup
from testlib import hostile

pytestmark = pytest.mark.trio

HOST = "127.0.0.1"
WITHIN_S = 60.0
HELLO = b"\x0e" + (24).to_bytes(8, "little") + bytes(24)  # an RPC HELLO, as llama-server sends first


@attrs.frozen(kw_only=True)
class Pki:
    helper: NodePaths  # node-1: the tunnel's
    serving: NodePaths  # node-0: the one admitted
    other: NodePaths  # node-2: of the cluster, not admitted
    stranger: NodePaths  # node-0 of another CA
    gateway: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = new_ca(validity_days=3)
    root = tmp_path_factory.mktemp("pki")
    return Pki(
        helper=issue_to_dir(ca, "node-1", root / "node-1", validity_days=3),
        serving=issue_to_dir(ca, "node-0", root / "node-0", validity_days=3),
        other=issue_to_dir(ca, "node-2", root / "node-2", validity_days=3),
        stranger=issue_to_dir(new_ca(validity_days=3), "node-0", root / "stranger", validity_days=3),
        gateway=issue_gateway_to_dir(ca, "gw1", root / "gw1", validity_days=3).dir,
    )


class Echo:
    """In place of ggml-rpc-server: echoes; counts the connections it got."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        async with stream:
            try:
                while data := await stream.receive_some(1 << 16):
                    await stream.send_all(data)
            except trio.BrokenResourceError:
                pass


class Connections:
    """The tunnel's connection handler, counted, with a wake-up as each ends."""

    def __init__(self, handle: Callable[[trio.abc.Stream], Awaitable[None]]) -> None:
        self.handle = handle
        self.open = 0
        self.served = 0
        self.ended = Wakeup()

    async def __call__(self, stream: trio.abc.Stream) -> None:
        self.open += 1
        self.served += 1
        try:
            await self.handle(stream)
        finally:
            self.open -= 1
            self.ended.fire()

    async def all_closed(self, within: float) -> None:
        with trio.fail_after(within):
            while True:
                ended = self.ended.next()
                if self.open == 0:
                    return
                await ended.wait()


@attrs.define
class Tunnel:
    server: TunnelServer
    echo: Echo
    connections: Connections
    client: TunnelClient  # the serving node's
    local: int  # its local end, as llama-server's --rpc names it
    pki: Pki
    good: int = 0  # connections the serving node made through it

    @property
    def port(self) -> int:
        return self.server.port

    def ctx(self, who: str) -> ssl.SSLContext:
        """A client's TLS as `who` (serving, other, stranger, gateway, none)."""
        if who == "none":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        if who == "gateway":
            return peer_client_ssl_context(self.pki.gateway / "gateway.crt", self.pki.gateway / "gateway.key")
        paths: NodePaths = getattr(self.pki, who)
        return peer_client_ssl_context(paths.cert, paths.key)


@pytest.fixture
async def tunnel(nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture) -> Tunnel:
    caplog.set_level(logging.WARNING)
    echo = Echo()
    await nursery.start(echo.serve)
    server = TunnelServer(peer_ssl_context(pki.helper), admits="node-0", target=(HOST, echo.port))
    connections = Connections(server._connection)
    server._connection = connections  # type: ignore[method-assign]
    port = await nursery.start(server.serve, HOST, 0)
    helper = Helper(node="node-1", address=HOST, port=port)
    client = TunnelClient(
        [helper], peer_client_ssl_context(pki.serving.cert, pki.serving.key), load_cert(pki.serving.ca_cert)
    )
    (local,) = await nursery.start(client.serve)
    return Tunnel(server=server, echo=echo, connections=connections, client=client, local=local, pki=pki)


def through(local: int, payload: bytes) -> bytes:
    """What llama-server would do: its bytes to the local end, as many read back (blocking)."""
    sock = hostile.connect(HOST, local)
    try:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        return got
    finally:
        sock.close()


async def assert_serving(t: Tunnel, caplog: pytest.LogCaptureFixture) -> None:
    """The serving node's bytes go through and back at once; no hostile connection reached the
    rpc-server; once the peers are gone every connection has ended; no traceback was logged."""
    payload = HELLO + os.urandom(3 << 20)
    with trio.fail_after(10):
        got = await run(through, t.local, payload)
    assert got == payload
    t.good += 1
    assert t.echo.accepted == t.good, (t.echo.accepted, t.good)  # the serving node's alone
    await t.connections.all_closed(within=5)
    assert t.server.stats.open.get(listener=rpctunnel.LISTENER) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage(), r.exc_text) for r in errors]


async def run(fn: Callable[..., object], *args: object, **kwargs: object) -> Any:
    """A blocking peer, in a thread, ended by its sockets' timeouts."""
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)


async def gone(t: Tunnel) -> None:
    with trio.fail_after(10):
        await trio.testing.wait_all_tasks_blocked(cushion=0.2)
        await t.connections.all_closed(within=10)


def tls(t: Tunnel, who: str) -> ssl.SSLSocket:
    sock = hostile.connect(HOST, t.port)
    return t.ctx(who).wrap_socket(sock)


# -- the tests --------------------------------------------------------------------------------


async def test_a_fin_or_rst_at_any_byte_of_the_handshake_or_after_it(
    tunnel: Tunnel, caplog: pytest.LogCaptureFixture
) -> None:
    t = tunnel
    ctx = t.ctx("serving")
    with trio.fail_after(WITHIN_S):
        # The whole command, then FIN: relayed to the rpc-server; the FIN ends the connection
        # (either side's end ends both: llama.cpp's RPC never half-closes), its echo or not.
        whole = await run(hostile.tls_cut, HOST, t.port, ctx, HELLO, how="fin")
        assert whole.request > 0 and whole.answer in (b"", HELLO), whole
        reached = 1  # the serving node's connections that may have reached the rpc-server
        in_handshake = set(range(1, 12)) | set(range(12, whole.handshake + 8, max(1, whole.handshake // 40)))
        for how in ("fin", "rst"):
            for n in sorted(in_handshake):
                got = await run(hostile.tls_cut, HOST, t.port, ctx, HELLO, in_handshake=n, how=how)
                assert got.answer == b"" and got.request == 0, (how, n, got)
            # The handshake whole and part of a command: relayed as far as it came, then ended.
            for n in (1, 5, whole.request - 1):
                await run(hostile.tls_cut, HOST, t.port, ctx, HELLO, in_request=n, how=how)
                reached += 1
    assert len(in_handshake) > 40
    await gone(t)
    # A cut at the handshake's last bytes may leave it whole (its length varies by a byte or
    # two), and a reset may discard a handshake's last bytes unread: the serving node's own
    # connections, relayed or not. Those alone may have reached the rpc-server.
    reached += 2 * sum(1 for n in in_handshake if n >= whole.handshake - 2)
    assert t.echo.accepted <= reached, (t.echo.accepted, reached)
    t.good = t.echo.accepted
    await assert_serving(t, caplog)


@pytest.mark.parametrize("who", ["other", "stranger", "gateway", "none"])
async def test_the_wrong_certificate_never_reaches_the_rpc_server(
    tunnel: Tunnel, caplog: pytest.LogCaptureFixture, who: str
) -> None:
    t = tunnel

    def try_commands() -> bytes:
        """The handshake (TLS 1.3: it may complete before the server has read the client's
        certificate), then RPC commands: nothing comes back, the connection ends."""
        try:
            sock = tls(t, who)
        except (ssl.SSLError, ConnectionError):
            return b""
        try:
            sock.sendall(HELLO * 100)
            return hostile.read_all(sock)
        except (ssl.SSLError, ConnectionError):
            return b""
        finally:
            sock.close()

    with trio.fail_after(WITHIN_S):
        for _ in range(5):
            assert await run(try_commands) == b""
    await gone(t)
    assert t.echo.accepted == 0
    await assert_serving(t, caplog)


async def test_garbage_instead_of_tls_and_inside_it(tunnel: Tunnel, caplog: pytest.LogCaptureFixture) -> None:
    t = tunnel
    tls_hello_start = bytes.fromhex("160301020001") + b"\x00" * 40
    huge_record = bytes.fromhex("16030140ff") + b"\x01" * 200

    def raw_after_handshake(data: bytes) -> bytes:
        sock = tls(t, "serving")
        raw = socket.socket(fileno=socket.dup(sock.fileno()))
        try:
            raw.sendall(data)
            raw.settimeout(hostile.TIMEOUT_S)
            return hostile.read_all(raw)
        finally:
            raw.close()
            sock.close()

    with trio.fail_after(WITHIN_S):
        for data in (HELLO, b"\x00" * 100, tls_hello_start, huge_record, bytes(range(256)) * 16):
            for offset in (1, len(data) // 2, len(data)):
                for how in ("fin", "rst"):
                    answer = await run(hostile.cut_at, HOST, t.port, data, offset, how=how)
                    assert HELLO not in answer, answer
        # Bytes that are no TLS record after a good handshake: the connection ends (the serving
        # node's: relayed to the rpc-server until then, so it counts as one of its).
        for garbage in (b"\x00" * 100, bytes.fromhex("170303ffff") + b"\x01" * 64):
            await run(raw_after_handshake, garbage)
            t.good += 1
    await gone(t)
    assert t.echo.accepted <= t.good
    t.good = t.echo.accepted  # a connection cut before the rpc-server was dialled never got there
    await assert_serving(t, caplog)


async def test_a_stalled_handshake_is_closed_at_its_deadline(
    tunnel: Tunnel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpctunnel, "HANDSHAKE_TIMEOUT_S", 0.5)
    t = tunnel

    def stall(first: int) -> float:
        sock = hostile.connect(HOST, t.port)
        try:
            if first:
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                conn = t.ctx("serving").wrap_bio(incoming, outgoing)
                try:
                    conn.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                sock.sendall(outgoing.read()[:first])
            started = time.monotonic()
            hostile.read_all(sock)
            return time.monotonic() - started
        finally:
            sock.close()

    with trio.fail_after(WITHIN_S):
        for first in (0, 1, 40, 10_000):
            took = await run(stall, first)
            assert 0.3 < took < 2.5, (first, took)  # closed by the server, not the socket's timeout (5 s)
    await assert_serving(t, caplog)


async def test_two_thousand_bare_connections(tunnel: Tunnel, caplog: pytest.LogCaptureFixture) -> None:
    t = tunnel

    def flood() -> None:
        socks = []
        try:
            for _ in range(2000):
                socks.append(hostile.connect(HOST, t.port))
        finally:
            for n, sock in enumerate(socks):
                if n % 2:
                    hostile.reset(sock)
                else:
                    sock.close()

    with trio.fail_after(WITHIN_S):
        await run(flood)
        await gone(t)
        busy = t.server.stats.shed.get(listener=rpctunnel.LISTENER, reason="busy")
        assert t.connections.served + busy == 2000, (t.connections.served, busy)
        await assert_serving(t, caplog)


async def test_silent_connections_at_the_cap_do_not_keep_the_serving_node_out(
    tunnel: Tunnel, caplog: pytest.LogCaptureFixture
) -> None:
    t = tunnel
    socks = await run(hostile.idle, HOST, t.port, MAX_CONNECTIONS + 8)
    try:
        with trio.fail_after(WITHIN_S):
            await trio.testing.wait_all_tasks_blocked(cushion=0.2)
            assert t.connections.open == MAX_CONNECTIONS
            with trio.fail_after(5):  # well before their handshake's deadline
                got = await run(through, t.local, HELLO)
            assert got == HELLO
            t.good += 1
    finally:
        for sock in socks:
            sock.close()
    await gone(t)
    await assert_serving(t, caplog)
