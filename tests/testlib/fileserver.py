"""A file server on loopback for download tests: llmgw's own HTTP server, with HTTP Range (which
a test can switch off), recording what each request asked for, and a gate that holds bodies
back so concurrent downloads overlap for sure. It can also stream a body without a
Content-Length (chunked).

`serve_raw` is a server that breaks HTTP's rules on purpose (a Content-Length that lies, a body
that ends only when the connection does), which llmgw's own server refuses to do."""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import trio

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.server import bound_address, serve_http


class Files:
    def __init__(self) -> None:
        self.content: dict[str, bytes] = {}
        self.streamed: dict[str, tuple[bytes, int]] = {}  # path -> (chunk, count): chunked, no Content-Length
        self.streamed_bytes = 0  # of streamed bodies, sent so far
        self.gets: list[str] = []
        self.authorizations: list[str] = []
        self.ranges_seen: list[str] = []
        self.honour_range = True
        self.release = trio.Event()  # bodies are sent only once set
        self.release.set()

    async def handle(self, request: Request) -> Response | StreamingResponse:
        self.gets.append(request.path)
        self.authorizations.append(request.headers.get("authorization", ""))
        if request.path in self.streamed:
            chunk, count = self.streamed[request.path]
            return StreamingResponse(status=200, body=self._stream(chunk, count))
        body = self.content.get(request.path)
        if body is None:
            raise HTTPError(404, "no such file")
        await self.release.wait()
        wanted = request.headers.get("range")
        if wanted:
            self.ranges_seen.append(wanted)
        if wanted and self.honour_range:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                return Response(status=416)
            return Response(
                status=206,
                body=body[start:],
                headers=(("content-range", f"bytes {start}-{len(body) - 1}/{len(body)}"),),
            )
        return Response(status=200, body=body)

    async def _stream(self, chunk: bytes, count: int) -> AsyncIterator[bytes]:
        for _ in range(count):
            yield chunk
            self.streamed_bytes += len(chunk)


async def serve_files(nursery: trio.Nursery) -> tuple[Files, str]:
    """A running file server and its base URL."""
    files = Files()
    listeners = await nursery.start(serve_http, files.handle, "127.0.0.1", 0)
    host, port = bound_address(listeners)
    return files, f"http://{host}:{port}"


@attrs.define
class Raw:
    """What `serve_raw` sends each request: `head` (status line and headers, as given), then
    `body_bytes` bytes, then it closes. `sent` counts the body bytes the client took; `closed` is
    set when a connection has ended, either way."""

    head: bytes
    body_bytes: int
    sent: int = 0
    closed: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            request = b""
            with trio.move_on_after(10):
                while b"\r\n\r\n" not in request and len(request) < 65536:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    request += data
            await stream.send_all(self.head)
            block = b"x" * 65536
            while self.sent < self.body_bytes:
                piece = block[: self.body_bytes - self.sent]
                await stream.send_all(piece)
                self.sent += len(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client stopped reading: what the tests want to see
        finally:
            await stream.aclose()
            self.closed.set()


async def serve_raw(nursery: trio.Nursery, head: bytes, body_bytes: int) -> tuple[Raw, str]:
    """A server on loopback answering every request with `head` and `body_bytes` bytes; its URL."""
    raw = Raw(head=head, body_bytes=body_bytes)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, raw.handle, listeners)
    host, port = listeners[0].socket.getsockname()[:2]
    return raw, f"http://{host}:{port}"
