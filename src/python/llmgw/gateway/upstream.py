"""HTTP/1.1 client connections to replicas' engines: the codec's client role (`llmgw.h1`) on trio,
pooled per endpoint.

`UpstreamPool.send` writes one request and returns as soon as the response head arrives, with
an `UpstreamResponse` whose `body()` yields the body's pieces as they arrive (de-chunked, never
re-parsed) and whose `aclose()` gives the connection back. The decisions are made
synchronously from the parser's state, then the I/O is done (as httpcore's pool does):

- A connection goes back to its endpoint's idle list only when the parser says the response
  ended cleanly and the engine did not ask to close; anything else (an error, a body not read
  to its end, a cancellation) closes it. The idle list is bounded; the newest is
  reused first, so idle ones age out on the engine's side rather than ours.
- A failure before any response byte is `UpstreamUnavailable` (the engine produced nothing, so
  the caller may try another replica). On a reused connection that failure may only mean the
  engine closed it while idle (RFC 9112 §9.3.1), so it is retried once on a fresh connection,
  unless it was silence (`UpstreamSilent`): then a fresh connection would wait the same.
- A failure after the head is `UpstreamBroken`.

Silence is bounded at every step. Connecting takes at most `connect_timeout_s`. Every socket
sets TCP_USER_TIMEOUT (data unacknowledged for about as long is an error) and TCP keepalive
(an idle connection, or one waiting for an answer, is checked every second): a peer cut off
the network fails its connections within a second or two, whether or not data is outstanding
(measured: a request written onto a pooled connection to a partitioned node fails in 1.4 s, one
waiting for its answer 1.5 s after the cut; without these options both wait out
`read_timeout_s`, the kernel retransmitting for about 15 minutes by tcp(7)'s tcp_retries2). A peer whose kernel
still answers while the engine does not (a stopped or hung process) is caught by the
first-byte timeout: when no response head has come within `first_byte_timeout_s`, the engine
is probed (`probe`: GET /health on a fresh connection); one that answers keeps the request
(a long non-streamed answer sends its head at the end), one that does not makes it
`UpstreamNoFirstByte`. `read_timeout_s` bounds silence in all.

Connections are opened by the pool's connect factory (as httpcore takes a network backend):
`open_tcp` by default, which also sets the socket options above; any `(host, port) -> stream`
will do, so tests reach an engine's handler over `trio.testing.memory_stream_pair` on a fake
clock. The pool bounds the connect with `connect_timeout_s` and translates its `OSError`.

Foreign exceptions (OSError, trio's stream errors, the parser's protocol errors) are translated
here, once.
"""

from __future__ import annotations

import errno
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial

import attrs
import trio

from llmgw.gateway.errors import (
    UpstreamBroken,
    UpstreamNoFirstByte,
    UpstreamSilent,
    UpstreamTooLarge,
    UpstreamUnavailable,
)
from llmgw.h1 import END, NEED_DATA, ClosedBeforeResponse, Head, ProtocolError, ResponseParser, request_bytes
from llmgw.http import fastio

RECEIVE_SIZE = 65536
_JOIN_BODY_BYTES = 65536  # a request body up to this is written with its head in one buffer
_STREAM_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError)
# What the kernel reports for a peer that stopped answering (TCP_USER_TIMEOUT, keepalive, a
# connect's SYNs) or that no route reaches: a fresh connection would meet the same.
_SILENT_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})


# Opens a connection to an engine: the stream, or OSError (refused, unreachable, ...).
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]


async def open_tcp(host: str, port: int, *, silence_s: float) -> trio.SocketStream:
    """The default connect factory: TCP, with a peer's silence bounded (`_bound_silence`)."""
    stream = await trio.open_tcp_stream(host, port)
    _bound_silence(stream, silence_s)
    return stream


@attrs.define(eq=False)
class _Conn:
    stream: trio.abc.Stream
    parser: ResponseParser = attrs.field(factory=ResponseParser)  # the current exchange's
    reused: bool = False


@attrs.define(kw_only=True)
class PoolStats:
    opened: int = 0
    reused: int = 0
    discarded: int = 0


