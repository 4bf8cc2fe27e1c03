"""The agent endpoint: where agents connect, prove who they are, and keep a link open.

Order of checks on a new connection, each refusal logged here with its reason and told to the
agent in the clearest way the stage allows (a flood of them is summarised, `RefusalLog`):

0. Until its TLS handshake shows a client certificate a connection is unproven: it counts in
   a small budget of its own (`listeners.unproven_budget`), where at the ceiling the oldest is
   closed for the newcomer, and must finish the handshake (without a certificate, send its
   request head too) within HANDSHAKE_TIMEOUT_S. A certificate moves it to the agents' budget
   (`max_agent_connections`; past it, 503 with Retry-After). See `_Place`.

1. TLS handshake with a client certificate from the cluster CA (OpenSSL refuses another CA's or
   an expired one; the agent receives the TLS alert at once). No certificate at all is refused
   there too, unless the control plane serves its release files (`[release] serve`, the
   default): then a peer without one gets as far as its request head, for the one route that
   needs none.
2. One request head, read once; `agentport.route` sends the mirror's requests to
   `llmgw.server.artifacts`, the release files' to `llmgw.server.releases` (any peer) and the
   rest to the link (no HTTP at all -> 400). A peer without a certificate asking for anything
   but a release file -> HTTP 403, logged as the TLS stage's refusal it stands for.
3. The certificate's serial is not revoked (`llmgw node remove`) -> else HTTP 403 with the reason.
   When the store cannot answer, the check fails closed: HTTP 503 saying so, and the agent retries.
4. The link's upgrade is to AGENT_PATH (else 404) and the node id it claims (`NODE_ID_HEADER`)
   equals the certificate's CN (else 403): `ServerSession.upgrade`.
5. WebSocket upgrade; from here the link's protocol is `llmgw.wire.session.ServerSession`'s:
   the first frame is a `Hello` of our protocol version with the same node id, else a
   `LinkError` frame and close.

This module is the adapter around that session: it moves frames, keeps the deadlines (the
hello's, each send's, the silence of a link past the heartbeat TTL, the certificate's expiry)
and acts on the session's events (registry, desired state, logs). A node's newer link replaces
an older one; `close_node` ends a node's link (revocation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio
import trio_websocket

from llmgw.errors import leaves, only
from llmgw.http import listeners
from llmgw.http import server as http
from llmgw.http.refusals import RefusalLog
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo, cert_info_from_der
from llmgw.pki.tls import send_tls_alert
from llmgw.pki.tlsdiag import describe_tls_failure
from llmgw.server import agentport, artifacts, releases
from llmgw.server.agentport import Route
from llmgw.server.asyncstore import AsyncStore
from llmgw.server.registry import Registry
from llmgw.server.store import StoreError
from llmgw.wire import agent_link as w
from llmgw.wire import session as s
from llmgw.wire.errors import UpgradeRefused, WireError

log = get_logger("llmgw.endpoint")

_LINK_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, trio_websocket.ConnectionClosed)

LISTENER = "agent"  # the listener's name in /metrics
# A connection is unproven until its TLS handshake shows a client certificate: the handshake,
# and the request head of a peer without a certificate, must come within this of the accept. A
# real agent's handshake takes a few round trips; three seconds covers a slow link many times
# over, and an unproven connection holds a place of the small unproven budget meanwhile.
HANDSHAKE_TIMEOUT_S = 3.0
HELLO_TIMEOUT_S = 10.0
REFUSAL_SEND_S = 1.0  # a refused agent is told why within this, then the connection closes
AGENTS_FULL_RETRY_S = 5  # Retry-After of an agent refused because max_agent_connections are open
# A message to an agent must be taken within this; an agent that stops reading is cut off
# (its link is closed) instead of stalling whoever pushes desired state to it.
SEND_TIMEOUT_S = 10.0
NO_CERTIFICATE_SERVER = (
    "a client connected without a certificate; only agents holding a node certificate may connect "
    "(`llmgw node add USER@HOST --reissue` gives a node one); without one, only the release files are served"
)
NO_CERTIFICATE_CLIENT = (
    "the control plane requires a node certificate and this agent sent none; check that node.crt and "
    "node.key are in the agent's pki directory, or add the node with `llmgw node add USER@HOST --reissue`"
)


@attrs.define(kw_only=True)
class Link:
    node_id: str
    conn_id: int
    ws: trio_websocket.WebSocketConnection
    session: s.ServerSession
    cancel_scope: trio.CancelScope


class AgentEndpoint:
    def __init__(
        self,
        *,
        registry: Registry,
        store: AsyncStore,
        heartbeat_interval_s: float,
        desired_state: Callable[[str], w.DesiredState],
        on_change: Callable[[], None] = lambda: None,
        artifact_store: artifacts.Artifacts | None = None,
        on_replicas: Callable[[str, tuple[w.ReplicaStatus, ...]], None] = lambda node, statuses: None,
        silence_timeout_s: float = 0.0,
        stats: listeners.ConnectionStats | None = None,
        max_connections: int = 0,
        send_timeout_s: float = artifacts.SEND_TIMEOUT_S,
        release_files: releases.Releases | None = None,
    ) -> None:
        self.send_timeout_s = send_timeout_s  # each write of a mirrored archive
        # A link silent this long (no heartbeat, no message) is closed: the agent is gone or cut
        # off, and its connection's resources go back. 0 = never (tests of other things).
        self.silence_timeout_s = silence_timeout_s
        self.stats = stats or listeners.ConnectionStats()
        self.max_connections = max_connections  # 0 = sized from the fd limit
        self.on_replicas = on_replicas
        self._log_waiters: dict[int, list[w.LogsReply]] = {}
        self._log_event = trio.Event()
        self._next_request = 0
        self.artifacts = artifact_store or artifacts.Artifacts(Path("/nonexistent"))
        self.releases = release_files or releases.Releases(directory=None, running=None, serve=False)
        self.registry = registry
        self.store = store
        self.heartbeat_interval_s = heartbeat_interval_s
        self.desired_state = desired_state
        self.on_change = on_change
        self.links: dict[str, Link] = {}
        # Connections that have not shown a client certificate have a small budget of their own
        # (sized in `serve`); at its ceiling the oldest still in its handshake is closed for the
        # newcomer. Closing the oldest rather than refusing the newest is what keeps agents
        # getting in: to lock them out a flood must then open more connections than the budget
        # holds within one agent's handshake (a few round trips), not once per deadline. A
        # certificate moves a connection to the agents' budget, where no bare connection goes.
        self.unproven_idle = listeners.IdleConnections(reason="unproven")
        self.unproven = listeners.Budget(0, self.unproven_idle)  # sized in `serve`
        self.agent_cap = 0  # set in `serve`
        self.agents_open = 0
        self.refusals = RefusalLog()

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
        if sockets:
            bound = [trio.SSLListener(sock, ssl_context, https_compatible=True) for sock in sockets]
        else:
            bound = await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host, https_compatible=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(self.artifacts.serve_index, on_change=self._mirror_changed))
            await self.releases.announce()
            task_status.started(bound)
            self.agent_cap = self.max_connections or listeners.default_max_connections(LISTENER)
            self.unproven.size = listeners.unproven_budget(self.agent_cap)
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

    async def _mirror_changed(self) -> None:
        for node_id in list(self.links):
            await self.push_desired_state(node_id)  # an archive came or went: `mirrored` changed

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
        place = _Place(self)
        cert: CertInfo | None = None
        cn = "?"
        try:
            if not await self._handshake(stream, address, deadline):
                return
            der = stream.getpeercert(binary_form=True)
            cert = cert_info_from_der(der) if der else None  # None: no certificate ([release] serve)
            cn = cert.common_name if cert is not None else "-"
            if cert is not None:
                # OpenSSL has checked it chains to the cluster CA (revocation is checked later).
                place.leave_unproven()
                if not place.enter_agents():
                    await self._refuse_agents_full(stream, cert, address)
                    return
            await self._serve(stream, cert, address, place, deadline)
        except Exception as exc:  # - one link's failure must never stop the endpoint
            reason = http.peer_reason(exc)
            if reason is None and only(exc, _LINK_BROKEN):
                reason = "closed"
            if reason is None:
                self.stats.abort(LISTENER, "internal")
                log.exception("agent_link_failed", address=address, cn=cn)
            else:
                self.stats.abort(LISTENER, reason)
                detail = repr(leaves(exc)[0])
                if cert is None:  # not known to be an agent: one of a flood, maybe
                    self._refusal("info", "agent_link_closed", address, reason, cn=cn, reason=reason, detail=detail)
                else:
                    log.info("agent_link_closed", address=address, cn=cn, reason=reason, detail=detail)
        finally:
            place.leave()
            await trio.aclose_forcefully(stream)

    def _shed(self, reason: str, peer: str) -> None:
        """Count and log (debug) a connection closed or turned away to make room."""
        self.stats.shed.inc(listener=LISTENER, reason=reason)
        self.refusals.refused(trio.current_time(), reason, peer, loud=False)
        log.debug("connection_shed", listener=LISTENER, reason=reason, peer=peer)

    def _refusal(self, level: str, event: str, address: str, kind: str, **fields) -> None:
        """Log the refusal of a peer not known to be an agent: at `level` while there are few,
        at debug when many (the listener then logs one summary per interval, `RefusalLog`)."""
        loud = self.refusals.refused(trio.current_time(), kind, address)
        getattr(log, level if loud else "debug")(event, address=address, **fields)

    async def _handshake(self, stream: trio.SSLStream, address: str, deadline: float) -> bool:
        """The TLS handshake, by `deadline`: a client certificate, if any, of the cluster CA;
        False if refused (logged, the agent told why by the TLS alert) or if this connection was
        closed meanwhile to make room for a newer one (counted by whoever closed it)."""
        with self.unproven_idle.waiting(peer=address) as shed:
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
                self._refusal("warning", "agent_refused", address, "tls", stage="tls", reason=reason)
                self.stats.abort(LISTENER, "tls")
                await send_tls_alert(stream)  # so the agent learns why, at once
                return False
        return not shed.cancelled_caught

    async def _refuse_agents_full(self, stream: trio.SSLStream, cert: CertInfo, address: str) -> None:
        """A certified agent past `max_agent_connections`: 503 with Retry-After, and it retries."""
        self.stats.shed.inc(listener=LISTENER, reason="agents_full")
        message = (
            f"the control plane holds as many agent connections as it may ({self.agent_cap}, [http] "
            "max_agent_connections); this agent retries by itself"
        )
        self._refusal(
            "warning", "agent_refused", address, "agents_full", stage="capacity", cn=cert.common_name, reason=message
        )
        with trio.move_on_after(REFUSAL_SEND_S):
            head = await agentport.read_head(stream)
            await agentport.answer(
                stream,
                head,
                503,
                message,
                timeout_s=REFUSAL_SEND_S,
                headers=(("retry-after", str(AGENTS_FULL_RETRY_S)),),
            )

    async def _serve(
        self, stream: trio.SSLStream, cert: CertInfo | None, address: str, place: _Place, deadline: float
    ) -> None:
        cn = cert.common_name if cert is not None else "-"
        if cert is None:
            # Still unproven: its head by the handshake's deadline, and it may be closed for a
            # newer connection while it waits.
            with self.unproven_idle.waiting(peer=address) as shed:
                with trio.move_on_at(deadline) as late:
                    head = await agentport.read_head(stream)
            if shed.cancelled_caught:
                return
            if late.cancelled_caught:
                self.stats.abort(LISTENER, "head_timeout")
                self._refusal("info", "agent_link_closed", address, "head_timeout", cn=cn, reason="head_timeout")
                return
        else:
            try:
                with trio.fail_after(HELLO_TIMEOUT_S):  # the whole request head, however it trickles in
                    head = await agentport.read_head(stream)
            except trio.TooSlowError:
                self.stats.abort(LISTENER, "head_timeout")
                log.info("agent_link_closed", address=address, cn=cn, reason="head_timeout")
                return
        where = agentport.route(head.request)
        if where is Route.NOT_HTTP:
            self.stats.abort(LISTENER, "malformed")
            await agentport.answer(stream, head, 400, "expected an HTTP request", timeout_s=REFUSAL_SEND_S)
            return
        assert head.request is not None
        if where is Route.RELEASE:  # public files: no certificate needed, none checked
            place.leave_unproven()  # bounded by releases.MAX_DOWNLOADS from here
            await releases.serve(
                stream, head.conn, head.request, self.releases, address, send_timeout_s=self.send_timeout_s
            )
            return
        if cert is None:
            # What OpenSSL would have refused at the handshake had the release route not needed
            # peers without a certificate: logged and worded as that refusal.
            self._refusal("warning", "agent_refused", address, "tls", stage="tls", reason=NO_CERTIFICATE_SERVER)
            self.stats.abort(LISTENER, "tls")
            await agentport.answer(stream, head, 403, NO_CERTIFICATE_CLIENT, timeout_s=REFUSAL_SEND_S)
            return
        await self._serve_authenticated(stream, head, where, cert, address)

    async def _serve_authenticated(
        self, stream: trio.SSLStream, head: agentport.Head, where: Route, cert: CertInfo, address: str
    ) -> None:
        assert head.request is not None
        session = s.ServerSession(cert.common_name, heartbeat_interval_s=self.heartbeat_interval_s)
        try:
            refusal = await self._revocation_refusal(cert)
            if refusal is not None:
                raise UpgradeRefused(*refusal)
            if where is Route.LINK:
                session.upgrade(head.request.target.decode("latin-1"), head.request.headers)
                agentport.check_upgrade(head)
        except UpgradeRefused as exc:
            stage = "upgrade" if exc.status == 400 else "identity"
            log.warning("agent_refused", address=address, stage=stage, cn=cert.common_name, reason=str(exc))
            self.stats.abort(LISTENER, "refused")
            await agentport.answer(stream, head, exc.status, str(exc), timeout_s=REFUSAL_SEND_S)
            return
        if where is Route.MIRROR:
            await artifacts.serve(
                stream, head.conn, head.request, self.artifacts, cert.common_name, send_timeout_s=self.send_timeout_s
            )
            return
        async with trio.open_nursery() as nursery:
            # trio-websocket reads the connection in a task of this nursery; it ends with the
            # connection, whichever way.
            try:
                with trio.fail_after(HELLO_TIMEOUT_S):
                    ws = await agentport.accept_link(nursery, stream, head)
                await self._run_link(ws, session, cert, address)
            finally:
                nursery.cancel_scope.cancel()

    async def _revocation_refusal(self, cert: CertInfo) -> tuple[int, str] | None:
        try:
            revoked = await self.store.is_revoked(cert.serial)
        except StoreError as exc:
            # Fail closed: a certificate not known to be valid does not get in.
            return 503, (
                f"the control plane's database is busy or failing, so the revocation of certificate {cert.serial:x} "
                f"cannot be checked; this connection is refused and the agent retries by itself ({exc})"
            )
        if revoked:
            return 403, (
                f"the certificate of node {cert.common_name!r} (serial {cert.serial:x}) was revoked by "
                "`llmgw node remove`; add the node again with `llmgw node add USER@HOST --reissue` to issue a new one"
            )
        return None

    async def _run_link(
        self, ws: trio_websocket.WebSocketConnection, session: s.ServerSession, cert: CertInfo, address: str
    ) -> None:
        node_id = cert.common_name
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                received = session.receive(await ws.get_message())
        except trio.TooSlowError:
            await _close_with(ws, session, w.BAD_MESSAGE, f"no hello within {HELLO_TIMEOUT_S:g} s")
            return
        except WireError as exc:
            log.warning("agent_refused", address=address, stage="hello", cn=node_id, reason=str(exc))
            await _close_with(ws, session, exc.code, str(exc))
            return
        if isinstance(received.event, s.Closed):
            log.warning("agent_reported_error", node=node_id, code=received.event.code, reason=received.event.message)
            return
        assert isinstance(received.event, s.Joined)
        hello = received.event.hello

        known = self.registry.nodes.get(node_id)
        try:
            row = await self.store.saw_node(node_id, address)
            cordoned, draining = row.cordoned, row.draining
        except StoreError as exc:
            # Best effort: last_seen and the address are for the operator; the link does not need them.
            log.warning("node_not_recorded", node=node_id, address=address, reason=str(exc))
            cordoned, draining = (known.cordoned, known.draining) if known is not None else (False, False)
        self.registry.know(node_id, address=address, cordoned=cordoned, draining=draining)
        now = self.registry.clock.now()
        not_after = cert.not_after.timestamp()
        conn_id = self.registry.connect(
            hello, address=address, cert_serial=cert.serial, cert_not_after=not_after, now=now
        )
        log.info(
            "agent_connected",
            node=node_id,
            address=address,
            agent_version=hello.agent_version,
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(hello.started_at)),
        )
        with trio.CancelScope() as scope:
            old = self.links.get(node_id)
            link = Link(node_id=node_id, conn_id=conn_id, ws=ws, session=session, cancel_scope=scope)
            self.links[node_id] = link
            if old is not None:
                old.cancel_scope.cancel()  # a node has one link; the newest wins
            self.on_change()
            try:
                # A certificate is good until its notAfter, not until the link happens to close.
                with trio.move_on_at(trio.current_time() + (not_after - time.time())) as expiry:
                    for frame in received.send:  # the Welcome
                        await _send(ws, frame)
                    if session.can_send(w.DesiredState):  # not if a push was first, or the link closed
                        await _send(ws, session.send(self.desired_state(node_id)))
                    await self._receive_loop(link)
                if expiry.cancelled_caught:
                    message = (
                        f"the certificate of node {node_id!r} (serial {cert.serial:x}) expired at "
                        f"{cert.not_after:%Y-%m-%d %H:%M:%S} UTC; renew it with `llmgw node add USER@HOST --reissue`"
                    )
                    log.warning("agent_certificate_expired", node=node_id, serial=f"{cert.serial:x}")
                    await _close_with(ws, session, w.CERT_EXPIRED, message)
            finally:
                self.registry.disconnect(node_id, conn_id)
                if self.links.get(node_id) is link:
                    del self.links[node_id]
                self.on_change()

    async def _receive_loop(self, link: Link) -> None:
        # Silence is counted in liveness time, as the registry counts it: the timer that fires
        # when the loop resumes from a stall reads the clock, which credits the stall, and waits
        # on (the agent's heartbeats are in the socket buffer, read next).
        clock = self.registry.clock
        timeout = self.silence_timeout_s or math.inf
        heard = clock.now()
        while True:
            with trio.move_on_at(clock.loop_time(heard + timeout)) as silence:
                text = await link.ws.get_message()  # cancel-safe: a message not taken stays queued
            if silence.cancelled_caught and clock.now() - heard < timeout:
                continue  # a stall moved the deadline
            if silence.cancelled_caught:
                reason = f"nothing received for {self.silence_timeout_s:g} s (heartbeats stopped); closing the link"
                log.warning("agent_link_silent", node=link.node_id, after_s=self.silence_timeout_s)
                await _close_with(link.ws, link.session, w.SILENT, reason)
                return
            heard = clock.now()
            try:
                received = link.session.receive(text)
            except WireError as exc:
                log.warning("agent_bad_message", node=link.node_id, code=exc.code, reason=str(exc))
                await _close_with(link.ws, link.session, exc.code, str(exc))
                return
            for frame in received.send:
                await _send(link.ws, frame)
            event = received.event
            if isinstance(event, s.Closed):
                log.warning("agent_reported_error", node=link.node_id, code=event.code, reason=event.message)
                return
            await self._on_event(link, event)

    async def _on_event(self, link: Link, event: s.Event) -> None:
        """What the control plane does with what an agent reports."""
        if isinstance(event, s.HeartbeatReceived):
            self.registry.heartbeat(link.node_id, link.conn_id, self.registry.clock.now())
            self.on_change()
        elif isinstance(event, s.InventoryReported):
            self.registry.inventory_changed(link.node_id, link.conn_id, event.inventory)
            self.on_change()
            await self.push_desired_state(link.node_id)  # e.g. a GPU appeared: vLLM is now wanted
        elif isinstance(event, s.LogsAnswered):
            waiter = self._log_waiters.get(event.reply.request_id)
            if waiter is not None:
                waiter.append(event.reply)
                self._log_event.set()
        elif isinstance(event, s.ReplicasReported):
            if self.registry.replicas_changed(link.node_id, link.conn_id, event.replicas):
                self.on_replicas(link.node_id, event.replicas)
                self.on_change()
        elif isinstance(event, s.EnginesReported):
            if self.registry.engines_changed(link.node_id, link.conn_id, event.engines):
                log.info(  # once per phase of an install, not once per progress report
                    "node_engines",
                    node=link.node_id,
                    engines=[f"{e.name}={e.version}" + _engine_mark(e) for e in event.engines],
                )
            self.on_change()

    async def push_desired_state(self, node_id: str) -> None:
        link = self.links.get(node_id)
        if link is not None and link.session.can_send(w.DesiredState):
            try:
                await _send(link.ws, link.session.send(self.desired_state(node_id)))
            except trio_websocket.ConnectionClosed:
                pass
            except trio.TooSlowError:
                # It does not read what we send: a link in name only. Its agent reconnects.
                log.warning("agent_link_not_reading", node=node_id, after_s=SEND_TIMEOUT_S)
                link.cancel_scope.cancel()

    async def request_logs(self, node_id: str, replica_id: str, lines: int, timeout_s: float = 10.0) -> w.LogsReply:
        """Ask a node's agent for the tail of a replica's log; the reply, or one saying why not."""
        self._next_request += 1
        rid = self._next_request
        link = self.links.get(node_id)
        if link is None or not link.session.can_send(w.LogsRequest):
            return w.LogsReply(request_id=rid, replica_id=replica_id, error=f"node {node_id} is not connected")
        box: list[w.LogsReply] = []
        self._log_waiters[rid] = box
        try:
            with trio.move_on_after(timeout_s):
                request = w.LogsRequest(request_id=rid, replica_id=replica_id, lines=lines)
                await _send(link.ws, link.session.send(request))
                while not box:
                    event = self._log_event
                    await event.wait()
                    if event is self._log_event:
                        self._log_event = trio.Event()
        except (trio_websocket.ConnectionClosed, trio.TooSlowError):
            pass  # the answer says it did not reply
        finally:
            self._log_waiters.pop(rid, None)
        return (
            box[0]
            if box
            else w.LogsReply(
                request_id=rid, replica_id=replica_id, error=f"node {node_id} did not answer within {timeout_s:g} s"
            )
        )

    async def close_node(self, node_id: str, code: str, message: str) -> bool:
        """End a node's open link, telling the agent why; False if it had none."""
        link = self.links.pop(node_id, None)
        if link is None:
            return False
        with trio.move_on_after(1):  # tell it why; a hung agent is not waited for
            await _close_with(link.ws, link.session, code, message)
        link.cancel_scope.cancel()
        return True


