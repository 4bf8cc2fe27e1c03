"""A standby control plane's two ports, while another leads the PostgreSQL store they share.

A standby holds what a leader starts from ready (`llmgw.server.app.Warm`: the CA, the agents'
TLS context, the admin credential, this llmgw's release file; the catalog is server.toml, read
and checked) and its store open when it can be (`StandbyStore`; `lease.STANDBY`: every write
refused, reads allowed: a standby comes up and stays up while PostgreSQL is away), and
answers whoever comes with where the leader is, as the lease names it (`Leader`, from the
seat's last look at the lease):

- the agent port, as a leader's (`agentlistener.AgentListener`: the same TLS, budgets and
  checks of the certificate): either link's upgrade and hello are judged as a leader judges
  them (`linkserver.StandbyEnd`), and the hello is answered with a `Redirect` naming the
  leader's agent port (its URL), then the link is closed; the agent or gateway dials the leader
  next. The release files and the mirror's archives are served as a leader serves them (they
  are files, not state).
- http_listen: the admin API (after the admin credential, as a leader checks it) answers 503
  with Retry-After and a JSON body naming the leader's admin URL (`not_leader`), which `llmgw
  ctl` follows; /health answers 503 "standby" (a load balancer sends nothing here), and the
  gateway's routes 503 naming the leader (a standby runs no gateway: in the several-planes
  topology clients use gateways of their own, docs/high-availability.md); /metrics says
  `llmgw_control_plane_leading 0`, and how many times it tried to take the lease.
"""

from __future__ import annotations

import contextlib
import hmac
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from llmgw.config import ServerConfig
from llmgw.errors import cut
from llmgw.http.errors import HTTPError
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Request, Response
from llmgw.http.openai import error_body
from llmgw.http.refusallines import RefusalLines
from llmgw.http.relay import gateway_route
from llmgw.http.server import bound_address, serve_http
from llmgw.log import get_logger
from llmgw.server.admin.api import is_admin_path
from llmgw.server.errors import StoreError
from llmgw.server.front import Bound, cannot_listen, split_hostport
from llmgw.server.links.agentlistener import AgentListener
from llmgw.server.links.linkserver import StandbyEnd
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire import gateway_session as gs

log = get_logger("llmgw.standby")
agent_log, gateway_log = get_logger("llmgw.endpoint"), get_logger("llmgw.gatewayfeed")  # as a leader's ends log

NOT_LEADER = "not_leader"  # the admin API's error code for "ask the leader", which `llmgw ctl` follows
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@attrs.frozen(kw_only=True)
class Leader:
    """Where the leader is, as a standby last read the lease: its agent port's URL and admin URL,
    "" while none is known (the lease has lapsed, or could not be read), and why not."""

    agent_url: str = ""
    admin_url: str = ""
    epoch: int = 0
    why_none: str = ""
    retry_after_s: float = 1.0

    def redirect(self) -> w.Redirect:
        if self.agent_url:
            message = (
                f"this control plane is a standby; the leader (epoch {self.epoch}) takes links at {self.agent_url}"
            )
            return w.Redirect(leader=self.agent_url, message=message)
        return w.Redirect(leader="", message=f"this control plane is a standby and {self.why_none}; trying again")

    def view(self) -> dict[str, Any] | None:
        if not self.agent_url:
            return None
        return {"agent_url": self.agent_url, "admin_url": self.admin_url, "epoch": self.epoch}


class StandbyStore:
    """A standby's store, opened when first needed and again after it failed (at most every
    `retry_s`): a standby comes up, and stays up, while PostgreSQL is away. It is read for one
    thing, the revocation of a certificate that asks for a link; while it cannot be read that
    check fails closed (`StoreError`: the link is refused with 503 and its agent retries)."""

    def __init__(self, open_store: Callable[[], AsyncStore], *, retry_s: float) -> None:
        self._open_store = open_store
        self.retry_s = retry_s
        self.store: AsyncStore | None = None
        self._failed: StoreError | None = None
        self._next_try = -math.inf

    async def open(self) -> None:
        """Open it now if it is not (its failure, if any, kept for the calls that need it)."""
        with contextlib.suppress(StoreError):
            await self._opened()

    async def _opened(self) -> AsyncStore:
        if self.store is not None:
            return self.store
        now = trio.current_time()
        if now < self._next_try and self._failed is not None:
            raise self._failed
        try:
            self.store = await trio.to_thread.run_sync(self._open_store)
        except StoreError as exc:
            self._failed, self._next_try = exc, now + self.retry_s
            log.warning("standby_store_unavailable", reason=str(exc), retry_in_s=self.retry_s)
            raise
        self._failed = None
        return self.store

    async def is_revoked(self, serial: int) -> bool:
        return await (await self._opened()).is_revoked(serial)

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()
            self.store = None


