"""What arrives on the agent port: one request head, read once, and where it goes.

The agent port (server.toml's agent_listen) is one TLS listener, for three things: the agent
link, a WebSocket at AGENT_PATH, and the artifact mirror, `GET ARTIFACTS_PREFIX + SHA256`
(`llmgw.server.artifacts`), both for node certificates only; and the release files, `GET
RELEASE_PREFIX + NAME` (`llmgw.server.releases`), for any peer (a node fetching its release has
no certificate yet). The endpoint reads the request head once
with h11 (`read_head`), `route` decides from the head alone, and each route then takes the
connection as it is: the mirror and the releases answer on the same h11 connection; the link's
request is checked by `llmgw.wire.session.ServerSession.upgrade` (`upgrade_request` hands it
over: the path, the node id, RFC 6455's opening handshake, all before any WebSocket handling),
then accepted by trio-websocket's public `wrap_server_stream` from the bytes already read
(`accept_link`, which gives them again through `llmgw.linkio.LinkStream`). Refusals before the
WebSocket (`answer`) are plain HTTP on that connection.

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

from llmgw.linkio import LinkStream
from llmgw.wire import agent_link as w
from llmgw.wire.session import UpgradeRequest

MAX_HEAD_BYTES = 16384
RECEIVE_SIZE = 65536


@attrs.frozen
class Head:
    """A request head as read: the h11 connection holding it, the request (None if the peer
    closed first or sent no HTTP), and the bytes that came after it."""

    conn: h11.Connection
    request: h11.Request | None
    trailing: bytes = b""
    raw: bytes = b""  # every byte read, the head's and any after it


class Route(enum.Enum):
    MIRROR = "mirror"  # answered by llmgw.server.artifacts
    RELEASE = "release"  # answered by llmgw.server.releases, to a peer without a certificate too
    LINK = "link"  # the agent link: ServerSession.upgrade checks its path and node id
    NOT_HTTP = "not_http"  # nothing to route: 400, close


def route(request: h11.Request | None) -> Route:
    """Where a request goes, from its head alone. Everything that is not the mirror's or the
    releases' is the link's to accept or refuse (404 for another path)."""
    if request is None:
        return Route.NOT_HTTP
    if request.target.startswith(w.ARTIFACTS_PREFIX.encode()):
        return Route.MIRROR
    if request.target.startswith(w.RELEASE_PREFIX.encode()):
        return Route.RELEASE
    return Route.LINK


async def read_head(stream: trio.abc.Stream, max_bytes: int = MAX_HEAD_BYTES) -> Head:
    """Read until one HTTP request head has arrived (the caller bounds the time)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
    raw = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return Head(conn, None, raw=bytes(raw))
        if isinstance(event, h11.Request):
            return Head(conn, event, conn.trailing_data[0], raw=bytes(raw))
        if event is not h11.NEED_DATA:
            return Head(conn, None, raw=bytes(raw))
        data = await stream.receive_some(RECEIVE_SIZE)
        if not data:
            return Head(conn, None, raw=bytes(raw))
        raw += data
        conn.receive_data(data)


def upgrade_request(head: Head) -> UpgradeRequest:
    """The link's upgrade request as `ServerSession.upgrade` checks it (RFC 6455's rules are the
    session's): the head h11 read, and how many bytes came after it."""
    request = head.request
    assert request is not None  # routed: Route.LINK
    return UpgradeRequest(
        method=request.method,
        target=request.target,
        http_version=request.http_version,
        headers=tuple((name, value) for name, value in request.headers),
        early=len(head.trailing),
    )


async def accept_link(nursery: trio.Nursery, stream: trio.abc.Stream, head: Head) -> trio_websocket.WebSocketConnection:
    """Accept the link's WebSocket on `stream` (its reader runs in `nursery`), the request
    already checked by `ServerSession.upgrade`: trio-websocket reads it again from `head.raw`."""
    request = await trio_websocket.wrap_server_stream(nursery, LinkStream(stream, prefix=head.raw))
    return await request.accept()


async def answer(
    stream: trio.abc.Stream,
    head: Head,
    status: int,
    body: str,
    *,
    timeout_s: float,
    headers: tuple[tuple[str, str], ...] = (),
) -> None:
    """Answer `status` with `body` (for the operator: what is wrong and the fix) and `headers`
    on the connection of `head`, within `timeout_s`; the caller then closes it."""
    data = body.encode() + b"\n"
    try:
        out = head.conn.send(
            h11.Response(
                status_code=status,
                headers=[
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close"),
                    *((k.encode(), v.encode()) for k, v in headers),
                ],
            )
        )
        out += head.conn.send(h11.Data(data=data)) + head.conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return  # h11 has no answer for this peer (what it sent was no request at all)
    with trio.move_on_after(timeout_s):
        await stream.send_all(out)
