"""A small HTTP/1.1 server on trio: the one HTTP stack of every llmgw port (the gateway and admin
API, the agent port, the sim engine).

`llmgw.h1` is the protocol, without I/O (its server role); this module is the trio loop around
it: read a request's head (`llmgw.http.head`), hand the `Request` (`llmgw.http.messages`) to the
handler, its body read when it asks (`llmgw.http.body`), write its answer (`llmgw.http.send`).
Keep-alive and pipelined requests are handled in order, one at a time per connection (RFC 9112
§9.3.2); a listener may serve one request per connection instead (`keep_alive=False`, the agent
port). A handler may also answer `Upgrade`, on a listener that takes them (`upgrades=True`): the
connection is then handed over, with the bytes already read, and is no longer HTTP (the agent
port's WebSocket).

Containment: whatever a peer does — close or reset at any byte, send garbage, stall, stop
reading — ends that connection only. The rule lives in one place, `serve_connection`: a
failure the peer caused (`Abort`, or trio's `BrokenResourceError` and friends, however
deeply a nursery wrapped it: `llmgw.http.errors.peer_reason`) is counted in `ConnectionStats`
by reason, logged at debug with the peer's address and returned; anything else is a bug of
ours, logged with its traceback, answered 500 when nothing was sent yet, and the connection
closed. Nothing reaches the listener's nursery. Errors are worded by the listener's
`ErrorBody` (plain text unless it says otherwise): this module knows statuses and messages, not
any API's error schema.

Deadlines, not per-read timeouts (a peer sending one byte a second must not keep a
connection forever):
- the whole request head within `head_timeout_s` of its first byte (of the connection's
  start, for the first request) -> 408 and close;
- the body: see `llmgw.http.body`;
- between requests, a keep-alive connection may idle for `keepalive_timeout_s`, then it is
  closed without a word (RFC 9112 §9.6);
- every write must drain within `send_timeout_s`: a client that stops reading a stream is cut.
Sizes: a head larger than `max_head_bytes` is 431 — measured whole, however it arrived — and a
body larger than `max_body_bytes` 413.

The body is read only when the handler asks for it (`Request.read`), so a handler decides from
the head alone — the API key, its limits, the route — before a byte of the body is buffered: a
request refused from its head is answered and its connection closed with the body unread.

HEAD is answered as GET would be, with the body left out (RFC 9110 §9.3.2): handlers see the
method as sent and `allow` lets a HEAD through where GET is allowed. A request with both
Content-Length and Transfer-Encoding is 400 and its connection closed (RFC 9112 §6.1).

Connections per listener are capped (`max_connections`, see `llmgw.http.listeners`): at the
cap the connection that has waited longest for a request (kept alive between requests, or new
and silent) is closed to make room; with none waiting, the newcomer is answered `503` with
Retry-After at once (`send.answer_busy`), so no client waits in the kernel's backlog on idle ones.
"""

from __future__ import annotations

import math
from functools import partial

import attrs
import trio

from llmgw.errors import leaves
from llmgw.h1 import ServerConnection
from llmgw.http.body import BodyBudget, ConnectionBody
from llmgw.http.errors import Abort, HTTPError, peer_reason
from llmgw.http.fdlimits import default_max_connections
from llmgw.http.head import LOOK_AGAIN_AFTER, read_request
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats, Shutdown, open_listeners, serve_capped
from llmgw.http.messages import Answer, ErrorBody, Handler, Request, Response, StreamingResponse, Upgrade, plain_error
from llmgw.http.send import (
    answer_and_close,
    answer_busy,
    busy_answer,
    linger,
    send_response,
    send_streaming,
    wait_for_disconnect,
)
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup

log = get_logger("llmgw.http")

