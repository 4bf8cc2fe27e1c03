"""Listening sockets shared by the control plane's servers: a connection budget per listener
(sized from the open-file limit by `llmgw.http.fdlimits`), the connections waiting on their peer
that a listener at its cap sheds, and the per-listener connection counts /metrics shows.

`open_listeners` opens them, with SO_REUSEPORT where several processes serve one port (a
gateway's workers, `llmgw.gatewayd`): each binds the port itself and the kernel spreads new
connections among the listening sockets, so no process hands connections to another.

`serve_capped` is `trio.serve_listeners` with a budget: each connection in its own task, at
most `max_connections` served at once. At the cap the newest client still gets in: the
connection that has waited longest on its peer (a keep-alive connection between requests, a
new one that has sent nothing yet, an agent-port connection still in its TLS handshake) is
closed to make room. RFC 9112 §9.6 lets a server close an idle connection whenever it likes,
and clients reopen one on demand; nginx does the same with its "reusable" connections when
`worker_connections` run out. When none is waiting, the newcomer is turned away at once
(`refuse`: `503` with Retry-After for HTTP) instead of being left in the kernel's backlog for
a place that may free in a minute. Turning away holds a descriptor for a moment, so it has a
small budget of its own (`overflow`); only past that does the listener stop accepting and the
backlog hold new connections. So a flood can neither take the descriptors the process needs
for its agents, its engines' connections and its database, nor keep a new client waiting on
connections that do nothing.

Every connection shed or turned away is counted (`llmgw_connections_shed_total`) and logged at
debug; `llmgw.http.refusals` turns a flood of them into one warning per interval
(`llmgw.http.refusallines.serve_summaries` logs it).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import math
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from functools import partial

import trio

from llmgw.http.fdlimits import default_overflow
from llmgw.http.refusallines import CONNECTIONS, serve_summaries
from llmgw.http.refusals import RefusalLog
from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry

log = get_logger("llmgw.listeners")

# The kernel caps a listen backlog at net.core.somaxconn; asking for the most lets it decide (as trio does).
BACKLOG = 0xFFFF
# Accept errors that mean "out of descriptors or memory for now": wait and accept again (as
# trio.serve_listeners does) rather than fail the listener.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY_S = 0.1
# The longest a connection turned away is held; `refuse` keeps its own, shorter deadlines.
REFUSE_S = 3.0


async def open_listeners(port: int, *, host: str | None, reuse_port: bool = False) -> list[trio.SocketListener]:
    """`trio.open_tcp_listeners`, or with `reuse_port` the same sockets bound with SO_REUSEPORT as
    well, one per address `host` resolves to. Sockets bound so by processes of one user share
    the port (a fixed one: with port 0 each would get its own)."""
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host)
    addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, type_, proto, _, sockaddr in addresses:
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners


class ConnectionStats:
    """Per listener: connections open now, their cap, those that ended by a peer's fault or a
    deadline (by reason), and those shed or turned away to make room (by reason). Rendered as
    Prometheus text by `render`."""

    def __init__(self) -> None:
        r = self.registry = MetricsRegistry()
        self.open = r.gauge("llmgw_connections_open", "Connections open now, per listener.", ("listener",))
        self.limit = r.gauge(
            "llmgw_connections_limit", "The most connections a listener serves at once.", ("listener",)
        )
        self.aborted = r.counter(
            "llmgw_connections_aborted_total",
            "Connections ended by the peer (closed, reset, garbage) or a deadline, by reason.",
            ("listener", "reason"),
        )
        self.at_capacity = r.counter(
            "llmgw_connections_at_capacity_total",
            "Times a listener stopped accepting because every place, its overflow's too, was taken.",
            ("listener",),
        )
        self.shed = r.counter(
            "llmgw_connections_shed_total",
            "Connections closed or turned away to make room, by reason: idle (waiting on its peer, closed for "
            "a newer connection), unproven (agent port: no certificate shown yet, closed for a newer connection), "
            "busy (no room: answered 503, or closed), agents_full (agent port: a certified agent answered 503).",
            ("listener", "reason"),
        )
        self.unproven = r.gauge(
            "llmgw_connections_unproven",
            "Agent-port connections open now that have not shown a client certificate.",
            ("listener",),
        )
        self.unproven_limit = r.gauge(
            "llmgw_connections_unproven_limit",
            "The most agent-port connections without a client certificate held at once.",
            ("listener",),
        )

    def abort(self, listener: str, reason: str) -> None:
        self.aborted.inc(listener=listener, reason=reason)

    def render(self) -> str:
        return self.registry.render()


class IdleConnections:
    """The connections of one budget that are waiting on their peer, oldest first: those a
    listener at its cap closes to make room (`shed_oldest`) and, the stoppable ones, those a
    stopping server closes (`stop`). A connection is here only while inside `waiting`."""

    def __init__(self, reason: str = "idle") -> None:
        self.reason = reason  # what a shed one counts as in llmgw_connections_shed_total
        # Insertion order is the order the waits began; OrderedDict pops its oldest in O(1).
        # Each: its peer, whether a stop ends it, and when its peer was last heard from (`heard`;
        # None: the wait's start, `began`, for `shed_silent`).
        self._waiting: OrderedDict[trio.CancelScope, tuple[str, bool, float, Callable[[], float] | None]] = (
            OrderedDict()
        )
        self._stopped = False

    def __len__(self) -> int:
        return len(self._waiting)

    @contextlib.contextmanager
    def waiting(
        self,
        *,
        peer: str = "",
        stoppable: bool = True,
        deadline: float = math.inf,
        heard: Callable[[], float] | None = None,
    ) -> Iterator[trio.CancelScope]:
        """A scope around a wait on the peer, cancelled when this connection is shed or, if
        `stoppable`, when the server stops; its `cancelled_caught` then tells the caller to
        close the connection quietly. `peer` is the address the shedding is counted under.
        `deadline`: the wait's own (one scope for both: a cancellation before it is a shedding
        or a stop). `heard()`: when the peer last sent something (`heard.Heard`), for `shed_silent`;
        without it, when the wait began."""
        scope = self.scope(peer=peer, stoppable=stoppable, deadline=deadline, heard=heard)
        try:
            with scope:
                yield scope
        finally:
            self._waiting.pop(scope, None)

    def scope(
        self,
        *,
        peer: str = "",
        stoppable: bool = True,
        deadline: float = math.inf,
        heard: Callable[[], float] | None = None,
    ) -> trio.CancelScope:
        """`waiting` without a generator, for the request path: the scope to wait in, counted
        as waiting until `settle` is called with it (which the caller must do, however the wait
        ends)."""
        scope = trio.CancelScope(deadline=deadline)
        if stoppable and self._stopped:
            scope.cancel()
        self._waiting[scope] = (peer, stoppable, trio.current_time(), heard)
        return scope

    def settle(self, scope: trio.CancelScope) -> None:
        """The connection waiting in `scope` (inside `waiting`) waits no more: it is neither shed
        nor stopped from now on, though its `waiting` block goes on (a request being answered)."""
        self._waiting.pop(scope, None)

    def shed_oldest(self) -> str | None:
        """Cancel the wait that began first; its peer, or None if nothing waits."""
        if not self._waiting:
            return None
        scope, (peer, *_) = self._waiting.popitem(last=False)
        scope.cancel()
        return peer

    def shed_silent(self, silent_s: float) -> str | None:
        """Cancel the wait whose peer has been silent longest, if for `silent_s` at least; its
        peer, or None. A look over every waiting one: for small budgets (the unproven one)."""
        if not self._waiting:
            return None

        def last_heard(item: tuple) -> float:
            _, (_, _, began, heard) = item
            return began if heard is None else heard()

        scope, (peer, *_) = found = min(self._waiting.items(), key=last_heard)
        if trio.current_time() - last_heard(found) < silent_s:
            return None
        del self._waiting[scope]
        scope.cancel()
        return peer

    def stop(self) -> None:
        """Cancel every stoppable wait, now and from now on."""
        self._stopped = True
        for scope, (_, stoppable, *_) in self._waiting.items():
            if stoppable:
                scope.cancel()


class Admission(enum.Enum):
    SERVE = "serve"  # a place was free
    SHED = "shed"  # the connection that waited longest was closed to make room
    FULL = "full"  # no place free and none waiting: turn the newcomer away


class Budget:
    """At most `size` connections at once; at the cap, a newcomer takes the place of the one
    that has waited longest on its peer (`idle`). Decided synchronously (`admit`), the caller
    does the I/O. A shed connection counts until it has closed, a moment later, so `used` may
    pass `size` by the connections closing meanwhile; an outer bound (serve_capped's places)
    keeps the descriptors bounded."""

    def __init__(self, size: int, idle: IdleConnections, *, silent_s: float = 0.0) -> None:
        """`silent_s`: only a connection whose peer has been silent that long is shed for a
        newcomer (`IdleConnections.shed_silent`; else the newcomer is turned away); 0: the one
        that began waiting first, however recently."""
        self.size = size
        self.idle = idle
        self.silent_s = silent_s
        self.used = 0

    def admit(self) -> tuple[Admission, str]:
        """Whether a newcomer is served; with SHED, the peer of the connection that made room."""
        if self.used < self.size:
            self.used += 1
            return Admission.SERVE, ""
        peer = self.idle.shed_silent(self.silent_s) if self.silent_s else self.idle.shed_oldest()
        if peer is None:
            return Admission.FULL, ""
        self.used += 1
        return Admission.SHED, peer

    def leave(self) -> None:
        self.used -= 1


class Shutdown:
    """A graceful stop of one server, begun once: its listeners stop accepting (with socket
    activation the kernel's backlog then holds new connections for the next process), each
    connection ends after the request it is on (answered with `Connection: close`), and idle
    keep-alive connections close now. Requests in flight are not touched: their owner waits
    for them (with a deadline) and then cancels what is left.

    Its `idle` are the server's connections waiting on their peer, which a listener at its cap
    also sheds; a new connection's wait for its first request is not stoppable (its request
    may be on the way: it is answered, with `Connection: close`)."""

    def __init__(self) -> None:
        self.begun = False
        self._accepting = trio.CancelScope()
        self.idle = IdleConnections()

    def begin(self) -> None:
        if self.begun:
            return
        self.begun = True
        self._accepting.cancel()
        self.idle.stop()


def peer_host(stream: trio.abc.Stream) -> str:
    """The peer's IP address under any stream wrappers (TLS); "?" when it has none."""
    inner = stream
    while not hasattr(inner, "socket") and hasattr(inner, "transport_stream"):
        inner = inner.transport_stream
    try:
        return str(inner.socket.getpeername()[0])  # type: ignore[attr-defined]
    except (OSError, AttributeError, IndexError, TypeError):  # AttributeError: a memory stream in tests
        return "?"


async def serve_capped(
    handle: Callable[[trio.abc.Stream], Awaitable[None]],
    listeners: list,
    *,
    max_connections: int,
    stats: ConnectionStats,
    listener: str,
    shutdown: Shutdown | None = None,
    idle: IdleConnections | None = None,
    refuse: Callable[[trio.abc.Stream], Awaitable[None]] | None = None,
    overflow: int | None = None,
    refusals: RefusalLog | None = None,
) -> None:
    """Accept on every listener, each connection in its own task, at most `max_connections`
    served at once (all listeners together); at the cap, shed the connection of `idle` (by
    default `shutdown.idle`) that has waited longest, or else turn the newcomer away with
    `refuse` (closed at once when None) while at most `overflow` are being turned away; past
    that, accepting pauses and the kernel's backlog holds new connections. `handle` and
    `refuse` must contain their connection's failures. Refusals are counted in `refusals`
    (whose summaries this logs). After `shutdown.begin()` nothing more is accepted, and this
    returns once every connection ended."""
    shutdown = shutdown or Shutdown()
    budget = Budget(max_connections, idle or shutdown.idle)
    spare = default_overflow(max_connections) if overflow is None else overflow
    # Every descriptor this listener's connections hold, the ones being turned away too.
    places = trio.Semaphore(max_connections + spare)
    refusals = refusals or RefusalLog(burst=0)
    stats.limit.set(max_connections, listener=listener)
    stats.open.set(0, listener=listener)

    def refused(reason: str, peer: str) -> None:
        stats.shed.inc(listener=listener, reason=reason)
        refusals.refused(trio.current_time(), reason, peer, loud=False)
        log.debug("connection_shed", listener=listener, reason=reason, peer=peer)

    async def serve(stream: trio.abc.Stream) -> None:
        stats.open.inc(listener=listener)
        try:
            await handle(stream)
        finally:
            stats.open.inc(-1, listener=listener)
            budget.leave()
            places.release()

    async def turn_away(stream: trio.abc.Stream) -> None:
        try:
            if refuse is not None:
                with trio.move_on_after(REFUSE_S):
                    await refuse(stream)
        finally:
            await trio.aclose_forcefully(stream)
            places.release()

    async def accept_loop(sock_listener, nursery: trio.Nursery) -> None:
        async with sock_listener:
            while True:
                if places.value == 0:
                    stats.at_capacity.inc(listener=listener)
                    refusals.refused(trio.current_time(), "paused", "", loud=False)
                    log.debug("connections_at_capacity", listener=listener, max_connections=max_connections)
                await places.acquire()
                try:
                    stream = await sock_listener.accept()
                except OSError as exc:
                    places.release()
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("accept_failed", listener=listener, reason=exc.strerror or str(exc))
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                except BaseException:
                    places.release()
                    raise
                admission, shed_peer = budget.admit()
                if admission is Admission.FULL:
                    refused("busy", peer_host(stream))
                    nursery.start_soon(turn_away, stream)
                    continue
                if admission is Admission.SHED:
                    refused(budget.idle.reason, shed_peer)
                nursery.start_soon(serve, stream)

    async with trio.open_nursery() as connections:
        with shutdown._accepting:
            async with trio.open_nursery() as accepting:
                # Its summaries, each when its interval ends, and what is left when accepting stops.
                await accepting.start(partial(serve_summaries, refusals, listener, event=CONNECTIONS))
                for sock_listener in listeners:
                    accepting.start_soon(accept_loop, sock_listener, connections)
