"""A small HTTP/1.1 server on h11 and trio, for the admin API, the gateway and the sim engine.

h11 is the protocol state machine; this module is the trio adapter around it: read bytes,
feed h11, hand a whole `Request` to the handler, write its `Response`. Keep-alive and
pipelined requests are handled in order, one at a time per connection (RFC 9112 §9.3.2).

A handler may answer with a `StreamingResponse` instead: its body is an async iterable of
byte chunks, each sent as soon as it is produced, with `transfer-encoding: chunked` (h11
chooses it for a response without a length, RFC 9112 §6.3; an HTTP/1.0 client gets a body
delimited by closing the connection). While a body streams the connection is also read, so a
client that goes away cancels the producer at once rather than at its next chunk.

Containment: whatever a peer does — close or reset at any byte, send garbage, stall, stop
reading — ends that connection only. The rule lives in one place, `serve_connection`: a
failure the peer caused (`_Abort`, or trio's `BrokenResourceError` and friends, however
deeply a nursery wrapped it) is counted in `ConnectionStats` by reason and logged at debug
with the peer's address; anything else is a bug of ours, logged with its traceback, answered
500 when nothing was sent yet, and the connection closed. Nothing reaches the listener's
nursery.

Deadlines, not per-read timeouts (a peer sending one byte a second must not keep a
connection forever):
- the whole request head within `head_timeout_s` of its first byte (of the connection's
  start, for the first request) -> 408 and close;
- the body at an average of at least `body_min_bytes_per_s` bytes a second (after a short grace) and
  whole within `body_timeout_s` -> 408 and close;
- between requests, a keep-alive connection may idle for `keepalive_timeout_s`, then it is
  closed without a word (RFC 9112 §9.6);
- every write must drain within `send_timeout_s`: a client that stops reading a stream is cut.
Sizes: a head larger than `max_head_bytes` is 431, a body larger than `max_body_bytes` 413.

The body is read only when the handler asks for it (`Request.read`, `Request.json`), so a
handler decides from the head alone — the API key, its limits, the route — before a byte of the
body is buffered: a request refused from its head is answered and its connection closed with the
body unread. What bodies are buffered at once, over all connections, is bounded by one
`BodyBudget` (`body_budget_bytes`): a body is counted before it is read, and past the budget it
waits briefly, then gets 503 with Retry-After. A chunked body may arrive in at most
`MAX_BODY_CHUNKS` chunks (h11 spends microseconds on each; tiny chunks would turn a body into
seconds of work), and is fed to h11 in small pieces so one read never holds the loop long.
JSON bodies are parsed by `llmgw.http.jsonbody`, in time linear in their size.

HEAD is answered as GET would be, with the body left out (RFC 9110 §9.3.2): handlers see the
method as sent and `allow` lets a HEAD through where GET is allowed. A request with both
Content-Length and Transfer-Encoding is 400 and its connection closed (RFC 9112 §6.1).

Connections per listener are capped (`max_connections`, see `llmgw.http.listeners`): at the
cap the connection that has waited longest for a request (kept alive between requests, or new
and silent) is closed to make room; with none waiting, the newcomer is answered `503` with
Retry-After at once (`answer_busy`), so no client waits in the kernel's backlog on idle ones.
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterable, Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

from llmgw.errors import cut, leaves
from llmgw.http import jsonbody
from llmgw.http.listeners import ConnectionStats, Shutdown, default_max_connections, serve_capped
from llmgw.log import get_logger

log = get_logger("llmgw.http")

RECEIVE_SIZE = 65536
MAX_JSON_DEPTH = jsonbody.MAX_DEPTH
# A chunked body is fed to h11 this much at a time, with a checkpoint between: h11 spends about
# 10 µs on each chunk, so a read full of 6-byte chunks must not be handed over at once.
CHUNKED_FEED_BYTES = 4096
MAX_BODY_CHUNKS = 4096
# A body up to this size is handed to the handler as bytes; a larger one as the bytearray it
# was read into (bytes-like for every use: JSON, sending), to keep a copy of it off the budget.
SMALL_BODY_BYTES = 64 << 10
# A body waits this long for room in the body budget before it is answered 503.
BODY_BUDGET_WAIT_S = 1.0
# A body's first bytes may take a moment (a client waiting for 100-continue, a slow start):
# the minimum rate is enforced on the average after this long.
BODY_RATE_GRACE_S = 5.0
# After an error answer that closes the connection, what the client still sends is read and
# dropped for a moment, so that closing does not reset the connection before the client has
# read the answer (RFC 9112 §9.6, "tear-down").
LINGER_S = 1.0
LINGER_BYTES = 256 * 1024


@attrs.frozen(kw_only=True)
class Limits:
    max_head_bytes: int = 16384
    max_body_bytes: int = 8 << 20
    body_budget_bytes: int = 64 << 20  # request bodies buffered at once, all connections together
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_bytes_per_s: int = 1024  # bytes per second, averaged over the body so far; 0 = no minimum
    keepalive_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    max_connections: int = 0  # 0 = sized from the file-descriptor limit, see `default_max_connections`


# -- requests and responses ------------------------------------------------------------------


@attrs.define(kw_only=True, eq=False)
class Request:
    """A request head, and its body for the asking: `read` and `json` read it (once), so a
    handler can refuse a request from its head before a byte of the body is buffered."""

    method: str
    path: str
    # Percent-decoded (UTF-8, undecodable bytes as U+FFFD); a parameter without a value is kept
    # as "" (`?force` -> {"force": [""]}), so that strict readers (`llmgw.http.params`) see it.
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    client: str
    _body: _BodySource

    @classmethod
    def of(
        cls,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        query: dict[str, list[str]] | None = None,
        client: str = "127.0.0.1:1",
    ) -> Request:
        """A request whose body is already in memory (tests, and requests made in-process)."""
        return cls(
            method=method, path=path, query=query or {}, headers=headers or {}, client=client, body=_Buffered(body)
        )

    @property
    def head(self) -> bool:
        return self.method == "HEAD"

    async def read(self, *, limit: int | None = None) -> bytes:
        """The whole body (read once, then the same bytes; a large one as a bytearray);
        `HTTPError(413)` past `limit` or the server's own limit."""
        return await self._body.read(limit)

    async def json(self, *, limit: int = jsonbody.INLINE_MAX_BYTES, what: str = "request body") -> Any:
        """The body as JSON, for the small bodies of the admin API and the page (at most `limit`
        bytes, parsed on the loop: see `llmgw.http.jsonbody`); `HTTPError(400)` naming what is
        wrong, 413 past `limit`."""
        data = await self.read(limit=min(limit, jsonbody.INLINE_MAX_BYTES))
        if not jsonbody.inline(data):
            raise HTTPError(
                413, f"{what} has more than {jsonbody.INLINE_MAX_VALUES} values; this route takes small bodies"
            )
        return parse_json(data, what=what)


