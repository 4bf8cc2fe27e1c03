"""HTTP/1.1 client connections to replicas' engines: h11 on trio, pooled per endpoint.

`UpstreamPool.send` writes one request and returns as soon as the response head arrives, with
an `UpstreamResponse` whose `body()` yields the body's chunks as they arrive (as h11 delivers
them, never re-parsed) and whose `aclose()` gives the connection back. The decisions are made
synchronously from h11's state, then the I/O is done (as httpcore's pool does):

- A connection goes back to its endpoint's idle list only when h11 says both sides finished
  the exchange cleanly and the server did not ask to close; anything else (an error, a body
  not read to its end, a cancellation) closes it. The idle list is bounded; the newest is
  reused first, so idle ones age out on the engine's side rather than ours.
- A failure before any response byte is `UpstreamUnavailable` (the engine produced nothing, so
  the caller may try another replica). On a reused connection that failure may only mean the
  engine closed it while idle (RFC 9112 §9.3.1), so it is retried once on a fresh connection.
- A failure after the head is `UpstreamBroken`.

Foreign exceptions (OSError, trio's stream errors, h11's protocol errors) are translated here,
once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import attrs
import h11
import trio

from llmgw.server.gateway.errors import UpstreamBroken, UpstreamUnavailable

RECEIVE_SIZE = 65536
_STREAM_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


@attrs.define(eq=False)
class _Conn:
    stream: trio.SocketStream
    h11: h11.Connection
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
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
    ) -> None:
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s  # silence allowed between bytes (an engine may think long)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self.stats = PoolStats()
        self.open_connections = 0

    def idle_count(self, host: str, port: int) -> int:
        return len(self._idle.get((host, port), ()))

    async def send(
        self, host: str, port: int, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        request = h11.Request(
            method=method,
            target=target,
            headers=[("host", f"{host}:{port}"), ("content-length", str(len(body))), *headers],
        )
        conn = self._take_idle(host, port)
        if conn is not None:
            try:
                return await self._exchange(host, port, conn, request, body)
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

    async def _connect(self, host: str, port: int) -> _Conn:
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise UpstreamUnavailable(
                f"connecting to {host}:{port} timed out after {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        self.stats.opened += 1
        self.open_connections += 1
        return _Conn(stream=stream, h11=h11.Connection(h11.CLIENT))

    async def _exchange(self, host: str, port: int, conn: _Conn, request: h11.Request, body: bytes) -> UpstreamResponse:
        try:
            data = conn.h11.send(request) + (conn.h11.send(h11.Data(data=body)) if body else b"")
            await conn.stream.send_all(data + conn.h11.send(h11.EndOfMessage()))
            while True:
                event = await _next_event(conn, self.read_timeout_s)
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    break
                raise UpstreamUnavailable(f"{host}:{port} closed the connection before answering")
        except UpstreamUnavailable:
            await self._discard(conn)
            raise
        except (*_STREAM_ERRORS, trio.TooSlowError) as exc:
            await self._discard(conn)
            raise UpstreamUnavailable(f"{host}:{port} failed before answering: {_describe(exc)}") from None
        except BaseException:
            await self._discard(conn)
            raise
        headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.headers)
        return UpstreamResponse(pool=self, key=(host, port), conn=conn, status=event.status_code, headers=headers)

    def _release(self, key: tuple[str, int], conn: _Conn) -> bool:
        """Keep the connection for reuse if h11 says it can be; whether it was kept."""
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
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

    def forget(self, host: str, port: int) -> list[_Conn]:
        """Drop an endpoint's idle connections (it left rotation); the caller closes them."""
        return self._idle.pop((host, port), [])

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
    headers: tuple[tuple[str, str], ...]
    _closed: bool = False

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive; ends at the end of the message. What h11 already
        holds when a chunk is taken goes out with it: when the engine writes faster than the
        client reads (many small SSE events), one write relays several, not one each."""
        host, port = self.key
        held = None  # an event read ahead of its turn
        while True:
            if held is not None:
                event, held = held, None
            else:
                try:
                    event = await _next_event(self.conn, self.pool.read_timeout_s)
                except trio.TooSlowError:
                    raise UpstreamBroken(
                        f"{host}:{port} sent nothing for {self.pool.read_timeout_s:g} s in the middle of a response"
                    ) from None
                except _STREAM_ERRORS as exc:
                    raise UpstreamBroken(
                        f"{host}:{port} failed in the middle of a response: {_describe(exc)}"
                    ) from None
            if isinstance(event, h11.Data):
                data = bytes(event.data)
                while True:
                    try:
                        more = self.conn.h11.next_event()
                    except h11.ProtocolError:
                        break  # h11 raises it again at the next read, where it is translated
                    if isinstance(more, h11.Data):
                        data += more.data
                    else:
                        held = None if more is h11.NEED_DATA else more
                        break
                yield data
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise UpstreamBroken(f"{host}:{port} closed the connection in the middle of a response")

    async def read(self, limit: int) -> bytes:
        out = bytearray()
        async for chunk in self.body():
            out += chunk
            if len(out) > limit:
                raise UpstreamBroken(f"{self.key[0]}:{self.key[1]} sent a body larger than {limit} bytes")
        return bytes(out)

    async def aclose(self) -> None:
        """Give the connection back if the exchange completed, else close it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.pool._release(self.key, self.conn):
            await self.pool._discard(self.conn)


async def _next_event(conn: _Conn, timeout: float):
    while True:
        event = conn.h11.next_event()
        if event is not h11.NEED_DATA:
            return event
        with trio.fail_after(timeout):
            data = await conn.stream.receive_some(RECEIVE_SIZE)
        conn.h11.receive_data(data)  # b"" tells h11 the peer closed


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc) or type(exc).__name__
