"""Relaying requests to an HTTP server on a Unix socket: how a gateway process passes on what is
the control plane's on `http_listen` — the admin API, the cluster page and /login, its /metrics —
to the control plane's private socket (`STATE_DIR/run/admin.sock`, `llmgw.server.admin.privatesocket`),
once the gateway serves that port from processes of its own.

`Relay.handle` is a handler of `llmgw.http.server`:

- The request goes on as it came — method, target, header fields as byte pairs (Host,
  Authorization, Cookie and Origin too: the admin API and the page check them) — but for the
  hop-by-hop fields and those `Connection` names (RFC 9110 §7.6.1). Its body is read first,
  within the listener's limits, and sent with its length. The client's address goes in
  `x-llmgw-client` (`CLIENT_HEADER`), which the control plane believes on its private socket
  only; one the client sent is dropped.
- An answer with a length of at most `max_whole_bytes` is read whole and answered as a
  `Response`. A longer one, or one without a length (the page's live feed, `GET
  /admin/v1/events`, server-sent events), is relayed as it arrives, each piece what the codec
  could decode of one read (`StreamingResponse`); the client going away closes the connection to the control plane,
  which ends the stream there.
- One connection per request, closed once answered: admin traffic is a few requests a minute
  and a Unix connect costs microseconds, so there is no pool, nor a pool's rules for
  connections gone stale while idle.

Every step is bounded, so a relayed request never holds a gateway worker: connecting
(`connect_timeout_s`), the answer's head (`first_byte_timeout_s`), each read of its body
(`idle_timeout_s`: four of the live feed's 15 s heartbeats), the head's size (`max_head_bytes`)
and what is held of the answer (`max_whole_bytes`; a streamed chunk is one read's worth). Each
failure is answered naming the control plane as its cause and what still works:
- no socket, none listening, no connection in time, the request not taken: 503 with
  Retry-After;
- the request taken but no answer in time: 504; an answer that is not HTTP, a head past the
  limit, or a whole answer cut short: 502;
- a streamed answer cut or silent midway: ended short (`BodyAborted`), as a client sees any
  upstream that breaks after its head.

The HTTP is the codec's client role (`llmgw.h1`: `request_bytes`, `ResponseParser`), as the
gateway's to engines. Why not the gateway's upstream pool (`gateway/upstream.py`): the HTTP stack imports nothing of
the gateway, and the pool is made for engines: it writes its own Host (the page's Origin check
needs the client's), retries on another connection, and on silence probes `/health`, which the
private socket does not serve.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NoReturn

import attrs
import trio

from llmgw.errors import cut
from llmgw.h1 import END, NEED_DATA, ClosedBeforeResponse, Head, ProtocolError, ResponseParser, request_bytes
from llmgw.http.errors import BodyAborted, HTTPError
from llmgw.http.jsonbody import INLINE_MAX_BYTES
from llmgw.http.messages import Headers, Request, Response, StreamingResponse
from llmgw.http.unixsocket import connect_unix
from llmgw.log import get_logger

log = get_logger("llmgw.relay")

# The largest body relayed: what every route of the control plane takes at most (the admin API,
# the page: `llmgw.http.jsonbody.read_json`).
RELAYED_BODY_MAX_BYTES = INLINE_MAX_BYTES
# The address of the client the relay serves, for the control plane's log lines and limits.
CLIENT_HEADER = "x-llmgw-client"
RECEIVE_SIZE = 65536
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {b"content-length", b"expect", CLIENT_HEADER.encode()}
_NOT_RELAYED = HOP_BY_HOP | {b"content-length"}
_NO_BODY = frozenset({204, 304})
STILL_SERVING = "the gateway keeps serving /v1/"
_STREAM_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


def gateway_route(path: str) -> bool:
    """Whether `path` is the gateway's on `http_listen` (wherever the gateway runs); everything
    else there is the control plane's own (`llmgw.server.admin.privatesocket`), and a gateway worker of
    the control plane relays it."""
    return path.startswith("/v1/") or path == "/health"


@attrs.frozen(kw_only=True)
class RelayLimits:
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 30.0  # the admin API answers at once; a reload reads a file
    idle_timeout_s: float = 60.0  # between reads of an answer's body: the live feed beats every 15 s
    max_head_bytes: int = 65536
    max_whole_bytes: int = 1 << 20  # an answer with a length up to this is read whole; longer, streamed
    retry_after_s: int = 2


class _Failed(Exception):
    """The relay could not get an answer: `status` (502, 503, 504) and `why`, for the message."""

    def __init__(self, status: int, why: str) -> None:
        self.status, self.why = status, why
        super().__init__(why)


@attrs.define(eq=False)
class _Upstream:
    """One connection to the upstream server and the parser of its answer."""

    stream: trio.abc.Stream
    parser: ResponseParser
    answering: bool = False  # the answer's head has come

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except _STREAM_ERRORS:
            raise _Failed(503, "it closed the connection before taking the request") from None

    async def next_event(self, timeout_s: float, silent: str) -> Head | bytes | object:
        """The parser's next event (a `Head`, a piece of the body, `END`), reading within
        `timeout_s`; `_Failed` with `silent` (504) past it, or 502 for what is not HTTP or a
        broken connection."""
        while True:
            try:
                event = self.parser.next_event()
            except ProtocolError as exc:
                raise _Failed(502, self._protocol_error(exc)) from None
            if event is not NEED_DATA:
                self.answering = self.answering or isinstance(event, Head)
                return event
            with trio.move_on_after(timeout_s) as waited:
                try:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                except _STREAM_ERRORS as exc:
                    raise _Failed(502, f"its connection broke ({exc.__class__.__name__})") from None
            if waited.cancelled_caught:
                raise _Failed(504, silent)
            self.parser.receive_data(data)  # b"": the peer closed, which the parser reports next

    def _protocol_error(self, exc: ProtocolError) -> str:
        if isinstance(exc, ClosedBeforeResponse) or (self.parser.eof and not self.answering):
            return "it closed the connection before answering"
        if self.parser.eof:
            return "it closed the connection in the middle of an answer"
        return f"it sent what is not an HTTP answer ({exc})"

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Relay:
    """Relays requests to the HTTP server on the Unix socket `path` (the module docstring)."""

    def __init__(self, path: Path, *, limits: RelayLimits | None = None) -> None:
        self.path = Path(path)
        self.limits = limits or RelayLimits()

    async def handle(self, request: Request) -> Response | StreamingResponse:
        try:
            return await self._relay(request)
        except _Failed as exc:
            level = log.info if exc.status == 503 else log.warning
            level("relay_failed", status=exc.status, path=cut(request.path), reason=exc.why, socket=str(self.path))
            raise self._error(exc) from None

    def _error(self, failed: _Failed) -> HTTPError:
        where = f"the control plane's private socket {self.path}"
        if failed.status == 503:
            retry = self.limits.retry_after_s
            return HTTPError(
                503,
                f"the control plane is not answering on its private socket {self.path}: {failed.why}; "
                f"{STILL_SERVING}; retry in {retry} s",
                headers=(("retry-after", str(retry)),),
            )
        if failed.status == 504:
            return HTTPError(504, f"the control plane took the request on {where} but {failed.why}; {STILL_SERVING}")
        return HTTPError(502, f"the control plane's answer on {where} was broken: {failed.why}; {STILL_SERVING}")

    async def _relay(self, request: Request) -> Response | StreamingResponse:
        # First: a slow client holds no connection to the control plane. No more than the
        # control plane's routes take (`read_json`): a body read before any credential is checked
        # is small, whoever sends it.
        body = await request.read(limit=RELAYED_BODY_MAX_BYTES)
        upstream = await self._connect(request.method)
        try:
            await upstream.send(request_head(request, body) + body)
            response = await self._head(upstream)
            return await self._answer(request, upstream, response)
        except BaseException:
            await upstream.aclose()
            raise

    async def _connect(self, method: str) -> _Upstream:
        timeout = self.limits.connect_timeout_s
        try:
            with trio.fail_after(timeout):
                stream = await connect_unix(self.path)
        except trio.TooSlowError:
            raise _Failed(503, f"no connection within {timeout:g} s (its backlog is full: it accepts none)") from None
        except FileNotFoundError:
            raise _Failed(503, "there is no socket (the control plane is not running, or not yet)") from None
        except ConnectionRefusedError:
            raise _Failed(503, "nothing listens on it (the control plane stopped)") from None
        except OSError as exc:
            raise _Failed(503, f"cannot connect: {exc.strerror or exc}") from None
        parser = ResponseParser(request_method=method, max_head_bytes=self.limits.max_head_bytes)
        return _Upstream(stream, parser)

    async def _head(self, upstream: _Upstream) -> Head:
        timeout = self.limits.first_byte_timeout_s
        with trio.move_on_after(timeout):
            event = await upstream.next_event(math.inf, "")  # this scope's deadline is the head's
            assert isinstance(event, Head), event  # the parser gives the head first (1xx ones skipped)
            return event
        raise _Failed(504, f"sent no answer within {timeout:g} s (its event loop may be held up)")

    async def _answer(self, request: Request, upstream: _Upstream, response: Head) -> Response | StreamingResponse:
        """The answer to the client: whole when its length allows (the connection then closed),
        else streamed, the body owning the connection."""
        headers = relayed_headers(response.headers)
        length = upstream.parser.content_length
        status = response.status
        whole = status in _NO_BODY or (length is not None and length <= self.limits.max_whole_bytes)
        if whole and not request.head:
            data = await self._read_whole(upstream)
            await upstream.aclose()
            return Response(status=status, body=data, headers=headers)
        # To a HEAD: the head alone, with the length the upstream announced; the body unread.
        relayed = RelayedBody(upstream, idle_timeout_s=self.limits.idle_timeout_s, path=self.path)
        return StreamingResponse(status=status, body=relayed, headers=headers, length=length)

    async def _read_whole(self, upstream: _Upstream) -> bytes:
        idle = self.limits.idle_timeout_s
        out = bytearray()
        while True:
            event = await upstream.next_event(idle, f"sent part of an answer and then nothing for {idle:g} s")
            if event is END:
                return bytes(out)
            out += event  # type: ignore[operator] - a piece of the body


class RelayedBody:
    """A relayed answer's body, read as the client takes it; the connection is closed at
    `aclose`, which the server calls however the response ends (sent whole, the client gone,
    never started: a HEAD)."""

    def __init__(self, upstream: _Upstream, *, idle_timeout_s: float, path: Path) -> None:
        self.upstream = upstream
        self.idle_timeout_s = idle_timeout_s
        self.path = path
        self.sent = 0

    def __aiter__(self) -> RelayedBody:
        return self

    async def __anext__(self) -> bytes:
        silent = f"it sent nothing for {self.idle_timeout_s:g} s in the middle of an answer"
        try:
            event = await self.upstream.next_event(self.idle_timeout_s, silent)
        except _Failed as exc:
            self._broke(exc.why)
        if event is END:
            raise StopAsyncIteration
        # What the parser could decode of the last read, in one piece: a burst of small chunks
        # is one write, not one each.
        self.sent += len(event)  # type: ignore[arg-type]
        return event  # type: ignore[return-value]

    def _broke(self, why: str) -> NoReturn:
        log.warning("relay_stream_broken", reason=why, sent_bytes=self.sent, socket=str(self.path))
        raise BodyAborted(f"the control plane's answer on {self.path} broke off: {why}")

    async def aclose(self) -> None:
        await self.upstream.aclose()


def request_head(request: Request, body: bytes | bytearray) -> bytes:
    """The request's head to the upstream: its method and target; its Host (`localhost` for an
    HTTP/1.0 client's that named none) and the length of `body` first; then the client's fields
    as they came but for the hop-by-hop ones, those `Connection` names and a client's own
    `CLIENT_HEADER`; then the client's address, and `Connection: close` (one request per
    connection)."""
    named = _connection_named(request.raw_headers)
    host = b"localhost"
    fields = []
    for k, v in request.raw_headers:
        if k in _NOT_FORWARDED or k in named:
            continue
        if k == b"host":
            host = v
        else:
            fields.append((k, v))
    fields += [
        (CLIENT_HEADER.encode(), request.client.encode("latin-1", "replace")),
        (b"connection", b"close"),
    ]
    return request_bytes(request.method, request.target.decode("latin-1"), host.decode("latin-1"), fields, body)


def relayed_headers(upstream: list[tuple[bytes, bytes]]) -> Headers:
    """The answer's fields to the client: the upstream's but for the hop-by-hop ones and those
    `Connection` names; the length is the server's to write."""
    named = _connection_named(upstream)
    return tuple((k, v) for k, v in upstream if k not in _NOT_RELAYED and k not in named)


def _connection_named(fields) -> set[bytes]:
    return {t.strip().lower() for k, v in fields if k == b"connection" for t in v.split(b",")}
