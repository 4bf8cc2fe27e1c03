"""The agent's side of the link: dial the control plane, prove who we are, stay connected.

One session: TCP, then the TLS handshake with the node certificate (done first and on its own,
so a refused certificate is an immediate, clear error and not a WebSocket timeout), then the
WebSocket upgrade naming our node id, `Hello`, and heartbeats until the link breaks. Every rule
of the link (what may be sent and received when, the Welcome's checks, which report replaces
which while the control plane reads slowly) is `llmgw.wire.session.AgentSession`'s; this module
moves its frames. One writer (`llmgw.linkio.Writer`) writes whatever the heartbeat, the
replica reports, the inventory and the engine tasks queue (`send`, which never waits on the
control plane); the receive loop gives every frame to the session and acts on its events.

Between sessions the agent waits with exponential backoff and full jitter, and keeps its work:
nothing here stops replicas. Every failure is logged once per attempt with the reason in the
operator's terms and the fix (`llmgw.linkfailure`).

Several control planes (agent.toml's `server` a list, when they share a PostgreSQL store): each
attempt dials the next in turn (`linkio.Targets`). A standby answers the hello with where the
leader is (`Redirect`), which is dialled next at once; a standby that knows no leader (a
takeover under way) counts as a failure. The backoff applies between rounds of every control
plane, not between dials: during a takeover the next one may lead already. A control plane that says
nothing for SILENT_HEARTBEATS of its heartbeat intervals (stopped, paused, cut off while its
kernel still takes our frames) is as good as gone: the agent dials the next one (with one
control plane there is no next: it waits on the link, as before there were several).
"""

from __future__ import annotations

import math
import random
import ssl
import time
from collections.abc import Awaitable, Callable

import attrs
import trio
import trio_websocket

from agent.node_address import NodeAddress, local_host
from llmgw.backoff import Backoff, Failures
from llmgw.errors import find
from llmgw.linkfailure import Redirected, SessionRefused, reason_of
from llmgw.linkio import LinkStream, Target, Targets, Writer
from llmgw.log import get_logger
from llmgw.pki.tls import send_tls_alert
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire.errors import WireError

log = get_logger("llmgw.agent.link")

CONNECT_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0  # one frame written to the control plane; past it the link is as good as down
GOODBYE_S = 1.0  # our LinkError to a control plane we refuse, before we hang up
SILENT_HEARTBEATS = 5  # the control plane's heartbeats missed in a row before the link is dialled again
MIN_SILENCE_S = 5.0  # ... and never less than this
# Redirects followed in a row at once; past it a redirect counts as a failure and waits its backoff
# (two standbys that each name the other, while the lease they read is stale).
MAX_REDIRECTS = 3


# Between sessions: 0.5 s doubling to 30 s, with full jitter, so that many agents refused together
# (a control-plane restart) do not return together; a session that was up starts it again.
LINK_BACKOFF = Backoff(first_s=0.5, max_s=30.0, jitter=True)


@attrs.define(kw_only=True)
class LinkState:
    """What the rest of the agent can read about the link."""

    connected: bool = False
    attempts: int = 0
    last_error: str = ""
    desired: w.DesiredState | None = None
    sessions: int = 0
    server_version: str = ""  # the control plane's llmgw, as its last Welcome said
    heartbeat_interval_s: float = 0.0  # what the control plane last told this link to heartbeat at


