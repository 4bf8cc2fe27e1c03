"""A gateway's listener and how it stops, for every gateway worker (`llmgw.gatewayd.worker`): in a
gateway process of its own, in the control plane's worker processes, or on its loop.

On cancellation the requests in flight finish, for at most `drain_s`, then whatever is left is
cut. Meanwhile, for a listener of its own and alone on its port, new requests get 503 with
Retry-After (and /health says "draining", so a load balancer stops sending). Where other
processes serve the port too — the listening sockets were passed to us (socket activation, the
control plane's workers), or each worker binds it with SO_REUSEPORT (`llmgw gateway`) — we stop
accepting instead: our socket leaves the port (a passed one stays open in its owner, its backlog
held for the next process; one of our own closes, and the kernel sends new connections to the
others, or refuses them, which a load balancer retries elsewhere), idle keep-alive connections
close, and each open connection gets the answer to the request it is on, with `Connection:
close`. A 503 there would fail the requests a balancer had already sent on its open
connections.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from llmgw.gateway.app import Gateway
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats, Shutdown
from llmgw.http.messages import Handler
from llmgw.http.openai import error_body
from llmgw.http.server import serve_http
from llmgw.log import get_logger

log = get_logger("llmgw.gateway")


async def serve_draining(
    handler: Handler,
    gateway: Gateway,
    host: str,
    port: int,
    *,
    limits: Limits,
    stats: ConnectionStats,
    drain_s: float,
    sockets: list[trio.SocketListener] | None = None,
    reuse_port: bool = False,
    cannot_listen: Callable[[OSError], Exception] | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` on (host, port) (or on `sockets`, passed to us) until cancelled, then drain
    as the module docstring says. A listener that cannot be opened is `cannot_listen(exc)`, which
    says which setting to change."""
    # Shielded: cancelling the process must not cut the requests in flight; the drain below
    # ends this scope itself, once they finished or the deadline passed.
    http_scope = trio.CancelScope(shield=True)
    shutdown = Shutdown()

    async def serve_until_drained(*, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        with http_scope:
            await serve_http(
                handler,
                host,
                port,
                limits=limits,
                errors=error_body,
                stats=stats,
                shutdown=shutdown,
                sockets=sockets,
                reuse_port=reuse_port,
                task_status=task_status,
            )

    async with trio.open_nursery() as nursery:
        try:
            try:
                listeners = await nursery.start(serve_until_drained)
            except OSError as exc:
                if cannot_listen is None:
                    raise
                raise cannot_listen(exc) from None
            task_status.started(listeners)
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(drain_s + 1) as cleanup:
                cleanup.shield = True
                log.info("server_draining", in_flight=sum(gateway.in_flight.values()))
                shared = bool(sockets) or reuse_port
                if shared:
                    # Others serve the port: new connections go to them (or wait for the next
                    # process in a passed socket's backlog) instead of being answered 503 here.
                    shutdown.begin()
                finished = await gateway.drain(drain_s, refuse_new=not shared)
                if not finished:
                    log.warning("server_drain_timed_out", in_flight=sum(gateway.in_flight.values()), after_s=drain_s)
            http_scope.cancel()
