"""A gateway's side of the gateway link: dial the control plane, prove who we are, keep the table.

One session: TCP, then the TLS handshake with the gateway's certificate (done first and on its
own, so a refused certificate is an immediate, clear error and not a WebSocket timeout), then the
WebSocket upgrade naming the gateway and this process (`GATEWAY_NAME_HEADER`,
`GATEWAY_INSTANCE_HEADER`), `GatewayHello`, and heartbeats until the link breaks. Every rule of
the link is `llmgw.wire.gateway_session.GatewaySession`'s; this module moves its frames and hands
what the control plane says to a `TableSink` (`llmgw.wire.gateway_link`): each part of the table
as it arrives, `heard` on every frame taken, `link_state(True, "")` once welcomed and
`link_state(False, why)` after every session or attempt that ended (so while the control plane
is away it is said again at each attempt, with the latest reason). The sink keeps the table
while the link is down; nothing here forgets it.

Several control planes (`--server` given more than once, when they share a PostgreSQL store):
each attempt dials the next in turn (`linkio.Targets`); a standby answers the hello with where
the leader is (`Redirect`), which is dialled next at once (at most MAX_REDIRECTS in a row; a
standby that knows no leader counts as a failure); the backoff applies between rounds of every
control plane, not between dials.

Between sessions the link waits with exponential backoff and full jitter (LINK_BACKOFF), short
enough that a gateway is back within a few seconds of its control plane's return (a revocation
made meanwhile then applies at once: the whole table comes with every Welcome); a TCP connect
unanswered for TCP_CONNECT_TIMEOUT_S is given up and made again, so that a path that returns
while a dial waits on the kernel's next SYN resend is found within seconds too. A link on which
the control plane says nothing for SILENT_HEARTBEATS of its heartbeat intervals is as good as
down (a half-open connection, a control plane that stopped) and is dialled again. Every failure
is logged with the reason in the operator's terms and the fix (`llmgw.linkfailure`), loudly when
the reason changes, quietly while it stays the same.

The certificate is read from a pki directory (`Credentials.load`: gateway.key, gateway.crt and
ca.crt, as `llmgw ca issue --gateway NAME --out DIR` writes them); its CN is the gateway's name.
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio
import trio_websocket

from llmgw import __version__
from llmgw.backoff import Backoff, Failures
from llmgw.errors import find
from llmgw.linkfailure import Redirected, SessionRefused, reason_of
from llmgw.linkio import LinkStream, Target, Targets, Writer, readable
from llmgw.log import get_logger
from llmgw.pki.ca import cert_info
from llmgw.pki.files import gateway_paths, load_cert
from llmgw.pki.tls import gateway_ssl_context, send_tls_alert
from llmgw.wire import gateway_link as g
from llmgw.wire import gateway_session as gs
from llmgw.wire.errors import WireError

log = get_logger("llmgw.gatewayd.link")

CONNECT_TIMEOUT_S = 10.0  # TCP and TLS together, the upgrade and the Welcome, each
# The TCP connect alone. The kernel sends an unanswered SYN again 1 s and 3 s after the first, then
# at 7 s: a path that returns after the 3 s resend is found sooner by a new dial (after at most
# LINK_BACKOFF's 3 s) than by the kernel's 7 s one. So a gateway cut off from its control plane
# sends a SYN at least every 3.5 s and is back within about that of the path's return, whatever
# the phase of its dial then (docs/gateway.md: a revocation made meanwhile applies within 5 s).
TCP_CONNECT_TIMEOUT_S = 3.5
SEND_TIMEOUT_S = 30.0  # one frame written to the control plane; past it the link is as good as down
GOODBYE_S = 1.0  # our LinkError to a control plane we refuse, before we hang up
SILENT_HEARTBEATS = 5  # the control plane's heartbeats missed in a row before the link is dialled again
MIN_SILENCE_S = 5.0  # ... and never less than this
# The largest frame taken from the control plane: the table is sent whole (every replica, every
# valid key: ~150 bytes each), so it may pass trio-websocket's default of 1 MiB on a big cluster.
MAX_TABLE_BYTES = 64 << 20
MAX_REDIRECTS = 3  # followed at once in a row; past it a redirect waits its backoff (as the agent's link)

# Between sessions: 0.25 s doubling to 3 s, with full jitter, so that many gateways refused
# together (a control-plane restart) do not return together, and each is back within a few
# seconds of its return; a session that was up starts it again.
LINK_BACKOFF = Backoff(first_s=0.25, max_s=3.0, jitter=True)

# What each heartbeat says (its `seq` is the session's): the worker's load, and its figures
# (`metrics`) if asked, else None (a heartbeat sent at once leaves them out: `GatewayHeartbeat`).
Load = Callable[[bool], g.GatewayHeartbeat]
ConnectTCP = Callable[[str, int], Awaitable[trio.abc.Stream]]


def no_load(metrics: bool) -> g.GatewayHeartbeat:
    return g.GatewayHeartbeat(seq=0, metrics=() if metrics else None)


@attrs.frozen(kw_only=True)
class Credentials:
    """What a gateway proves itself with: its name (its certificate's CN) and the TLS context
    that presents its certificate and trusts only the cluster's CA."""

    name: str
    ssl_context: ssl.SSLContext = attrs.field(repr=False)
    cert_serial: int

    @classmethod
    def load(cls, pki_dir: Path) -> Credentials:
        """From `pki_dir` (gateway.key, gateway.crt, ca.crt); a `MachineError` naming the file and
        the fix if one is missing, unreadable, open to others or not a gateway's certificate."""
        context = gateway_ssl_context(pki_dir)  # checks the files and the certificate's role first
        info = cert_info(load_cert(gateway_paths(pki_dir).cert))
        return cls(name=info.common_name, ssl_context=context, cert_serial=info.serial)


@attrs.define(kw_only=True)
class LinkState:
    """What the rest of the gateway can read about the link."""

    connected: bool = False
    attempts: int = 0
    sessions: int = 0  # sessions that were welcomed
    last_error: str = ""
    server_version: str = ""  # the control plane's llmgw, as its last Welcome said


class GatewayLink:
    """One gateway process's link to the control plane, kept up forever (`serve`)."""

    def __init__(
        self,
        *,
        target: Target | Targets,
        tls: ssl.SSLContext,
        name: str,
        instance: str,
        sink: g.TableSink,
        load: Load = no_load,
        applied: Callable[[], trio.Event] | None = None,
        tls_name: str = "",
        started_at: float | None = None,
        backoff: Backoff = LINK_BACKOFF,
        rng: random.Random | None = None,
        dial: Callable[[], Awaitable[trio.abc.Stream]] | None = None,
        connect_tcp: ConnectTCP = trio.open_tcp_stream,
    ) -> None:
        """`dial`: how a session's stream is opened (default: TCP and TLS to `target`; memory
        streams in tests); `connect_tcp`: how the default dial opens TCP (tests: one that hangs).
        `tls_name`: the name the control plane's certificate must cover, if not the host dialled
        (the control plane's own workers dial it on loopback). `applied()`: an event set when
        the gateway next routes by a new rotation, which sends a heartbeat at once (what
        `load()` says has changed: the rotation's version). `target`: the control plane, or every
        one (`Targets`)."""
        self.targets = target if isinstance(target, Targets) else Targets([target])
        self.target = self.targets.current  # the one dialled last
        self.applied = applied
        self.tls = tls
        self.tls_name = tls_name
        self.name = name
        self.instance = instance
        self.sink = sink
        self.load = load
        self.started_at = time.time() if started_at is None else started_at
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.dial = dial or self._dial
        self.connect_tcp = connect_tcp
        self.state = LinkState()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a session open forever, dialling again with backoff; never returns. Started at
        once: the gateway serves from its sink's table (none yet, or its last) meanwhile."""
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
            loud = was_up or reason != self.state.last_error
            self.state.connected = False
            self.state.last_error = reason
            self.sink.link_state(False, reason)
            if moved is not None and moved.leader and redirects < MAX_REDIRECTS and self.targets.lead_to(moved.leader):
                redirects += 1
                log.info("gateway_link_redirected", server=str(self.target), leader=moved.leader)
                continue  # the leader, now
            redirects = 0
            tried += 1
            if not was_up and tried < len(self.targets.configured):
                continue  # the backoff is between rounds of every control plane, as the agent's link
            tried = 0
            failures.failed(trio.current_time())
            delay = failures.delay(self.rng)
            (log.warning if loud else log.debug)(
                "gateway_link_down", server=str(self.target), reason=reason, retry_in_s=round(delay, 2)
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
                # Cancelled while the session also failed: being cancelled wins.
                await trio.lowlevel.checkpoint()
            raise
        return "the control plane closed the link", None

    def reason_of(self, exc: BaseException) -> str:
        return reason_of(exc, str(self.target), connect_timeout_s=CONNECT_TIMEOUT_S, side="gateway")

    async def run_session(self) -> None:
        """One session: dial the control plane (TCP, TLS), then `run_on` that stream."""
        await self.run_on(await self.dial())

    async def _dial(self) -> trio.SSLStream:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            with trio.move_on_after(TCP_CONNECT_TIMEOUT_S) as connecting:
                tcp = await self.connect_tcp(self.target.host, self.target.port)
            if connecting.cancelled_caught:
                raise SessionRefused(
                    f"no answer from {self.target} within {TCP_CONNECT_TIMEOUT_S:g} s: check the address, routes "
                    "and firewalls; dialling again"
                )
            # `tls_name` is for the configured address (the control plane's workers dial it on
            # loopback); a leader a standby named is checked by the host it is dialled at.
            configured = self.tls_name and self.target in self.targets.configured
            name = self.tls_name if configured else self.target.host
            tls = trio.SSLStream(tcp, self.tls, server_hostname=name, https_compatible=True)
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
        session = gs.GatewaySession(self.name, self.instance, self._hello)
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
                        max_message_size=MAX_TABLE_BYTES,
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
            await trio.aclose_forcefully(connected)  # not left to the garbage collector

    def _hello(self) -> g.GatewayHello:
        return g.GatewayHello(
            protocol_version=g.GATEWAY_PROTOCOL_VERSION,
            name=self.name,
            instance=self.instance,
            gateway_version=__version__,
            started_at=self.started_at,
        )

    async def _converse(self, ws: trio_websocket.WebSocketConnection, session: gs.GatewaySession) -> None:
        writer = Writer(session, send_timeout_s=SEND_TIMEOUT_S)
        async with trio.open_nursery() as nursery:
            session.start()
            await nursery.start(self._write, writer, ws)  # the hello is written
            welcomed = await self._receive(ws, writer, CONNECT_TIMEOUT_S)
            assert isinstance(welcomed, gs.Welcomed)  # the session refuses anything else first
            welcome = welcomed.welcome
            self._up(welcome)
            nursery.start_soon(self._heartbeats, writer, welcome.heartbeat_interval_s)
            silence_s = max(SILENT_HEARTBEATS * welcome.heartbeat_interval_s, MIN_SILENCE_S)
            while True:
                event = await self._receive(ws, writer, silence_s)
                if isinstance(event, gs.TableChanged):
                    self._apply(event.message)
                    if isinstance(event.message, g.KeysChanged):
                        self._beat(writer)  # the sink holds them now: say so at once

    def _up(self, welcome: g.GatewayWelcome) -> None:
        self.state.connected = True
        self.state.sessions += 1
        self.state.server_version = welcome.server_version
        self.sink.link_state(True, "")
        log.info(
            "gateway_link_up",
            server=str(self.target),
            gateway=self.name,
            instance=self.instance,
            server_version=welcome.server_version,
        )

    def _apply(self, message: g.RotationChanged | g.KeysChanged | g.ShareChanged) -> None:
        if isinstance(message, g.RotationChanged):
            self.sink.rotation_changed(message)
        elif isinstance(message, g.KeysChanged):
            self.sink.keys_changed(message)
        else:
            self.sink.share_changed(message)

    async def _write(self, writer: Writer, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        try:
            await writer.serve(ws, task_status=task_status)
        except trio.TooSlowError:
            raise SessionRefused(
                f"the control plane took no message for {SEND_TIMEOUT_S:g} s: the link is as good as down"
            ) from None

    async def _receive(self, ws: trio_websocket.WebSocketConnection, writer: Writer, silence_s: float) -> gs.Event:
        """The next event; `SessionRefused` when the control plane closes the link, sends what
        the session refuses (it is told why first) or says nothing for `silence_s`."""
        with trio.move_on_after(silence_s) as silent:
            text = await ws.get_message()
        if silent.cancelled_caught:
            raise SessionRefused(
                f"nothing from the control plane for {silence_s:g} s (its heartbeats stopped); dialling again"
            )
        frame = await readable(writer.session, text)  # a rotation of thousands: read in a thread
        try:
            event = writer.session.receive(frame)
        except WireError as exc:
            await writer.close(exc.code, str(exc), timeout_s=GOODBYE_S)
            raise SessionRefused(f"the control plane sent something this gateway does not understand: {exc}") from None
        if isinstance(event, gs.RedirectReceived):
            raise Redirected(event.leader, event.message)
        if isinstance(event, gs.Closed):
            raise SessionRefused(f"the control plane closed the link: {event.message}")
        self.sink.heard(trio.current_time())
        return event

    def _beat(self, writer: Writer, metrics: bool = False) -> None:
        session = writer.session
        assert isinstance(session, gs.GatewaySession)
        session.heartbeat(self.load(metrics))  # a newer replaces one unsent
        writer.wake()

    async def _heartbeats(self, writer: Writer, interval: float) -> None:
        """A heartbeat every `interval`, with the gateway's metrics, and one at once without them
        when the gateway routes by a new rotation (`applied`) or holds new keys (`_converse`): a
        move and a key's change wait for what they say (`llmgw.server.gatewayfeed`)."""
        due = trio.current_time()
        while writer.session.open:
            applied = self.applied() if self.applied is not None else None  # taken before the load is read
            timely = trio.current_time() >= due
            if timely:
                due = trio.current_time() + interval
            self._beat(writer, metrics=timely)
            with trio.move_on_after(due - trio.current_time()):
                await (applied.wait() if applied is not None else trio.sleep_forever())


async def serve_gateway_link(
    server_url: str | Sequence[str],
    tls: ssl.SSLContext,
    *,
    name: str,
    instance: str,
    sink: g.TableSink,
    load: Load = no_load,
    applied: Callable[[], trio.Event] | None = None,
    tls_name: str = "",
    started_at: float | None = None,
    task_status: trio.TaskStatus[GatewayLink] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep this gateway process (`instance`, e.g. `llmgw.wire.gateway_session.new_instance()`)
    linked to the control plane at `server_url` (wss://HOST:PORT, its agent_listen; or every control
    plane's, when several share a store, dialled in turn and followed to the leader) as the gateway
    `name` (its certificate's CN; `Credentials.load` gives both it and `tls`), feeding `sink`
    forever; `load()` says what each heartbeat reports, and one goes at once when `applied()` is
    set (`GatewayLink`); `tls_name`: the name the control plane's certificate must cover, if not
    the host of `server_url`. Started at once, with the link (its
    `state` says whether it is up); never returns."""
    link = GatewayLink(
        target=Targets.parse(server_url),
        tls=tls,
        name=name,
        instance=instance,
        sink=sink,
        load=load,
        applied=applied,
        tls_name=tls_name,
        started_at=started_at,
    )
    task_status.started(link)
    await link.serve()
