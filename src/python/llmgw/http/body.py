"""A request's body: read from its connection only when the handler asks, under the body's
deadlines and the listener's budget.

Deadlines, not per-read timeouts: the body at an average of at least `body_min_bytes_per_s`
bytes a second (after `BODY_RATE_GRACE_S`) and whole within `body_timeout_s`, else 408 and the
connection closes. Larger than `max_body_bytes` (or the route's own limit) is 413.

What bodies are buffered at once, over all connections of a listener, is bounded by one
`BodyBudget` (`body_budget_bytes`): a body is counted before it is read (a chunked one as it
comes), and past the budget it waits briefly, then gets 503 with Retry-After. A chunked body
may arrive in at most `MAX_BODY_CHUNKS` chunks (the parser spends microseconds on each; tiny
chunks would turn a body into seconds of work), and is fed to it in small pieces so one read
never holds the loop long.
"""

from __future__ import annotations

import trio

from llmgw.http.errors import Abort, peer_reason, too_large
from llmgw.http.h1 import END, NEED_DATA, Data, ProtocolError, ServerConnection
from llmgw.http.limits import Limits
from llmgw.http.messages import BodySource
from llmgw.http.send import RECEIVE_SIZE, send

# A chunked body is fed to the parser this much at a time, with a checkpoint between: it spends
# microseconds on each chunk, so a read full of 6-byte chunks must not be handed over at once.
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
        raise Abort(
            "body_budget",
            503,
            f"the server is buffering {self.used} bytes of request bodies, its limit of {self.max_bytes}; "
            "try again in a moment",
            headers=(("retry-after", "1"),),
        )

    def give(self, n: int) -> None:
        self.used -= n
        self._room.unpark()


class ConnectionBody(BodySource):
    """The body of the request a connection is on, read from it when first asked for.
    `settled` is set once no more of it will be read: read whole, or abandoned (the handler
    answered without it, or reading it failed) — then the connection closes after the answer."""

    def __init__(
        self, conn: ServerConnection, stream, limits: Limits, budget: BodyBudget, declared: int | None
    ) -> None:
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
                raise too_large(limit)
            return self.data
        if self.failed is not None:
            raise self.failed
        try:
            if limit is not None and self.declared is not None and self.declared > limit:
                raise too_large(limit)
            try:
                self.data = await self._read(self.limits.max_body_bytes if limit is None else limit)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                # The peer broke the connection under the body: the connection's to end, not
                # the handler's to answer (`server._call_handler` lets an `Abort` through).
                raise Abort(peer_reason(exc) or "closed", message=f"reading the request body: {exc}") from exc
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
        unfed = b""  # of a chunked body: read, not yet given to the parser (see CHUNKED_FEED_BYTES)
        while True:
            part = next_event(conn)
            if isinstance(part, Data):
                if chunked:  # counted as it comes
                    await self.budget.take(len(part.data))
                    self.taken += len(part.data)
                    chunks += part.chunks
                    if chunks > MAX_BODY_CHUNKS:
                        raise Abort(
                            "malformed",
                            400,
                            f"chunked request body in more than {MAX_BODY_CHUNKS} chunks; send it with "
                            "Content-Length or in larger chunks",
                        )
                if chunked:
                    body += part.data
                else:  # the parser never gives more than the declared length
                    body[got : got + len(part.data)] = part.data
                got += len(part.data)
                if got > limit:
                    if limit < limits.max_body_bytes:
                        raise too_large(limit)
                    raise Abort("too_large", 413, f"request body is larger than the limit of {limit} bytes")
            elif part is END:
                return bytes(body) if got <= SMALL_BODY_BYTES else body
            elif part is NEED_DATA and unfed:
                await trio.lowlevel.checkpoint()
                conn.receive_data(unfed[:CHUNKED_FEED_BYTES])
                unfed = unfed[CHUNKED_FEED_BYTES:]
            elif part is NEED_DATA:
                if conn.expecting_continue:
                    await send(self.stream, conn.send_continue(), limits)
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
                    raise Abort(
                        "body_too_slow",
                        408,
                        f"request body arrived slower than {limits.body_min_bytes_per_s} bytes per second "
                        f"({got} bytes in {trio.current_time() - start:.1f} s)",
                    )
                raise Abort("body_timeout", 408, f"request body not received within {limits.body_timeout_s:g} s")
            else:
                raise Abort("closed", message="connection closed in the middle of the request body")

    def release(self) -> None:
        if self.taken:
            self.budget.give(self.taken)
            self.taken = 0


def next_event(conn: ServerConnection):
    """The parser's next event; what it cannot parse is the peer's fault (`Abort`, with the
    status the parser gives: 400, 431 for a head too large, 501, 505)."""
    try:
        return conn.next_event()
    except ProtocolError as exc:
        if conn.eof:  # the peer closed in the middle of a message
            raise Abort("closed", message=str(exc)) from None
        if exc.status == 431:
            raise Abort("too_large", 431, str(exc)) from None
        raise Abort("malformed", exc.status, f"malformed HTTP request: {exc}") from None
