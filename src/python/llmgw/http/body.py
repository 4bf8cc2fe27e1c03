"""A request's body: read from its connection only when the handler asks, under the body's
deadlines and the listener's budget.

Deadlines, not per-read timeouts: the body at an average of at least `body_min_bytes_per_s`
bytes a second (after `BODY_RATE_GRACE_S`) and whole within `body_timeout_s`, else 408 and the
connection closes. Larger than `max_body_bytes` (or the route's own limit) is 413.

Memory is bounded by the configuration, not by the garbage collector (issue 42):
- What bodies hold at once, over all connections of a listener, is bounded by one `BodyBudget`
  (`body_budget_bytes`), charged for the bytes that arrived, as they arrive: a body declaring
  8 MiB and sending a few KB holds a few KB. Past the budget a body waits briefly, then gets
  503 with Retry-After.
- No one holds more than a share of the budget (`BodyBudget.share`): the bodies of one owner —
  the API key a handler names (`Request.body_owner`), else the peer's address — wait once they
  hold it, so a key trickling large bodies slows its own requests only.
- Bodies still arriving never all wait on each other: with the budget (or an owner's share)
  full, the body that began to hold bytes last among those still arriving gives way to an
  older one that needs room — its read ends, 503, and its bytes are let go — so the oldest
  always finish. Charged as they arrive, concurrent bodies would otherwise each hold a part,
  none finish, and all be refused together.
- A body's buffer grows with what arrived (never the declared length up front), and is let go
  the moment its request ends, however it ends: a failure is kept without its traceback (the
  frames it names would keep the buffer alive in a reference cycle that only the cyclic
  collector frees), and the reading frame drops the buffer before an exception leaves it.

A chunked body may arrive in at most `MAX_BODY_CHUNKS` chunks (the parser spends microseconds on
each; tiny chunks would turn a body into seconds of work), and is fed to it in small pieces so
one read never holds the loop long.
"""

from __future__ import annotations

import copy

import trio

from llmgw.h1 import END, NEED_DATA, Data, ProtocolError, ServerConnection
from llmgw.http.budget import BodyBudget, Claim
from llmgw.http.errors import Abort, peer_reason, too_large
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
# A body's first bytes may take a moment (a client waiting for 100-continue, a slow start):
# the minimum rate is enforced on the average after this long.
BODY_RATE_GRACE_S = 5.0


class ConnectionBody(BodySource):
    """The body of the request a connection is on, read from it when first asked for.
    `settled` is set once no more of it will be read: read whole, or abandoned (the handler
    answered without it, or reading it failed) — then the connection closes after the answer.
    Its bytes are charged to the owner `Request.read` names (the module's docstring)."""

    def __init__(
        self,
        conn: ServerConnection,
        stream,
        limits: Limits,
        budget: BodyBudget,
        declared: int | None,
    ) -> None:
        self.conn, self.stream, self.limits, self.budget, self.declared = conn, stream, limits, budget, declared
        self.data: bytes | None = None
        self.failed: BaseException | None = None  # without its traceback (the module's docstring)
        self.claim: Claim | None = None  # its place in the budget, once it is read
        self.settled = trio.Event()

    @property
    def whole(self) -> bool:
        return self.data is not None

    async def read(self, limit: int | None, owner: str = "") -> bytes:
        if self.data is not None:
            if limit is not None and len(self.data) > limit:
                raise too_large(limit)
            return self.data
        if self.failed is not None:
            raise copy.copy(self.failed)
        try:
            if limit is not None and self.declared is not None and self.declared > limit:
                raise too_large(limit)
            self.claim = self.budget.claim(owner)
            try:
                self.data = await self._read(self.limits.max_body_bytes if limit is None else limit)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                # The peer broke the connection under the body: the connection's to end, not
                # the handler's to answer (`server._call_handler` lets an `Abort` through).
                raise Abort(peer_reason(exc) or "closed", message=f"reading the request body: {exc}") from None
            return self.data
        except Exception as exc:
            self.failed = _bare(exc)
            raise
        except BaseException:  # cancelled: the request is over
            self.failed = Abort("closed", message="the request ended while its body was read")
            raise
        finally:
            self.settled.set()

    async def _read(self, limit: int) -> bytes:
        body = bytearray()  # grows with what arrives (the module's docstring)
        claim = self.claim
        assert claim is not None
        try:
            pending = self._read_buffered(body, limit, claim)
            if pending is not END:
                with claim.receiving():
                    await self._read_into(body, limit, claim, pending)
            if claim.gave_way:  # to an older body (`BodyBudget`)
                raise Abort("body_budget", 503, claim.gave_way, headers=(("retry-after", "1"),))
        except BaseException:
            # Let the buffer go now, not when the exception does: its traceback names the frames
            # that hold it, and the handler's frames may keep the exception in a cycle.
            del body[:]
            raise
        finally:
            claim.arrived()
        return bytes(body) if len(body) <= SMALL_BODY_BYTES else body

    def _read_buffered(self, body: bytearray, limit: int, claim: Claim) -> object:
        """A Content-Length body's bytes the connection already holds, while they fit the budget
        at once: most bodies arrive with their head, and are read here with no wait and so
        nothing to give way in (no cancel scope to pay for). END once the body is whole, else
        what `_read_into` goes on from (a part not yet taken, or None)."""
        if self.declared is None:  # chunked: `_read_into` counts its chunks
            return None
        while True:
            part = next_event(self.conn)
            if part is END:
                return END
            if not isinstance(part, Data) or not claim.try_take(len(part.data)):
                return part
            body += part.data  # the parser never gives more than the declared length
            if len(body) > limit:
                raise self._too_large(limit)

    def _too_large(self, limit: int) -> Abort:
        if limit < self.limits.max_body_bytes:
            return too_large(limit)
        return Abort("too_large", 413, f"request body is larger than the limit of {limit} bytes")

    async def _read_into(self, body: bytearray, limit: int, claim: Claim, pending: object = None) -> None:
        conn, limits = self.conn, self.limits
        chunked = self.declared is None
        start = trio.current_time()
        total_deadline = start + limits.body_timeout_s
        chunks = 0
        unfed = b""  # of a chunked body: read, not yet given to the parser (see CHUNKED_FEED_BYTES)
        while True:
            part, pending = (next_event(conn) if pending is None else pending), None
            if isinstance(part, Data):
                await claim.take(len(part.data))  # counted as it comes
                if chunked:
                    chunks += part.chunks
                    if chunks > MAX_BODY_CHUNKS:
                        raise Abort(
                            "malformed",
                            400,
                            f"chunked request body in more than {MAX_BODY_CHUNKS} chunks; send it with "
                            "Content-Length or in larger chunks",
                        )
                body += part.data  # the parser never gives more than the declared length
                if len(body) > limit:
                    raise self._too_large(limit)
            elif part is END:
                return
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
                    deadline = min(deadline, start + BODY_RATE_GRACE_S + len(body) / limits.body_min_bytes_per_s)
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
                        f"({len(body)} bytes in {trio.current_time() - start:.1f} s)",
                    )
                raise Abort("body_timeout", 408, f"request body not received within {limits.body_timeout_s:g} s")
            else:
                raise Abort("closed", message="connection closed in the middle of the request body")

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()
        self.failed = None


def _bare(exc: Exception) -> Exception:
    """`exc` again without its traceback, cause or context (a copy: the one raised keeps them)."""
    try:
        bare = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied: said as text
        return Abort("closed", message=f"reading the request body failed: {exc}")
    bare.__traceback__ = bare.__cause__ = bare.__context__ = None
    return bare


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