class StandbyListener(AgentListener):
    """The agent port of a standby: either link's request is answered with where the leader is
    (`linkserver.StandbyEnd`), after the checks a leader makes."""

    def __init__(self, *, leader: Callable[[], Leader], heartbeat_interval_s: float, **listener: Any) -> None:
        def redirect() -> w.Redirect:
            return leader().redirect()

        def agent_session(cn: str, standby: Callable[[], w.Redirect]) -> s.ServerSession:
            return s.ServerSession(
                cn, heartbeat_interval_s=heartbeat_interval_s, desired_state=_no_desired_state, standby=standby
            )

        def gateway_session(cn: str, standby: Callable[[], w.Redirect]) -> gs.GatewayServerSession:
            return gs.GatewayServerSession(
                cn, heartbeat_interval_s=heartbeat_interval_s, table=_no_table, standby=standby
            )

        super().__init__(
            agents=StandbyEnd(agent_session, redirect, who="agent", who_field="node", log=agent_log),
            gateways=StandbyEnd(gateway_session, redirect, who="gateway", who_field="gateway", log=gateway_log),
            **listener,
        )
        self.leader = leader


def _no_desired_state() -> w.DesiredState:
    raise AssertionError("a standby makes no desired state")


def _no_table(kind: type) -> Any:
    raise AssertionError("a standby sends no table")


class StandbyFront:
    """What a standby answers on http_listen (the module docstring)."""

    def __init__(self, *, admin_token: str, leader: Callable[[], Leader], tries: Callable[[], int] = lambda: 0) -> None:
        """`tries()`: this process's tries at taking the lease so far (`LeaseKeeper.tries`)."""
        self._token = admin_token.encode()
        # Wrong credentials, a few lines each interval and then a summary (`refusals.serve`).
        self.refusals = RefusalLines("http")
        self.leader = leader
        self.tries = tries

    async def handle(self, request: Request) -> Response:
        leader = self.leader()
        retry = (("retry-after", str(max(1, math.ceil(leader.retry_after_s)))),)
        where = (
            f"the leader's admin API is at {leader.admin_url}"
            if leader.admin_url
            else f"{leader.why_none}; try again shortly"
        )
        if is_admin_path(request.path):
            self._authorize(request)
            message = f"this control plane is a standby and changes nothing; {where}"
            error = {"message": message, "type": "unavailable_error", "param": None, "code": NOT_LEADER}
            return Response.json(503, {"error": {**error, "leader": leader.view()}}, retry)
        if request.path == "/health":
            return Response.json(503, {"status": "standby", "leader": leader.view()}, retry)
        if gateway_route(request.path):
            raise HTTPError(
                503,
                f"this control plane is a standby and serves no gateway; send requests to a gateway (`llmgw gateway`) "
                f"or to the leader ({leader.admin_url or 'none leads now'})",
                code=NOT_LEADER,
                headers=retry,
            )
        if request.path == "/metrics":
            text = (
                "# HELP llmgw_control_plane_leading Whether this control plane leads (1) or stands by (0).\n"
                "# TYPE llmgw_control_plane_leading gauge\nllmgw_control_plane_leading 0\n"
                "# HELP llmgw_lease_tries_total Tries at taking the lease, refused or not (one each lease_renew_s).\n"
                f"# TYPE llmgw_lease_tries_total counter\nllmgw_lease_tries_total {self.tries()}\n"
            )
            return Response(status=200, body=text.encode(), headers=(("content-type", METRICS_TYPE),))
        raise HTTPError(
            404, f"no route {cut(request.method, 20)} {cut(request.path)} on a standby; {where}", kind="not_found_error"
        )

    def _authorize(self, request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            self.refusals.refused(
                log, "admin_credential_refused", kind="admin", peer=request.client, client=request.client
            )
            raise HTTPError(
                401,
                "the admin API needs the admin credential (Authorization: Bearer ...), the same on every control "
                "plane of the cluster; `llmgw ctl` reads it from the state directory (admin.token) or --credential FILE",
                kind="authentication_error",
            )


async def serve_standby(
    config: ServerConfig,
    listener: StandbyListener,
    front: StandbyFront,
    *,
    ssl_context,
    stats: ConnectionStats,
    task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A standby's agent port and http_listen, until cancelled; started with their addresses."""
    agent_host, agent_port = split_hostport(config.server.agent_listen)
    http_host, http_port = split_hostport(config.server.http_listen)
    async with trio.open_nursery() as nursery:
        await nursery.start(front.refusals.serve)  # its summaries of wrong credentials
        try:
            agents = await nursery.start(listener.serve, agent_host, agent_port, ssl_context)
        except OSError as exc:
            raise cannot_listen("agent_listen", config.server.agent_listen, exc) from None
        http = partial(serve_http, limits=config.http, errors=error_body, stats=stats, listener="http")
        try:
            answers = await nursery.start(http, front.handle, http_host, http_port)
        except OSError as exc:
            raise cannot_listen("http_listen", config.server.http_listen, exc) from None
        task_status.started(Bound(agent_address=bound_address(agents), http_address=bound_address(answers)))
