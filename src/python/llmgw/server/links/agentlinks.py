"""The agent link's end on the control plane: the agents linked, and what the control plane does
with what they say. The link itself (the upgrade judged, the hello within its deadline, the one
writer, the receive loop, silence, expiry, redirecting while not leading) is the link runtime's,
`llmgw.server.links.linkserver`; every rule of the protocol is `llmgw.wire.agent_session.ServerSession`'s.

A hello records the node (the store, best effort; the registry, which numbers the connection);
its first DesiredState is made once it is recorded. Each agent is told a heartbeat interval
stretched by how many agents are linked (`HeartbeatRule`), and may be silent as long as its node
may. `push_desired_state`, `request_logs` and `close_node` queue on its link, never waiting on
the agent; while this control plane does not lead (`leading()`) it pushes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from llmgw import linkio
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo
from llmgw.server.errors import StoreError
from llmgw.server.links.agentfigures import AgentFigures
from llmgw.server.links.heartbeats import HeartbeatRule
from llmgw.server.links.linkserver import LinkServer, ServedLink
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s

log = get_logger("llmgw.endpoint")  # the agent port's logger, whose lines operators filter on

LOGS_TIMEOUT_S = 10.0


@attrs.define(kw_only=True, eq=False)
class LinkedAgent(ServedLink):
    """One agent's link, once its hello was taken."""

    conn_id: int  # the registry's number for this connection of the node
    logs: linkio.Replies = attrs.field(factory=linkio.Replies)  # LogsRequests' callers

    @property
    def node_id(self) -> str:
        return self.cert.common_name  # the session checked the hello's against it

    key = node_id

    @property
    def fields(self) -> dict[str, str]:
        return {"node": self.node_id}

    def push(self) -> None:
        self.session.push()  # type: ignore[attr-defined]
        self.writer.wake()


