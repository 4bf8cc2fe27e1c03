"""Weights between nodes: each agent serves the files it holds to the other nodes of its cluster,
and fetches pieces from them.

The server (`PeerServer`) listens on agent.toml's `weights_port` (0: a port the kernel picks),
on every address, and says which in its weights report (`WeightsHeld.port`), so the control
plane's tracker can name it to the others. It speaks HTTPS with the node's own certificate and
requires the client's: one of the cluster CA's, of a node (a gateway's is refused), and of a node
the control plane still counts as a member (the tracker's last answer lists them, or the control
plane is asked again when a node not listed comes: `Members`; a node removed is refused from
then on). It answers the two requests of `llmgw.weightpieces` (a file's piece list, one piece by its
Range) for a file whole and verified here, or one being downloaded (the pieces in so far), at
most `weightpieces.UPLOADS` pieces at once. Every connection is contained like every other
llmgw port's (`llmgw.http.server`), its TLS handshake due within `HANDSHAKE_TIMEOUT_S`.

The client side (`PeerClient`) runs in worker threads: one HTTPS connection per node and thread,
kept alive, the server's certificate checked by hand against the cluster CA and the node id the
tracker named (node certificates are issued for client authentication: a TLS client's own check
of the server's purpose would refuse them). A piece is read whole, hashed, and written only when
its hash is the one expected.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import attrs
import trio
from cryptography import x509

from llmgw.http.errors import HTTPError
from llmgw.http.limits import Limits
from llmgw.http.listeners import Shutdown, open_listeners, peer_host, serve_capped
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.http.server import ConnectionStats, serve_connection
from llmgw.log import get_logger
from llmgw.pki.ca import ROLE_NODE, CertInfo, cert_info, cert_info_from_der, check_issued_by
from llmgw.pki.files import NodePaths, load_cert
from llmgw.weightpieces import PIECE_MAX, Offer, PieceSender, hash_piece, span
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.peers")

MAX_CONNECTIONS = 256
KEPT_PER_PEER = 4  # idle connections a client keeps to one peer
MAX_PIECE_LIST = 1 << 20  # a piece list's JSON, at most (128 hashes are ~9 KB)
HANDSHAKE_TIMEOUT_S = 10.0
MEMBERS_REFRESH_S = 5.0  # the members asked again at most this often (a node not listed came)
STALL_S = 15.0  # a peer that sends nothing for this long is given up (a client's socket timeout)
LISTENER = "weights"
LIMITS = Limits(head_timeout_s=10.0, keepalive_timeout_s=30.0, send_timeout_s=STALL_S, max_head_bytes=4096)


def peer_ssl_context(files: NodePaths) -> ssl.SSLContext:
    """The weights port's TLS: this node's certificate, and a client's required, of the cluster CA
    (OpenSSL checks its chain, dates and purpose; the server checks its role and membership)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(files.cert), str(files.key))
    ctx.load_verify_locations(cafile=str(files.ca_cert))
    return ctx