BUSY_RETRY_AFTER_S = 1
# An aborted request's answer names a code, for the error bodies that carry one (OpenAI's).
_ABORT_CODES = {
    400: "malformed_request",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_too_large",
    503: "overloaded",  # the body budget (`llmgw.http.body.BodyBudget`)
}
INTERNAL_ERROR = "internal error in llmgw; the server's log has the traceback"


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: Limits = Limits(),
    errors: ErrorBody = plain_error,
    stats: ConnectionStats | None = None,
    listener: str = "http",
    shutdown: Shutdown | None = None,
    sockets: list[trio.SocketListener] | None = None,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP on (host, port), or on `sockets` already listening (socket activation); with
    `reuse_port`, sharing the port with other processes (`listeners.open_listeners`).
    `shutdown.begin()` stops it gracefully (see `Shutdown`); cancellation stops it at once."""
    listeners = sockets or await open_listeners(port, host=host, reuse_port=reuse_port)
    task_status.started(listeners)
    stats = stats or ConnectionStats()
    shutdown = shutdown or Shutdown()
    budget = BodyBudget.of(limits)
    busy = busy_answer(
        errors(
            HTTPError(
                503,
                "the server is serving as many connections as it may, none of them idle; "
                f"retry in {BUSY_RETRY_AFTER_S} s",
                code="overloaded",
                headers=(("retry-after", str(BUSY_RETRY_AFTER_S)),),
            )
        )
    )

    async def one(stream: trio.abc.Stream) -> None:
        await serve_connection(
            handler,
            stream,
            limits=limits,
            errors=errors,
            stats=stats,
            listener=listener,
            shutdown=shutdown,
            budget=budget,
        )

    cap = limits.max_connections or default_max_connections(listener)
    await serve_capped(
        one,
        listeners,
        max_connections=cap,
        stats=stats,
        listener=listener,
        shutdown=shutdown,
        refuse=partial(answer_busy, busy),
    )


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
    if not isinstance(peer, tuple):  # a Unix socket's peer: a path, empty for a client that bound none
        return "unix"
    return f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"


@attrs.define(kw_only=True, eq=False)
class ServedConnection:
    """One connection as served: its protocol state, its stream and the listener's rules for it."""

    conn: ServerConnection
    stream: trio.abc.Stream
    client: str
    limits: Limits
    errors: ErrorBody
    shutdown: Shutdown
    budget: BodyBudget
    keep_alive: bool
    upgrades: bool
    departure: _Departure = attrs.field(init=False)
    # The task's count of trips through the scheduler when it last made sure of one (see
    # `head.read_request`); -1: none counted yet.
    yielded_at: int = -1
    # Heads waited for without a look first since a look found nothing (`head.read_request`).
    looks_skipped: int = LOOK_AGAIN_AFTER
    # What a handler keeps for the requests of this connection alone (`Request.per_connection`).
    per_connection: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        # Not given the connection itself: the two naming each other would be a reference
        # cycle, keeping the connection's buffers until the cyclic collector runs.
        self.departure = _Departure(self.conn, self.stream, self.limits)


# A handler that has not answered within this long has its client watched for departure (see
# `_Departure`); one that answers sooner costs no read of the connection at all. The timer is
# moved only when it would go off sooner than the first bound: watching begins between the two.
DEPARTURE_WATCH_AFTER_S = 0.05
DEPARTURE_WATCH_AFTER_MIN_S = 0.025


