"""A small HTTP/1.1 server on h11 and trio, for the admin API, the gateway and the sim engine.

h11 is the protocol state machine; this module is the trio adapter around it: read bytes,
feed h11, hand a whole `Request` to the handler, write its `Response`. Keep-alive and
pipelined requests are handled in order, one at a time per connection (RFC 9112 §9.3.2).

A handler may answer with a `StreamingResponse` instead: its body is an async iterable of
byte chunks, each sent as soon as it is produced, with `transfer-encoding: chunked` (h11
chooses it for a response without a length, RFC 9112 §6.3; an HTTP/1.0 client gets a body
delimited by closing the connection). While a body streams the connection is also read, so a
client that goes away cancels the producer at once rather than at its next chunk.

Limits, each answered with its proper status instead of a hang or a crash: a request head
larger than `max_head_bytes` (431), a body larger than `max_body_bytes` (413), a head not
received within `head_timeout_s` of the connection going idle (the connection is closed), a
body stalled for `body_timeout_s` (408).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

from llmgw.log import get_logger

log = get_logger("llmgw.http")

RECEIVE_SIZE = 65536


@attrs.frozen(kw_only=True)
class Limits:
    max_head_bytes: int = 16384
    max_body_bytes: int = 1 << 20
    head_timeout_s: float = 30.0
    body_timeout_s: float = 30.0


@attrs.frozen(kw_only=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes
    client: str

    def json(self) -> Any:
        """The body as JSON; raises `HTTPError(400)` naming what is wrong."""
        try:
            return json.loads(self.body or b"null")
        except ValueError as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from None


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


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: Limits = Limits(),
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners)
    await trio.serve_listeners(lambda stream: _serve_connection(handler, limits, stream), listeners)


def bound_address(listeners: list) -> tuple[str, int]:
    """(host, port) a SocketListener or an SSLListener over one is bound to."""
    listener = listeners[0]
    while not isinstance(listener, trio.SocketListener):
        listener = listener.transport_listener
    host, port = listener.socket.getsockname()[:2]
    return host, port


async def _serve_connection(handler: Handler, limits: Limits, stream: trio.abc.Stream) -> None:
    try:
        peer = stream.socket.getpeername()
        client = f"{peer[0]}:{peer[1]}"
    except (OSError, AttributeError):  # AttributeError: an in-memory stream in tests
        client = "?"
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
    try:
        while True:
            request = await _read_request(conn, stream, limits, client)
            if request is None:
                return
            response = await _call_handler(handler, request, conn, stream, limits)
            if response is None:
                return  # the client went away while the handler worked: it was cancelled
            if isinstance(response, StreamingResponse):
                if not await _send_streaming(conn, stream, response, limits):
                    return
            else:
                await _send_response(conn, stream, response)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except _Refuse as refuse:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await _send_response(conn, stream, error_response(refuse.status, refuse.message), close=True)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        pass  # the client went away; nothing to answer
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await stream.aclose()


async def _call_handler(handler: Handler, request: Request, conn: h11.Connection, stream, limits: Limits):
    """The handler's response; None if the client closed the connection first, in which case the
    handler is cancelled (so a gateway request stops its upstream request too)."""
    answer: list = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            try:
                answer.append(await handler(request))
            except HTTPError as exc:
                answer.append(error_response(exc.status, exc.message, exc.kind, exc.headers))
            except Exception:  # - one bad request must not take the server down
                log.exception("http_handler_failed", method=request.method, path=request.path)
                answer.append(
                    error_response(500, "internal error in llmgw; the server's log has the traceback", "server_error")
                )
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            await _wait_for_disconnect(conn, stream, limits)
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(watch)
    return answer[0] if answer else None


class _Refuse(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


async def _next_event(conn: h11.Connection, stream: trio.SocketStream, timeout: float, on_timeout: _Refuse | None):
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Refuse(exc.error_status_hint, f"malformed HTTP request: {exc}") from None
        if event is not h11.NEED_DATA:
            return event
        with trio.move_on_after(timeout) as scope:
            data = await stream.receive_some(RECEIVE_SIZE)
        if scope.cancelled_caught:
            if on_timeout is None:
                return h11.ConnectionClosed()
            raise on_timeout
        conn.receive_data(data)


async def _read_request(conn: h11.Connection, stream, limits: Limits, client: str) -> Request | None:
    event = await _next_event(conn, stream, limits.head_timeout_s, None)
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise _Refuse(400, f"expected a request, got {type(event).__name__}")
    # h11 bounds a head that arrives in pieces; one that arrives whole is measured here.
    head_size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
    if head_size > limits.max_head_bytes:
        raise _Refuse(431, f"request head of {head_size} bytes is larger than the limit of {limits.max_head_bytes}")
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _Refuse(413, f"request body of {declared} bytes is larger than the limit of {limits.max_body_bytes}")
    body = bytearray()
    stalled = _Refuse(408, f"request body not received within {limits.body_timeout_s:g} s")
    while True:
        part = await _next_event(conn, stream, limits.body_timeout_s, stalled)
        if isinstance(part, h11.Data):
            body += part.data
            if len(body) > limits.max_body_bytes:
                raise _Refuse(413, f"request body is larger than the limit of {limits.max_body_bytes} bytes")
        elif isinstance(part, h11.EndOfMessage):
            break
        else:
            raise _Refuse(400, "connection closed in the middle of the request body")
    target = urlsplit(event.target.decode("latin-1"))
    return Request(
        method=event.method.decode("ascii"),
        path=target.path,
        query=parse_qs(target.query),
        headers=headers,
        body=bytes(body),
        client=client,
    )


async def _send_response(conn: h11.Connection, stream, response: Response, close: bool = False) -> None:
    headers = [(k.encode(), v.encode()) for k, v in response.headers]
    headers.append((b"content-length", str(len(response.body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await stream.send_all(
        conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
    )
    if response.body:
        await stream.send_all(conn.send(h11.Data(data=response.body)))
    await stream.send_all(conn.send(h11.EndOfMessage()))


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def _send_streaming(conn: h11.Connection, stream, response: StreamingResponse, limits: Limits) -> bool:
    """Send a streamed response; whether it completed. False (the client went away, or the
    producer failed) means the connection must be closed."""
    headers = [(k.encode(), v.encode()) for k, v in response.headers if k.lower() != "content-length"]
    completed = False
    try:
        # Inside the try: a client gone before the head still gets the producer closed.
        await stream.send_all(
            conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
        )
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await _wait_for_disconnect(conn, stream, limits)
                nursery.cancel_scope.cancel()  # the client is gone: stop the producer now

            nursery.start_soon(watch)
            try:
                completed = await _send_body(conn, stream, response.body)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        aclose = getattr(response.body, "aclose", None)
        if aclose is not None:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await aclose()
    return completed


async def _send_body(conn: h11.Connection, stream, body: AsyncIterable[bytes]) -> bool:
    # The producer's failures and the client's are told apart: only the first is a bug to log.
    chunks = aiter(body)
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except Exception:
            log.exception("http_stream_failed")
            return False
        if not chunk:
            continue  # an empty chunk would end a chunked body (RFC 9112 §7.1)
        try:
            await stream.send_all(conn.send(h11.Data(data=chunk)))
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            return False
    try:
        await stream.send_all(conn.send(h11.EndOfMessage()))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        return False
    return True


async def _wait_for_disconnect(conn: h11.Connection, stream, limits: Limits) -> None:
    """Read the connection while a response streams; return when the client has closed it.
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
