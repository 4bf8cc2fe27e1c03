"""Hostile peers against a node's weights port (`agent.peers.PeerServer`), on real sockets on
loopback with real TLS: what a broken or malicious client does to it (testlib.hostile's peers,
and TLS ones whose handshake runs in memory so the test decides what reaches the wire).

The server holds one small file whole (three pieces, the last short) and one large sparse one
whose pieces (16 MiB) outlast any socket's buffers. Each test misbehaves in one way: a FIN or an
RST at many bytes of the TLS handshake and of a request head, garbage instead of TLS or inside
it, a stalled handshake, a trickled head, a piece not read, more piece requests than upload
places, thousands of bare connections, bad ranges, a port full of idle connections. After each,
`assert_serving`: a proper `PeerClient` gets the piece list and every piece right, every upload
place is back once the peers are gone, every connection has ended, and nothing was logged at
error level (a traceback). Deadlines are shortened by monkeypatching the module's constants;
the waits for them are on trio's clock, bounded, and the sockets' own timeouts bound each peer."""

from __future__ import annotations

import hashlib
import logging
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

from agent import peers
from agent.peers import MAX_CONNECTIONS, Members, Peer, PeerClient, PeerFailed, PeerServer, peer_ssl_context
from agent.weights import WeightsStore
from llmgw import weightpieces
from llmgw.http.send import LINGER_S
from llmgw.pki.ca import new_ca
from llmgw.pki.files import NodePaths, issue_to_dir
from llmgw.wakeup import Wakeup
from llmgw.weightpieces import UPLOADS
from llmgw.wire import agent_link as w
from testlib import hostile

pytestmark = pytest.mark.trio

