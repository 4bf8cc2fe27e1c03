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

Connections per listener are capped (`max_connections`): past the cap the server stops
accepting, and new connections wait in the kernel's backlog until one ends, instead of
exhausting the process's file descriptors.
"""

from __future__ import annotations

import errno
import json
import re
from collections.abc import AsyncIterable, Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

from llmgw.errors import leaves
from llmgw.http.listeners import ConnectionStats, Shutdown, default_max_connections, serve_capped
from llmgw.log import get_logger

log = get_logger("llmgw.http")

RECEIVE_SIZE = 65536
MAX_JSON_DEPTH = 64
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
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_bytes_per_s: int = 1024  # bytes per second, averaged over the body so far; 0 = no minimum
    keepalive_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    max_connections: int = 0  # 0 = sized from the file-descriptor limit, see `default_max_connections`


# -- requests and responses ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Request:
    method: str
    path: str
    # Percent-decoded (UTF-8, undecodable bytes as U+FFFD); a parameter without a value is kept
    # as "" (`?force` -> {"force": [""]}), so that strict readers (`llmgw.http.params`) see it.
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes
    client: str

    def json(self) -> Any:
        """The body as JSON; raises `HTTPError(400)` naming what is wrong."""
        return parse_json(self.body or b"null")


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


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers=()) -> Response:
    # OpenAI's error shape, so clients of the gateway and of the admin API parse one format.
    return Response.json(status, {"error": {"message": message, "type": kind, "code": status}}, tuple(headers))


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


# -- JSON bodies -------------------------------------------------------------------------------

# A JSON string (escapes included, unrolled so it never backtracks) or one bracket.
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects deeper than `limit`, decided before
    parsing (a parser recursing 100,000 levels is a crash, not a bad request). Brackets inside
    strings do not count."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # cannot nest deeper than it has openings: the common case, in C
    depth = 0
    for m in _JSON_TOKENS.finditer(data):
        c = m.group()[0]
        if c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c != 0x22:  # a closing bracket ('"' opens a skipped string)
            depth -= 1
    return False


def parse_json(data: bytes, *, what: str = "request body") -> Any:
    """`data` as JSON, or `HTTPError(400)` naming the problem: invalid, or nested deeper than
    `MAX_JSON_DEPTH`."""
    if json_depth_exceeds(data):
        raise HTTPError(400, f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise HTTPError(400, f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # a backstop: the depth check above should make this unreachable
        raise HTTPError(400, f"{what} nests arrays or objects too deeply") from None


class _Abort(Exception):
    """The peer's fault or a deadline: this connection ends. `status` > 0: answer it first
    (when the response has not begun)."""

    def __init__(self, reason: str, status: int = 0, message: str = "") -> None:
        self.reason, self.status, self.message = reason, status, message
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

    async def one(stream: trio.abc.Stream) -> None:
        await serve_connection(handler, stream, limits=limits, stats=stats, listener=listener, shutdown=shutdown)

    cap = limits.max_connections or default_max_connections(listener)
    await serve_capped(one, listeners, max_connections=cap, stats=stats, listener=listener, shutdown=shutdown)


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
) -> None:
    """Serve one connection until it closes. Never raises (but Cancelled): see the module's
    "Containment"."""
    client = peer_address(stream)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
    try:
        await _serve_requests(handler, limits, conn, stream, client, shutdown or Shutdown())
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
                await _answer_and_close(conn, stream, limits, error_response(abort.status, abort.message))
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
    handler: Handler, limits: Limits, conn: h11.Connection, stream, client: str, shutdown: Shutdown
) -> None:
    first = True
    while True:
        request = await _read_request(conn, stream, limits, client, first=first, shutdown=shutdown)
        first = False
        if request is None:
            return
        response = await _call_handler(handler, request, conn, stream, limits)
        if response is None:
            raise _Abort("closed", message="the client closed the connection before the answer")
        # Stopping: this answer is the connection's last, and it says so (RFC 9112 §9.6).
        if isinstance(response, StreamingResponse):
            await _send_streaming(conn, stream, response, limits, close=shutdown.begun)
        else:
            await _send_response(conn, stream, response, limits, close=shutdown.begun)
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return
        conn.start_next_cycle()


async def _call_handler(handler: Handler, request: Request, conn: h11.Connection, stream, limits: Limits):
    """The handler's response; None if the client closed the connection first, in which case the
    handler is cancelled (so a gateway request stops its upstream request too)."""
    answer: list = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            try:
                answer.append(await handler(request))
            except Exception as exc:  # - one bad request must not take the server down
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
    conn: h11.Connection, stream, limits: Limits, client: str, *, first: bool, shutdown: Shutdown
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
        if head_deadline is None:
            # Between requests: idle until the keep-alive deadline, or the server stopping.
            idle = shutdown.idle_scope(now + limits.keepalive_timeout_s)
            try:
                with idle:
                    conn.receive_data(await stream.receive_some(RECEIVE_SIZE))
            finally:
                shutdown.leave_idle(idle)
            if idle.cancelled_caught:
                return None  # an idle keep-alive connection: closed quietly
            continue
        if not await _receive(conn, stream, head_deadline):
            if first and not conn.trailing_data[0]:
                raise _Abort("head_timeout", message=f"nothing sent within {limits.head_timeout_s:g} s")
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
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _Abort(
            "too_large", 413, f"request body of {declared} bytes is larger than the limit of {limits.max_body_bytes}"
        )
    body = await _read_body(conn, stream, limits)
    target = urlsplit(event.target.decode("latin-1"))
    return Request(
        method=event.method.decode("ascii"),
        path=target.path,
        query=parse_qs(target.query, keep_blank_values=True),
        headers=headers,
        body=body,
        client=client,
    )


async def _read_body(conn: h11.Connection, stream, limits: Limits) -> bytes:
    start = trio.current_time()
    total_deadline = start + limits.body_timeout_s
    body = bytearray()
    while True:
        part = _next_event(conn)
        if isinstance(part, h11.Data):
            body += part.data
            if len(body) > limits.max_body_bytes:
                raise _Abort(
                    "too_large", 413, f"request body is larger than the limit of {limits.max_body_bytes} bytes"
                )
        elif isinstance(part, h11.EndOfMessage):
            return bytes(body)
        elif part is h11.NEED_DATA:
            if conn.they_are_waiting_for_100_continue:
                await _send(stream, conn.send(h11.InformationalResponse(status_code=100, headers=[])), limits)
            deadline = total_deadline
            if limits.body_min_bytes_per_s > 0:
                # The average so far must stay above the minimum: each byte buys 1/rate seconds.
                deadline = min(deadline, start + BODY_RATE_GRACE_S + len(body) / limits.body_min_bytes_per_s)
            if not await _receive(conn, stream, deadline):
                if deadline < total_deadline:
                    raise _Abort(
                        "body_too_slow",
                        408,
                        f"request body arrived slower than {limits.body_min_bytes_per_s} bytes per second "
                        f"({len(body)} bytes in {trio.current_time() - start:.1f} s)",
                    )
                raise _Abort("body_timeout", 408, f"request body not received within {limits.body_timeout_s:g} s")
        else:
            raise _Abort("closed", message="connection closed in the middle of the request body")


async def _send(stream, data: bytes, limits: Limits) -> None:
    """Write, or `TooSlowError` when the peer has not taken it within `send_timeout_s`."""
    with trio.fail_after(limits.send_timeout_s):
        await stream.send_all(data)


async def _send_response(conn: h11.Connection, stream, response: Response, limits: Limits, close: bool = False) -> None:
    headers = [(k.encode(), v.encode()) for k, v in response.headers]
    headers.append((b"content-length", str(len(response.body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    data = conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
    if response.body:
        data += conn.send(h11.Data(data=response.body))
    await _send(stream, data + conn.send(h11.EndOfMessage()), limits)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def _send_streaming(
    conn: h11.Connection, stream, response: StreamingResponse, limits: Limits, close: bool = False
) -> None:
    """Send a streamed response. The client going away, or the producer failing, ends the
    connection (`_Abort` or the stream's error)."""
    headers = [(k.encode(), v.encode()) for k, v in response.headers if k.lower() != "content-length"]
    if close:
        headers.append((b"connection", b"close"))
    gone: list[bool] = []
    try:
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
    past one request's worth of them this stops reading and lets TCP push back."""
    while len(conn.trailing_data[0]) < limits.max_head_bytes + limits.max_body_bytes:
        try:
            data = await stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if not data:
            return
        conn.receive_data(data)
    await trio.sleep_forever()
