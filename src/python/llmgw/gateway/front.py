"""A gateway's listener and how it stops, for every process that serves the gateway: the control
plane's front (`llmgw.server.front`) and a gateway worker (`llmgw.gatewayd.worker`).

On cancellation the requests in flight finish, for at most `drain_s`, then whatever is left is
cut. Meanwhile new requests get 503 with Retry-After (and /health says "draining", so a load
balancer stops sending) — unless the listening sockets were passed to us (socket activation):
then we stop accepting, new connections wait in the kernel's backlog for the next process, and
each open connection gets the answer to the request it is on and then closes.
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
                if sockets:
                    # The sockets outlive us: new connections wait in the backlog for the next
                    # process instead of being answered 503 here.
                    shutdown.begin()
                finished = await gateway.drain(drain_s, refuse_new=not sockets)
                if not finished:
                    log.warning("server_drain_timed_out", in_flight=sum(gateway.in_flight.values()), after_s=drain_s)
            http_scope.cancel()