SIZE = 2 * weightpieces.PIECE_MIN + 777  # three pieces of 1 MiB, the last 777 bytes
CONTENT = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(SIZE // 32 + 1))[:SIZE]
DIGEST = hashlib.sha256(CONTENT).hexdigest()
HASHES = [weightpieces.hash_piece(CONTENT[a : a + n]) for a, n in (weightpieces.span(i, SIZE) for i in range(3))]
# Sparse, under a digest of the test's choosing: the server serves what its directory holds and
# hashes it only when asked for its piece hashes, which no test does.
BIG_SIZE = (1 << 30) + 1
BIG = "b1" * 32
HOST = "127.0.0.1"
WITHIN_S = 60.0  # the most any test here may take


@attrs.frozen(kw_only=True)
class Pki:
    server: NodePaths  # node-a's: the weights port's
    client: NodePaths  # node-b's: the well-behaved and the hostile peers alike


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = new_ca(validity_days=3)
    root = tmp_path_factory.mktemp("pki")
    return Pki(
        server=issue_to_dir(ca, "node-a", root / "node-a", validity_days=3),
        client=issue_to_dir(ca, "node-b", root / "node-b", validity_days=3),
    )


class Uploads:
    """The server's upload places (the semaphore's methods `PeerServer` uses), saying when one
    comes back, so a test waits for all of them on that rather than polling."""

    def __init__(self, size: int) -> None:
        self.places = trio.Semaphore(size)
        self.size = size
        self.returned = Wakeup()

    @property
    def value(self) -> int:
        return self.places.value

    def acquire_nowait(self) -> None:
        self.places.acquire_nowait()

    def release(self) -> None:
        self.places.release()
        self.returned.fire()

    async def all_back(self, within: float) -> None:
        with trio.fail_after(within):
            while True:
                returned = self.returned.next()
                if self.value == self.size:
                    return
                await returned.wait()


class Connections:
    """The server's connection handler, counted: how many are being served, and a wake-up as
    each ends."""

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
class Port:
    server: PeerServer
    uploads: Uploads
    connections: Connections
    pki: Pki
    ctx: ssl.SSLContext  # a client's TLS, as PeerClient's: node-b's certificate, the server's checked by hand

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def peer(self) -> Peer:
        return Peer(node="node-a", address=HOST, port=self.port)


@pytest.fixture
async def weights_port(nursery: trio.Nursery, tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture) -> Port:
    caplog.set_level(logging.WARNING)
    root = tmp_path / "weights"
    (root / DIGEST).mkdir(parents=True)
    (root / DIGEST / "m-Q8_0.gguf").write_bytes(CONTENT)
    (root / BIG).mkdir()
    with (root / BIG / "big.gguf").open("wb") as f:
        f.truncate(BIG_SIZE)
    store = WeightsStore(root)
    server = PeerServer(store.offer, peer_ssl_context(pki.server), Members())
    uploads = Uploads(UPLOADS)
    server.sender.uploads = uploads  # type: ignore[assignment]
    connections = Connections(server._connection)
    server._connection = connections  # type: ignore[method-assign]
    await nursery.start(server.serve, 0)
    client = PeerClient(pki.client.ca_cert, pki.client.cert, pki.client.key)
    return Port(server=server, uploads=uploads, connections=connections, pki=pki, ctx=client.ssl_context)


def fetch(port: Port, *, address: str = HOST) -> tuple[dict, bytes]:
    """The file's piece list and its pieces as a well-behaved node gets them (blocking)."""
    client = PeerClient(port.pki.client.ca_cert, port.pki.client.cert, port.pki.client.key)
    peer = attrs.evolve(port.peer, address=address)
    try:
        listing = client.pieces(peer, DIGEST, hashes=True)
        data = b""
        for i, h in enumerate(listing["hashes"]):
            with client.buffer() as buffer:
                data += bytes(client.piece(peer, DIGEST, i, SIZE, h, buffer))
    finally:
        client.close()
    return listing, data


async def assert_serving(port: Port, caplog: pytest.LogCaptureFixture) -> None:
    """The port serves a well-behaved node at once and correctly; once the peers are gone,
    every upload place is back and every connection has ended; nothing logged a traceback."""
    with trio.fail_after(10):
        listing, data = await run(fetch, port)
    assert listing == {
        "size": SIZE,
        "piece_size": weightpieces.PIECE_MIN,
        "complete": True,
        "have": weightpieces.bitmap(None, 3),
        "hashes": HASHES,
    }
    assert data == CONTENT
    await port.uploads.all_back(within=5)
    assert port.server.sender.uploads.value == UPLOADS
    await port.connections.all_closed(within=5)  # a peer told off lingers a moment: at most LINGER_S
    assert port.server.stats.open.get(listener=peers.LISTENER) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage(), r.exc_text) for r in errors]


async def gone(port: Port) -> None:
    """After many peers left at once: the server has taken every connection from its backlog
    and ended each. (At the cap, a connection ending still holds its place until it has closed,
    though no longer one to close for a newcomer: a newcomer in that instant is turned away.)"""
    with trio.fail_after(10):
        await trio.testing.wait_all_tasks_blocked(cushion=0.2)
        await port.connections.all_closed(within=10)


async def run(fn: Callable[..., object], *args: object, **kwargs: object) -> Any:
    """A blocking peer, in a thread: a deadline around it fails the test at once, and the thread
    ends by its sockets' timeouts."""
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)


def head(target: str, *headers: tuple[str, str]) -> bytes:
    return hostile.request_bytes("GET", target, headers=headers)[0]


def piece_head(digest: str, index: int, size: int, *more: tuple[str, str]) -> bytes:
    start, length = weightpieces.span(index, size)
    return head(w.WEIGHTS_PREFIX + digest, ("range", f"bytes={start}-{start + length - 1}"), *more)