def allow(request: Request, method: str) -> None:
    """405 unless `request` is `method`, or a HEAD where `method` is GET (RFC 9110 §9.3.2)."""
    if request.method == method or (method == "GET" and request.method == "HEAD"):
        return
    allowed = "GET, HEAD" if method == "GET" else method
    raise HTTPError(
        405, f"{cut(request.path)} takes {method}, not {cut(request.method, 20)}", headers=(("allow", allowed),)
    )


@attrs.frozen(kw_only=True)
class Response:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        body = json.dumps(obj, indent=None, separators=(",", ":")).encode() + b"\n"
        return cls(status=status, body=body, headers=(("content-type", "application/json"), *headers))


@attrs.frozen(kw_only=True)
class StreamingResponse:
    """A response whose body is produced while it is sent. Iteration is cancelled when the client
    goes away, and the iterable's `aclose()` (an async generator's) is called however it ends.
    Once the head is sent the status cannot change: a producer that raises ends the connection
    without the final chunk, which a client sees as a truncated body."""

    status: int
    body: AsyncIterable[bytes]
    headers: tuple[tuple[str, str], ...] = ()


class BodyAborted(Exception):
    """Raised by a streamed body's producer to end its response without the last chunk, for a
    reason it has logged itself (an upstream broke): the client sees a truncated body, and
    this is not logged as a bug."""


