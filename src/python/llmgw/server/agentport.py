"""What arrives on the agent port: one request head, read once, and where it goes.

The agent port (server.toml's agent_listen) is one TLS listener, for three things: the agent
link, a WebSocket at AGENT_PATH, and the artifact mirror, `GET ARTIFACTS_PREFIX + SHA256`
(`llmgw.server.artifacts`), both for node certificates only; and the release files, `GET
RELEASE_PREFIX + NAME` (`llmgw.server.releases`), for any peer (a node fetching its release has
no certificate yet). The endpoint reads the request head once
with h11 (`read_head`), `route` decides from the head alone, and each route then takes the
connection as it is: the mirror and the releases answer on the same h11 connection; the link's request is
checked to be a WebSocket upgrade (`check_upgrade`, RFC 6455 §4.2.1, before any WebSocket
handling), then accepted by trio-websocket's public `wrap_server_stream` from the bytes already
read (`accept_link` replays them: trio-websocket has no public way to start from a parsed
request, and its internals are not ours to call). Refusals before the WebSocket (`answer`) are
plain HTTP on that connection.

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


def check_upgrade(head: Head) -> None:
    """`UpgradeRefused(400)` unless the request is a WebSocket upgrade trio-websocket will accept."""
    request = head.request
    assert request is not None  # routed: Route.LINK
    # RFC 6455 §4.1: the opening handshake is an HTTP/1.1 GET.
    if request.method != b"GET" or request.http_version != b"1.1":
        raise UpgradeRefused(
            400,
            f"expected a WebSocket upgrade (GET, HTTP/1.1) to {w.AGENT_PATH}, got {request.method.decode('latin-1')} "
            f"HTTP/{request.http_version.decode('latin-1')}",
        )
    if head.trailing:
        # RFC 6455 §4.1: a client waits for the server's handshake before it sends a frame.
        raise UpgradeRefused(400, f"{len(head.trailing)} bytes after the upgrade request, before the server's 101")
    # RFC 6455 §4.2.1: what makes a request an opening handshake.
    fields: dict[bytes, list[bytes]] = {}
    for name, value in request.headers:
        fields.setdefault(name.lower(), []).append(value)
    tokens = {t.strip().lower() for v in fields.get(b"connection", []) for t in v.split(b",")}
    problems = []
    if b"websocket" not in {v.strip().lower() for v in fields.get(b"upgrade", [])}:
        problems.append("no 'Upgrade: websocket'")
    if b"upgrade" not in tokens:
        problems.append("no 'Connection: Upgrade'")
    if len(fields.get(b"sec-websocket-key", [])) != 1:
        problems.append("not one Sec-WebSocket-Key")
    if fields.get(b"sec-websocket-version") != [b"13"]:
        problems.append("Sec-WebSocket-Version is not 13")
    if problems:
        raise UpgradeRefused(400, f"expected a WebSocket upgrade to {w.AGENT_PATH}: {'; '.join(problems)}")


async def accept_link(nursery: trio.Nursery, stream: trio.abc.Stream, head: Head) -> trio_websocket.WebSocketConnection:
    """Accept the link's WebSocket on `stream` (its reader runs in `nursery`), the request
    already checked by `check_upgrade`: trio-websocket reads it again from `head.raw`."""
    request = await trio_websocket.wrap_server_stream(nursery, _Replay(stream, head.raw))
    return await request.accept()


class _Replay(trio.abc.Stream):
    """A stream whose first bytes were already read (to route the request): gives them again."""

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self.inner = inner
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


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