class UpstreamPool:
    def __init__(
        self,
        *,
        max_idle_per_endpoint: int = 64,
        connect_timeout_s: float = 1.0,
        first_byte_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        probe_timeout_s: float = 2.0,
        connect: Connect | None = None,
    ) -> None:
        """`connect`: the connect factory (default `open_tcp`, silence bounded by the connect timeout)."""
        self.connect = connect or partial(open_tcp, silence_s=connect_timeout_s)
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s  # silence before the engine is probed
        self.read_timeout_s = read_timeout_s  # silence allowed in all (an engine may think long)
        self.probe_timeout_s = probe_timeout_s  # for GET /health's answer, once connected
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self.stats = PoolStats()
        self.open_connections = 0

    def idle_count(self, host: str, port: int) -> int:
        return len(self._idle.get((host, port), ()))

    async def send(
        self, host: str, port: int, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        request = request_bytes(method, target, f"{host}:{port}", headers, body)
        conn = self._take_idle(host, port)
        if conn is not None:
            try:
                return await self._exchange(host, port, conn, request, body)
            except UpstreamSilent:
                raise
            except UpstreamUnavailable:
                pass  # closed by the engine while idle: once more, on a fresh connection
        conn = await self._connect(host, port)
        return await self._exchange(host, port, conn, request, body)

    def _take_idle(self, host: str, port: int) -> _Conn | None:
        idle = self._idle.get((host, port))
        if not idle:
            return None
        conn = idle.pop()
        conn.reused = True
        self.stats.reused += 1
        return conn

    async def _open(self, host: str, port: int) -> trio.abc.Stream:
        try:
            with trio.fail_after(self.connect_timeout_s):
                return await self.connect(host, port)
        except trio.TooSlowError:
            raise UpstreamSilent(f"connecting to {host}:{port} timed out after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            kind = UpstreamSilent if _errno(exc) in _SILENT_ERRNOS else UpstreamUnavailable
            raise kind(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None

    async def _connect(self, host: str, port: int) -> _Conn:
        stream = await self._open(host, port)
        self.stats.opened += 1
        self.open_connections += 1
        return _Conn(stream=stream)

    async def _exchange(self, host: str, port: int, conn: _Conn, request: bytes, body: bytes) -> UpstreamResponse:
        conn.parser = ResponseParser()
        try:
            if len(body) <= _JOIN_BODY_BYTES:  # one write for the usual request
                await fastio.send_all(conn.stream, request + body)
            else:  # a large body goes out as it is, not copied into one buffer with the head
                await fastio.send_all(conn.stream, request)
                await fastio.send_all(conn.stream, body)
            head = await self._head(host, port, conn)
        except UpstreamUnavailable:
            await self._discard(conn)
            raise
        except _STREAM_ERRORS as exc:
            await self._discard(conn)
            kind = UpstreamSilent if _errno(exc) in _SILENT_ERRNOS else UpstreamUnavailable
            raise kind(f"{host}:{port} failed before answering: {_describe(exc)}") from None
        except BaseException:
            await self._discard(conn)
            raise
        return UpstreamResponse(pool=self, key=(host, port), conn=conn, status=head.status, headers=head.headers)

    async def _head(self, host: str, port: int, conn: _Conn) -> Head:
        """The response head. Each `first_byte_timeout_s` without it the engine is probed; the
        wait goes on while it answers probes, up to `read_timeout_s` in all. (A head that comes
        during a probe that fails is lost with the connection: the engine answered a request
        but not GET /health within `probe_timeout_s`, and is not trusted with more.)"""
        waited = 0.0
        while True:
            window = min(self.first_byte_timeout_s, self.read_timeout_s - waited)
            with trio.move_on_after(window):
                try:
                    return await _head_event(conn)
                except ClosedBeforeResponse:
                    raise UpstreamUnavailable(f"{host}:{port} closed the connection before answering") from None
            waited += window
            if waited >= self.read_timeout_s:
                raise UpstreamNoFirstByte(f"{host}:{port} sent no answer for {self.read_timeout_s:g} s")
            why = await self.probe(host, port)
            if why is not None:
                raise UpstreamNoFirstByte(f"{host}:{port} sent no answer within {waited:g} s and {why}")

    async def probe(self, host: str, port: int) -> str | None:
        """Whether the engine at host:port answers now: None when it does, else what failed.

        GET /health on a fresh connection, answered within `probe_timeout_s` once connected,
        with any status below 500 (a 401 or 404 is an answer; a 503 is an engine saying it
        cannot serve). Not a bare TCP connect: the kernel completes those for a process that
        is stopped or hung. No key is sent: every engine llmgw runs serves /health without one."""
        try:
            stream = await self._open(host, port)
        except UpstreamUnavailable as exc:
            return f"does not answer a probe: {exc}"
        probe = _Conn(stream=stream, parser=ResponseParser(request_method="GET"))
        try:
            with trio.fail_after(self.probe_timeout_s):
                await stream.send_all(
                    request_bytes("GET", "/health", f"{host}:{port}", ((b"connection", b"close"),), b"")
                )
                head = await _head_event(probe)
        except trio.TooSlowError:
            return f"does not answer GET /health within {self.probe_timeout_s:g} s"
        except ClosedBeforeResponse:
            return "closed a probe's connection without answering"
        except _STREAM_ERRORS as exc:
            return f"failed a probe: {_describe(exc)}"
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()
        if head.status >= 500:
            return f"answered GET /health with {head.status}"
        return None

    def _release(self, key: tuple[str, int], conn: _Conn) -> bool:
        """Keep the connection for reuse if the parser says it can be; whether it was kept."""
        if conn.parser.reusable:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.max_idle_per_endpoint:
                idle.append(conn)
                return True
        return False

    async def _discard(self, conn: _Conn) -> None:
        self.stats.discarded += 1
        self.open_connections -= 1
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await conn.stream.aclose()

    def close_idle(self, host: str, port: int) -> int:
        """Close an endpoint's idle connections (it left rotation, or went down: they may be
        dead); how many. Idle ones have nothing to flush, so this does not wait."""
        conns = self._idle.pop((host, port), [])
        for conn in conns:
            self.stats.discarded += 1
            self.open_connections -= 1
            _close_now(conn.stream)
        return len(conns)

    async def aclose(self) -> None:
        for conns in list(self._idle.values()):
            for conn in conns:
                await self._discard(conn)
        self._idle.clear()


@attrs.define(kw_only=True, eq=False)
class UpstreamResponse:
    pool: UpstreamPool
    key: tuple[str, int]
    conn: _Conn
    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # names lower-case
    _closed: bool = False
    # The silence allowed at each read of the body from now on (a stream whose tokens have begun
    # to flow: `[gateway] stream_stall_s`); None: the pool's `read_timeout_s`.
    stall_s: float | None = None

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; ends at the end of the message. What has arrived
        when a piece is taken goes out with it (`llmgw.h1.ResponseParser`): when the engine writes
        faster than the client reads (many small SSE events), one write relays several.
        Silence is bounded by `read_timeout_s` at each read (`stall_s` once set)."""
        host, port = self.key
        parser, stream = self.conn.parser, self.conn.stream
        read = True  # whether this piece's bytes came with a read (a checkpoint) since the last
        while True:
            try:
                event = parser.next_event()
                if event is NEED_DATA:
                    timeout = self.pool.read_timeout_s if self.stall_s is None else self.stall_s
                    with trio.move_on_after(timeout):
                        parser.receive_data(await fastio.receive(stream, RECEIVE_SIZE))  # b"": the peer closed
                        read = True
                        continue
                    raise UpstreamBroken(f"{host}:{port} sent nothing for {timeout:g} s in the middle of a response")
            except _STREAM_ERRORS as exc:
                raise UpstreamBroken(f"{host}:{port} failed in the middle of a response: {_describe(exc)}") from None
            if event is END:
                return
            if not read:  # another piece of the same read (many tiny chunks): yield between them
                await trio.lowlevel.checkpoint()
            read = False
            yield event  # type: ignore[misc] - bytes: the head came once, before the body

    async def read(self, limit: int) -> bytes:
        out = bytearray()
        async for chunk in self.body():
            out += chunk
            if len(out) > limit:
                raise UpstreamTooLarge(f"{self.key[0]}:{self.key[1]} sent a body larger than {limit} bytes")
        return bytes(out)

    async def aclose(self) -> None:
        """Give the connection back if the exchange completed, else close it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.pool._release(self.key, self.conn):
            await self.pool._discard(self.conn)


async def _head_event(conn: _Conn) -> Head:
    """The response head (1xx ones skipped); cancellable at any point without losing a byte."""
    parser = conn.parser
    while True:
        event = parser.next_event()
        if event is NEED_DATA:
            # Nothing can have come before the request was written: wait first, read once.
            parser.receive_data(await fastio.receive(conn.stream, RECEIVE_SIZE, waits=True))  # b"": the peer closed
        else:
            assert isinstance(event, Head), event
            return event


def _close_now(stream: trio.abc.Stream) -> None:
    """Close an idle stream without waiting (it has nothing to flush): a socket's file
    descriptor, or each half of a stream that has `close` (trio's memory streams, in tests)."""
    sock = getattr(stream, "socket", None)
    if sock is not None:
        sock.close()
        return
    for half in (getattr(stream, "send_stream", None), getattr(stream, "receive_stream", None)):
        close = getattr(half, "close", None)
        if close is not None:
            close()


def _bound_silence(stream: trio.SocketStream, timeout_s: float) -> None:
    """Make a peer's silence an error within about `timeout_s` (at least 1 s), on Linux (tcp(7)):
    TCP_USER_TIMEOUT fails a connection whose data stays unacknowledged that long, and with
    keepalive it also ends one whose keepalive probes go unanswered, so a connection with
    nothing outstanding (idle in the pool, or waiting for an answer) is checked too. A floor
    of 1 s: the kernel's minimum retransmission timeout is 200 ms, and a single lost segment
    must not end a connection."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    settings = (
        ("TCP_USER_TIMEOUT", max(1000, int(timeout_s * 1000))),  # milliseconds
        ("TCP_KEEPIDLE", max(1, math.ceil(timeout_s))),  # seconds
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", 3),  # where TCP_USER_TIMEOUT is missing; Linux lets it decide instead
    )
    for name, value in settings:
        if hasattr(socket, name):
            stream.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _errno(exc: BaseException) -> int | None:
    """The OS error number behind `exc` (trio wraps socket errors in BrokenResourceError)."""
    cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
    return cause.errno if isinstance(cause, OSError) else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(exc) or type(exc).__name__