class HTTPError(Exception):
    """Raised by handlers to answer with an error status and an explanation."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", headers=()) -> None:
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = tuple(headers)
        super().__init__(message)

    def __reduce__(self):  # pickled by a JSON worker's projection (llmgw.http.jsonbody)
        return (_http_error, (self.status, self.message, self.kind, self.headers))


def _http_error(status: int, message: str, kind: str, headers: tuple) -> HTTPError:
    return HTTPError(status, message, kind=kind, headers=headers)


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers=()) -> Response:
    # OpenAI's error shape, so clients of the gateway and of the admin API parse one format.
    return Response.json(status, {"error": {"message": message, "type": kind, "code": status}}, tuple(headers))


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


# -- JSON bodies -------------------------------------------------------------------------------


def parse_json(data: bytes, *, what: str = "request body") -> Any:
    """`data` as JSON, or `HTTPError(400)` naming the problem: invalid, or nested deeper than
    `MAX_JSON_DEPTH`. Parsed on the loop: for small bodies only (`jsonbody.INLINE_MAX_BYTES`);
    a larger one goes through `jsonbody.JsonWorkers`."""
    try:
        return jsonbody.loads(data, what=what)
    except jsonbody.InvalidJson as exc:
        raise HTTPError(400, exc.message) from None


async def parse_body(
    request: Request, workers: jsonbody.JsonWorkers, fn: Callable[..., Any], *args: Any, what: str = "request body"
) -> Any:
    """`fn(body as JSON, *args)` for a body of any size up to the limit, the loop never held
    long (see `llmgw.http.jsonbody`): 400 for bad JSON, 503 when the parsers are all busy."""
    body = await request.read()
    try:
        return await workers.parse(body, fn, *args, what=what)
    except jsonbody.InvalidJson as exc:
        raise HTTPError(400, exc.message) from None
    except jsonbody.ParserBusy as exc:
        raise HTTPError(
            503, f"{exc}; try again in a moment", kind="unavailable_error", headers=(("retry-after", "1"),)
        ) from None


# -- request bodies ----------------------------------------------------------------------------


class BodyBudget:
    """Request body bytes buffered at once over every connection of a listener: a body takes
    its size before it is read (a chunked one as it comes) and gives it back when its request
    is over. A body that does not fit waits up to `wait_s` for room, then is answered 503."""

    def __init__(self, max_bytes: int, *, wait_s: float = BODY_BUDGET_WAIT_S) -> None:
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self.used = 0
        self.refused = 0
        self._room = trio.lowlevel.ParkingLot()

    async def take(self, n: int) -> None:
        if self.used + n <= self.max_bytes and not self._room:
            self.used += n
            return
        with trio.move_on_after(self.wait_s):
            while True:
                await self._room.park()
                if self.used + n <= self.max_bytes:
                    self.used += n
                    self._room.unpark()  # there may be room for the next one too
                    return
        self.refused += 1
        raise _Abort(
            "body_budget",
            503,
            f"the server is buffering {self.used} bytes of request bodies, its limit of {self.max_bytes}; "
            "try again in a moment",
            headers=(("retry-after", "1"),),
        )

    def give(self, n: int) -> None:
        self.used -= n
        self._room.unpark()


class _BodySource:
    async def read(self, limit: int | None) -> bytes:
        raise NotImplementedError


class _Buffered(_BodySource):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, limit: int | None) -> bytes:
        if limit is not None and len(self.data) > limit:
            raise _too_large(limit)
        return self.data


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body is larger than the limit of {limit} bytes for this route")


class _ConnectionBody(_BodySource):
    """The body of the request a connection is on, read from it when first asked for.
    `settled` is set once no more of it will be read: read whole, or abandoned (the handler
    answered without it, or reading it failed) — then the connection closes after the answer."""

    def __init__(self, conn: h11.Connection, stream, limits: Limits, budget: BodyBudget, declared: int | None) -> None:
        self.conn, self.stream, self.limits, self.budget, self.declared = conn, stream, limits, budget, declared
        self.data: bytes | None = None
        self.failed: BaseException | None = None
        self.taken = 0
        self.settled = trio.Event()

    @property
    def whole(self) -> bool:
        return self.data is not None

    async def read(self, limit: int | None) -> bytes:
        if self.data is not None:
            if limit is not None and len(self.data) > limit:
                raise _too_large(limit)
            return self.data
        if self.failed is not None:
            raise self.failed
        try:
            if limit is not None and self.declared is not None and self.declared > limit:
                raise _too_large(limit)
            try:
                self.data = await self._read(self.limits.max_body_bytes if limit is None else limit)
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError) as exc:
                # The peer broke the connection under the body: the connection's to end, not
                # the handler's to answer (`_call_handler` lets an `_Abort` through).
                raise _Abort(peer_reason(exc) or "closed", message=f"reading the request body: {exc}") from exc
            return self.data
        except BaseException as exc:
            self.failed = exc
            raise
        finally:
            self.settled.set()

    async def _read(self, limit: int) -> bytes:
        conn, limits = self.conn, self.limits
        chunked = self.declared is None
        if not chunked:
            await self.budget.take(self.declared)
            self.taken += self.declared
        start = trio.current_time()
        total_deadline = start + limits.body_timeout_s
        # A body of known length is read into its place, with no copy at the end: it is what
        # the budget counted, once (a large one is handed out as this bytearray).
        body = bytearray(self.declared) if not chunked else bytearray()
        got = 0
        chunks = 0
        unfed = b""  # of a chunked body: read, not yet given to h11 (see CHUNKED_FEED_BYTES)
        while True:
            part = _next_event(conn)
            if isinstance(part, h11.Data):
                if chunked:  # counted as it comes
                    await self.budget.take(len(part.data))
                    self.taken += len(part.data)
                    chunks += part.chunk_start
                    if chunks > MAX_BODY_CHUNKS:
                        raise _Abort(
                            "malformed",
                            400,
                            f"chunked request body in more than {MAX_BODY_CHUNKS} chunks; send it with "
                            "Content-Length or in larger chunks",
                        )
                if chunked:
                    body += part.data
                else:  # h11 never gives more than the declared length
                    body[got : got + len(part.data)] = part.data
                got += len(part.data)
                if got > limit:
                    if limit < limits.max_body_bytes:
                        raise _too_large(limit)
                    raise _Abort("too_large", 413, f"request body is larger than the limit of {limit} bytes")
            elif isinstance(part, h11.EndOfMessage):
                return bytes(body) if got <= SMALL_BODY_BYTES else body
            elif part is h11.NEED_DATA and unfed:
                await trio.lowlevel.checkpoint()
                conn.receive_data(unfed[:CHUNKED_FEED_BYTES])
                unfed = unfed[CHUNKED_FEED_BYTES:]
            elif part is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    await _send(self.stream, conn.send(h11.InformationalResponse(status_code=100, headers=[])), limits)
                deadline = total_deadline
                if limits.body_min_bytes_per_s > 0:
                    # The average so far must stay above the minimum: each byte buys 1/rate seconds.
                    deadline = min(deadline, start + BODY_RATE_GRACE_S + got / limits.body_min_bytes_per_s)
                with trio.move_on_at(deadline):
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                    if chunked:
                        data, unfed = data[:CHUNKED_FEED_BYTES], data[CHUNKED_FEED_BYTES:]
                    conn.receive_data(data)
                    continue
                if deadline < total_deadline:
                    raise _Abort(
                        "body_too_slow",
                        408,
                        f"request body arrived slower than {limits.body_min_bytes_per_s} bytes per second "
                        f"({got} bytes in {trio.current_time() - start:.1f} s)",
                    )
                raise _Abort("body_timeout", 408, f"request body not received within {limits.body_timeout_s:g} s")
            else:
                raise _Abort("closed", message="connection closed in the middle of the request body")

    def release(self) -> None:
        if self.taken:
            self.budget.give(self.taken)
            self.taken = 0


class _Abort(Exception):
    """The peer's fault or a deadline: this connection ends. `status` > 0: answer it first
    (when the response has not begun)."""

    def __init__(self, reason: str, status: int = 0, message: str = "", headers=()) -> None:
        self.reason, self.status, self.message, self.headers = reason, status, message, tuple(headers)
        super().__init__(f"{reason}: {message}" if message else reason)


_PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, h11.RemoteProtocolError)


def peer_reason(exc: BaseException) -> str | None:
    """Why a connection broke, when every failure inside `exc` is the peer's; None when any
    is not (a bug of ours)."""
    reasons = []
    for leaf in leaves(exc):
        if isinstance(leaf, _Abort):
            reasons.append(leaf.reason)
        elif isinstance(leaf, trio.TooSlowError):
            reasons.append("send_timeout")
        elif isinstance(leaf, trio.BrokenResourceError):
            cause = leaf.__cause__
            reset = isinstance(cause, OSError) and cause.errno in (errno.ECONNRESET, errno.EPIPE)
            reasons.append("reset" if reset else "closed")
        elif isinstance(leaf, (trio.ClosedResourceError, h11.RemoteProtocolError)):
            reasons.append("closed")
        else:
            return None
    return reasons[0] if reasons else None


# -- serving -----------------------------------------------------------------------------------


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: Limits = Limits(),
    stats: ConnectionStats | None = None,
    listener: str = "http",
    shutdown: Shutdown | None = None,
    sockets: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP on (host, port), or on `sockets` already listening (socket activation).
    `shutdown.begin()` stops it gracefully (see `Shutdown`); cancellation stops it at once."""
    listeners = sockets or await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners)
    stats = stats or ConnectionStats()
    shutdown = shutdown or Shutdown()
    budget = BodyBudget(limits.body_budget_bytes)

    async def one(stream: trio.abc.Stream) -> None:
        await serve_connection(
            handler, stream, limits=limits, stats=stats, listener=listener, shutdown=shutdown, budget=budget
        )

    cap = limits.max_connections or default_max_connections(listener)
    await serve_capped(
        one, listeners, max_connections=cap, stats=stats, listener=listener, shutdown=shutdown, refuse=answer_busy
    )