class AgentLinks(LinkServer[LinkedAgent]):
    log = log
    who, who_field = "agent", "node"

    def __init__(
        self,
        *,
        registry: NodeRegistry,
        store: AsyncStore,
        heartbeat_interval_s: float,
        desired_state: Callable[[str], w.DesiredState],
        on_change: Callable[[], None] = lambda: None,
        on_replicas: Callable[[str, tuple[w.ReplicaStatus, ...]], None] = lambda node, statuses: None,
        on_weights: Callable[[str, w.WeightsHeld], None] = lambda node, held: None,
        silence_timeout_s: float = 0.0,
        heartbeat_max_rate: float = 0.0,
        **link: Any,
    ) -> None:
        """`link`: the runtime's (`leading`, `redirect`); the clock is the registry's."""
        super().__init__(
            clock=registry.clock, heartbeat_interval_s=heartbeat_interval_s, silence_timeout_s=silence_timeout_s, **link
        )
        self.registry = registry
        self.store = store
        # The interval each agent is told, stretched as agents link (0: no stretching).
        self.heartbeats = HeartbeatRule(
            interval_s=heartbeat_interval_s, ttl_s=registry.ttl, max_rate=heartbeat_max_rate
        )
        self.desired_state = desired_state
        self.on_change = on_change
        self.on_replicas = on_replicas
        self.on_weights = on_weights
        self.figures = AgentFigures()

    def render_metrics(self) -> str:
        """The link's families for /metrics: heartbeat delays, the interval told, links up, nodes
        by state (a standby knows none)."""
        interval = self.heartbeats.interval(len(self.links))
        return self.figures.render(links=len(self.links), interval_s=interval, registry=self.registry)

    async def mirror_changed(self) -> None:
        if not self.leading():
            return
        for link in list(self.links.values()):
            link.push()  # an archive came or went: `mirrored` changed

    # -- the link runtime's hooks -----------------------------------------------------------------

    def _session(self, cert: CertInfo, *, standby=None) -> s.ServerSession:
        # A standby's answers the hello with a Redirect: it tells no interval and makes no state.
        interval = self.heartbeats.interval(len(self.links) + 1)  # this one's too
        return s.ServerSession(
            cert.common_name,
            heartbeat_interval_s=self.heartbeat_interval_s if standby else interval,
            desired_state=partial(self.desired_state, cert.common_name),
            standby=standby,
        )

    async def _joined(
        self, event: s.Joined, session: s.ServerSession, writer: linkio.Writer, cert: CertInfo, address: str
    ) -> LinkedAgent:
        """The node is connected: in the store (best effort) and the registry."""
        hello, node_id = event.hello, cert.common_name
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
        told = session.heartbeat_interval_s
        self.registry.told(node_id, conn_id, self.heartbeats.ttl(told))
        return LinkedAgent(conn_id=conn_id, session=session, writer=writer, cert=cert, address=address, interval_s=told)

    def _expired(self, link: LinkedAgent) -> str:
        cert = link.cert
        return (
            f"the certificate of node {link.node_id!r} (serial {cert.serial:x}) expired at "
            f"{cert.not_after:%Y-%m-%d %H:%M:%S} UTC; renew it with `llmgw node add USER@HOST --reissue`"
        )

    def _beat(self, link: LinkedAgent) -> None:
        # Each heartbeat tells the agent the interval to keep, stretched by how many agents are
        # linked now; a longer one gives its node a longer time to live at once.
        interval = self.heartbeats.interval(len(self.links))
        if interval != link.interval_s:
            link.interval_s = interval
            self.registry.told(link.node_id, link.conn_id, self.heartbeats.ttl(interval))
        link.session.heartbeat(interval)  # type: ignore[attr-defined]

    def _silence_s(self, link: LinkedAgent) -> float:
        # As long as its node may be silent before it is lost: longer when its agent was told a
        # stretched interval (the configured silence at the configured interval).
        timeout = self.silence_timeout_s or math.inf
        return timeout * self.registry.ttl_of(link.node_id, link.conn_id) / self.registry.ttl

    def _published(self, link: LinkedAgent) -> None:
        self.on_change()

    def _removed(self, link: LinkedAgent, published: bool) -> None:
        self.registry.disconnect(link.node_id, link.conn_id)
        link.logs.end()
        self.on_change()

    def _on_event(self, link: LinkedAgent, event: s.Event) -> None:
        """What the control plane does with what an agent reports."""
        if isinstance(event, s.HeartbeatReceived):
            # A joined node's heartbeat changes nothing to place or show: with thousands of
            # nodes, a reconcile pass per heartbeat was most of the control plane's CPU.
            if self.registry.heartbeat(link.node_id, link.conn_id, self.registry.clock.now()):
                self.on_change()
            if event.sent_at > 0:  # an agent of this release: it says when it sent it
                self.figures.heartbeat_counted(event.sent_at)
        elif isinstance(event, s.InventoryReported):
            self.registry.inventory_changed(link.node_id, link.conn_id, event.inventory)
            self.on_change()
            link.push()  # e.g. a GPU appeared: vLLM is now wanted
        elif isinstance(event, s.WeightsReported):
            # Placement reads the whole files; a download's progress changes only what is shown.
            if self.registry.weights_changed(link.node_id, link.conn_id, event.weights):
                self.on_weights(link.node_id, event.weights)
                self.on_change()
        elif isinstance(event, s.LogsAnswered):
            link.logs.give(event.reply.request_id, event.reply)
        elif isinstance(event, s.ReplicasReported):
            if self.registry.replicas_changed(link.node_id, link.conn_id, event.replicas):
                self.on_replicas(link.node_id, event.replicas)
                self.on_change()
        elif isinstance(event, s.SpeedsReported):
            # Placement reads the figures; a measurement starting or waiting changes what is shown.
            if self.registry.speeds_changed(link.node_id, link.conn_id, event.speeds):
                log.info(
                    "node_speeds",
                    node=link.node_id,
                    speeds=[f"{x.engine}/{x.backend}={x.gen_tps:g}" for x in event.speeds if x.gen_tps > 0],
                )
            self.on_change()
        elif isinstance(event, s.EnginesReported):
            if self.registry.engines_changed(link.node_id, link.conn_id, event.engines):
                log.info(  # once per phase of an install, not once per progress report
                    "node_engines",
                    node=link.node_id,
                    engines=[f"{e.name}={e.version}" + _engine_mark(e) for e in event.engines],
                )
            self.on_change()

    # -- what the rest of the control plane asks ----------------------------------------------

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
        session: s.ServerSession | None = link.session if link is not None else None  # type: ignore[assignment]
        rid = session.request_logs(replica_id, lines) if session is not None else None
        if link is None or rid is None:
            why = (
                "is not connected" if session is None or not session.joined else "has too many log requests unanswered"
            )
            return w.LogsReply(request_id=0, replica_id=replica_id, error=f"node {node_id} {why}; ask again later")
        link.writer.wake()
        reply = await link.logs.wait(rid, timeout_s)
        if reply is None:
            why = "'s link closed before it answered" if link.logs.ended else f" did not answer within {timeout_s:g} s"
            reply = w.LogsReply(request_id=rid, replica_id=replica_id, error=f"node {node_id}{why}")
        return reply

    async def close_node(self, node_id: str, code: str, message: str) -> bool:
        """End a node's open link, telling the agent why; False if it had none."""
        link = self.links.pop(node_id, None)
        if link is None:
            return False
        await self.close(link, code, message)
        return True


def _engine_mark(e: w.EngineStatus) -> str:
    installing = e.state == w.ENGINE_INSTALLING
    return f" (installing: {e.phase})" if installing else "" if e.ok else " (failed)"