class AgentLink:
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
        self.dial = dial or (lambda target: self._dial())
        self.targets = target if isinstance(target, Targets) else Targets([target])
        self.target = self.targets.current  # the one dialled last
        self.source_address = source_address
        self.address = address if address is not None else NodeAddress()
        self.node_id = node_id
        self.ssl_context = ssl_context
        self.make_hello = make_hello
        self.backoff = backoff or LINK_BACKOFF
        self.rng = rng or random.Random()
        self.state = LinkState()
        self._desired_changed = Wakeup()
        self._writer: Writer | None = None  # the current session's, once welcomed
        # Set by the agent: answers the control plane's request for a replica's log tail.
        self.answer_logs: Callable[[w.LogsRequest], w.LogsReply] = lambda req: w.LogsReply(
            request_id=req.request_id, replica_id=req.replica_id, error="this agent keeps no replica logs"
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a session open forever, reconnecting with backoff; never returns."""
        task_status.started()
        failures = Failures(self.backoff)
        redirects = 0  # followed in a row, at once
        tried = 0  # control planes tried in this round without a session
        while True:
            self.target = self.targets.next()
            self.state.attempts += 1
            sessions_before = self.state.sessions
            moved: Redirected | None = None
            try:
                await self.run_session()
                reason = "the control plane closed the link"
            except Exception as exc:  # noqa: BLE001 - the link must outlive any one failure
                reason = self.reason_of(exc)
                moved = find(exc, Redirected)
            except BaseException as exc:
                if find(exc, trio.Cancelled) is not None:
                    # Cancelled while the session also failed (a refusal arriving as the agent
                    # stops): being cancelled wins, not the failure beside it.
                    await trio.lowlevel.checkpoint()
                raise
            was_up = self.state.sessions > sessions_before
            if was_up:
                failures.reset()  # the link was up: a control-plane restart gets a prompt reconnect
                redirects = tried = 0
            self.state.connected = False
            self.state.last_error = reason
            if moved is not None and moved.leader and redirects < MAX_REDIRECTS and self.targets.lead_to(moved.leader):
                redirects += 1
                log.info("link_redirected", server=str(self.target), leader=moved.leader)
                continue  # the leader, now
            redirects = 0
            tried += 1
            if not was_up and tried < len(self.targets.configured):
                # The backoff grows by rounds of every control plane, not by dials: during a
                # takeover the next in turn may be the new leader already.
                log.warning("link_down", server=str(self.target), reason=reason, next=str(self.targets.peek()))
                continue
            tried = 0
            failures.failed(trio.current_time())
            delay = failures.delay(self.rng)
            log.warning("link_down", server=str(self.target), reason=reason, retry_in_s=round(delay, 2))
            await trio.sleep(delay)

    def reason_of(self, exc: BaseException) -> str:
        return reason_of(exc, str(self.target), connect_timeout_s=CONNECT_TIMEOUT_S)

    async def run_session(self) -> None:
        """One session: dial the control plane (TCP, TLS), then `run_on` that stream."""
        await self.run_on(await self.dial(self.target))

    async def _dial(self) -> trio.SSLStream:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            tcp = await trio.open_tcp_stream(
                self.target.host, self.target.port, local_address=self.source_address or None
            )
            self.address.set(local_host(tcp.socket))
            tls = trio.SSLStream(tcp, self.ssl_context, server_hostname=self.target.host, https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError:
                await send_tls_alert(tls)  # tells the server why we hung up (e.g. its cert)
                raise
            except BaseException:
                await trio.aclose_forcefully(tls)
                raise
        return tls

    async def run_on(self, connected: trio.abc.Stream) -> None:
        """One session on a stream connected to the control plane (`run_session`'s TLS stream;
        a memory stream in tests): the upgrade, the hello, then frames until the link ends."""
        stream = LinkStream(connected, eof="the control plane closed the connection during the upgrade")
        said: list[w.Hello] = []

        def hello() -> w.Hello:
            said.append(self.make_hello())
            return said[-1]

        session = s.AgentSession(self.node_id, hello)
        path, headers = session.upgrade_request()
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(CONNECT_TIMEOUT_S), trio.CancelScope() as upgrade:
                    stream.on_failure = upgrade.cancel  # a refusal read by trio-websocket's reader (linkio)
                    ws = await trio_websocket.wrap_client_stream(
                        nursery, stream, self.target.host, path, extra_headers=headers
                    )
                if upgrade.cancelled_caught:
                    raise stream.failure
                stream.on_failure = None
                try:
                    await self._converse(ws, session, said)
                finally:
                    with trio.move_on_after(1) as cleanup:
                        cleanup.shield = True
                        await ws.aclose()
                nursery.cancel_scope.cancel()
        finally:
            self.state.connected = False
            self._writer = None
            await trio.aclose_forcefully(connected)  # not left to the garbage collector

    async def _converse(
        self, ws: trio_websocket.WebSocketConnection, session: s.AgentSession, said: list[w.Hello]
    ) -> None:
        writer = Writer(session, send_timeout_s=SEND_TIMEOUT_S)
        async with trio.open_nursery() as nursery:
            session.start()
            await nursery.start(self._write, writer, ws)  # the hello is written
            welcomed = await self._receive(ws, writer, CONNECT_TIMEOUT_S)
            assert isinstance(welcomed, s.WelcomeReceived)  # the session refuses anything else first
            welcome = welcomed.welcome
            self.state.connected = True
            self.state.sessions += 1
            self.state.server_version = welcome.server_version
            self._writer = writer
            # What changed between the hello and the welcome, `send` refused (no session yet):
            # the control plane would hold the hello's view until the next change.
            for message in catch_up(said[-1], self.make_hello()):
                writer.send(message)
            log.info("link_up", server=str(self.target), node=self.node_id, server_version=welcome.server_version)
            beat = _Beat(welcome.heartbeat_interval_s)
            self.state.heartbeat_interval_s = beat.interval
            nursery.start_soon(self._heartbeats, writer, beat)
            silence_s = self._silence_s(beat.interval)
            while True:
                event = await self._receive(ws, writer, silence_s)
                if isinstance(event, s.ServerHeartbeatReceived):
                    told = event.heartbeat_interval_s
                    if told and told != beat.interval:
                        # The cluster grew or shrank: the control plane spreads its agents' heartbeats.
                        log.info("heartbeat_interval_changed", node=self.node_id, was_s=beat.interval, now_s=told)
                        beat.change(told)
                        self.state.heartbeat_interval_s = told
                        silence_s = self._silence_s(told)
                elif isinstance(event, s.LogsRequested):
                    # Replies are bounded (the session's rule): past it, read nothing until one
                    # is written, which holds the control plane back too.
                    await writer.wait_room(w.LogsReply)
                    writer.send(self.answer_logs(event.request))
                elif isinstance(event, s.DesiredStateReceived):
                    self.state.desired = event.desired
                    self._desired_changed.fire()

    def _silence_s(self, interval_s: float) -> float:
        """How long a control plane may say nothing before the agent leaves it: five of its
        heartbeats (at least 5 s) when there are others to go to. The one control plane there
        is, stopped or stalled, is waited for on its open link (its kernel still takes our
        frames; a path that is cut ends the link at the send deadline): leaving it would gain
        nothing, and cost it the link it finds again when it resumes."""
        if len(self.targets.configured) == 1:
            return math.inf
        return max(SILENT_HEARTBEATS * interval_s, MIN_SILENCE_S)

    async def desired_changed(self) -> None:
        """Return when the next desired state arrives."""
        await self._desired_changed.wait()  # a Wakeup: until the next one arrives

    async def send(self, message: w.AgentMessage) -> bool:
        """Queue `message` on the current session, if one is up; False if not (the next hello
        carries it, or, between a hello and its welcome, the catch-up after the welcome). Never waits on the control plane: an unsent report of the same kind is
        replaced by this one (`llmgw.wire.session`), and the writer's deadline ends a link the
        control plane does not read."""
        await trio.lowlevel.checkpoint()
        writer = self._writer
        return writer is not None and self.state.connected and writer.send(message)

    async def _write(self, writer: Writer, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        try:
            await writer.serve(ws, task_status=task_status)
        except trio.TooSlowError:
            raise SessionRefused(
                f"the control plane took no message for {SEND_TIMEOUT_S:g} s: the link is as good as down"
            ) from None

    async def _receive(self, ws: trio_websocket.WebSocketConnection, writer: Writer, silence_s: float) -> s.Event:
        """The next event; `SessionRefused` when the control plane closes the link, sends what
        the session refuses (it is told why first) or says nothing for `silence_s`; `Redirected`
        when it does not lead."""
        with trio.move_on_after(silence_s) as silent:
            text = await ws.get_message()
        if silent.cancelled_caught:
            raise SessionRefused(
                f"nothing from the control plane for {silence_s:g} s (its heartbeats stopped: paused, or cut off); "
                "dialling again"
            )
        try:
            event = writer.session.receive(text)
        except WireError as exc:
            await writer.close(exc.code, str(exc), timeout_s=GOODBYE_S)
            raise SessionRefused(f"the control plane sent something this agent does not understand: {exc}") from None
        if isinstance(event, s.RedirectReceived):
            raise Redirected(event.leader, event.message)
        if isinstance(event, s.Closed):
            raise SessionRefused(f"the control plane closed the link: {event.message}")
        return event

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
    return out
