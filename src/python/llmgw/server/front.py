"""The control plane's HTTP front: one listener for the gateway, the admin API and /metrics.

It stops as every gateway's listener does (`llmgw.gateway.front.serve_draining`): on
cancellation the requests in flight finish, for at most `drain_s`, then whatever is left is
cut; meanwhile new requests get 503 with Retry-After, unless the listening sockets were passed
to us (socket activation). Also here: the addresses the control plane reports once it listens
(`Bound`).
"""

from __future__ import annotations

from functools import partial

import attrs
import trio

from llmgw.config import ServerConfig
from llmgw.errors import MachineError
from llmgw.gateway.app import Gateway
from llmgw.gateway.front import serve_draining
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Handler
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
    then drain as `llmgw.gateway.front` says."""
    host, port = split_hostport(config.server.http_listen)
    await serve_draining(
        handler,
        gateway,
        host,
        port,
        limits=config.http,
        stats=stats,
        drain_s=drain_s,
        sockets=sockets,
        cannot_listen=partial(cannot_listen, "http_listen", config.server.http_listen),
        task_status=task_status,
    )


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
