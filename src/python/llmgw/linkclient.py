"""The dialling end of a link, once for both links: an agent's (`agent.link`) and a gateway's
(`llmgw.gatewayd.link`) are this runtime with their session and what they do with its events.

One session: TCP, then the TLS handshake with the peer's certificate (done first and on its own,
so a refused certificate is an immediate, clear error and not a WebSocket timeout), then the
WebSocket upgrade the session names (`DialingSession.upgrade_request`), its hello, and frames
until the link breaks. Every rule of the link is the session's (`llmgw.wire.agent_session`,
`llmgw.wire.gateway_session`); this module moves its frames: one writer (`linkio.Writer`)
writes what the session queues, each frame within SEND_TIMEOUT_S, and one receive loop gives
every frame to the session and its event to the adapter (`_on_event`). A control plane's
refusal read by trio-websocket's reader wakes the upgrade (`linkio.LinkStream`).

Between sessions the link waits by its adapter's backoff (full jitter), and keeps the work of
the process it serves. Several control planes (agent.toml's `server` a list, a gateway's
`--server`s, when they share a PostgreSQL store): each attempt dials the next in turn
(`linkio.Targets`); a standby answers the hello with where the leader is (`Redirect`), which is
dialled next at once (at most MAX_REDIRECTS in a row; a standby that knows no leader counts as a
failure); the backoff applies between rounds of every control plane, not between dials: during
a takeover the next one may lead already. A control plane that says nothing for
SILENT_HEARTBEATS of its heartbeat intervals (stopped, paused, cut off while its kernel still
takes our frames) is as good as gone and the link is dialled again (an agent with one control
plane waits on it instead: `wait_on_sole_target`). Every failure is logged with the reason in
the operator's terms and the fix (`llmgw.linkfailure`).

What differs between the links is a few class attributes (the words, the logs, the largest
frame) and the hooks an adapter overrides: `_new_session`, `_up`, `_on_event`, `_heard`,
`_down`, `_connected`.
"""

from __future__ import annotations

import math
import random
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
import trio_websocket

from llmgw.backoff import Backoff, Failures
from llmgw.errors import find
from llmgw.linkfailure import Redirected, SessionRefused, reason_of
from llmgw.linkio import LinkStream, Target, Targets, Writer, readable
from llmgw.log import get_logger
from llmgw.pki.tls import send_tls_alert
from llmgw.pki.tlsdiag import Side
from llmgw.wire.errors import WireError
from llmgw.wire.session import Closed, DialingSession, RedirectReceived

CONNECT_TIMEOUT_S = 10.0  # TCP and TLS together, the upgrade and the Welcome, each
SEND_TIMEOUT_S = 30.0  # one frame written to the control plane; past it the link is as good as down
GOODBYE_S = 1.0  # our LinkError to a control plane we refuse, before we hang up
SILENT_HEARTBEATS = 5  # the control plane's heartbeats missed in a row before the link is dialled again
MIN_SILENCE_S = 5.0  # ... and never less than this
# Redirects followed in a row at once; past it a redirect counts as a failure and waits its backoff
# (two standbys that each name the other, while the lease they read is stale).
MAX_REDIRECTS = 3

ConnectTCP = Callable[[str, int], Awaitable[trio.SocketStream]]
Dial = Callable[[Target], Awaitable[trio.abc.Stream]]


@attrs.define(kw_only=True)
class LinkState:
    """What the rest of the process can read about its link."""

    connected: bool = False
    attempts: int = 0
    sessions: int = 0  # sessions that were welcomed
    last_error: str = ""
    server_version: str = ""  # the control plane's llmgw, as its last Welcome said
    heartbeat_interval_s: float = 0.0  # what the control plane last told this link to heartbeat at


