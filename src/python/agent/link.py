"""The agent's side of the link: its adapter on the link runtime both dialling ends share.

`llmgw.linkclient.LinkClient` dials the control plane (TCP, TLS with the node certificate, the
WebSocket upgrade naming our node id), keeps the session up with backoff and full jitter, follows
a standby to the leader and leaves a control plane that falls silent; every rule of the link
(what may be sent and received when, the Welcome's checks, which report replaces which while the
control plane reads slowly) is `llmgw.wire.agent_session.AgentSession`'s. This module is what
the agent does with it: its hello, the reports it catches up after the Welcome, its heartbeats
at the interval the control plane tells, the desired state it keeps, the log tails it answers.
One writer (`llmgw.linkio.Writer`) writes whatever the heartbeat, the replica reports, the
inventory and the engine tasks queue (`send`, which never waits on the control plane).

Nothing here stops replicas: between sessions the agent keeps its work. With several control
planes the agent leaves a silent one after SILENT_HEARTBEATS of its heartbeats; with one, there
is no other to go to, and it waits on that link (`LinkClient.wait_on_sole_target`).
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import trio

from agent.node_address import NodeAddress, local_host
from llmgw.backoff import Backoff
from llmgw.linkclient import LinkClient, LinkState
from llmgw.linkio import Target, Targets, Writer
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s

# Between sessions: 0.5 s doubling to 30 s, with full jitter, so that many agents refused together
# (a control-plane restart) do not return together; a session that was up starts it again.
LINK_BACKOFF = Backoff(first_s=0.5, max_s=30.0, jitter=True)


@attrs.define(kw_only=True)
class AgentLinkState(LinkState):
    """What the rest of the agent can read about the link: the link's, and the desired state."""

    desired: w.DesiredState | None = None


class AgentLink(LinkClient):
    log = get_logger("llmgw.agent.link")
    who, tls_side, log_prefix = "agent", "client", ""
    silent_words = "its heartbeats stopped: paused, or cut off"
    wait_on_sole_target = True

    def __init__(
        self,
        *,
        target: Target | Targets,
        node_id: str,
        ssl_context: ssl.SSLContext,
        make_hello: Callable[[], w.Hello],
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        source_address: str = "",
        address: NodeAddress | None = None,
        dial: Callable[[Target], Awaitable[trio.abc.Stream]] | None = None,
    ) -> None:
        """`target`: the control plane, or every one (`Targets`) when several share a store.
        `address` gets the local address of each connection: where this node's engines listen.
        `dial(target)`: how a session's stream is opened (default: TCP and TLS; memory streams in
        tests)."""
        super().__init__(
            target=target,
            ssl_context=ssl_context,
            backoff=backoff or LINK_BACKOFF,
            rng=rng,
            dial=dial,
            connect_tcp=partial(trio.open_tcp_stream, local_address=source_address or None),
            state=AgentLinkState(),
        )
        self.state: AgentLinkState
        self.source_address = source_address
        self.address = address if address is not None else NodeAddress()
        self.node_id = node_id
        self.make_hello = make_hello
        self._said: w.Hello | None = None  # the current session's hello, once made
        self._beat: _Beat | None = None  # the current session's heartbeat interval
        self._desired_changed = Wakeup()
        # Set by the agent: answers the control plane's request for a replica's log tail.
        self.answer_logs: Callable[[w.LogsRequest], w.LogsReply] = lambda req: w.LogsReply(
            request_id=req.request_id, replica_id=req.replica_id, error="this agent keeps no replica logs"
        )

    def _connected(self, tcp: trio.SocketStream) -> None:
        self.address.set(local_host(tcp.socket))

    def _new_session(self) -> s.AgentSession:
        def hello() -> w.Hello:
            self._said = self.make_hello()
            return self._said

        return s.AgentSession(self.node_id, hello)

    async def _up(self, welcome: w.Welcome, writer: Writer, nursery: trio.Nursery) -> None:
        # What changed between the hello and the welcome, `send` refused (no session yet):
        # the control plane would hold the hello's view until the next change.
        assert self._said is not None
        for message in catch_up(self._said, self.make_hello()):
            writer.send(message)
        self.log.info("link_up", server=str(self.target), node=self.node_id, server_version=welcome.server_version)
        self._beat = _Beat(welcome.heartbeat_interval_s)
        nursery.start_soon(self._heartbeats, writer, self._beat)

    async def _on_event(self, event: s.Event, writer: Writer) -> None:
        if isinstance(event, s.ServerHeartbeatReceived):
            told = event.heartbeat_interval_s
            assert self._beat is not None
            if told and told != self._beat.interval:
                # The cluster grew or shrank: the control plane spreads its agents' heartbeats.
                self.log.info("heartbeat_interval_changed", node=self.node_id, was_s=self._beat.interval, now_s=told)
                self._beat.change(told)
                self.state.heartbeat_interval_s = told
                self.silence_s = self.silence_for(told)
        elif isinstance(event, s.LogsRequested):
            # Replies are bounded (the session's rule): past it, read nothing until one
            # is written, which holds the control plane back too.
            await writer.wait_room(w.LogsReply)
            writer.send(self.answer_logs(event.request))
        elif isinstance(event, s.DesiredStateReceived):
            self.state.desired = event.desired
            self._desired_changed.fire()

    async def desired_changed(self) -> None:
        """Return when the next desired state arrives."""
        await self._desired_changed.wait()  # a Wakeup: until the next one arrives

    async def send(self, message: w.AgentMessage) -> bool:
        """Queue `message` on the current session, if one is up; False if not (the next hello
        carries it, or, between a hello and its welcome, the catch-up after the welcome). Never
        waits on the control plane: an unsent report of the same kind is replaced by this one
        (`llmgw.wire.agent_session`), and the writer's deadline ends a link the control plane
        does not read."""
        await trio.lowlevel.checkpoint()
        writer = self.writer
        return writer is not None and self.state.connected and writer.send(message)

    async def _heartbeats(self, writer: Writer, beat: _Beat) -> None:
        session = writer.session
        assert isinstance(session, s.AgentSession)
        while session.can_send(w.Heartbeat):
            session.heartbeat(time.time())  # one waits at most: a newer replaces it
            writer.wake()
            sent = trio.current_time()
            # Until the interval has passed since this one: a change of it (`_Beat.change`) is
            # counted from this heartbeat, so a shorter one told may make the next due at once.
            while trio.current_time() < sent + beat.interval:
                with trio.CancelScope(deadline=sent + beat.interval) as beat.waiting:
                    await trio.sleep_forever()


class _Beat:
    """The heartbeat interval of one link: the Welcome's, then what the control plane's
    heartbeats tell; `change` wakes the heartbeat loop to wait by the new one."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.waiting: trio.CancelScope | None = None

    def change(self, interval: float) -> None:
        self.interval = interval
        if self.waiting is not None:
            self.waiting.cancel()


def catch_up(said: w.Hello, now: w.Hello) -> list[w.AgentMessage]:
    """The reports that bring a control plane from the hello `said` to the state of `now`: each
    kind that changed, whole (level-triggered, as every report is)."""
    out: list[w.AgentMessage] = []
    if now.inventory != said.inventory:
        out.append(w.InventoryChanged(inventory=now.inventory))
    if now.engines != said.engines:
        out.append(w.EnginesChanged(engines=now.engines))
    if now.replicas != said.replicas:
        out.append(w.ReplicasChanged(replicas=now.replicas))
    if now.weights != said.weights:
        out.append(w.WeightsChanged(weights=now.weights))
    if now.speeds != said.speeds:
        out.append(w.SpeedsChanged(speeds=now.speeds))
    return out
