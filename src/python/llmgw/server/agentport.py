"""What arrives on the agent port: one request head, read once, and where it goes.

The agent port (server.toml's agent_listen) is one TLS listener with node certificates, for two
things: the agent link, a WebSocket at AGENT_PATH, and the artifact mirror, `GET
ARTIFACTS_PREFIX + SHA256` (`llmgw.server.artifacts`). The endpoint reads the request head once
with h11 (`read_head`), `route` decides from the head alone, and each route then takes the
connection as it is: the mirror answers on the same h11 connection; the link's WebSocket is
accepted from the request already parsed (`link_protocol`, `accept_link`), so no byte is read
twice or replayed. Refusals before the WebSocket (`answer`) are plain HTTP on that connection.

Why one port and not a listener of its own for the mirror: `node add`, agent.toml and the
firewall rules in docs/security.md name one control-plane port for everything a node needs,
and the mirror wants the same client certificates as the link; a second port would be one more
thing to open and to get wrong, for a request the head already tells apart.
"""

from __future__ import annotations

import enum

import attrs
import h11
import trio
import trio_websocket
import wsproto
import wsproto.utilities

from llmgw.wire import agent_link as w
from llmgw.wire.errors import UpgradeRefused

MAX_HEAD_BYTES = 16384
RECEIVE_SIZE = 65536


@attrs.frozen
class Head:
    """A request head as read: the h11 connection holding it, the request (None if the peer
    closed first or sent no HTTP), and the bytes that came after it."""

    conn: h11.Connection
    request: h11.Request | None
    trailing: bytes = b""


class Route(enum.Enum):
    MIRROR = "mirror"  # answered by llmgw.server.artifacts
    LINK = "link"  # the agent link: ServerSession.upgrade checks its path and node id
    NOT_HTTP = "not_http"  # nothing to route: 400, close


def route(request: h11.Request | None) -> Route:
    """Where a request goes, from its head alone. Everything that is not the mirror's is the
    link's to accept or refuse (404 for another path)."""
    if request is None:
        return Route.NOT_HTTP
    if request.target.startswith(w.ARTIFACTS_PREFIX.encode()):
        return Route.MIRROR
    return Route.LINK


async def read_head(stream: trio.abc.Stream, max_bytes: int = MAX_HEAD_BYTES) -> Head:
    """Read until one HTTP request head has arrived (the caller bounds the time)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return Head(conn, None)
        if isinstance(event, h11.Request):
            return Head(conn, event, conn.trailing_data[0])
        if event is not h11.NEED_DATA:
            return Head(conn, None)
        data = await stream.receive_some(RECEIVE_SIZE)
        if not data:
            return Head(conn, None)
        conn.receive_data(data)


def link_protocol(head: Head) -> wsproto.WSConnection:
    """The server side of the link's WebSocket, given the upgrade request already parsed;
    `UpgradeRefused(400)` if the request is not a WebSocket upgrade."""
    request = head.request
    assert request is not None  # routed: Route.LINK
    # RFC 6455 §4.1: the opening handshake is an HTTP/1.1 GET. wsproto assumes both.
    if request.method != b"GET" or request.http_version != b"1.1":
        raise UpgradeRefused(
            400,
            f"expected a WebSocket upgrade (GET, HTTP/1.1) to {w.AGENT_PATH}, got {request.method.decode('latin-1')} "
            f"HTTP/{request.http_version.decode('latin-1')}",
        )
    if head.trailing:
        # RFC 6455 §4.1: a client waits for the server's handshake before it sends a frame (and
        # wsproto's server would drop what came early).
        raise UpgradeRefused(400, f"{len(head.trailing)} bytes after the upgrade request, before the server's 101")
    protocol = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    try:
        # wsproto's own door for a request read elsewhere: "used if the request has already
        # been received and parsed".
        protocol.initiate_upgrade_connection(request.headers, request.target)
    except (wsproto.utilities.RemoteProtocolError, h11.ProtocolError) as exc:
        raise UpgradeRefused(400, f"expected a WebSocket upgrade to {w.AGENT_PATH}: {exc}") from None
    return protocol


async def accept_link(
    nursery: trio.Nursery, stream: trio.abc.Stream, protocol: wsproto.WSConnection
) -> trio_websocket.WebSocketConnection:
    """Accept the link's WebSocket on `stream`; its reader runs in `nursery`.

    trio-websocket has no public way to start from a parsed request, so this is its
    `wrap_server_stream` (0.12) with our `protocol` in place of a fresh one: the one place that
    knows trio-websocket's internals (`_reader_task`, `_get_request`). The link tests on real
    sockets (tests/agent/test_link.py) fail if they move.
    """
    connection = trio_websocket.WebSocketConnection(stream, protocol)
    nursery.start_soon(connection._reader_task)
    request = await connection._get_request()
    return await request.accept()


async def answer(stream: trio.abc.Stream, head: Head, status: int, body: str, *, timeout_s: float) -> None:
    """Answer `status` with `body` (for the operator: what is wrong and the fix) on the
    connection of `head`, within `timeout_s`; the caller then closes it."""
    data = body.encode() + b"\n"
    try:
        out = head.conn.send(
            h11.Response(
                status_code=status,
                headers=[
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close"),
                ],
            )
        )
        out += head.conn.send(h11.Data(data=data)) + head.conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return  # h11 has no answer for this peer (what it sent was no request at all)
    with trio.move_on_after(timeout_s):
        await stream.send_all(out)