class LinkClient:
    """One process's link to the control plane, kept up forever (`serve`), or one session of it
    (`run_session`, `run_on`). An adapter subclasses it with its session and its events."""

    log = get_logger("llmgw.link")  # the adapter's, so that its events keep their logger's name
    who = "agent"  # who this side is, in the reasons: "agent" or "gateway"
    tls_side: Side = "client"  # whose certificate a TLS failure is about (`llmgw.pki.tlsdiag`)
    log_prefix = ""  # of the link's log events: "link_up", "link_down", "link_redirected"
    # A failure said again with the same reason is logged at debug (a gateway that retries every
    # few seconds while its control plane is away); else each is a warning.
    quiet_repeats = False
    silent_words = "its heartbeats stopped"  # why a silent control plane is left, in the reason
    max_message_size = 1 << 20  # the largest frame taken from the control plane (trio-websocket's default)
    wait_on_sole_target = False  # with one control plane, wait on its silent link rather than dial again

    def __init__(
        self,
        *,
        target: Target | Targets,
        ssl_context: ssl.SSLContext,
        backoff: Backoff,
        rng: random.Random | None = None,
        dial: Dial | None = None,
        connect_tcp: ConnectTCP = trio.open_tcp_stream,
        tcp_timeout_s: float = math.inf,
        tls_name: str = "",
        state: LinkState | None = None,
    ) -> None:
        """`target`: the control plane, or every one (`Targets`) when several share a store.
        `dial(target)`: how a session's stream is opened (default: TCP and TLS; memory streams in
        tests); `connect_tcp`: how the default dial opens TCP, given up after `tcp_timeout_s`.
        `tls_name`: the name the control plane's certificate must cover at the configured
        addresses, if not the host dialled."""
        self.targets = target if isinstance(target, Targets) else Targets([target])
        self.target = self.targets.current  # the one dialled last
        self.ssl_context = ssl_context
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.dial = dial or self._dial
        self.connect_tcp = connect_tcp
        self.tcp_timeout_s = tcp_timeout_s
        self.tls_name = tls_name
        self.state = state or LinkState()
        self.writer: Writer | None = None  # the current session's, once welcomed
        self.silence_s = math.inf  # how long the control plane may say nothing now

    # -- the hooks of an adapter --------------------------------------------------------------

    def _new_session(self) -> DialingSession:
        raise NotImplementedError

    async def _up(self, welcome: Any, writer: Writer, nursery: trio.Nursery) -> None:
        """Welcomed: what the adapter starts (its heartbeats) and says."""

    async def _on_event(self, event: Any, writer: Writer) -> None:
        """Every later event of the session but a Redirect and a LinkError."""

    def _heard(self) -> None:
        """A frame from the control plane was taken."""

    def _down(self, reason: str) -> None:
        """An attempt or a session ended, for `reason`."""

    def _connected(self, tcp: trio.SocketStream) -> None:
        """TCP is up (before TLS): the connection's local address, if the adapter wants it."""

    # -- the link, kept up --------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a session open forever, dialling again with backoff; never returns. Started at
        once: the process does its work meanwhile."""
        task_status.started()
        failures = Failures(self.backoff)
        redirects = 0  # followed in a row, at once
        tried = 0  # control planes tried in this round without a session
        while True:
            self.target = self.targets.next()
            self.state.attempts += 1
            sessions_before = self.state.sessions
            reason, moved = await self._session_ended()
            was_up = self.state.sessions > sessions_before
            if was_up:
                failures.reset()  # the link was up: a control-plane restart gets a prompt reconnect
                redirects = tried = 0
            loud = not self.quiet_repeats or was_up or reason != self.state.last_error
            self.state.connected = False
            self.state.last_error = reason
            self._down(reason)
            if moved is not None and moved.leader and redirects < MAX_REDIRECTS and self.targets.lead_to(moved.leader):
                redirects += 1
                self.log.info(f"{self.log_prefix}link_redirected", server=str(self.target), leader=moved.leader)
                continue  # the leader, now
            redirects = 0
            tried += 1
            if not was_up and tried < len(self.targets.configured):
                # The backoff grows by rounds of every control plane, not by dials: during a
                # takeover the next in turn may be the new leader already.
                (self.log.debug if self.quiet_repeats else self.log.warning)(
                    f"{self.log_prefix}link_down", server=str(self.target), reason=reason, next=str(self.targets.peek())
                )
                continue
            tried = 0
            failures.failed(trio.current_time())
            delay = failures.delay(self.rng)
            (self.log.warning if loud else self.log.debug)(
                f"{self.log_prefix}link_down", server=str(self.target), reason=reason, retry_in_s=round(delay, 2)
            )
            await trio.sleep(delay)

    async def _session_ended(self) -> tuple[str, Redirected | None]:
        """Run one session; why it ended, and where the leader is if a standby said so."""
        try:
            await self.run_session()
        except Exception as exc:  # noqa: BLE001 - the link must outlive any one failure
            return self.reason_of(exc), find(exc, Redirected)
        except BaseException as exc:
            if find(exc, trio.Cancelled) is not None:
                # Cancelled while the session also failed (a refusal arriving as the process
                # stops): being cancelled wins, not the failure beside it.
                await trio.lowlevel.checkpoint()
            raise
        return "the control plane closed the link", None

    def reason_of(self, exc: BaseException) -> str:
        return reason_of(exc, str(self.target), connect_timeout_s=CONNECT_TIMEOUT_S, side=self.tls_side)

    # -- one session --------------------------------------------------------------------------

    async def run_session(self) -> None:
        """One session: dial the control plane (TCP, TLS), then `run_on` that stream."""
        await self.run_on(await self.dial(self.target))

    async def _dial(self, target: Target) -> trio.SSLStream:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            with trio.move_on_after(self.tcp_timeout_s) as connecting:
                tcp = await self.connect_tcp(target.host, target.port)
            if connecting.cancelled_caught:
                raise SessionRefused(
                    f"no answer from {target} within {self.tcp_timeout_s:g} s: check the address, routes "
                    "and firewalls; dialling again"
                )
            self._connected(tcp)
            # `tls_name` is for the configured addresses (the control plane's own gateway workers
            # dial it on loopback); a leader a standby named is checked by the host it is dialled at.
            configured = self.tls_name and target in self.targets.configured
            tls = trio.SSLStream(
                tcp,
                self.ssl_context,
                server_hostname=self.tls_name if configured else target.host,
                https_compatible=True,
            )
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError:
                await send_tls_alert(tls)  # tells the control plane why we hung up (e.g. its certificate)
                raise
            except BaseException:
                await trio.aclose_forcefully(tls)
                raise
        return tls

    async def run_on(self, connected: trio.abc.Stream) -> None:
        """One session on a stream connected to the control plane (`run_session`'s TLS stream; a
        memory stream in tests): the upgrade, the hello, then frames until the link ends."""
        stream = LinkStream(connected, eof="the control plane closed the connection during the upgrade")
        session = self._new_session()
        path, headers = session.upgrade_request()
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(CONNECT_TIMEOUT_S), trio.CancelScope() as upgrade:
                    # A refusal read by trio-websocket's reader would not wake the upgrade (linkio).
                    stream.on_failure = upgrade.cancel
                    ws = await trio_websocket.wrap_client_stream(
                        nursery,
                        stream,
                        self.target.host,
                        path,
                        extra_headers=headers,
                        max_message_size=self.max_message_size,
                    )
                if upgrade.cancelled_caught:
                    raise stream.failure
                stream.on_failure = None
                try:
                    await self._converse(ws, session)
                finally:
                    with trio.move_on_after(1) as cleanup:
                        cleanup.shield = True
                        await ws.aclose()
                nursery.cancel_scope.cancel()
        finally:
            self.state.connected = False
            self.writer = None
            await trio.aclose_forcefully(connected)  # not left to the garbage collector

    async def _converse(self, ws: trio_websocket.WebSocketConnection, session: DialingSession) -> None:
        writer = Writer(session, send_timeout_s=SEND_TIMEOUT_S)
        async with trio.open_nursery() as nursery:
            session.start()
            await nursery.start(self._write, writer, ws)  # the hello is written
            welcome = (await self._receive(ws, writer, CONNECT_TIMEOUT_S)).welcome  # the session allows no other first
            self.state.connected = True
            self.state.sessions += 1
            self.state.server_version = welcome.server_version
            self.state.heartbeat_interval_s = welcome.heartbeat_interval_s
            self.silence_s = self.silence_for(welcome.heartbeat_interval_s)
            self.writer = writer
            await self._up(welcome, writer, nursery)
            while True:
                await self._on_event(await self._receive(ws, writer, self.silence_s), writer)

    def silence_for(self, interval_s: float) -> float:
        """How long a control plane telling `interval_s` may say nothing before it is left: five
        of its heartbeats (at least 5 s). An agent waits on the one control plane there is,
        stopped or stalled, on its open link (its kernel still takes our frames; a path that is
        cut ends the link at the send deadline): leaving it would gain nothing, and cost it the
        link it finds again when it resumes."""
        if self.wait_on_sole_target and len(self.targets.configured) == 1:
            return math.inf
        return max(SILENT_HEARTBEATS * interval_s, MIN_SILENCE_S)

    async def _write(self, writer: Writer, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        try:
            await writer.serve(ws, task_status=task_status)
        except trio.TooSlowError:
            raise SessionRefused(
                f"the control plane took no message for {SEND_TIMEOUT_S:g} s: the link is as good as down"
            ) from None

    async def _receive(self, ws: trio_websocket.WebSocketConnection, writer: Writer, silence_s: float) -> Any:
        """The next event; `SessionRefused` when the control plane closes the link, sends what
        the session refuses (it is told why first) or says nothing for `silence_s`; `Redirected`
        when it does not lead."""
        with trio.move_on_after(silence_s) as silent:
            text = await ws.get_message()
        if silent.cancelled_caught:
            raise SessionRefused(
                f"nothing from the control plane for {silence_s:g} s ({self.silent_words}); dialling again"
            )
        frame = await readable(writer.session, text)  # a long one (a rotation of thousands) read in a thread
        try:
            event = writer.session.receive(frame)
        except WireError as exc:
            await writer.close(exc.code, str(exc), timeout_s=GOODBYE_S)
            raise SessionRefused(
                f"the control plane sent something this {self.who} does not understand: {exc}"
            ) from None
        if isinstance(event, RedirectReceived):
            raise Redirected(event.leader, event.message)
        if isinstance(event, Closed):
            raise SessionRefused(f"the control plane closed the link: {event.message}")
        self._heard()
        return event
