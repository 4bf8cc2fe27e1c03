"""The cluster page's live feed: server-sent events from the admin API (`GET /admin/v1/events`).

One stream per open page. It sends what the control plane's one feed (`llmgw.server.admin.pagefeed`)
publishes: the whole cluster as the page shows it (the admin API's views, as `ctl` reads them,
less what changes at every heartbeat) at once, as a `cluster` event, then, whenever something
changed, a `changes` event with the nodes and replicas that changed, by id, and what is gone;
a stream that fell behind (a slow client) is sent the whole cluster again instead. Besides, the
gateway's history each time it is sampled (`history`). Between them a comment line every
`HEARTBEAT_S` keeps proxies from closing the connection and lets the page notice a dead one.
No polling: each stream sleeps on the feed's and the history's wake-ups.

The wire format is the HTML standard's `text/event-stream` (event: NAME / data: JSON / blank
line); the browser's EventSource reconnects by itself and each new stream starts with the whole
cluster.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import trio

from llmgw.server.admin.pagefeed import Feed, wait_any

HEARTBEAT_S = 15.0


def frame(event: str, data: Any) -> bytes:
    # One `data:` line: json.dumps never writes a newline without indent.
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def stream(
    feed: Feed,
    *,
    history: Any = None,
    session_expires_at: float | None = None,
) -> AsyncIterator[bytes]:
    """The body of one page's event stream; ends when the session expires (the page then asks
    for a new URL) or the client goes away (the HTTP server cancels it)."""
    yield b"retry: 2000\n\n"  # EventSource's reconnect delay, in milliseconds
    sent = 0  # the feed's version this stream has sent; 0: none yet
    history_changed = None
    with feed.watching():
        while True:
            published = feed.published.next()  # taken before looking: a version published meanwhile wakes the wait
            found = feed.next_for(sent)
            if found is not None:
                first = not sent
                sent, pieces = found
                for piece in pieces:  # a whole cluster is megabytes with thousands of nodes: sent in pieces
                    yield piece
                if first and history is not None:
                    history_changed = history.sampled.next()
                    yield frame("history", history.view())
                continue
            watched = [published, *([history_changed] if history_changed is not None else [])]
            timeout = HEARTBEAT_S
            if session_expires_at is not None:
                timeout = min(timeout, max(0.0, session_expires_at - trio.current_time()))
            if await wait_any(watched, timeout):
                if history_changed is not None and history_changed.is_set():
                    # The next sample taken first: one taken while this frame waits to be sent is not lost.
                    history_changed = history.sampled.next()
                    yield frame("history", history.view())
                continue
            if session_expires_at is not None and trio.current_time() >= session_expires_at:
                yield frame("expired", {"detail": "this page's session expired; run `llmgw ctl page` for a new URL"})
                return
            yield b": heartbeat\n\n"
