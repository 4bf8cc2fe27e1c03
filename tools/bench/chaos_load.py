"""The chaos benchmark's load: a steady rate of non-streamed requests and a fixed number of
streams in flight through the gateway, each outcome recorded with when it started and ended.

The client is an ordinary HTTP/1.1 client on trio + h11 with keep-alive connections, and one
rule of its own: a request written onto a connection it *reused* that fails before any byte
of an answer is sent once more on a fresh connection (the server may close an idle
connection at any moment, RFC 9112 §9.3.1) — what browsers, curl and llmgw's own upstream
pool do. Nothing else is retried: every other error, status other than 200, stream that ends
without `data: [DONE]`, or answer later than the client timeout is a failure.
"""

from __future__ import annotations

import json
import math

import attrs
import h11
import trio

RECEIVE = 65536


@attrs.frozen(kw_only=True)
class Outcome:
    kind: str  # "request" or "stream"
    started: float
    ended: float
    ok: bool
    reason: str = ""


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.used = False


class _Stale(Exception):
    """A reused connection failed before any byte of the answer."""


class Load:
    def __init__(
        self, host: str, port: int, token: str, *, model: str, rate: float, streams: int, timeout_s: float = 30.0
    ) -> None:
        self.host, self.port, self.token, self.model = host, port, token, model
        self.rate, self.streams, self.timeout_s = rate, streams, timeout_s
        self.outcomes: list[Outcome] = []
        self._idle: list[_Conn] = []
        self.stopping = False

    # -- one exchange ---------------------------------------------------------------------------

    async def _connect(self) -> _Conn:
        return _Conn(await trio.open_tcp_stream(self.host, self.port))

    def _request(self, body: dict) -> h11.Request:
        data = json.dumps(body).encode()
        return h11.Request(
            method="POST",
            target="/v1/chat/completions",
            headers=[
                ("host", "chaos"),
                ("content-type", "application/json"),
                ("authorization", f"Bearer {self.token}"),
                ("content-length", str(len(data))),
            ],
        ), data

    async def _exchange(self, conn: _Conn, body: dict) -> tuple[int, bytes]:
        reused = conn.used
        conn.used = True
        head, data = self._request(body)
        answered = False
        try:
            await conn.stream.send_all(
                conn.h11.send(head) + conn.h11.send(h11.Data(data=data)) + conn.h11.send(h11.EndOfMessage())
            )
            status, out = 0, bytearray()
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    chunk = await conn.stream.receive_some(RECEIVE)
                    conn.h11.receive_data(chunk)
                    continue
                answered = True
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    out += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return status, bytes(out)
                else:
                    raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}", 0)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            if reused and not answered:
                raise _Stale() from exc
            raise

    def _give_back(self, conn: _Conn) -> None:
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.stream.socket.close()

    async def one(self, body: dict) -> tuple[int, bytes]:
        """One exchange with the keep-alive rule above."""
        for attempt in range(2):
            conn = self._idle.pop() if self._idle and attempt == 0 else await self._connect()
            try:
                status, data = await self._exchange(conn, body)
            except _Stale:
                conn.stream.socket.close()
                continue
            except BaseException:
                conn.stream.socket.close()
                raise
            self._give_back(conn)
            return status, data
        raise RuntimeError("unreachable")  # the second attempt is on a fresh connection: never stale

    async def _timed(self, kind: str, body: dict, check) -> None:
        started = trio.current_time()
        reason = ""
        try:
            with trio.fail_after(self.timeout_s):
                status, data = await self.one(body)
            reason = check(status, data)
        except trio.TooSlowError:
            reason = f"no answer within {self.timeout_s:g} s"
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.outcomes.append(
            Outcome(kind=kind, started=started, ended=trio.current_time(), ok=not reason, reason=reason)
        )

    # -- the load -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: `rate` requests a second (each in its own task, so a slow answer
        does not slow the rate) and `streams` streams, each followed by the next."""
        plain = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        streamed = {**plain, "max_tokens": 60, "stream": True}

        def plain_ok(status: int, data: bytes) -> str:
            if status != 200:
                return f"HTTP {status}: {data[:160]!r}"
            return "" if json.loads(data)["choices"][0]["message"]["content"] else "empty answer"

        def stream_ok(status: int, data: bytes) -> str:
            if status != 200:
                return f"HTTP {status}: {data[:160]!r}"
            return "" if data.rstrip().endswith(b"data: [DONE]") else f"cut short: {data[-120:]!r}"

        async def streamer() -> None:
            while True:
                await self._timed("stream", streamed, stream_ok)

        async with trio.open_nursery() as nursery:
            for _ in range(self.streams):
                nursery.start_soon(streamer)
            task_status.started()
            period = 1.0 / self.rate if self.rate > 0 else math.inf
            next_at = trio.current_time()
            while True:
                nursery.start_soon(self._timed, "request", plain, plain_ok)
                next_at += period
                await trio.sleep_until(next_at)

    def between(self, start: float, end: float) -> dict:
        """What ran during [start, end) — started in it, or in flight when it began (a stream
        cut by a fault started before it): counts and failures of each kind."""
        window = [o for o in self.outcomes if o.started < end and o.ended >= start]
        out: dict = {}
        for kind, name in (("request", "requests"), ("stream", "streams")):
            of_kind = [o for o in window if o.kind == kind]
            failed = [o for o in of_kind if not o.ok]
            out[name] = len(of_kind)
            out[f"failed_{name}"] = len(failed)
            if failed:
                out[f"{name}_failures"] = sorted({o.reason[:200] for o in failed})[:5]
            done = [o.ended - o.started for o in of_kind if o.ok]
            out[f"{name}_slowest_s"] = round(max(done), 2) if done else None
        return out
