"""Listening sockets shared by the control plane's servers: a connection cap per listener,
the open-file budget it is sized from, and the per-listener connection counts /metrics shows.

`serve_capped` is `trio.serve_listeners` with a cap: each connection in its own task, at most
`max_connections` at once; past that it stops accepting, and the kernel's backlog holds new
connections until one ends, so a flood of clients cannot take the descriptors the process
needs for its agents, its engines' connections and its database.
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Awaitable, Callable

import trio

from llmgw.log import get_logger
from llmgw.metrics import Registry

log = get_logger("llmgw.listeners")

# Accept errors that mean "out of descriptors or memory for now": wait and accept again (as
# trio.serve_listeners does) rather than fail the listener.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY_S = 0.1


def fd_limit() -> int:
    """This process's soft limit on open files."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise the soft open-file limit towards the hard one (a server's connections are files;
    many systems start processes at a soft 1024); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


# Descriptors kept out of every listener's budget: the database, logs, engine and agent
# processes' pipes, trio's wakeup and signal fds, thread pools.
FD_RESERVE = 128


def default_max_connections(kind: str, limit: int | None = None) -> int:
    """A listener's connection cap when the configuration leaves it to us.

    Agents get their own budget (an eighth of the descriptors, at most 4096 nodes) so a flood
    of HTTP clients can never lock a node out; HTTP connections share the rest by half, since
    a gateway request holds a second descriptor for its upstream connection."""
    budget = max(64, (fd_limit() if limit is None else limit) - FD_RESERVE)
    agents = max(16, min(4096, budget // 8))
    if kind == "agent":
        return agents
    return max(16, (budget - agents) // 2)


class ConnectionStats:
    """Per listener: connections open now, their cap, and those that ended by a peer's fault
    or a deadline, by reason. Rendered as Prometheus text by `render`."""

    def __init__(self) -> None:
        r = self.registry = Registry()
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
            "Times a listener stopped accepting because it served its most connections.",
            ("listener",),
        )

    def abort(self, listener: str, reason: str) -> None:
        self.aborted.inc(listener=listener, reason=reason)

    def render(self) -> str:
        return self.registry.render()


class Shutdown:
    """A graceful stop of one server, begun once: its listeners stop accepting (with socket
    activation the kernel's backlog then holds new connections for the next process), each
    connection ends after the request it is on (answered with `Connection: close`), and idle
    keep-alive connections close now. Requests in flight are not touched: their owner waits
    for them (with a deadline) and then cancels what is left."""

    def __init__(self) -> None:
        self.begun = False
        self._accepting = trio.CancelScope()
        self._idle: set[trio.CancelScope] = set()

    def begin(self) -> None:
        if self.begun:
            return
        self.begun = True
        self._accepting.cancel()
        for scope in self._idle:
            scope.cancel()

    def idle_scope(self, deadline: float) -> trio.CancelScope:
        """A scope for a wait between requests: cancelled at `deadline` or when the stop
        begins, whichever is first. Leave it with `leave_idle`."""
        scope = trio.CancelScope(deadline=deadline)
        if self.begun:
            scope.cancel()
        self._idle.add(scope)
        return scope

    def leave_idle(self, scope: trio.CancelScope) -> None:
        self._idle.discard(scope)


async def serve_capped(
    handle: Callable[[trio.abc.Stream], Awaitable[None]],
    listeners: list,
    *,
    max_connections: int,
    stats: ConnectionStats,
    listener: str,
    shutdown: Shutdown | None = None,
) -> None:
    """Accept on every listener, each connection in its own task, at most `max_connections`
    at once (all listeners together); past that, accepting pauses and the kernel's backlog
    holds new connections. `handle` must contain its connection's failures. After
    `shutdown.begin()` nothing more is accepted, and this returns once every connection ended."""
    slots = trio.Semaphore(max_connections)
    stats.limit.set(max_connections, listener=listener)
    stats.open.set(0, listener=listener)
    shutdown = shutdown or Shutdown()

    async def run(stream: trio.abc.Stream) -> None:
        stats.open.inc(listener=listener)
        try:
            await handle(stream)
        finally:
            stats.open.inc(-1, listener=listener)
            slots.release()

    async def accept_loop(sock_listener, nursery: trio.Nursery) -> None:
        async with sock_listener:
            while True:
                if slots.value == 0:
                    stats.at_capacity.inc(listener=listener)
                    log.warning("connections_at_capacity", listener=listener, max_connections=max_connections)
                await slots.acquire()
                try:
                    stream = await sock_listener.accept()
                except OSError as exc:
                    slots.release()
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("accept_failed", listener=listener, reason=exc.strerror or str(exc))
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                except BaseException:
                    slots.release()
                    raise
                nursery.start_soon(run, stream)

    async with trio.open_nursery() as connections:
        with shutdown._accepting:
            async with trio.open_nursery() as accepting:
                for sock_listener in listeners:
                    accepting.start_soon(accept_loop, sock_listener, connections)
