"""One HTTP exchange over a memory stream pair, served by llmgw's own HTTP server
(`llmgw.http.server.serve_connection`) exactly as on a socket: the request's bytes in, the answer
parsed by an h11 client. For handlers tested without sockets (the agent port's routes); and
`parse_answer`, for what a server sent on a real connection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import h11
import trio
import trio.testing

from llmgw.http.messages import Handler
from llmgw.http.server import serve_connection


@attrs.frozen
class Answered:
    status: int
    headers: dict[bytes, bytes]  # a repeated header: its last value
    body: bytes
    raw: bytes  # every byte the server sent


async def exchange(handler: Handler, request: bytes, *, eof: bool = False, **serve) -> Answered:
    """Send `request` (one request's bytes; then the end of the stream with `eof`), read until
    the server closes, and parse the answer (status 0: there was none); returns once
    `serve_connection` (one request per connection, and `serve`'s options) has."""
    return await converse(partial(serve_connection, handler, keep_alive=False, **serve), request, eof=eof)


async def converse(
    serve: Callable[[trio.abc.Stream], Awaitable[object]], request: bytes, *, eof: bool = False
) -> Answered:
    """`exchange` with any server of one connection: `serve(stream)`."""
    client, server = trio.testing.memory_stream_pair()
    raw = bytearray()

    async def read() -> None:
        while chunk := await client.receive_some(65536):
            raw.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await client.send_all(request)
        if eof:
            await client.send_eof()
        await serve(server)
    return parse_answer(bytes(raw), head=request.startswith(b"HEAD "))


def parse_answer(raw: bytes, *, head: bool = False) -> Answered:
    """Every byte a server sent on one connection, parsed by an h11 client as the answer to a
    GET (`head`: to a HEAD, without a body); status 0 when there was no whole answer."""
    conn = h11.Connection(h11.CLIENT)
    method = b"HEAD" if head else b"GET"  # how to read the answer: with a body or not
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"test")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    status, headers, body = 0, {}, b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return Answered(status=0, headers={}, body=b"", raw=raw)
        if isinstance(event, h11.Response):
            status, headers = event.status_code, dict(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return Answered(status=status, headers=headers, body=body, raw=raw)
        else:  # closed with no whole answer
            return Answered(status=0, headers={}, body=b"", raw=raw)
