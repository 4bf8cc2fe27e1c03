"""A request's head, read off its connection under its deadlines and made into a `Request` (the
body is `llmgw.http.body`'s, read when the handler asks): the server's loop (`llmgw.http.server`)
calls `read_request` for each request of a connection, and the codec's server role
(`llmgw.h1.ServerConnection`) parses what is read.

- A new connection sends its head within `head_timeout_s`; a kept-alive one may idle for
  `keepalive_timeout_s` before its next head starts, then has `head_timeout_s` for it (408 and
  close past either, or a quiet close between requests, RFC 9112 §9.6). While nothing of a head
  has come, the listener may close the connection to make room at its cap, and a stopping server
  closes it (`listeners.Shutdown.idle`).
- The socket is read at once when it has data (`fastio`); whether to look before waiting is
  learnt (`LOOK_AGAIN_AFTER`): a read that finds nothing costs about as much as one that finds a
  request. Once per request the task yields, unless it went through the scheduler since the
  last one.
- What the head says is checked here where the codec leaves it to the server: a credential field
  given twice (400), a declared body past `max_body_bytes` (413). A head's bytes are kept as read
  for a listener that may hand the connection over (`Upgrade`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import trio

from llmgw.h1 import CLOSED, END, NEED_DATA, RequestHead, ServerConnection
from llmgw.http import fastio
from llmgw.http.body import ConnectionBody, next_event
from llmgw.http.errors import Abort
from llmgw.http.messages import Request
from llmgw.http.send import RECEIVE_SIZE

if TYPE_CHECKING:
    from llmgw.http.server import ServedConnection

# Heads waited for at once (see `_read_head`) after a look that found nothing, before looking again.
LOOK_AGAIN_AFTER = 8


async def _receive(c: ServedConnection, deadline: float | None, raw: bytearray | None, *, tried: bool = False) -> bool:
    """Read once into the parser (and into `raw`, when the head's bytes are kept), unless
    `deadline` passes first (then False; None: the caller's scope bounds the wait). `tried`:
    the caller found nothing to read a moment ago, so this waits at once."""
    data = None if tried else fastio.receive_now(c.stream, RECEIVE_SIZE)
    if data is None:
        waits = fastio.plain(c.stream)
        if deadline is None:
            data = await fastio.receive(c.stream, RECEIVE_SIZE, waits=waits)
        else:
            with trio.move_on_at(deadline):
                data = await fastio.receive(c.stream, RECEIVE_SIZE, waits=waits)
            if data is None:
                return False
    _take(c, data, raw)
    return True


def _take(c: ServedConnection, data: bytes, raw: bytearray | None) -> None:
    """Bytes read: to the parser, and to `raw` when the head's bytes are kept."""
    c.conn.receive_data(data)
    if raw is not None:
        raw += data


async def read_request(c: ServedConnection, *, first: bool) -> Request | None:
    """The next request, its head read (its body is read when the handler asks)."""
    request = await _read_head(c, first=first)
    if request is not None:
        # A client that always has the next request ready (pipelined, or fast) and a handler
        # that answers without waiting (a local route) would keep this task from ever yielding:
        # reads that find data do not (`fastio`). So once per request, unless the task went
        # through the scheduler since the last time (a wait for the head, or the handler's own
        # wait for its upstream): then it yielded already, and a checkpoint would only cost.
        points = _schedule_points()
        if points < 0 or points == c.yielded_at:
            await trio.lowlevel.checkpoint()
            points = _schedule_points()
        c.yielded_at = points
    return request


def _schedule_points() -> int:
    """How many times the current task has gone through the scheduler (trio counts them for
    `trio.testing.assert_checkpoints`); -1 where this trio does not say."""
    return getattr(trio.lowlevel.current_task(), "_schedule_points", -1)


async def _read_head(c: ServedConnection, *, first: bool) -> Request | None:
    conn, limits = c.conn, c.limits
    now = trio.current_time()
    # A new connection must send its head within head_timeout_s; a kept-alive one may idle
    # for keepalive_timeout_s before the next head starts, then has head_timeout_s for it.
    head_deadline = now + limits.head_timeout_s if first or conn.buffered else None
    # The head's bytes as read, for a listener that may hand the connection over (`Upgrade`).
    raw = bytearray(conn.trailing()) if c.upgrades else None
    while True:
        event = next_event(conn)
        if event is not NEED_DATA:
            break
        if head_deadline is None and conn.buffered:
            head_deadline = trio.current_time() + limits.head_timeout_s
        if not conn.buffered:
            # Nothing of a request yet: idle between requests until the keep-alive deadline, or
            # new and silent until the head deadline. Either way the listener may close this
            # connection quietly to make room at its cap (`listeners.IdleConnections`), and a
            # stopping server closes the idle ones (not a new one: its request may be on the way).
            # What came meanwhile (the next request of a fast client) needs no wait. Whether to
            # look before waiting is learnt: a read that finds nothing costs about as much as
            # one that finds a request, so a connection whose look found nothing waits at once
            # for its next few heads (a wait finds a request already there just as well).
            if c.looks_skipped >= LOOK_AGAIN_AFTER:
                data = fastio.receive_now(c.stream, RECEIVE_SIZE)
                if data is not None:
                    _take(c, data, raw)
                    continue
                c.looks_skipped = 0
            else:
                c.looks_skipped += 1
            fresh = head_deadline is not None
            until = head_deadline if fresh else now + limits.keepalive_timeout_s
            idle = c.shutdown.idle.scope(peer=c.client, stoppable=not fresh, deadline=until)
            try:
                with idle:
                    await _receive(c, None, raw, tried=True)  # the wait's deadline is the idle scope's own
            finally:
                c.shutdown.idle.settle(idle)
            if not idle.cancelled_caught:
                continue
            if trio.current_time() < until:
                return None  # shed to make room, or the server stops
            if fresh:
                raise Abort("head_timeout", message=f"nothing sent within {limits.head_timeout_s:g} s")
            return None  # the keep-alive deadline: closed quietly (RFC 9112 §9.6)
        if not await _receive(c, head_deadline, raw):
            raise Abort(
                "head_timeout", 408, f"request head not received within {limits.head_timeout_s:g} s; send it whole"
            )
    if event is CLOSED:
        return None
    if not isinstance(event, RequestHead):
        raise Abort("malformed", 400, f"expected a request, got {event!r}")
    # The parser measured the head whole, however it arrived (431 past `max_head_bytes`).
    raw_headers = tuple(event.headers)  # names lower-case
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
    if len(headers) < len(raw_headers):  # a field repeated: is it one that must not be?
        _no_repeated_credentials(raw_headers)
    declared = event.length  # None: chunked (the parser refused a head with both framings)
    if declared is not None and declared > limits.max_body_bytes:
        raise Abort(
            "too_large", 413, f"request body of {declared} bytes is larger than the limit of {limits.max_body_bytes}"
        )
    head = bytes(raw[: len(raw) - conn.buffered]) if raw is not None else b""
    body = ConnectionBody(conn, c.stream, limits, c.budget, declared)
    pipelined = 0
    if declared == 0:
        # No body: take the parser's end of the message now, so the request is whole before the handler runs.
        body.data = _no_body(conn)
        body.settled.set()
        pipelined = conn.buffered
    path, query = _split_target(event.target)
    return Request(
        method=event.method.decode("ascii"),
        target=event.target,
        path=path,
        query=query,
        raw_headers=raw_headers,
        headers=headers,
        client=c.client,
        http_version=event.http_version,
        pipelined=pipelined,
        body=body,
        head_bytes=head,
        per_connection=c.per_connection,
    )


# Fields that carry a credential: each at most once (RFC 9110 §5.3 lets a field be repeated
# only where it is a list, and these are not; RFC 6265 §5.4: one Cookie). Given twice, which one
# a server, a proxy in front of it or a log believes is a guess, so none is.
_SINGLE_CREDENTIALS = (b"authorization", b"proxy-authorization", b"cookie")


def _no_repeated_credentials(raw_headers: tuple[tuple[bytes, bytes], ...]) -> None:
    names = [name for name, _ in raw_headers]
    for name in _SINGLE_CREDENTIALS:
        if names.count(name) > 1:
            shown = name.decode().title()
            raise Abort("malformed", 400, f"{shown} given more than once; send one {shown} header field")


def _split_target(target: bytes) -> tuple[str, dict[str, list[str]]]:
    """The request target's path and query; the usual origin-form path alone is not parsed."""
    if target.startswith(b"/") and b"?" not in target and b"#" not in target:
        return target.decode("latin-1"), {}
    parts = urlsplit(target.decode("latin-1"))
    return parts.path, parse_qs(parts.query, keep_blank_values=True)


def _no_body(conn: ServerConnection) -> bytes:
    event = next_event(conn)
    if event is not END:
        raise Abort("malformed", 400, f"expected the end of a request without a body, got {event!r}")
    return b""