def tls(port: Port, *, rcvbuf: int = 0, timeout: float = hostile.TIMEOUT_S) -> ssl.SSLSocket:
    """A TLS connection with node-b's certificate, its handshake done; `rcvbuf`: a small receive
    buffer (set before connecting: it bounds the window), for a peer that stops reading."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect((HOST, port.port))
    return port.ctx.wrap_socket(sock)


def ask(port: Port, request: bytes) -> bytes:
    """One request on its own TLS connection; everything answered until the server closes."""
    sock = tls(port)
    try:
        sock.sendall(request)
        return hostile.read_all(sock, limit=4 << 20)
    finally:
        sock.close()


# -- TLS in memory: the test decides which bytes reach the wire -------------------------------


def tls_cut(port: Port, request: bytes, **kw: Any) -> hostile.Cut:
    """`hostile.tls_cut` with node-b's certificate (the TLS in memory: the test decides what
    reaches the wire)."""
    return hostile.tls_cut(HOST, port.port, port.ctx, request, **kw)


# -- the tests --------------------------------------------------------------------------------


async def test_a_fin_or_rst_at_any_byte_of_the_handshake_or_of_a_request(
    weights_port: Port, caplog: pytest.LogCaptureFixture
) -> None:
    port = weights_port
    request = piece_head(DIGEST, 2, SIZE)  # the short last piece: a place taken, given back
    with trio.fail_after(WITHIN_S):
        # The whole request, then FIN: the piece's head is sent; the client is then gone (its FIN,
        # a TLS stream's end without close_notify), the piece stopped and its place given back.
        whole = await run(tls_cut, port, request, how="fin")
        assert hostile.status_of(whole.answer) == 206, whole
        # Every byte of the first records' headers, then every few bytes of the handshake.
        in_handshake = set(range(1, 12)) | set(range(12, whole.handshake + 8, max(1, whole.handshake // 40)))
        in_request = hostile.offsets(b"\0" * whole.request)[:-1]  # the encrypted request, short of its end
        in_plain = hostile.offsets(request)[:-1]  # the request whole in TLS, short of its head's end
        for how in ("fin", "rst"):
            for n in sorted(in_handshake):
                got = await run(tls_cut, port, request, in_handshake=n, how=how)
                assert got.answer == b"" and got.request == 0, (how, n, got)
            for n in in_request:
                got = await run(tls_cut, port, request, in_request=n, how=how)
                assert got.answer == b"" and got.request == n, (how, n, got)
            for n in in_plain:
                got = await run(tls_cut, port, request, plain=n, how=how)
                assert got.answer == b"", (how, n, got)
    assert len(in_handshake) > 40
    await assert_serving(port, caplog)


async def test_garbage_instead_of_tls(weights_port: Port, caplog: pytest.LogCaptureFixture) -> None:
    port = weights_port
    tls_hello_start = bytes.fromhex("160301020001") + b"\x00" * 40  # a record header, then nonsense
    huge_record = bytes.fromhex("16030140ff") + b"\x01" * 200  # a handshake record of 16 KiB announced
    plain_http = head(w.WEIGHTS_PREFIX + DIGEST + w.PIECES_SUFFIX)
    with trio.fail_after(WITHIN_S):
        for data in (plain_http, b"\x00" * 100, tls_hello_start, huge_record, bytes(range(256)) * 16):
            for offset in (1, len(data) // 2, len(data)):
                for how in ("fin", "rst"):
                    answer = await run(hostile.cut_at, HOST, port.port, data, offset, how=how)
                    assert not answer.startswith(b"HTTP/"), answer  # no plain HTTP on this port
    await assert_serving(port, caplog)


async def test_garbage_inside_tls(weights_port: Port, caplog: pytest.LogCaptureFixture) -> None:
    port = weights_port

    def raw_after_handshake(data: bytes) -> bytes:
        """The handshake done, bytes that are no TLS record, on the socket under the TLS."""
        sock = tls(port)
        raw = socket.socket(fileno=socket.dup(sock.fileno()))
        try:
            raw.sendall(data)
            raw.settimeout(hostile.TIMEOUT_S)
            return hostile.read_all(raw)
        finally:
            raw.close()
            sock.close()

    with trio.fail_after(WITHIN_S):
        # Not HTTP, inside good TLS: told so (400), and closed.
        for garbage in (b"\x00" * 100, b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\n\x00\x01\x02 garbage\r\n\r\n"):
            answer = await run(ask, port, garbage)
            assert hostile.status_of(answer) == 400, answer
        # Bytes that are no TLS record, after a good handshake: the connection ends, nothing answered.
        for garbage in (b"\x00" * 100, b"GET / HTTP/1.1\r\n\r\n", bytes.fromhex("170303ffff") + b"\x01" * 64):
            answer = await run(raw_after_handshake, garbage)
            assert b"HTTP/" not in answer, answer
    await assert_serving(port, caplog)


async def test_a_stalled_handshake_is_closed_at_its_deadline(
    weights_port: Port, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "HANDSHAKE_TIMEOUT_S", 0.5)
    port = weights_port

    def stall(first: int) -> float:
        """Send the first `first` bytes of a handshake (0: nothing), then wait: the seconds
        until the server closes (at most the socket's timeout)."""
        sock = hostile.connect(HOST, port.port)
        try:
            if first:
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                conn = port.ctx.wrap_bio(incoming, outgoing)
                try:
                    conn.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                sock.sendall(outgoing.read()[:first])
            started = time.monotonic()
            hostile.read_all(sock)  # the server's flight, if it got a whole ClientHello; then its close
            return time.monotonic() - started
        finally:
            sock.close()

    with trio.fail_after(WITHIN_S):
        # Nothing; inside the ClientHello; all of it (the server then waits for the client's second flight).
        for first in (0, 1, 40, 10_000):
            took = await run(stall, first)
            assert 0.3 < took < 2.5, (first, took)  # not the socket's timeout (5 s): closed by the server
    await assert_serving(port, caplog)


async def test_a_head_trickled_byte_by_byte(
    weights_port: Port, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "LIMITS", attrs.evolve(peers.LIMITS, head_timeout_s=1.0))
    port = weights_port
    slow = piece_head(DIGEST, 0, SIZE, ("connection", "close"), ("x-pad", "p" * 200))
    fast = piece_head(DIGEST, 2, SIZE, ("connection", "close"))
    with trio.fail_after(WITHIN_S):
        # Slower than the head's deadline: 408 at it, then closed.
        answer, took = await run(lambda: hostile.trickle_on(tls(port), slow, interval_s=0.02, limit_s=10))
        assert hostile.status_of(answer) == 408 and b"request head not received within 1 s" in answer, answer
        assert 0.9 < took < 1.0 + LINGER_S + 1.0, took  # the deadline, then the linger after the answer
        # A byte at a time within the deadline: answered.
        answer, _ = await run(lambda: hostile.trickle_on(tls(port), fast, interval_s=0.002, limit_s=10))
        assert hostile.status_of(answer) == 206 and answer.endswith(CONTENT[2 * weightpieces.PIECE_MIN :]), answer[:200]
    await assert_serving(port, caplog)


def drained_to_close(sock: ssl.SSLSocket, timeout: float) -> bool:
    """Read what the server sent until it closes: True if it did within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except (ConnectionError, ssl.SSLError):
        pass
    return True


def stalled_piece(port: Port, digest: str, index: int, size: int) -> tuple[ssl.SSLSocket, bytes]:
    """A peer that asks for a piece, reads the first bytes of the answer (its head) and no more."""
    sock = tls(port, rcvbuf=4096)
    sock.sendall(piece_head(digest, index, size))
    return sock, sock.recv(4096)


async def test_a_peer_that_stops_reading_a_piece_gives_its_upload_place_back_at_the_send_deadline(
    weights_port: Port, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    send_s = 2.0
    monkeypatch.setattr(peers, "LIMITS", attrs.evolve(peers.LIMITS, send_timeout_s=send_s))
    port = weights_port
    stalled: list[ssl.SSLSocket] = []
    try:
        with trio.fail_after(WITHIN_S):
            # Every upload place taken by a peer that reads the head of its 16 MiB piece and no more.
            for i in range(UPLOADS):
                sock, first = await run(stalled_piece, port, BIG, i, BIG_SIZE)
                stalled.append(sock)
                assert hostile.status_of(first) == 206, first
            assert port.uploads.value == 0
            # Meanwhile a node is told to ask another.
            answer = await run(ask, port, piece_head(DIGEST, 0, SIZE, ("connection", "close")))
            assert hostile.status_of(answer) == 503 and b"retry-after: 1" in answer, answer
            client = PeerClient(port.pki.client.ca_cert, port.pki.client.cert, port.pki.client.key)
            with pytest.raises(PeerFailed):
                await run(client.piece, port.peer, DIGEST, 0, SIZE, HASHES[0], bytearray(SIZE + 1))
            await run(client.close)
            # Each stalled piece is cut at its send deadline, and its place given back.
            await port.uploads.all_back(within=send_s + 5)
            for sock in stalled:
                assert await run(drained_to_close, sock, 5)
            await port.connections.all_closed(within=5)
            assert port.server.stats.aborted.get(listener=peers.LISTENER, reason="send_timeout") == UPLOADS
    finally:
        for sock in stalled:
            sock.close()
    await assert_serving(port, caplog)


async def test_more_piece_requests_than_upload_places(weights_port: Port, caplog: pytest.LogCaptureFixture) -> None:
    port = weights_port
    extra = 4
    held: list[ssl.SSLSocket] = []
    statuses = []
    try:
        with trio.fail_after(WITHIN_S):
            for i in range(UPLOADS + extra):
                sock, first = await run(stalled_piece, port, BIG, i, BIG_SIZE)
                held.append(sock)
                statuses.append(hostile.status_of(first))
                if statuses[-1] == 503:
                    assert b"retry-after: 1" in first and b"ask another" in first, first
            assert statuses == [206] * UPLOADS + [503] * extra, statuses
            assert port.uploads.value == 0
            # The peers go (half of them with a reset) in the middle of their pieces: every place
            # comes back at once, long before any send deadline.
            for n, sock in enumerate(held):
                if n % 2:
                    hostile.reset(sock)
                else:
                    sock.close()
            await port.uploads.all_back(within=5)
    finally:
        for sock in held:
            sock.close()
    await assert_serving(port, caplog)


async def test_two_thousand_bare_connections(weights_port: Port, caplog: pytest.LogCaptureFixture) -> None:
    port = weights_port

    def flood() -> None:
        socks = []
        try:
            for _ in range(2000):
                socks.append(hostile.connect(HOST, port.port))
        finally:
            for n, sock in enumerate(socks):
                if n % 2:
                    hostile.reset(sock)
                else:
                    sock.close()

    with trio.fail_after(WITHIN_S):
        await run(flood)
        await gone(port)
        # Each was served (its handshake broke off) or, at the cap, turned away at once.
        busy = port.server.stats.shed.get(listener=peers.LISTENER, reason="busy")
        assert port.connections.served + busy == 2000, (port.connections.served, busy)
        await assert_serving(port, caplog)


@pytest.mark.parametrize(
    ("value", "status"),
    [
        (None, 416),  # no Range at all
        ("bytes=0-", 416),
        ("bytes=-1048576", 416),  # a suffix range
        ("bytes=abc-def", 416),
        ("BYTES=0-1048575", 416),
        ("bytes=0-1048575,1048576-2097151", 416),  # two ranges
        ("bytes=1-1048576", 416),  # a piece's length, not on its boundary
        ("bytes=0-1048574", 416),  # short of the piece
        ("bytes=0-2097151", 416),  # two pieces
        ("bytes=1048575-0", 416),  # backwards
        ("bytes=3145728-4194303", 416),  # a piece past the end
        ("bytes=2097152-2097152", 416),  # one byte of the last piece
        ("bytes=\xb2-\xb3", 416),  # not ASCII digits
        ("bytes=" + "9" * 19 + "-" + "9" * 19, 416),
        ("bytes=" + "9" * 20 + "-" + "9" * 20, 416),
        ("bytes=0-" + "9" * 3800, 416),  # nearly as long as a head may be
        ("bytes=" + "9" * 5000 + "-" + "9" * 5000, 431),  # longer than a head may be
        ("bytes=2097152-2097928", 206),  # the last piece, exactly
    ],
)
async def test_ranges_that_are_not_one_piece(
    weights_port: Port, caplog: pytest.LogCaptureFixture, value: str | None, status: int
) -> None:
    port = weights_port
    headers = [("connection", "close")] + ([("range", value)] if value is not None else [])
    request = head(w.WEIGHTS_PREFIX + DIGEST, *headers)
    with trio.fail_after(WITHIN_S):
        answer = await run(ask, port, request)
    assert hostile.status_of(answer) == status, answer[:300]
    if status == 416:
        assert b"ask for one piece: Range: bytes=A-B on piece boundaries" in answer
    if status == 206:
        assert answer.endswith(CONTENT[2 * weightpieces.PIECE_MIN :])
    await assert_serving(port, caplog)


# -- the port full -------------------------------------------------------------------------------


async def test_silent_connections_at_the_cap_do_not_keep_a_node_out(
    weights_port: Port, caplog: pytest.LogCaptureFixture
) -> None:
    """As many connections as the port serves, each silent in its TLS handshake (well within its
    deadline): a node's connection takes the place of the one silent longest."""
    port = weights_port
    socks = await run(hostile.idle, HOST, port.port, MAX_CONNECTIONS + 8)
    try:
        with trio.fail_after(WITHIN_S):
            await trio.testing.wait_all_tasks_blocked(cushion=0.2)  # every one accepted, or waiting
            assert port.connections.open == MAX_CONNECTIONS
            with trio.fail_after(5):  # well before their handshake's deadline
                _, data = await run(fetch, port)
            assert data == CONTENT
    finally:
        for sock in socks:
            sock.close()
    await gone(port)
    await assert_serving(port, caplog)


async def test_kept_alive_connections_at_the_cap_do_not_keep_a_node_out(
    weights_port: Port, caplog: pytest.LogCaptureFixture
) -> None:
    """As many connections as the port serves, each kept alive after a request (as each node's
    PeerClient keeps a few): a new node's connection takes the place of the one idle longest."""
    port = weights_port
    held: list[ssl.SSLSocket] = []
    try:
        with trio.fail_after(WITHIN_S):
            for _ in range(MAX_CONNECTIONS):
                sock = await run(tls, port)
                held.append(sock)
                await run(sock.sendall, head(w.WEIGHTS_PREFIX + DIGEST + w.PIECES_SUFFIX))
                answer = await run(sock.recv, 65536)
                assert hostile.status_of(answer) == 200, answer
            assert port.connections.open == MAX_CONNECTIONS
            with trio.fail_after(5):  # well before the keep-alive deadline
                _, data = await run(fetch, port)
            assert data == CONTENT
    finally:
        for sock in held:
            sock.close()
    await gone(port)
    await assert_serving(port, caplog)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_port_the_kernel_picks_is_the_same_on_ipv4_and_ipv6(
    weights_port: Port, caplog: pytest.LogCaptureFixture
) -> None:
    """The port is told to the others as one number: with 0 in agent.toml it must be the port on
    every address family (the kernel would pick one per family)."""
    port = weights_port
    with trio.fail_after(WITHIN_S):
        for address in (HOST, "::1"):
            _, data = await run(fetch, port, address=address)
            assert data == CONTENT, address
    await assert_serving(port, caplog)
