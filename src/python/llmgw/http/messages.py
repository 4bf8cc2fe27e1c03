"""What a handler of `llmgw.http.server` is given and what it answers.

A `Request` is its head, and its body for the asking (`read`, once): a handler decides from the
head alone before a byte of the body is buffered. Its headers are kept as the byte pairs the codec
parsed (`raw_headers`: names lower-case, every repeat in order), so what a proxy forwards is
what came; `headers` is the convenience view (decoded, a repeated header's last value) and
`header_values` every value of one. `per_connection` is a dict the server gives every request of
one connection alike, for what a handler keeps from one to the next (the gateway: the digest of
the API key last sent on it); None from a server that keeps nothing.

A handler answers with a `Response` (a body in memory), a `StreamingResponse` (a body produced
while it is sent) or an `Upgrade` (the connection handed to another protocol: the agent port's
WebSocket), or raises `HTTPError`. How an error is worded on the wire is the listener's
`ErrorBody`: `plain_error` here (text, the message and a newline) unless the listener says
otherwise (`llmgw.http.openai` for the JSON APIs). Header values are `str` (sent as UTF-8) or
`bytes` (sent as they are).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import attrs
import trio

from llmgw.errors import cut
from llmgw.http.errors import HTTPError, too_large

HeaderField = str | bytes
Headers = tuple[tuple[HeaderField, HeaderField], ...]


class BodySource:
    """Where a request's body comes from: memory (`Buffered`), or the connection
    (`llmgw.http.body.ConnectionBody`)."""

    async def read(self, limit: int | None, owner: str = "") -> bytes:
        """The whole body; `owner`: whom the bytes it holds are charged to while they are."""
        raise NotImplementedError


class Buffered(BodySource):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, limit: int | None, owner: str = "") -> bytes:
        if limit is not None and len(self.data) > limit:
            raise too_large(limit)
        return self.data


@attrs.define(kw_only=True, eq=False)
class Request:
    """A request head, and its body for the asking: `read` reads it (once), so a handler can
    refuse a request from its head before a byte of the body is buffered."""

    method: str
    target: bytes  # as sent: the path and the query, undecoded
    path: str
    # Percent-decoded (UTF-8, undecodable bytes as U+FFFD); a parameter without a value is kept
    # as "" (`?force` -> {"force": [""]}), so that strict readers (`llmgw.http.params`) see it.
    query: dict[str, list[str]]
    raw_headers: tuple[tuple[bytes, bytes], ...]  # as parsed: lower-case names, repeats in order
    headers: dict[str, str]  # convenience: decoded (latin-1), a repeated header keeps its last value
    client: str
    http_version: bytes = b"1.1"
    # Bytes that had come after this request's head when it was parsed, for a request without a
    # body: a pipelined request, or frames sent before an upgrade was answered.
    pipelined: int = 0
    _body: BodySource
    _head_bytes: bytes = b""  # the head as read, kept for an `Upgrade` only
    # The same dict for every request of the connection, for handlers (the module's docstring).
    per_connection: dict[str, Any] | None = None
    # Whom the body's bytes are charged to while they are held (`read`): set by a handler that
    # knows whose request it is (the gateway: its API key) before the body is read.
    body_owner: str = ""

    @classmethod
    def of(
        cls,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        raw_headers: tuple[tuple[bytes, bytes], ...] = (),
        query: dict[str, list[str]] | None = None,
        client: str = "127.0.0.1:1",
        per_connection: dict[str, Any] | None = None,
    ) -> Request:
        """A request whose body is already in memory (tests, and requests made in-process)."""
        pairs = raw_headers + tuple((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())
        return cls(
            method=method,
            target=path.encode(),
            path=path,
            query=query or {},
            raw_headers=pairs,
            headers={k.decode("latin-1"): v.decode("latin-1") for k, v in pairs},
            client=client,
            body=Buffered(body),
            per_connection=per_connection,
        )

    @property
    def head(self) -> bool:
        return self.method == "HEAD"

    def header_values(self, name: str) -> list[str]:
        """Every value of header `name` (lower-case), in the order sent."""
        key = name.encode("latin-1")
        return [v.decode("latin-1") for k, v in self.raw_headers if k == key]

    async def read(self, *, limit: int | None = None) -> bytes:
        """The whole body (read once, then the same bytes; a large one as a bytearray);
        `HTTPError(413)` past `limit` or the server's own limit. While it is held, its bytes
        are charged to `body_owner` in the listener's body budget, which holds each owner to a
        share (`llmgw.http.body`); with none set, to the client's address."""
        return await self._body.read(limit, self.body_owner or "addr:" + client_host(self.client))


def client_host(client: str) -> str:
    """The host of a `Request.client` ("HOST:PORT", "[V6]:PORT", or a word for no address)."""
    if client.startswith("["):
        return client[1 : client.find("]")] if "]" in client else client[1:]
    return client.rsplit(":", 1)[0] if client.count(":") == 1 else client


def allow(request: Request, method: str) -> None:
    """405 unless `request` is `method`, or a HEAD where `method` is GET (RFC 9110 §9.3.2)."""
    if request.method == method or (method == "GET" and request.method == "HEAD"):
        return
    allowed = "GET, HEAD" if method == "GET" else method
    raise HTTPError(
        405,
        f"{cut(request.path)} takes {method}, not {cut(request.method, 20)}",
        code="method_not_allowed",
        headers=(("allow", allowed),),
    )


@attrs.frozen(kw_only=True)
class Response:
    status: int
    body: bytes = b""
    headers: Headers = ()

    @classmethod
    def json(cls, status: int, obj: Any, headers: Headers = ()) -> Response:
        body = json.dumps(obj, indent=None, separators=(",", ":")).encode() + b"\n"
        return cls(status=status, body=body, headers=(("content-type", "application/json"), *headers))

    @classmethod
    def text(cls, status: int, text: str, headers: Headers = ()) -> Response:
        """`text` and a newline, as plain UTF-8 text."""
        return cls(
            status=status, body=text.encode() + b"\n", headers=(("content-type", "text/plain; charset=utf-8"), *headers)
        )


@attrs.frozen(kw_only=True)
class StreamingResponse:
    """A response whose body is produced while it is sent. Iteration is cancelled when the client
    goes away, and the iterable's `aclose()` (an async generator's, or a `llmgw.http.files`
    body's) is called however it ends, unstarted too (a HEAD). Once the head is sent the status
    cannot change: a producer that raises ends the connection without the final chunk, which a
    client sees as a truncated body. With `length` the body is sent with that Content-Length
    (the codec then holds the producer to it); without, chunked."""

    status: int
    body: AsyncIterable[bytes]
    headers: Headers = ()
    length: int | None = None


@attrs.frozen
class Upgrade:
    """A handler's answer that takes the connection over from HTTP (a WebSocket opening
    handshake, which the new protocol's library answers itself): the server writes nothing and
    calls `run(stream, prefix)`, `prefix` being every byte of the connection read from this
    request's head on (the library reads the request again from it). Only a server started with
    `upgrades=True` takes one, for a request without a body; `run` contains its own failures."""

    run: Callable[[trio.abc.Stream, bytes], Awaitable[None]]


Answer = Response | StreamingResponse | Upgrade
Handler = Callable[[Request], Awaitable[Answer]]
# How a listener words an error on the wire: the status, message and headers of `HTTPError` as
# a response.
ErrorBody = Callable[[HTTPError], Response]


def plain_error(error: HTTPError) -> Response:
    """An error as plain text: its message and a newline (what the agent port answers, and an
    agent shows its operator)."""
    return Response.text(error.status, error.message, error.headers)
