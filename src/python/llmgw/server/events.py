"""The cluster page's live feed: server-sent events from the admin API (`GET /admin/v1/events`).

One stream per open page. It sends the whole cluster as the admin API describes it (the same
views `ctl` reads) at once, then again whenever the control plane says something changed —
nodes, liveness, replicas, drains, an operator's action — at most every `MIN_INTERVAL_S`
however often things change, and the gateway's history each time it is sampled. Between them a
comment line every `HEARTBEAT_S` keeps proxies from closing the connection and lets the page
notice a dead one. No polling: each stream sleeps on the plane's change events.

The wire format is the HTML standard's `text/event-stream` (event: NAME / data: JSON / blank
line); the browser's EventSource reconnects by itself and each new stream starts with a snapshot.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import trio

from llmgw.engines import cpubackend
from llmgw.server.keys import key_view

HEARTBEAT_S = 15.0
MIN_INTERVAL_S = 0.25  # a burst of changes (a drain, a node joining) is one snapshot, not fifty


class Views(Protocol):
    """What the feed reads of the control plane (`llmgw.server.views.ClusterViews`)."""

    def fabric_map(self) -> Any: ...
    def node_views(self) -> list[dict[str, Any]]: ...
    def replica_views(self) -> list[dict[str, Any]]: ...
    def model_views(self) -> list[dict[str, Any]]: ...
    def rotation_changed(self) -> trio.Event: ...
    def cluster_changed(self) -> trio.Event: ...


def cpu_warning(cpu: dict[str, Any] | None) -> str:
    """What `llmgw doctor` says of a generic virtual CPU (its rules, llmgw.engines.cpubackend), from
    what the node reported: its model name, or x86 flags without AVX2/FMA."""
    if not cpu:
        return ""
    model, flags = cpu.get("model") or "", set(cpu.get("flags") or ())
    generic = bool(cpubackend.virtual_model(model))
    x86 = bool(flags & {"sse2", "lm", "fpu"})
    lacking = cpubackend.missing_x86(flags)
    if generic or (x86 and lacking):
        missing = f" (no {', '.join(lacking)})" if x86 and lacking else ""
        return (
            f"generic virtual CPU {model!r}{missing}: llama.cpp runs its slow scalar code; give the VM the host's "
            "CPU model (Proxmox: `qm set VMID --cpu host`), see `llmgw doctor`"
        )
    return ""


async def snapshot(plane: Views, keys: Callable[[], Any] | None = None) -> dict[str, Any]:
    fabrics = plane.fabric_map()
    nodes = plane.node_views()
    for n in nodes:
        n["cpu_warning"] = cpu_warning(n.get("cpu"))
    return {
        "at": time.time(),
        "nodes": nodes,
        "fabrics": [{"name": f.name, "identity": f.identity, "nodes": list(f.nodes)} for f in fabrics.fabrics],
        "notes": list(fabrics.notes),
        "replicas": plane.replica_views(),
        "models": plane.model_views(),
        "keys": [key_view(r) for r in await keys()] if keys is not None else [],
    }


def frame(event: str, data: Any) -> bytes:
    # One `data:` line: json.dumps never writes a newline without indent.
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def wait_any(events: Sequence[trio.Event], timeout_s: float) -> bool:
    """Wait until any of `events` is set, for at most `timeout_s`; whether one was."""
    if any(e.is_set() for e in events):
        return True
    woke = False
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:

            async def one(event: trio.Event) -> None:
                nonlocal woke
                await event.wait()
                woke = True
                nursery.cancel_scope.cancel()

            for e in events:
                nursery.start_soon(one, e)
    return woke


async def stream(
    plane: Views,
    *,
    keys: Callable[[], Any] | None = None,
    history: Any = None,
    touched: Callable[[], trio.Event] | None = None,
    session_expires_at: float | None = None,
) -> AsyncIterator[bytes]:
    """The body of one page's event stream; ends when the session expires (the page then asks
    for a new URL) or the client goes away (the HTTP server cancels it)."""
    yield b"retry: 2000\n\n"  # EventSource's reconnect delay, in milliseconds
    last_sent = -float("inf")
    while True:
        # Taken before the snapshot is built, so a change during it wakes the next wait.
        changes = [plane.rotation_changed(), plane.cluster_changed()]
        if touched is not None:
            changes.append(touched())
        history_changed = history.sampled.next() if history is not None else None
        await trio.sleep_until(last_sent + MIN_INTERVAL_S)
        last_sent = trio.current_time()
        yield frame("cluster", await snapshot(plane, keys))
        if history is not None:
            yield frame("history", history.view())
        while True:
            watched = [*changes, *([history_changed] if history_changed is not None else [])]
            timeout = HEARTBEAT_S
            if session_expires_at is not None:
                timeout = min(timeout, max(0.0, session_expires_at - trio.current_time()))
            if await wait_any(watched, timeout):
                if any(e.is_set() for e in changes):
                    break
                # Only the history moved: send it alone (the next sample taken first: one taken
                # while this frame waits to be sent is not lost).
                history_changed = history.sampled.next()
                yield frame("history", history.view())
                continue
            if session_expires_at is not None and trio.current_time() >= session_expires_at:
                yield frame("expired", {"detail": "this page's session expired; run `llmgw ctl page` for a new URL"})
                return
            yield b": heartbeat\n\n"
