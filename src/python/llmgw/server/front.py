"""The control plane's HTTP front: one listener for the gateway, the admin API and /metrics,
and how it stops.

On cancellation the requests in flight finish, for at most `drain_s`, then whatever is left is
cut. Meanwhile new requests get 503 with Retry-After — unless the listening sockets were passed
to us (socket activation): then we stop accepting, new connections wait in the kernel's backlog
for the next process, and each open connection gets the answer to the request it is on and then
closes. Also here: the addresses the control plane reports once it listens (`Bound`).
"""

from __future__ import annotations

import attrs
import trio

from llmgw.config import ServerConfig
from llmgw.errors import MachineError
from llmgw.gateway.app import Gateway
from llmgw.http.listeners import ConnectionStats, Shutdown
from llmgw.http.messages import Handler
from llmgw.http.openai import error_body
from llmgw.http.server import serve_http
from llmgw.log import get_logger

log = get_logger("llmgw.server")


@attrs.frozen(kw_only=True)
class Bound:
    agent_address: tuple[str, int]
    http_address: tuple[str, int]

    @property
    def admin_url(self) -> str:
        host, port = self.http_address
        return f"http://{_url_host(host)}:{port}"


async def serve_front(
    handler: Handler,
    gateway: Gateway,
    config: ServerConfig,
    *,
    stats: ConnectionStats,
    sockets: list[trio.SocketListener],
    drain_s: float,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` on `[server] http_listen` (or on `sockets`, passed to us) until cancelled,
    then drain as the module docstring says."""
    host, port = split_hostport(config.server.http_listen)
    # Shielded: cancelling the control plane must not cut the requests in flight; the drain
    # below ends this scope itself, once they finished or the deadline passed.
    http_scope = trio.CancelScope(shield=True)
    shutdown = Shutdown()

    async def serve_until_drained(*, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        with http_scope:
            await serve_http(
                handler,
                host,
                port,
                limits=config.http,
                errors=error_body,
                stats=stats,
                shutdown=shutdown,
                sockets=sockets,
                task_status=task_status,
            )

    async with trio.open_nursery() as nursery:
        try:
            try:
                listeners = await nursery.start(serve_until_drained)
            except OSError as exc:
                raise cannot_listen("http_listen", config.server.http_listen, exc) from None
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


def cannot_listen(key: str, value: str, exc: OSError) -> MachineError:
    return MachineError(
        f"cannot listen on {value} ([server] {key}): {exc.strerror or exc}; is another llmgw server running, "
        "or is the port taken? Stop it, or set another address in server.toml"
    )


def split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