BUSY_RETRY_AFTER_S = 1
_BUSY_BODY = (
    json.dumps(
        {
            "error": {
                "message": "the server is serving as many connections as it may, none of them idle; "
                f"retry in {BUSY_RETRY_AFTER_S} s",
                "type": "server_error",
                "code": 503,
            }
        },
        separators=(",", ":"),
    ).encode()
    + b"\n"
)
# Sent before the request is read (h11 answers only a request it has parsed), so written out
# here; a client reads it as the answer to the request it sends (RFC 9112 §9.6: the server
# closes, and says so).
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    + f"retry-after: {BUSY_RETRY_AFTER_S}\r\ncontent-length: {len(_BUSY_BODY)}\r\n".encode()
    + b"connection: close\r\n\r\n"
    + _BUSY_BODY
)
BUSY_SEND_S = 1.0


async def answer_busy(stream: trio.abc.Stream) -> None:
    """Turn away a connection the listener has no room for: `503` with Retry-After, written
    within BUSY_SEND_S, then a half-close and a short linger so the client reads it rather
    than a reset. Never raises (but Cancelled); the caller closes the stream."""
    try:
        with trio.fail_after(BUSY_SEND_S):
            await stream.send_all(BUSY_ANSWER)
        await _linger(stream)
    except Exception as exc:  # - a refusal's failure ends that connection only
        if peer_reason(exc) is None:
            log.exception("http_busy_answer_failed")


