"""The agent link's adapter on the control plane: it moves frames between trio-websocket and
`llmgw.wire.session.ServerSession`, keeps the link's deadlines and acts on the session's events.
Every rule of the link is the session's; around them, this module does the I/O:

1. `link`: `ServerSession.upgrade` judges the request and the store's word on the certificate;
   refused, it is answered in plain HTTP saying why, accepted, with an `Upgrade` (`_serve_link`).
2. The WebSocket is accepted, its first frame given to the session within HELLO_TIMEOUT_S. A
   `Joined` records the node (store, registry); then the link's one writer (`linkio.Writer`)
   writes the Welcome and first DesiredState the session queued, and once the Welcome is out
   the link is published in `links`.
3. `_receive_loop` gives every later frame to the session and acts on its events; a
   ServerHeartbeat goes every heartbeat interval (`_heartbeats`). A link silent past the
   heartbeat TTL (in the registry's stall-aware clock), one whose certificate expires and one
   whose agent takes no frame within SEND_TIMEOUT_S are closed.
4. While this control plane does not lead (`leading()`: its term is over), it pushes nothing
   and a new link is answered with where the leader is (`AgentListener.answer_standby`).

Only the writer writes: `push_desired_state`, `request_logs`, `close_node`, the heartbeats and
the receive loop queue. The connections (budgets, TLS, HTTP, routes) are `AgentListener`'s, which this extends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio
import trio_websocket

from llmgw import linkio
from llmgw.http.messages import Request, Upgrade
from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry
from llmgw.pki.ca import CertInfo
from llmgw.server import agentport
from llmgw.server.agentlistener import HELLO_TIMEOUT_S, REFUSAL_SEND_S, AgentListener
from llmgw.server.errors import StoreError
from llmgw.server.heartbeats import HeartbeatRule
from llmgw.server.registry import NodeRegistry
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire.errors import UpgradeRefused, WireError

log = get_logger("llmgw.endpoint")

__all__ = ["HELLO_TIMEOUT_S", "SEND_TIMEOUT_S", "AgentEndpoint", "Link"]

# A frame to an agent must be taken within this; an agent that stops reading is cut off (its
# link is closed), and until then what waits for it is bounded by its session's outbox.
SEND_TIMEOUT_S = 10.0
LOGS_TIMEOUT_S = 10.0
# From a millisecond (a quiet control plane on one machine) to the 20 s a swamped one would take.
HEARTBEAT_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)


@attrs.define(kw_only=True, eq=False)
class Link:
    node_id: str
    conn_id: int
    session: s.ServerSession
    writer: linkio.Writer
    cancel_scope: trio.CancelScope
    interval_s: float  # the heartbeat interval its agent was told last (`llmgw.server.heartbeats`)
    logs: linkio.Replies = attrs.field(factory=linkio.Replies)  # LogsRequests' callers

    def push(self) -> None:
        self.session.push()
        self.writer.wake()


class AgentEndpoint(AgentListener):
    def __init__(
        self,
        *,
        registry: NodeRegistry,
        heartbeat_interval_s: float,
        desired_state: Callable[[str], w.DesiredState],
        on_change: Callable[[], None] = lambda: None,
        on_replicas: Callable[[str, tuple[w.ReplicaStatus, ...]], None] = lambda node, statuses: None,
        silence_timeout_s: float = 0.0,
        heartbeat_max_rate: float = 0.0,
        leading: Callable[[], bool] = lambda: True,
        redirect: Callable[[], w.Redirect] | None = None,
        **listener: Any,
    ) -> None:
        """`listener`: the connections' (`AgentListener`: store, artifact_store, release_files, stats, ...).
        `leading()`: whether this control plane leads now (its term's); while it does not, no
        desired state is pushed and a new link is answered with `redirect()` (where the leader is)."""
        super().__init__(**listener)
        self.leading = leading
        self.redirect = redirect or (lambda: w.Redirect(leader="", message="this control plane does not lead"))
        self.registry = registry
        self.heartbeat_interval_s = heartbeat_interval_s
        # The interval each agent is told, stretched as agents link (0: no stretching).
        self.heartbeats = HeartbeatRule(
            interval_s=heartbeat_interval_s, ttl_s=registry.ttl, max_rate=heartbeat_max_rate
        )
        self.desired_state = desired_state
        self.on_change = on_change
        self.on_replicas = on_replicas
        # A link silent this long (no heartbeat, no message) is closed: the agent is gone or cut
        # off, and its connection's resources go back. 0 = never (tests of other things).
        self.silence_timeout_s = silence_timeout_s
        self.links: dict[str, Link] = {}  # node id -> its link, once the Welcome is written
        self.metrics = MetricsRegistry()
        self._delays = self.metrics.histogram(
            "llmgw_agent_heartbeat_delay_seconds",
            "From an agent's sending a heartbeat (its clock) to the registry's counting it (this "
            "control plane's): network, queues, and this process's loop; across machines, also the "
            "difference of their clocks.",
            buckets=HEARTBEAT_DELAY_BUCKETS,
        )
        self._interval = self.metrics.gauge(
            "llmgw_agent_heartbeat_interval_seconds",
            "The heartbeat interval agents are told now, stretched as the cluster grows.",
        )
        self._linked = self.metrics.gauge("llmgw_agent_links", "Agents linked to this control plane now.")
        self._nodes = self.metrics.gauge("llmgw_nodes", "The nodes this control plane knows, by state.", ("state",))

    def render_metrics(self) -> str:
        """The link's families for /metrics: heartbeat delays, the interval told, links up, nodes
        by state (a standby knows none)."""
        self._interval.set(self.heartbeats.interval(len(self.links)))
        self._linked.set(len(self.links))
        for state, count in self.registry.counts(self.registry.clock.now()).items():
            self._nodes.set(count, state=state)
        return self.metrics.render()

    async def mirror_changed(self) -> None:
        if not self.leading():
            return
        for link in list(self.links.values()):
            link.push()  # an archive came or went: `mirrored` changed

    async def link(self, request: Request, cert: CertInfo, address: str) -> Upgrade:
        """The link's request: the session judges it with the store's word on the certificate
        (a refusal is answered in plain HTTP, saying why); accepted, the connection is handed
        to the WebSocket (`_serve_link`)."""
        node_id = cert.common_name
        if not self.leading():
            standby = s.ServerSession(
                node_id, heartbeat_interval_s=self.heartbeat_interval_s, desired_state=_none, standby=self.redirect
            )
            return await self.answer_standby(standby, request, cert, address)
        session = s.ServerSession(
            node_id,
            heartbeat_interval_s=self.heartbeats.interval(len(self.links) + 1),  # this one's too
            desired_state=partial(self.desired_state, node_id),
        )
        try:
            session.upgrade(agentport.upgrade_request(request), await self.standing(cert))
        except UpgradeRefused as exc:
            raise self.refuse(cert, address, exc) from None
        return self.upgrade(partial(self._serve_link, session, cert, address), cert, address)

    async def _serve_link(
        self, session: s.ServerSession, cert: CertInfo, address: str, stream: trio.abc.Stream, prefix: bytes
    ) -> None:
        async with trio.open_nursery() as nursery:  # trio-websocket's reader, which ends with the link
            with trio.fail_after(HELLO_TIMEOUT_S):
                ws = await agentport.accept_link(nursery, stream, prefix)
            await self._run_link(ws, session, cert, address)
            nursery.cancel_scope.cancel()

    async def _run_link(
        self, ws: trio_websocket.WebSocketConnection, session: s.ServerSession, cert: CertInfo, address: str
    ) -> None:
        node_id = cert.common_name
        writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                event = session.receive(await ws.get_message())
        except trio.TooSlowError:
            why = f"no hello within {HELLO_TIMEOUT_S:g} s"
            await writer.close(w.BAD_MESSAGE, why, timeout_s=REFUSAL_SEND_S, ws=ws)  # not started yet: `ws`
            return
        except WireError as exc:
            self.log_refusal("warning", "agent_refused", address, "hello", stage="hello", cn=node_id, reason=str(exc))
            await writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S, ws=ws)
            return
        if isinstance(event, s.Closed):
            log.warning("agent_reported_error", node=node_id, code=event.code, reason=event.message)
            return
        assert isinstance(event, s.Joined)
        conn_id = await self._record(event.hello, cert, address)
        told = session.heartbeat_interval_s
        self.registry.told(node_id, conn_id, self.heartbeats.ttl(told))
        with trio.CancelScope() as scope:
            link = Link(
                node_id=node_id, conn_id=conn_id, session=session, writer=writer, cancel_scope=scope, interval_s=told
            )
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._write, link, ws)  # the Welcome is written: published
                    nursery.start_soon(self._heartbeats, link)
                    # A certificate is good until its notAfter, not until the link happens to close.
                    with trio.move_on_at(trio.current_time() + (cert.not_after.timestamp() - time.time())) as expiry:
                        await self._receive_loop(link, ws)
                    if expiry.cancelled_caught:
                        message = (
                            f"the certificate of node {node_id!r} (serial {cert.serial:x}) expired at "
                            f"{cert.not_after:%Y-%m-%d %H:%M:%S} UTC; renew it with `llmgw node add USER@HOST --reissue`"
                        )
                        log.warning("agent_certificate_expired", node=node_id, serial=f"{cert.serial:x}")
                        await writer.close(w.CERT_EXPIRED, message, timeout_s=REFUSAL_SEND_S)
                    nursery.cancel_scope.cancel()
            finally:
                self.registry.disconnect(node_id, conn_id)
                if self.links.get(node_id) is link:
                    del self.links[node_id]
                link.logs.end()
                self.on_change()

    async def _record(self, hello: w.Hello, cert: CertInfo, address: str) -> int:
        """The node is connected: in the store (best effort) and the registry; its conn id."""
        node_id = cert.common_name
        known = self.registry.nodes.get(node_id)
        try:
            row = await self.store.saw_node(node_id, address)
            cordoned, draining = row.cordoned, row.draining
        except StoreError as exc:
            # Best effort: last_seen and the address are for the operator; the link does not need them.
            log.warning("node_not_recorded", node=node_id, address=address, reason=str(exc))
            cordoned, draining = (known.cordoned, known.draining) if known is not None else (False, False)
        self.registry.know(node_id, address=address, cordoned=cordoned, draining=draining)
        conn_id = self.registry.connect(
            hello,
            address=address,
            cert_serial=cert.serial,
            cert_not_after=cert.not_after.timestamp(),
            now=self.registry.clock.now(),
        )
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(hello.started_at))
        log.info(
            "agent_connected", node=node_id, address=address, agent_version=hello.agent_version, started_at=started
        )
        return conn_id

    async def _write(self, link: Link, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        """The link's one writer; the link is published once its first frame, the Welcome, is out."""
        try:
            await link.writer.serve(ws, on_first=partial(self._publish, link), task_status=task_status)
        except trio.TooSlowError:
            # It does not read what we send: a link in name only. Its agent reconnects.
            log.warning("agent_link_not_reading", node=link.node_id, after_s=SEND_TIMEOUT_S)
            raise

    async def _heartbeats(self, link: Link) -> None:
        """A ServerHeartbeat every heartbeat interval, so that the agent notices a control plane
        that stopped (its kernel would still take the agent's frames) and dials the next; each
        tells the agent the interval to keep, stretched by how many agents are linked now."""
        while True:
            await trio.sleep(link.interval_s)
            interval = self.heartbeats.interval(len(self.links))
            if interval != link.interval_s:
                link.interval_s = interval
                self.registry.told(link.node_id, link.conn_id, self.heartbeats.ttl(interval))
            link.session.heartbeat(interval)
            link.writer.wake()

    def _publish(self, link: Link) -> None:
        old = self.links.get(link.node_id)
        self.links[link.node_id] = link
        if old is not None:
            old.cancel_scope.cancel()  # a node has one link; the newest wins
        self.on_change()

    async def _receive_loop(self, link: Link, ws: trio_websocket.WebSocketConnection) -> None:
        # Silence is counted in liveness time, as the registry counts it: the timer that fires
        # when the loop resumes from a stall reads the clock, which credits the stall, and waits
        # on (the agent's heartbeats are in the socket buffer, read next).
        clock = self.registry.clock
        heard = clock.now()

        def silence_s() -> float:
            # As long as its node may be silent before it is lost: longer when its agent was
            # told a stretched interval (the configured silence at the configured interval).
            timeout = self.silence_timeout_s or math.inf
            return timeout * self.registry.ttl_of(link.node_id, link.conn_id) / self.registry.ttl

        while True:
            timeout = silence_s()
            try:
                with trio.move_on_at(clock.loop_time(heard + timeout)) as silence:
                    text = await ws.get_message()  # cancel-safe: a message not taken stays queued
            except trio_websocket.ConnectionClosed:
                if link.session.goodbye is not None:
                    return  # we closed it (`close_node`), and the agent answered
                raise
            if link.session.goodbye is not None:
                # We are closing it (a node removed, a leader stepping down): what came meanwhile
                # is moot, and our LinkError goes out before the link ends.
                with trio.move_on_after(REFUSAL_SEND_S):
                    await link.writer.finished.wait()
                return
            if silence.cancelled_caught and clock.now() - heard < (timeout := silence_s()):
                # A stall moved the deadline, or the cluster grew meanwhile: its agent was told a
                # longer interval while this waited on the shorter one.
                continue
            if silence.cancelled_caught:
                reason = f"nothing received for {timeout:g} s (heartbeats stopped); closing the link"
                log.warning("agent_link_silent", node=link.node_id, after_s=timeout)
                await link.writer.close(w.SILENT, reason, timeout_s=REFUSAL_SEND_S)
                return
            heard = clock.now()
            try:
                event = link.session.receive(text)
            except WireError as exc:
                log.warning("agent_bad_message", node=link.node_id, code=exc.code, reason=str(exc))
                await link.writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S)
                return
            if isinstance(event, s.Closed):
                log.warning("agent_reported_error", node=link.node_id, code=event.code, reason=event.message)
                return
            self._on_event(link, event)

    def _on_event(self, link: Link, event: s.Event) -> None:
        """What the control plane does with what an agent reports."""
        if isinstance(event, s.HeartbeatReceived):
            # A joined node's heartbeat changes nothing to place or show: with thousands of
            # nodes, a reconcile pass per heartbeat was most of the control plane's CPU.
            if self.registry.heartbeat(link.node_id, link.conn_id, self.registry.clock.now()):
                self.on_change()
            if event.sent_at > 0:  # an agent of this release: it says when it sent it
                self._delays.observe_at((), max(0.0, time.time() - event.sent_at))
        elif isinstance(event, s.InventoryReported):
            self.registry.inventory_changed(link.node_id, link.conn_id, event.inventory)
            self.on_change()
            link.push()  # e.g. a GPU appeared: vLLM is now wanted
        elif isinstance(event, s.LogsAnswered):
            link.logs.give(event.reply.request_id, event.reply)
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
        """The node's desired state changed: its link writes a fresh one next (while this control
        plane leads: one whose term has ended tells its agents nothing more). Never waits."""
        link = self.links.get(node_id)
        if link is not None and self.leading():
            link.push()
        await trio.lowlevel.checkpoint()

    async def request_logs(
        self, node_id: str, replica_id: str, lines: int, timeout_s: float = LOGS_TIMEOUT_S
    ) -> w.LogsReply:
        """Ask a node's agent for the tail of a replica's log; the reply, or one saying why not."""
        link = self.links.get(node_id)
        rid = link.session.request_logs(replica_id, lines) if link is not None else None
        if rid is None:
            why = (
                "is not connected"
                if link is None or not link.session.joined
                else "has too many log requests unanswered"
            )
            return w.LogsReply(request_id=0, replica_id=replica_id, error=f"node {node_id} {why}; ask again later")
        link.writer.wake()
        reply = await link.logs.wait(rid, timeout_s)
        if reply is None:
            why = "'s link closed before it answered" if link.logs.ended else f" did not answer within {timeout_s:g} s"
            reply = w.LogsReply(request_id=rid, replica_id=replica_id, error=f"node {node_id}{why}")
        return reply

    async def close_all(self, code: str, message: str) -> int:
        """End every open link, telling each agent why (a leader stepping down); how many."""
        closing = list(self.links)
        async with trio.open_nursery() as nursery:  # each bounded by REFUSAL_SEND_S, all at once
            for node_id in closing:
                nursery.start_soon(self.close_node, node_id, code, message)
        return len(closing)

    async def close_node(self, node_id: str, code: str, message: str) -> bool:
        """End a node's open link, telling the agent why; False if it had none."""
        link = self.links.pop(node_id, None)
        if link is None:
            return False
        await link.writer.close(code, message, timeout_s=REFUSAL_SEND_S)  # a hung agent is not waited for
        link.cancel_scope.cancel()
        return True


def _none() -> w.DesiredState:
    raise AssertionError("a standby's session makes no desired state")


def _engine_mark(e: w.EngineStatus) -> str:
    installing = e.state == w.ENGINE_INSTALLING
    return f" (installing: {e.phase})" if installing else "" if e.ok else " (failed)"
