"""The control plane's private socket: its own routes — the admin API, the cluster page and
/login, /metrics — on `STATE_DIR/run/admin.sock`, for the gateway processes that serve
`http_listen` in its place to relay to (`llmgw.http.relay`), so those routes keep their URL.

Reaching it takes being the user the control plane runs as (or root): the socket is 0600 in a
0700 directory (`llmgw.http.unixsocket`, which also replaces a stale socket and refuses to take
one a live server answers on). What it believes and `http_listen` does not: the relayed
client's address in `x-llmgw-client` (`relay.CLIENT_HEADER`), which becomes the request's
`client`, the address the admin API's and the page's log lines show (a refused credential, a
login, an opened live feed). Nothing else is believed: the admin credential, a page session,
its CSRF token and `Origin` are checked as on `http_listen`. The gateway's routes (`/v1/`,
`/health`) are not served here: they are the gateway's, whichever process serves it.
"""

from __future__ import annotations

from pathlib import Path

import trio

from llmgw import paths
from llmgw.errors import cut
from llmgw.http.errors import HTTPError
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Handler, Request, Response, StreamingResponse
from llmgw.http.openai import error_body
from llmgw.http.relay import CLIENT_HEADER, gateway_route
from llmgw.http.unixsocket import serve_http_unix

LISTENER = "admin_socket"  # its connections' label in /metrics
MAX_CLIENT_CHARS = 64  # the longest "[IPv6 address]:port" is 47


def believing_the_relay(handler: Handler) -> Handler:
    """`handler` behind the private socket's rules (the module docstring)."""

    async def handle(request: Request) -> Response | StreamingResponse:
        relayed = request.headers.get(CLIENT_HEADER)
        if relayed:
            request.client = cut(relayed, MAX_CLIENT_CHARS)
        if gateway_route(request.path):
            raise HTTPError(
                404,
                f"{cut(request.path)} is the gateway's, not served on the control plane's private socket; "
                "send it to http_listen",
                kind="not_found_error",
            )
        return await handler(request)

    return handle


async def serve_admin_socket(
    handler: Handler,
    state_dir: Path,
    *,
    limits: Limits,
    stats: ConnectionStats,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `handler` (the control plane's own routes) on its private socket until cancelled,
    worded as on `http_listen` (OpenAI's error shape); `task_status` gets the socket's path."""
    await serve_http_unix(
        believing_the_relay(handler),
        paths.admin_socket_path(state_dir),
        limits=limits,
        errors=error_body,
        stats=stats,
        listener=LISTENER,
        task_status=task_status,
    )