class _Departure:
    """Whether the client leaves while a handler runs: one task per connection (`run`), which
    cancels the handler's scope when the client closes the connection, so that a gateway
    request stops its upstream request too.

    Reading the connection while the handler runs costs a read, a registration with epoll and
    a task switch each way; most answers are ready sooner than a client's departure matters. So
    a request at most moves the deadline of the task's timer (`arm`: no task switch, no system
    call; not even that when the timer already goes off late enough, as it does for requests
    one after another), and only a handler still running when it goes off, from
    `DEPARTURE_WATCH_AFTER_MIN_S` to `DEPARTURE_WATCH_AFTER_S` later, has the connection read
    (`llmgw.http.send.wait_for_disconnect`), once its body is settled (until then the handler
    may be reading it). `disarm` leaves the timer be (one that goes off with no handler running
    just stops until the next `arm`) and waits for the reading to stop, if it began, before the
    connection is read for the next request: one reader at a time."""

    def __init__(self, conn: ServerConnection, stream: trio.abc.Stream, limits: Limits) -> None:
        self.conn, self.stream, self.limits = conn, stream, limits
        self._timer = trio.CancelScope()
        self._request: ConnectionBody | None = None
        self.departed = False  # the client left while a handler ran: the connection was cancelled
        self._reading: trio.CancelScope | None = None
        self.stopped = Wakeup()  # the reading has stopped

    def arm(self, body: ConnectionBody) -> None:
        """Watch for the client while a handler runs: if it leaves, the connection is cancelled
        (`run`'s scope), the handler with it, and `departed` says why."""
        self._request = body
        now = trio.current_time()
        if not now + DEPARTURE_WATCH_AFTER_MIN_S <= self._timer.deadline < math.inf:
            self._timer.deadline = now + DEPARTURE_WATCH_AFTER_S

    async def disarm(self) -> None:
        """The handler is done: stop watching, and wait until the connection is no longer read."""
        self._request = None
        if self._reading is not None:
            stopped = self.stopped.next()
            self._reading.cancel()
            with trio.CancelScope(shield=True):
                await stopped.wait()

    async def run(self, connection: trio.CancelScope) -> None:
        """Until cancelled; `connection`: the scope cancelled when the client leaves."""
        while True:
            with trio.CancelScope(deadline=self._timer.deadline) as self._timer:
                await trio.sleep_forever()
            if self._request is None:
                self._timer = trio.CancelScope()  # no handler runs: no deadline until the next `arm`
                continue
            body = self._request
            try:
                with trio.CancelScope() as self._reading:
                    await body.settled.wait()
                    if body.whole:
                        await wait_for_disconnect(self.conn, self.stream, self.limits)
                        self.departed = True
                        connection.cancel()
                        await trio.sleep_forever()  # until disarmed
                    else:
                        await trio.sleep_forever()  # the body broke off: the connection ends after the answer
            finally:
                self._reading = None
                self.stopped.fire()


async def serve_connection(
    handler: Handler,
    stream: trio.abc.Stream,
    *,
    limits: Limits = Limits(),
    errors: ErrorBody = plain_error,
    stats: ConnectionStats | None = None,
    listener: str = "http",
    shutdown: Shutdown | None = None,
    budget: BodyBudget | None = None,
    keep_alive: bool = True,
    upgrades: bool = False,
) -> str | None:
    """Serve one connection until it closes, or until an `Upgrade` answer's `run` returns; the
    stream is closed either way. Never raises (but Cancelled): see the module's "Containment".
    Returns why the connection ended when the peer ended it or missed a deadline (the reason
    /metrics counts), else None."""
    c = ServedConnection(
        conn=ServerConnection(max_head_bytes=limits.max_head_bytes),
        stream=stream,
        client=peer_address(stream),
        limits=limits,
        errors=errors,
        shutdown=shutdown or Shutdown(),
        budget=budget or BodyBudget.of(limits),
        keep_alive=keep_alive,
        upgrades=upgrades,
    )
    try:
        handover = reason = None
        failed = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.departure.run, nursery.cancel_scope)
            try:
                handover = await _serve_requests(handler, c)
            except Exception as exc:  # noqa: BLE001 - `_failed` logs a bug with its traceback
                # Ended here, inside the nursery: an exception that left it would be kept by
                # trio's nursery frames in a reference cycle, with every buffer of the
                # connection, until the cyclic collector runs (issue 42).
                failed = True
                reason = await _failed(c, exc, stats, listener)
            nursery.cancel_scope.cancel()
        if failed:
            return reason
        if c.departure.departed:
            log.debug("http_connection_aborted", listener=listener, client=c.client, reason="closed", detail="departed")
            if stats is not None:
                stats.abort(listener, "closed")
            return "closed"
        if handover is not None:
            # No longer HTTP: nothing may be answered on it from here, whatever happens.
            upgrade, prefix = handover
            try:
                await upgrade.run(stream, prefix)
            except Exception:  # - `run` contains its own failures: one that escapes is a bug
                log.exception("http_upgrade_failed", listener=listener, client=c.client)
                if stats is not None:
                    stats.abort(listener, "internal")
        return None
    finally:
        await trio.aclose_forcefully(stream)