class _Place:
    """Which of the endpoint's budgets one connection counts in: the unproven one from its
    accept; the agents' once it has shown a client certificate; neither once it fetches a
    release file (bounded by releases.MAX_DOWNLOADS)."""

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint
        self.unproven = True
        self.agent = False
        endpoint.stats.unproven.inc(listener=LISTENER)

    def leave_unproven(self) -> None:
        if self.unproven:
            self.unproven = False
            self.endpoint.unproven.leave()
            self.endpoint.stats.unproven.inc(-1, listener=LISTENER)

    def enter_agents(self) -> bool:
        """Take a place in the agents' budget; False when all are taken."""
        if self.endpoint.agents_open >= self.endpoint.agent_cap:
            return False
        self.endpoint.agents_open += 1
        self.agent = True
        return True

    def leave(self) -> None:
        self.leave_unproven()
        if self.agent:
            self.agent = False
            self.endpoint.agents_open -= 1


async def _send(ws: trio_websocket.WebSocketConnection, frame: str) -> None:
    """One frame to the agent; `TooSlowError` if it is not taken within SEND_TIMEOUT_S."""
    with trio.fail_after(SEND_TIMEOUT_S):
        await ws.send_message(frame)


async def _close_with(
    ws: trio_websocket.WebSocketConnection, session: s.ServerSession, code: str, message: str
) -> None:
    """Tell the agent why (once), then close; bounded, since the agent may be the reason."""
    frame = session.close(code, message)
    with trio.move_on_after(REFUSAL_SEND_S):
        try:
            if frame is not None:
                await ws.send_message(frame)
            await ws.aclose(code=1008, reason=code)
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _peer_host(stream: trio.SSLStream) -> str:
    try:
        return stream.transport_stream.socket.getpeername()[0]
    except (OSError, AttributeError):
        return "?"


def _engine_mark(e: w.EngineStatus) -> str:
    if e.state == w.ENGINE_INSTALLING:
        return f" (installing: {e.phase})"
    return "" if e.ok else " (failed)"