def bound_address(listeners: list) -> tuple[str, int]:
    """(host, port) a SocketListener or an SSLListener over one is bound to."""
    listener = listeners[0]
    while not isinstance(listener, trio.SocketListener):
        listener = listener.transport_listener
    host, port = listener.socket.getsockname()[:2]
    return host, port


def peer_address(stream: trio.abc.Stream) -> str:
    inner = stream
    while not hasattr(inner, "socket") and hasattr(inner, "transport_stream"):
        inner = inner.transport_stream
    try:
        peer = inner.socket.getpeername()  # type: ignore[attr-defined]
    except (OSError, AttributeError):  # AttributeError: an in-memory stream in tests
        return "?"
    return f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"


async def serve_connection(
    handler: Handler,
    stream: trio.abc.Stream,
    *,
    limits: Limits = Limits(),
    stats: ConnectionStats | None = None,
    listener: str = "http",
    shutdown: Shutdown | None = None,
    budget: BodyBudget | None = None,
) -> None:
    """Serve one connection until it closes. Never raises (but Cancelled): see the module's
    "Containment"."""
    client = peer_address(stream)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
    budget = budget or BodyBudget(limits.body_budget_bytes)
    try:
        await _serve_requests(handler, limits, conn, stream, client, shutdown or Shutdown(), budget)
    except Exception as exc:
        reason = peer_reason(exc)
        if reason is None:
            log.exception("http_connection_failed", listener=listener, client=client)
            if stats is not None:
                stats.abort(listener, "internal")
            error = error_response(500, "internal error in llmgw; the server's log has the traceback", "server_error")
            await _answer_and_close(conn, stream, limits, error)
        else:
            abort = next((e for e in leaves(exc) if isinstance(e, _Abort)), None)
            log.debug("http_connection_aborted", listener=listener, client=client, reason=reason, detail=str(exc))
            if stats is not None:
                stats.abort(listener, reason)
            if abort is not None and abort.status:
                error = error_response(abort.status, abort.message, headers=abort.headers)
                await _answer_and_close(conn, stream, limits, error)
    finally:
        await trio.aclose_forcefully(stream)