async def _failed(c: ServedConnection, exc: Exception, stats: ConnectionStats | None, listener: str) -> str | None:
    """A connection's requests ended by `exc`: logged, counted and answered if nothing was sent
    yet. Returns the peer's reason (what /metrics counts), or None for a bug of ours."""
    reason = peer_reason(exc)
    if reason is None:
        log.exception("http_connection_failed", listener=listener, client=c.client)
        if stats is not None:
            stats.abort(listener, "internal")
        await answer_and_close(c.conn, c.stream, c.limits, c.errors(HTTPError(500, INTERNAL_ERROR)))
        return None
    log.debug("http_connection_aborted", listener=listener, client=c.client, reason=reason, detail=str(exc))
    if stats is not None:
        stats.abort(listener, reason)
    error = _abort_answer(exc, c.errors)
    if error is not None:
        await answer_and_close(c.conn, c.stream, c.limits, error)
    return reason


def _abort_answer(exc: Exception, errors: ErrorBody) -> Response | None:
    """The answer an aborted connection gets, if its `Abort` has one. Apart so that no local
    of the frames the exception's traceback names holds it: that would be a reference cycle,
    kept with every buffer of the connection until the cyclic collector runs (issue 42)."""
    abort = next((e for e in leaves(exc) if isinstance(e, Abort)), None)
    if abort is None or not abort.status:
        return None
    code = _ABORT_CODES.get(abort.status)
    return errors(HTTPError(abort.status, abort.message, code=code, headers=abort.headers))


async def _serve_requests(handler: Handler, c: ServedConnection) -> tuple[Upgrade, bytes] | None:
    """Answer requests until the connection is done with HTTP; an `Upgrade` answer and the
    bytes to give its protocol, if one took the connection over."""
    first = True
    while True:
        request = await read_request(c, first=first)
        first = False
        if request is None:
            return None
        body = request._body
        assert isinstance(body, ConnectionBody)
        try:
            response = await _call_handler(handler, request, c)
            if isinstance(response, Upgrade):
                if not c.upgrades:
                    raise RuntimeError(f"an Upgrade answer to {request.path} on a listener that takes none")
                if not body.whole:
                    raise Abort("malformed", 400, "an upgrade request has no body; send it without one")
                # Every byte read from the head on: the parser holds what came after the head.
                return response, request._head_bytes + c.conn.trailing()
            # A body left unread (the request was refused from its head) or broken off cannot be
            # skipped to the next request: this answer is the connection's last, and says so. So
            # is an answer while stopping (RFC 9112 §9.6), and every answer of a listener that
            # serves one request per connection.
            close = c.shutdown.begun or not body.whole or not c.keep_alive
            if isinstance(response, StreamingResponse):
                await send_streaming(c.conn, c.stream, response, c.limits, close=close, head=request.head)
            else:
                await send_response(c.conn, c.stream, response, c.limits, close=close, head=request.head)
        finally:
            body.release()
        if not body.whole:
            await linger(c.stream)
            return None
        if not c.conn.reusable:
            return None
        c.conn.start_next_cycle()


async def _call_handler(handler: Handler, request: Request, c: ServedConnection) -> Answer:
    """The handler's answer. It runs in the connection's own task: no task, nursery or scope
    per request. A client that leaves meanwhile cancels the whole connection (`_Departure`: a
    gateway request stops its upstream request too)."""
    body = request._body
    assert isinstance(body, ConnectionBody)
    c.departure.arm(body)
    try:
        return await handler(request)
    except Exception as exc:  # - one bad request must not take the server down
        if peer_reason(exc) is not None and any(isinstance(e, Abort) for e in leaves(exc)):
            raise  # reading the body failed by the peer's fault: the connection's to handle
        # No local may hold the error (see `_abort_answer`): it is worded, and the words kept.
        return c.errors(_handler_error(exc, request))
    finally:
        await c.departure.disarm()


def _handler_error(exc: BaseException, request: Request) -> HTTPError:
    """What a handler's failure is answered as: its `HTTPError`, or a 500 for a bug (logged)."""
    found = leaves(exc)
    if len(found) == 1 and isinstance(found[0], HTTPError):
        return found[0]
    log.exception("http_handler_failed", method=request.method, path=request.path)
    return HTTPError(500, INTERNAL_ERROR)