def peer_client_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A node's TLS when it dials another node's port (the weights port, a helper's RPC tunnel):
    its own certificate shown; the server's checked by `check_node` after the handshake, not by
    OpenSSL (node certificates are issued for client authentication: a TLS client's own check
    of the server's purpose would refuse them)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # checked by `check_node` instead (the purpose, above)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def check_node(der: bytes | None, ca: x509.Certificate, node: str) -> None:
    """That a server's certificate (DER, as the handshake gave it) is node `node`'s, of this
    cluster's CA and valid now: `PeerFailed` saying what it is otherwise."""
    if not der:
        raise PeerFailed("it showed no certificate")
    cert = x509.load_der_x509_certificate(der)
    try:
        check_issued_by(cert, ca)
    except Exception as exc:  # noqa: BLE001 - any failure of the check is a refusal
        raise PeerFailed(f"its certificate is not this cluster's ({exc})") from None
    info = cert_info(cert)
    if not info.valid_at(datetime.now(timezone.utc)):
        raise PeerFailed(f"its certificate is not valid now ({info.not_before} to {info.not_after})")
    if info.common_name != node or info.role != ROLE_NODE:
        raise PeerFailed(f"it is {info.common_name!r} ({info.role}), not node {node!r}")


def client_node(stream: trio.SSLStream) -> CertInfo | None:
    """The certificate a client showed on a port of `peer_ssl_context` (OpenSSL checked its
    chain, dates and purpose in the handshake), if it is a node's; None otherwise (a gateway's)."""
    der = stream.getpeercert(binary_form=True)
    info = cert_info_from_der(der) if der else None
    return info if info is not None and info.role == ROLE_NODE else None


async def node_connection(
    raw: trio.abc.Stream,
    ssl_context: ssl.SSLContext,
    shutdown: Shutdown,
    handle: Callable[[trio.SSLStream, CertInfo | None], Awaitable[None]],
    *,
    failed_event: str,
    handshake_s: float,
) -> None:
    """One connection to a node's mutual-TLS port (the weights port's, a llama.cpp RPC tunnel's):
    its handshake due within `handshake_s` (the port's own), waiting meanwhile among `shutdown.idle` (the one
    waiting longest is closed for a newcomer at the port's cap), then `handle` with the client's
    node certificate (None: not a node's). A peer that broke off or a handshake refused ends that
    connection quietly; anything else is logged as `failed_event`: the port goes on. The stream is
    closed at the end."""
    stream = trio.SSLStream(raw, ssl_context, server_side=True)
    try:
        deadline = trio.current_time() + handshake_s
        with shutdown.idle.waiting(peer=peer_host(raw), deadline=deadline) as waited:
            await stream.do_handshake()
        if waited.cancelled_caught:
            return  # its deadline, or closed for a newcomer
        await handle(stream, client_node(stream))
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
        return  # a peer that broke off, or a handshake refused: that connection only
    except Exception:  # - one connection's failure must never stop the port
        log.exception(failed_event)
    finally:
        await trio.aclose_forcefully(stream)


class Members:
    """The nodes of this cluster as the control plane last listed them (None until it has): in the
    tracker's answers while this node fetches, and asked again (`ask`) when a node not listed
    comes for pieces. It may have joined since: a node that only serves what it holds hears of
    no newcomer otherwise, and would refuse every one (each then went to the source)."""

    def __init__(self, ask: Callable[[], frozenset[str]] | None = None) -> None:
        self.ids: frozenset[str] | None = None
        self.ask = ask  # blocking: the control plane's list (`agent.swarm.Tracker.members`)
        self.asked_at = -float("inf")
        self._asking = trio.Lock()

    def admits(self, node_id: str) -> bool:
        return self.ids is None or node_id in self.ids

    async def refresh(self) -> None:
        """The list as the control plane has it now, unless asked within MEMBERS_REFRESH_S: nodes
        refused, however many, cannot have it asked more often. A failure keeps the last list."""
        if self.ask is None:
            return
        async with self._asking:
            now = trio.current_time()
            if now - self.asked_at < MEMBERS_REFRESH_S:
                return
            self.asked_at = now
            try:
                self.ids = await trio.to_thread.run_sync(self.ask)
            except (OSError, ValueError, PeerFailed, http.client.HTTPException) as exc:
                log.info("weights_members_unknown", reason=str(exc), detail="the last list of the members stands")


class PeerServer:
    def __init__(self, offers: Callable[[str], Offer | None], ssl_context: ssl.SSLContext, members: Members) -> None:
        self.offers = offers
        self.ssl_context = ssl_context
        self.members = members
        self.stats = ConnectionStats()
        self.sender = PieceSender()
        self.port = 0
        # Its `idle`: the connections waiting on their peer (in the TLS handshake, or for a
        # request, kept alive between pieces), of which the one waiting longest is closed for a
        # newcomer at MAX_CONNECTIONS (`serve_capped`); without it every newcomer is turned away.
        self.shutdown = Shutdown()

    async def serve(self, port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await listen(port)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await serve_capped(
            self._connection,
            listeners,
            max_connections=MAX_CONNECTIONS,
            stats=self.stats,
            listener=LISTENER,
            shutdown=self.shutdown,
        )

    async def _connection(self, raw: trio.abc.Stream) -> None:
        await node_connection(
            raw,
            self.ssl_context,
            self.shutdown,
            self._serve,
            failed_event="weights_connection_failed",
            handshake_s=HANDSHAKE_TIMEOUT_S,
        )

    async def _serve(self, stream: trio.SSLStream, node: CertInfo | None) -> None:
        if node is not None and not self.members.admits(node.common_name):
            await self.members.refresh()  # a node that joined since the list was made
        if node is None or not self.members.admits(node.common_name):
            who = node.common_name if node else "a peer without a node's certificate"
            log.warning("weights_peer_refused", peer=who)
            # Said, not just closed: the asker tells "refused" from "broke off" and asks elsewhere.
            refusal = HTTPError(403, "this node serves weights to the nodes of its cluster only")
            await serve_connection(_refuse(refusal), stream, limits=LIMITS, stats=self.stats, listener=LISTENER)
            return
        await serve_connection(
            lambda request: self._handle(request, node.common_name),
            stream,
            limits=LIMITS,
            stats=self.stats,
            listener=LISTENER,
            shutdown=self.shutdown,
        )

    async def _handle(self, request: Request, node: str) -> Response | StreamingResponse:
        allow(request, "GET")
        return await self.sender.answer(request, self.offers, place="node")


def _refuse(refusal: HTTPError) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        raise refusal

    return handler


async def listen(port: int) -> list[trio.SocketListener]:
    """Listeners on every address (IPv4 and IPv6), all at one port: the weights report names one.
    With 0 the kernel picks a port per address family (trio's `open_tcp_listeners` says so: a
    node reached over IPv6 would be asked at its IPv4 port), so the first listener's is taken for
    all, bound again at once; once more from the start if another process took it meanwhile."""
    for attempt in range(3):
        listeners = await open_listeners(port, host=None)
        chosen = listeners[0].socket.getsockname()[1]
        if all(listener.socket.getsockname()[1] == chosen for listener in listeners):
            return listeners
        for listener in listeners:
            await listener.aclose()
        try:
            return await open_listeners(chosen, host=None)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 2:
                raise
    raise AssertionError("unreachable")


# -- the client side: blocking, in worker threads ------------------------------------------


class PeerFailed(Exception):
    """A peer that did not give what was asked (unreachable, refused, cut, wrong answer)."""


class PeerUnreachable(PeerFailed):
    """A peer that could not be connected to (or whose certificate is not the node's)."""


class PeerBusy(PeerFailed):
    """A peer sending as many pieces as it may: ask another, or it again soon."""


class PeerCorrupt(Exception):
    """A peer sent a piece whose SHA-256 is not the one expected."""


@attrs.frozen(kw_only=True)
class Peer:
    node: str
    address: str
    port: int
    complete: bool = False


class PeerClient:
    """HTTPS to other nodes' weights ports, with this node's certificate; the server's
    certificate checked by hand (see the module docstring). Thread-safe: a connection per
    (thread, peer)."""

    def __init__(
        self, ca_cert: Path, cert: Path, key: Path, *, control_plane_context: ssl.SSLContext | None = None
    ) -> None:
        """`control_plane_context`: the link's TLS (the cluster CA, the control plane's certificate
        checked against the address dialled), for the control plane when it seeds a file."""
        self.ca = load_cert(ca_cert)
        self.control_plane_context = control_plane_context
        self.ssl_context = peer_client_ssl_context(cert, key)
        self._idle: dict[Peer, list[http.client.HTTPSConnection]] = {}  # kept-alive connections, by peer
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []  # piece buffers given back (`buffer`)

    def _conn(self, peer: Peer) -> http.client.HTTPSConnection:
        """A kept connection to `peer` no other thread uses, or a new one (its certificate checked)."""
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
        seeder = peer.node == w.CONTROL_PLANE_PEER
        if seeder and self.control_plane_context is None:
            raise PeerUnreachable("the control plane seeds this file and this client has no TLS for it")
        context = self.control_plane_context if seeder else self.ssl_context
        conn = http.client.HTTPSConnection(peer.address, peer.port, context=context, timeout=STALL_S)
        try:
            conn.connect()
            if not seeder:  # the control plane's certificate was checked by the handshake
                self._check_server(conn, peer)
        except (OSError, ssl.SSLError, PeerFailed) as exc:
            conn.close()
            raise PeerUnreachable(f"cannot reach node {peer.node} at {peer.address}:{peer.port}: {exc}") from None
        return conn

    def _keep(self, peer: Peer, conn: http.client.HTTPSConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < KEPT_PER_PEER:
                idle.append(conn)
                return
        conn.close()

    def _check_server(self, conn: http.client.HTTPSConnection, peer: Peer) -> None:
        sock = conn.sock
        check_node(sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None, self.ca, peer.node)

    def _get(
        self, peer: Peer, target: str, headers: dict[str, str], limit: int, into: bytearray | None = None
    ) -> tuple[int, bytes | memoryview]:
        """(status, body) of one GET; a body past `limit` bytes is a broken peer's, a 403 a refusal
        (`PeerUnreachable`: this node may not fetch from that one, as if it could not reach it)."""
        status, body = self._exchange(peer, target, headers, limit, into)
        if status == 403:
            said = bytes(body[:300]).decode("utf-8", "replace").strip()
            raise PeerUnreachable(f"node {peer.node} refuses this node: {said}")
        return status, body

    def _exchange(
        self, peer: Peer, target: str, headers: dict[str, str], limit: int, into: bytearray | None = None
    ) -> tuple[int, bytes | memoryview]:
        """`into`: a buffer the body is read into (a piece: no new 16 MiB object per piece, whose
        pages the kernel must find and clear each time); the body is then a view of it."""
        for attempt in (0, 1):  # a kept connection the peer closed meanwhile: once more, afresh
            conn = self._conn(peer)
            try:
                conn.request("GET", target, headers=headers)
                response = conn.getresponse()
                if into is not None and response.status == 206:
                    body: bytes | memoryview = read_into(response, memoryview(into)[: limit + 1])
                else:
                    body = response.read(limit + 1)
                if len(body) > limit:
                    conn.close()
                    raise PeerFailed(f"node {peer.node} sent more than the {limit} bytes asked for")
                if response.will_close or not response.isclosed():
                    conn.close()
                else:
                    self._keep(peer, conn)
                return response.status, body
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if attempt or isinstance(exc, (socket.timeout, TimeoutError)):
                    raise PeerFailed(f"node {peer.node} broke off ({exc!r})") from None
        raise AssertionError("unreachable")

    def pieces(self, peer: Peer, digest: str, *, hashes: bool) -> dict:
        target = w.WEIGHTS_PREFIX + digest + w.PIECES_SUFFIX + ("?hashes=1" if hashes else "")
        status, body = self._get(peer, target, {}, MAX_PIECE_LIST)
        if status != 200:
            raise PeerFailed(f"node {peer.node} answered {status} for the pieces of {digest[:12]}")
        try:
            answer = json.loads(body)
            assert isinstance(answer, dict) and isinstance(answer.get("have"), str)
        except (ValueError, AssertionError):
            raise PeerFailed(f"node {peer.node} answered something else than a piece list") from None
        return answer

    @contextlib.contextmanager
    def buffer(self) -> Iterator[bytearray]:
        """A buffer for one piece, taken from those given back (as many as pieces fetched at once)."""
        with self._lock:
            buffer = self._buffers.pop() if self._buffers else bytearray(PIECE_MAX + 1)
        try:
            yield buffer
        finally:
            with self._lock:
                self._buffers.append(buffer)

    def piece(self, peer: Peer, digest: str, index: int, size: int, expected: str, buffer: bytearray) -> memoryview:
        """Piece `index` from `peer`, its SHA-256 checked: `PeerCorrupt` when it is not `expected`.
        The bytes are a view of `buffer` (from `buffer()`): use them while it is held."""
        start, length = span(index, size)
        status, body = self._get(
            peer, w.WEIGHTS_PREFIX + digest, {"Range": f"bytes={start}-{start + length - 1}"}, length, buffer
        )
        if status == 503:
            raise PeerBusy(f"node {peer.node} is sending as many pieces as it may")
        if status != 206 or len(body) != length:
            raise PeerFailed(f"node {peer.node} answered {status} with {len(body)} bytes for piece {index}")
        body = memoryview(body)
        got = hash_piece(body)
        if got != expected:
            raise PeerCorrupt(
                f"node {peer.node} sent piece {index} of {digest[:12]} with sha256 {got[:16]}…, not {expected[:16]}…"
            )
        return body

    def close(self) -> None:
        with self._lock:
            kept = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for conn in kept:
            conn.close()


def read_into(response: http.client.HTTPResponse, view: memoryview) -> memoryview:
    """The body (or as much of it as fits `view`) read into `view`; the part of it filled."""
    done = 0
    while done < len(view):
        n = response.readinto(view[done:])
        if not n:
            break
        done += n
    return view[:done]