async def _answer_and_close(conn: h11.Connection, stream, limits: Limits, response: Response) -> None:
    """Answer an error on a connection about to close, if no response has begun; whatever
    the peer does meanwhile is ignored (it ends the connection either way)."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return  # the response has begun: cutting the connection is the only signal left
    try:
        await _send_response(conn, stream, response, limits, close=True)
        await _linger(stream)
    except Exception as exc:  # - the connection ends either way; nothing may escape it
        if peer_reason(exc) is None:
            log.exception("http_error_answer_failed", status=response.status)


async def _linger(stream) -> None:
    """Half-close and read what is still coming for a moment, so the answer just sent is not
    destroyed by a reset when we close with unread data."""
    send_eof = getattr(stream, "send_eof", None)
    if send_eof is not None:
        await send_eof()
    read = 0
    with trio.move_on_after(LINGER_S):
        while read < LINGER_BYTES:
            data = await stream.receive_some(RECEIVE_SIZE)
            if not data:
                return
            read += len(data)


async def _serve_requests(
    handler: Handler, limits: Limits, conn: h11.Connection, stream, client: str, shutdown: Shutdown, budget: BodyBudget
) -> None:
    first = True
    while True:
        request = await _read_request(conn, stream, limits, client, first=first, shutdown=shutdown, budget=budget)
        first = False
        if request is None:
            return
        body = request._body
        assert isinstance(body, _ConnectionBody)
        try:
            response = await _call_handler(handler, request, conn, stream, limits)
            if response is None:
                raise _Abort("closed", message="the client closed the connection before the answer")
            # A body left unread (the request was refused from its head) or broken off cannot be
            # skipped to the next request: this answer is the connection's last, and says so. So
            # is an answer while stopping (RFC 9112 §9.6).
            close = shutdown.begun or not body.whole
            if isinstance(response, StreamingResponse):
                await _send_streaming(conn, stream, response, limits, close=close, head=request.head)
            else:
                await _send_response(conn, stream, response, limits, close=close, head=request.head)
        finally:
            body.release()
        if not body.whole:
            await _linger(stream)
            return
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return
        conn.start_next_cycle()


async def _call_handler(handler: Handler, request: Request, conn: h11.Connection, stream, limits: Limits):
    """The handler's response; None if the client closed the connection first, in which case the
    handler is cancelled (so a gateway request stops its upstream request too). The connection
    is watched for that only once the body is settled: until then the handler may be reading it."""
    answer: list = []
    body = request._body
    assert isinstance(body, _ConnectionBody)
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            try:
                answer.append(await handler(request))
            except Exception as exc:  # - one bad request must not take the server down
                if peer_reason(exc) is not None and any(isinstance(e, _Abort) for e in leaves(exc)):
                    raise  # reading the body failed by the peer's fault: the connection's to handle
                http_error = _only_http_error(exc)
                if http_error is not None:
                    answer.append(
                        error_response(http_error.status, http_error.message, http_error.kind, http_error.headers)
                    )
                else:
                    log.exception("http_handler_failed", method=request.method, path=request.path)
                    answer.append(
                        error_response(
                            500, "internal error in llmgw; the server's log has the traceback", "server_error"
                        )
                    )
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            await body.settled.wait()
            if body.whole:
                await _wait_for_disconnect(conn, stream, limits)
                nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(watch)
    return answer[0] if answer else None


def _only_http_error(exc: BaseException) -> HTTPError | None:
    found = leaves(exc)
    return found[0] if len(found) == 1 and isinstance(found[0], HTTPError) else None


async def _receive(conn: h11.Connection, stream, deadline: float) -> bool:
    """Read once into h11, unless `deadline` passes first (then False)."""
    with trio.move_on_at(deadline):
        data = await stream.receive_some(RECEIVE_SIZE)
        conn.receive_data(data)
        return True
    return False


def _next_event(conn: h11.Connection):
    try:
        return conn.next_event()
    except h11.RemoteProtocolError as exc:
        if conn.trailing_data[1]:  # the peer closed in the middle of a message
            raise _Abort("closed", message=str(exc)) from None
        status = exc.error_status_hint
        reason = "too_large" if status == 431 else "malformed"
        raise _Abort(reason, status, f"malformed HTTP request: {exc}") from None


async def _read_request(
    conn: h11.Connection, stream, limits: Limits, client: str, *, first: bool, shutdown: Shutdown, budget: BodyBudget
) -> Request | None:
    now = trio.current_time()
    # A new connection must send its head within head_timeout_s; a kept-alive one may idle
    # for keepalive_timeout_s before the next head starts, then has head_timeout_s for it.
    head_deadline = now + limits.head_timeout_s if first or conn.trailing_data[0] else None
    while True:
        event = _next_event(conn)
        if event is not h11.NEED_DATA:
            break
        if head_deadline is None and conn.trailing_data[0]:
            head_deadline = trio.current_time() + limits.head_timeout_s
        if not conn.trailing_data[0]:
            # Nothing of a request yet: idle between requests until the keep-alive deadline, or
            # new and silent until the head deadline. Either way the listener may close this
            # connection quietly to make room at its cap (`listeners.IdleConnections`), and a
            # stopping server closes the idle ones (not a new one: its request may be on the way).
            fresh = head_deadline is not None
            with shutdown.idle.waiting(peer=client, stoppable=not fresh) as idle:
                received = await _receive(conn, stream, head_deadline if fresh else now + limits.keepalive_timeout_s)
            if idle.cancelled_caught:
                return None
            if received:
                continue
            if fresh:
                raise _Abort("head_timeout", message=f"nothing sent within {limits.head_timeout_s:g} s")
            return None  # the keep-alive deadline: closed quietly (RFC 9112 §9.6)
        if not await _receive(conn, stream, head_deadline):
            raise _Abort(
                "head_timeout", 408, f"request head not received within {limits.head_timeout_s:g} s; send it whole"
            )
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise _Abort("malformed", 400, f"expected a request, got {type(event).__name__}")
    # h11 bounds a head that arrives in pieces; one that arrives whole is measured here.
    head_size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
    if head_size > limits.max_head_bytes:
        raise _Abort(
            "too_large", 431, f"request head of {head_size} bytes is larger than the limit of {limits.max_head_bytes}"
        )
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
    if "transfer-encoding" in headers and "content-length" in headers:
        # RFC 9112 §6.1: a message with both may be an attempt at request smuggling; answer
        # and close rather than guess which framing the sender meant.
        raise _Abort("malformed", 400, "request has both Content-Length and Transfer-Encoding; send one of them")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _Abort(
            "too_large", 413, f"request body of {declared} bytes is larger than the limit of {limits.max_body_bytes}"
        )
    chunked = "transfer-encoding" in headers
    body = _ConnectionBody(conn, stream, limits, budget, None if chunked else int(declared or 0))
    if not chunked and not int(declared or 0):
        # No body: take h11's EndOfMessage now, so the request is whole before the handler runs.
        body.data = _no_body(conn)
        body.settled.set()
    target = urlsplit(event.target.decode("latin-1"))
    return Request(
        method=event.method.decode("ascii"),
        path=target.path,
        query=parse_qs(target.query, keep_blank_values=True),
        headers=headers,
        client=client,
        body=body,
    )


def _no_body(conn: h11.Connection) -> bytes:
    event = _next_event(conn)
    if not isinstance(event, h11.EndOfMessage):
        raise _Abort("malformed", 400, f"expected the end of a request without a body, got {type(event).__name__}")
    return b""


async def _send(stream, data: bytes, limits: Limits) -> None:
    """Write, or `TooSlowError` when the peer has not taken it within `send_timeout_s`."""
    with trio.fail_after(limits.send_timeout_s):
        await stream.send_all(data)


async def _send_response(
    conn: h11.Connection, stream, response: Response, limits: Limits, close: bool = False, head: bool = False
) -> None:
    """Send a whole response; to a HEAD, its head alone, with the length the body would have."""
    headers = [(k.encode(), v.encode()) for k, v in response.headers if k.lower() != "content-length"]
    headers.append((b"content-length", str(len(response.body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    data = conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
    if response.body and not head:
        data += conn.send(h11.Data(data=response.body))
    await _send(stream, data + conn.send(h11.EndOfMessage()), limits)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def _send_streaming(
    conn: h11.Connection, stream, response: StreamingResponse, limits: Limits, close: bool = False, head: bool = False
) -> None:
    """Send a streamed response. The client going away, or the producer failing, ends the
    connection (`_Abort` or the stream's error). To a HEAD: the head alone, the producer closed
    unstarted."""
    headers = [(k.encode(), v.encode()) for k, v in response.headers if k.lower() != "content-length"]
    if close:
        headers.append((b"connection", b"close"))
    gone: list[bool] = []
    try:
        if head:
            start = h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status))
            await _send(stream, conn.send(start) + conn.send(h11.EndOfMessage()), limits)
            return
        # Inside the try: a client gone before the head still gets the producer closed.
        await _send(
            stream,
            conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status))),
            limits,
        )
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await _wait_for_disconnect(conn, stream, limits)
                gone.append(True)
                nursery.cancel_scope.cancel()  # the client is gone: stop the producer now

            nursery.start_soon(watch)
            try:
                await _send_body(conn, stream, response.body, limits)
            finally:
                nursery.cancel_scope.cancel()
        if gone:
            raise _Abort("closed", message="the client closed the connection during a streamed response")
    finally:
        aclose = getattr(response.body, "aclose", None)
        if aclose is not None:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await aclose()


async def _send_body(conn: h11.Connection, stream, body: AsyncIterable[bytes], limits: Limits) -> None:
    # The producer's failures and the client's are told apart: only the first is a bug to log,
    # and neither is answered (the head is out): the connection closes without the last chunk.
    chunks = aiter(body)
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except BodyAborted as exc:
            raise _Abort("body_aborted", message=str(exc)) from None  # said where it was raised
        except Exception:
            log.exception("http_stream_failed")
            raise _Abort("producer_failed", message="the streamed body's producer failed") from None
        if not chunk:
            continue  # an empty chunk would end a chunked body (RFC 9112 §7.1)
        await _send(stream, conn.send(h11.Data(data=chunk)), limits)
    await _send(stream, conn.send(h11.EndOfMessage()), limits)


async def _wait_for_disconnect(conn: h11.Connection, stream, limits: Limits) -> None:
    """Read the connection while a response is made; return when the client has closed it.
    Bytes that arrive meanwhile (a pipelined request) go to h11's buffer for the next cycle;
    past one head's worth of them this stops reading and lets TCP push back (what is buffered
    here is outside the body budget, so it stays small)."""
    while len(conn.trailing_data[0]) < limits.max_head_bytes:
        try:
            data = await stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if not data:
            return
        conn.receive_data(data)
    await trio.sleep_forever()
