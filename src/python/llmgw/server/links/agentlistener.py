"""The agent port's listener: each connection from its accept to its route.

Order of checks on a new connection, each refusal logged here with its reason and told to the
agent in the clearest way the stage allows (a flood of them is summarised, `RefusalLog`):

0. Until its TLS handshake shows a client certificate a connection is unproven: it counts in
   a small budget of its own (`fdlimits.unproven_budget`), where at the ceiling the oldest is
   closed for the newcomer, and must finish the handshake (without a certificate, send its
   request head too) within HANDSHAKE_TIMEOUT_S. A certificate moves it to the agents' budget
   (`max_agent_connections`; past it, 503 with Retry-After). See `Place`.
1. TLS handshake with a client certificate from the cluster CA (OpenSSL refuses another CA's or
   an expired one; the agent receives the TLS alert at once). No certificate at all is refused
   there too, unless the control plane serves its release files (`[release] serve`, the
   default): then a peer without one gets as far as its request head, for the one route that
   needs none.
2. HTTP, on the shared server (`llmgw.http.server.serve_connection`: `[http]`'s head deadline,
   head size, send deadline and linger; one request per connection): `_route` sends the
   mirror's requests to `llmgw.server.nodes.artifacts`, the release files' to
   `llmgw.server.nodes.releases` (any peer), the gateway link's to `gateways` and the rest to the
   agent link's end, `agents`. A peer without a certificate asking for anything but a release
   file -> HTTP 403, logged as the TLS stage's refusal it stands for.
3. The mirror: the certificate a node's and not revoked (`llmgw.wire.agent_session`'s
   `check_standing` and `check_node_role`, the agent link's rules too). A link's request goes to
   its end (`llmgw.server.links.agentlinks.AgentLinks`, `llmgw.server.links.gatewaylinks.GatewayFeed`, or a
   standby's), each on the link runtime (`llmgw.server.links.linkserver`), with this listener as its
   `Port`: the store's word on a certificate (`standing`), a refusal counted and said (`refuse`),
   the connection handed over and contained (`upgrade`), refusals logged among the port's
   (`log_refusal`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import attrs
import trio
import trio_websocket

from llmgw.errors import leaves, only
from llmgw.http import listeners
from llmgw.http.body import BodyBudget
from llmgw.http.errors import HTTPError, peer_reason
from llmgw.http.fdlimits import default_max_connections, unproven_budget
from llmgw.http.heard import HeardListener, heard_at
from llmgw.http.limits import Limits
from llmgw.http.messages import Answer, Handler, Request, Upgrade, allow
from llmgw.http.refusals import RefusalLog
from llmgw.http.server import serve_connection
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo, cert_info_from_der
from llmgw.pki.tls import send_tls_alert
from llmgw.pki.tlsdiag import describe_tls_failure
from llmgw.server.errors import StoreError
from llmgw.server.links import agentport, tracker
from llmgw.server.links.agentport import Route
from llmgw.server.links.linkserver import REFUSAL_SEND_S
from llmgw.server.nodes import artifacts, releases
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_session as s
from llmgw.wire.errors import UpgradeRefused
from llmgw.wire.session import Standing

log = get_logger("llmgw.endpoint")

_LINK_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, trio_websocket.ConnectionClosed)

LISTENER = "agent"  # the listener's name in /metrics
# A connection is unproven until its TLS handshake shows a client certificate: the handshake,
# and the request head of a peer without a certificate, must come within this of the accept. A
# real agent's handshake takes a few round trips; three seconds covers a slow link many times
# over, and an unproven connection holds a place of the small unproven budget meanwhile.
HANDSHAKE_TIMEOUT_S = 3.0
AGENTS_FULL_RETRY_S = 5  # Retry-After of an agent refused because max_agent_connections are open
# At the unproven budget's ceiling, a newcomer takes the place of the connection whose peer has
# been silent longest, once silent this long; else the newcomer is closed and dials again after
# its backoff. A real agent answers each step of its handshake within a round trip: one merely
# slow to be served (a thousand redialling after a cut, waiting on the handshakes before theirs)
# keeps its place, and its half-done work is not thrown away for a newcomer's. A flood that
# would keep agents out must refresh every place this often (512 connections a second at 256).
UNPROVEN_SILENT_S = 0.5
NO_CERTIFICATE_SERVER = (
    "a client connected without a certificate; only agents holding a node certificate may connect "
    "(`llmgw node add USER@HOST --reissue` gives a node one); without one, only the release files are served"
)
NO_AGENT_LINK = "this port serves no agent link"
NO_GATEWAY_LINK = (
    "this control plane serves no gateway link; gateways connect to a control plane started by `llmgw server` "
    "or `llmgw up`"
)
NO_CERTIFICATE_CLIENT = (
    "the control plane requires a node certificate and this agent sent none; check that node.crt and "
    "node.key are in the agent's pki directory, or add the node with `llmgw node add USER@HOST --reissue`"
)


class AgentListener:
    """Accepts connections on the agent port and routes each request: a link's to its end
    (`agents`, `gateways`), to which it is the `linkserver.Port`."""

    def __init__(
        self,
        *,
        store: AsyncStore,
        artifact_store: artifacts.Artifacts | None = None,
        stats: listeners.ConnectionStats | None = None,
        limits: Limits = Limits(),
        max_connections: int = 0,
        release_files: releases.Releases | None = None,
        agents: LinkEnd | None = None,
        gateways: LinkEnd | None = None,
        mirror_changed: Callable[[], Awaitable[None]] | None = None,
        weights_tracker: tracker.Tracker | None = None,
    ) -> None:
        """`agents`, `gateways`: the links' ends (None: that link is not served here, 404);
        `mirror_changed()`: the mirror's index changed (an archive came or went)."""
        self.store = store
        self.limits = limits  # [http]'s: the head's deadline and size, each write's deadline
        self.stats = stats or listeners.ConnectionStats()
        self.max_connections = max_connections  # 0 = sized from the fd limit
        self.artifacts = artifact_store or artifacts.Artifacts(Path("/nonexistent"))
        self.releases = release_files or releases.Releases(directory=None, running=None, serve=False)
        self.budget = BodyBudget.of(limits)  # no route reads a body: closed unread
        # Connections that have not shown a client certificate have a small budget of their own
        # (sized in `serve`); at its ceiling the oldest still in its handshake is closed for the
        # newcomer. Closing the oldest rather than refusing the newest is what keeps agents
        # getting in: to lock them out a flood must then open more connections than the budget
        # holds within one agent's handshake (a few round trips), not once per deadline. A
        # certificate moves a connection to the agents' budget, where no bare connection goes.
        self.unproven_idle = listeners.IdleConnections(reason="unproven")
        self.unproven = listeners.Budget(0, self.unproven_idle, silent_s=UNPROVEN_SILENT_S)  # sized in `serve`
        self.agent_cap = max_connections  # 0 until `serve` sizes it from the fd limit
        self.agents_open = 0
        self.refusals = RefusalLog()
        self.agents = agents
        self.gateways = gateways
        self.mirror_changed = mirror_changed or _nothing
        self.tracker = weights_tracker

    async def serve(
        self,
        host: str,
        port: int,
        ssl_context,
        *,
        sockets: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept agents on (host, port), or on `sockets` already listening (socket activation).
        The mirror's index is built (off the loop) before this reports started, so the first
        desired state of every node already knows what is mirrored."""
        tcp = sockets or await trio.open_tcp_listeners(port, host=host)
        # Each connection notes when its peer last sent something: a place in the unproven
        # budget is taken from a silent peer only (`UNPROVEN_SILENT_S`).
        bound = [trio.SSLListener(HeardListener(sock), ssl_context, https_compatible=True) for sock in tcp]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(self.artifacts.serve_index, on_change=self.mirror_changed))
            await self.releases.announce()
            task_status.started(bound)
            self.agent_cap = self.max_connections or default_max_connections(LISTENER)
            self.unproven.size = unproven_budget(self.agent_cap)
            self.stats.unproven.set(0, listener=LISTENER)
            self.stats.unproven_limit.set(self.unproven.size, listener=LISTENER)
            # The listener's own bound covers the three: agents, unproven connections, and the
            # release downloads (which have left the unproven budget, bounded by their own).
            await listeners.serve_capped(
                self._handle,
                bound,
                max_connections=self.agent_cap + self.unproven.size + releases.MAX_DOWNLOADS,
                stats=self.stats,
                listener=LISTENER,
                idle=self.unproven_idle,
                refusals=self.refusals,
            )

    async def standing(self, cert: CertInfo) -> Standing:
        """What the store says of `cert`, with its role (the session judges both)."""
        try:
            return Standing(serial=cert.serial, revoked=await self.store.is_revoked(cert.serial), role=cert.role)
        except StoreError as exc:
            return Standing(serial=cert.serial, unknown=str(exc), role=cert.role)

    async def _handle(self, stream: trio.SSLStream) -> None:
        """One connection, contained: whatever the peer does ends this connection only (see
        `llmgw.http.server`'s "Containment"); a bug of ours is logged with its traceback. It
        counts in the unproven budget until it shows a client certificate, then in the agents'."""
        address = _peer_host(stream)
        deadline = trio.current_time() + HANDSHAKE_TIMEOUT_S
        admission, shed_peer = self.unproven.admit()
        if admission is listeners.Admission.FULL:  # every unproven place busy, none of them waiting
            self._shed("busy", address)
            await trio.aclose_forcefully(stream)
            return
        if admission is listeners.Admission.SHED:
            self._shed(self.unproven_idle.reason, shed_peer)
        place = Place(self, unproven=True)
        cn = "?"
        try:
            if not await self._handshake(stream, address, deadline):
                return
            der = stream.getpeercert(binary_form=True)
            # None: no certificate ([release] serve); OpenSSL has checked that one chains to the
            # cluster CA (revocation is checked per route).
            cert = cert_info_from_der(der) if der else None
            cn = cert.common_name if cert is not None else "-"
            await self.serve_peer(stream, cert, address, place=place, deadline=deadline)
        except Exception:  # - one connection's failure must never stop the port
            self.stats.abort(LISTENER, "internal")
            log.exception("agent_link_failed", address=address, cn=cn)
        finally:
            place.leave()
            await trio.aclose_forcefully(stream)

    async def serve_peer(
        self,
        stream: trio.abc.Stream,
        cert: CertInfo | None,
        address: str,
        *,
        place: Place | None = None,
        deadline: float | None = None,
    ) -> None:
        """Serve a connection whose TLS handshake is done, `cert` the client certificate it showed
        (None: none). Without one it stays unproven until routed: its head by `deadline` (the
        handshake's), and it may be closed for a newer connection meanwhile. `place`: the budgets
        it counts in since its accept; None for one accepted elsewhere (tests over memory
        streams), then counted in the agents' budget alone."""
        own = place is None
        place = place or Place(self, unproven=False)
        try:
            if cert is not None:
                place.leave_unproven()
                if not place.enter_agents():
                    await self._refuse_agents_full(stream, cert, address)
                    return
                reason = await self._serve_http(stream, partial(self._route, cert=cert, address=address, place=place))
                if reason is not None:
                    log.info("agent_link_closed", address=address, cn=cert.common_name, reason=reason)
                return
            if deadline is None:
                deadline = trio.current_time() + HANDSHAKE_TIMEOUT_S
            reason = None
            with self.unproven_idle.waiting(peer=address, heard=heard_at(stream)) as shed:
                handler = partial(self._route, cert=None, address=address, place=place, shed=shed)
                head_s = max(0.0, deadline - trio.current_time())
                reason = await self._serve_http(stream, handler, attrs.evolve(self.limits, head_timeout_s=head_s))
            if reason is not None and not shed.cancelled_caught:
                self.log_refusal("info", "agent_link_closed", address, reason, cn="-", reason=reason)
        finally:
            if own:
                place.leave()

    async def _serve_http(self, stream: trio.abc.Stream, handler: Handler, limits: Limits | None = None) -> str | None:
        """One request on the shared HTTP server, by the agent port's rules; why the peer ended
        it, if it did (counted in /metrics already)."""
        return await serve_connection(
            handler,
            stream,
            limits=limits or self.limits,
            stats=self.stats,
            listener=LISTENER,
            budget=self.budget,
            keep_alive=False,
            upgrades=True,
        )

    async def _route(
        self,
        request: Request,
        *,
        cert: CertInfo | None,
        address: str,
        place: Place,
        shed: trio.CancelScope | None = None,
    ) -> Answer:
        if shed is not None:
            self.unproven_idle.settle(shed)  # routed: no longer one to close for a newcomer
        where = agentport.route(request)
        if where is Route.RELEASE:  # public files: no certificate needed, none checked
            place.leave_unproven()  # bounded by releases.MAX_DOWNLOADS from here
            return await releases.handle(request, self.releases, address)
        if cert is None:
            # What OpenSSL would have refused at the handshake had the release route not needed
            # peers without a certificate: logged and worded as that refusal.
            self.log_refusal("warning", "agent_refused", address, "tls", stage="tls", reason=NO_CERTIFICATE_SERVER)
            self.stats.abort(LISTENER, "tls")
            raise HTTPError(403, NO_CERTIFICATE_CLIENT)
        if where is Route.LINK:
            if self.agents is None:
                raise HTTPError(404, NO_AGENT_LINK)
            return await self.agents.link(self, request, cert, address)
        if where is Route.GATEWAY:
            if self.gateways is None:
                raise HTTPError(404, NO_GATEWAY_LINK)
            return await self.gateways.link(self, request, cert, address)
        try:
            standing = await self.standing(cert)
            s.check_standing(cert.common_name, standing)
            s.check_node_role(cert.common_name, standing)
        except UpgradeRefused as exc:
            raise self.refuse(cert, address, exc) from None
        if where is Route.PEERS:
            if self.tracker is None:
                raise HTTPError(404, "this control plane tracks no weights")
            return await tracker.handle(request, self.tracker, cert.common_name)
        if where is Route.WEIGHTS:
            origin = self.tracker.origin if self.tracker is not None else None
            if origin is None:
                raise HTTPError(404, 'this control plane serves no weights ([downloads] weights_origin = "node")')
            allow(request, "GET")
            return await origin.sender.answer(request, origin.offer, place="control plane")
        return await artifacts.handle(request, self.artifacts, cert.common_name)

    def refuse(self, cert: CertInfo, address: str, exc: UpgradeRefused) -> HTTPError:
        """A certified peer's refused request, logged; the answer saying why, to raise."""
        stage = "upgrade" if exc.status == 400 else "identity"
        self.log_refusal("warning", "agent_refused", address, stage, stage=stage, cn=cert.common_name, reason=str(exc))
        self.stats.abort(LISTENER, "refused")
        return HTTPError(exc.status, str(exc))

    def upgrade(
        self, run: Callable[[trio.abc.Stream, bytes], Awaitable[None]], cert: CertInfo, address: str
    ) -> Upgrade:
        """The connection handed to `run` (the link), which may end it any way: what the peer
        did is counted and logged at info, a bug of ours with its traceback."""

        async def contained(stream: trio.abc.Stream, prefix: bytes) -> None:
            try:
                await run(stream, prefix)
            except Exception as exc:  # - counted and logged here, a bug with its traceback
                reason = peer_reason(exc)
                if reason is None and only(exc, _LINK_BROKEN):
                    reason = "closed"
                if reason is None:
                    self.stats.abort(LISTENER, "internal")
                    log.exception("agent_link_failed", address=address, cn=cert.common_name)
                    return
                self.stats.abort(LISTENER, reason)
                detail = repr(leaves(exc)[0])
                log.info("agent_link_closed", address=address, cn=cert.common_name, reason=reason, detail=detail)

        return Upgrade(contained)

    def _shed(self, reason: str, peer: str) -> None:
        """Count and log (debug) a connection closed or turned away to make room."""
        self.stats.shed.inc(listener=LISTENER, reason=reason)
        self.refusals.refused(trio.current_time(), reason, peer, loud=False)
        log.debug("connection_shed", listener=LISTENER, reason=reason, peer=peer)

    def log_refusal(self, level: str, event: str, address: str, kind: str, **fields) -> None:
        """Log a refusal on this port (a peer not known to be an agent, a certificate or a hello
        refused): at `level` while there are few, at debug when many (the listener then logs one
        summary per interval, `RefusalLog`, counting it under `kind`)."""
        loud = self.refusals.refused(trio.current_time(), kind, address)
        getattr(log, level if loud else "debug")(event, address=address, **fields)

    async def _handshake(self, stream: trio.SSLStream, address: str, deadline: float) -> bool:
        """The TLS handshake, by `deadline`: a client certificate, if any, of the cluster CA;
        False if refused (logged, the agent told why by the TLS alert) or if this connection was
        closed meanwhile to make room for a newer one (counted by whoever closed it)."""
        with self.unproven_idle.waiting(peer=address, heard=heard_at(stream)) as shed:
            try:
                with trio.fail_at(deadline):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError) as exc:
                if isinstance(exc, trio.TooSlowError):
                    reason = f"no TLS handshake within {HANDSHAKE_TIMEOUT_S:g} s"
                else:
                    reason = (
                        describe_tls_failure(exc, side="server") or f"TLS handshake failed: {exc.__cause__ or exc!r}"
                    )
                self.log_refusal("warning", "agent_refused", address, "tls", stage="tls", reason=reason)
                self.stats.abort(LISTENER, "tls")
                await send_tls_alert(stream)  # so the agent learns why, at once
                return False
        return not shed.cancelled_caught

    async def _refuse_agents_full(self, stream: trio.abc.Stream, cert: CertInfo, address: str) -> None:
        """A certified agent past `max_agent_connections`: 503 with Retry-After, and it retries."""
        self.stats.shed.inc(listener=LISTENER, reason="agents_full")
        message = (
            f"the control plane holds as many agent connections as it may ({self.agent_cap}, [http] "
            "max_agent_connections); this agent retries by itself"
        )
        self.log_refusal(
            "warning", "agent_refused", address, "agents_full", stage="capacity", cn=cert.common_name, reason=message
        )

        async def full(request: Request) -> Answer:
            raise HTTPError(503, message, headers=(("retry-after", str(AGENTS_FULL_RETRY_S)),))

        with trio.move_on_after(REFUSAL_SEND_S):
            await self._serve_http(stream, full)


class LinkEnd(Protocol):
    """A link's end on this port (`linkserver.LinkServer`, or a standby's `linkserver.StandbyEnd`)."""

    async def link(self, port: AgentListener, request: Request, cert: CertInfo, address: str) -> Answer: ...


async def _nothing() -> None:
    await trio.lowlevel.checkpoint()


class Place:
    """Which of the listener's budgets one connection counts in: the unproven one from its
    accept; the agents' once it has shown a client certificate; neither once it fetches a
    release file (bounded by releases.MAX_DOWNLOADS)."""

    def __init__(self, listener: AgentListener, *, unproven: bool) -> None:
        """`unproven`: admitted to the unproven budget (`listener.unproven.admit`)."""
        self.listener = listener
        self.unproven = unproven
        self.agent = False
        if unproven:
            listener.stats.unproven.inc(listener=LISTENER)

    def leave_unproven(self) -> None:
        if self.unproven:
            self.unproven = False
            self.listener.unproven.leave()
            self.listener.stats.unproven.inc(-1, listener=LISTENER)

    def enter_agents(self) -> bool:
        """Take a place in the agents' budget; False when all are taken."""
        if self.listener.agents_open >= self.listener.agent_cap:
            return False
        self.listener.agents_open += 1
        self.agent = True
        return True

    def leave(self) -> None:
        self.leave_unproven()
        if self.agent:
            self.agent = False
            self.listener.agents_open -= 1


def _peer_host(stream: trio.SSLStream) -> str:
    try:
        return stream.transport_stream.socket.getpeername()[0]
    except (OSError, AttributeError):
        return "?"
