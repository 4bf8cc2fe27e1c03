"""The agent's side of the link: dial the control plane, prove who we are, stay connected.

One session: TCP, then the TLS handshake with the node certificate (done first and on its own,
so a refused certificate is an immediate, clear error and not a WebSocket timeout), then the
WebSocket upgrade naming our node id, `Hello`, and heartbeats until the link breaks. What may
be sent and received when is `llmgw.wire.session.AgentSession`'s; this module moves its frames.

Between sessions the agent waits with exponential backoff and full jitter, and keeps its work:
nothing here stops replicas. Every failure is logged once per attempt with the reason in the
operator's terms and the fix (`describe_failure`).
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from agent.node_address import NodeAddress, local_host
from llmgw.errors import UsageError, find, leaves, only
from llmgw.log import get_logger
from llmgw.pki.tls import send_tls_alert
from llmgw.pki.tlsdiag import describe_tls_failure
from llmgw.wire import agent_link as w
from llmgw.wire import session as s
from llmgw.wire.errors import WireError

log = get_logger("llmgw.agent.link")

CONNECT_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0  # one message written to the control plane; past it the link is as good as down


@attrs.frozen(kw_only=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        # Full jitter: many agents refused together (a control-plane restart) do not return together.
        return rng.uniform(0, min(self.max_s, self.initial_s * self.factor**attempt))


@attrs.frozen(kw_only=True)
class Target:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "wss" or not parts.hostname:
            raise UsageError(f"control plane URL {url!r} must look like wss://HOST:PORT")
        return cls(host=parts.hostname, port=parts.port or 443)


class SessionRefused(Exception):
    """The control plane (or TLS) refused this agent; `reason` says why and what to do."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@attrs.define(kw_only=True)
class LinkState:
    """What the rest of the agent can read about the link."""

    connected: bool = False
    attempts: int = 0
    last_error: str = ""
    desired: w.DesiredState | None = None
    sessions: int = 0


class AgentLink:
    def __init__(
        self,
        *,
        target: Target,
        node_id: str,
        ssl_context: ssl.SSLContext,
        make_hello: Callable[[], w.Hello],
        backoff: Backoff = Backoff(),
        rng: random.Random | None = None,
        source_address: str = "",
        address: NodeAddress | None = None,
    ) -> None:
        """`address` gets the local address of each connection: where this node's engines listen."""
        self.target = target
        self.source_address = source_address
        self.address = address if address is not None else NodeAddress()
        self.node_id = node_id
        self.ssl_context = ssl_context
        self.make_hello = make_hello
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.state = LinkState()
        self._desired_changed = trio.Event()
        self._ws: trio_websocket.WebSocketConnection | None = None
        self._session: s.AgentSession | None = None
        # Set by the agent: answers the control plane's request for a replica's log tail.
        self.answer_logs: Callable[[w.LogsRequest], w.LogsReply] = lambda req: w.LogsReply(
            request_id=req.request_id, replica_id=req.replica_id, error="this agent keeps no replica logs"
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a session open forever, reconnecting with backoff; never returns."""
        task_status.started()
        failures = 0
        while True:
            self.state.attempts += 1
            sessions_before = self.state.sessions
            try:
                await self.run_session()
                reason = "the control plane closed the link"
            except Exception as exc:  # noqa: BLE001 - the link must outlive any one failure
                reason = self.reason_of(exc)
            except BaseException as exc:
                if find(exc, trio.Cancelled) is not None:
                    # Cancelled while the session also failed (a refusal arriving as the agent
                    # stops): being cancelled wins, not the failure beside it.
                    await trio.lowlevel.checkpoint()
                raise
            if self.state.sessions > sessions_before:
                failures = 0  # the link was up: a control-plane restart gets a prompt reconnect
            self.state.connected = False
            self.state.last_error = reason
            delay = self.backoff.delay(failures, self.rng)
            failures += 1
            log.warning(
                "link_down", server=f"{self.target.host}:{self.target.port}", reason=reason, retry_in_s=round(delay, 2)
            )
            await trio.sleep(delay)

    def reason_of(self, exc: BaseException) -> str:
        refused = find(exc, SessionRefused)
        if refused is not None:
            return refused.reason
        rejected = find(exc, trio_websocket.ConnectionRejected)
        if rejected is not None:
            body = (rejected.body or b"").decode("utf-8", "replace").strip()
            return f"the control plane refused this node (HTTP {rejected.status_code}): {body}"
        closed = find(exc, trio_websocket.ConnectionClosed)
        if closed is not None and describe_tls_failure(exc, side="client") is None:
            return f"the link closed: {closed.reason}"
        if only(
            exc,
            (
                OSError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                trio.TooSlowError,
                trio_websocket.HandshakeError,
                trio_websocket.ConnectionClosed,
            ),
        ):
            return describe_failure(exc, self.target)
        log.exception("link_failed_unexpectedly", server=f"{self.target.host}:{self.target.port}")
        return f"unexpected failure: {leaves(exc)[0]!r} (a bug in llmgw; the log above has the traceback)"

    async def run_session(self) -> None:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            tcp = await trio.open_tcp_stream(
                self.target.host, self.target.port, local_address=self.source_address or None
            )
            self.address.set(local_host(tcp.socket))
            stream = trio.SSLStream(tcp, self.ssl_context, server_hostname=self.target.host, https_compatible=True)
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError:
                await send_tls_alert(stream)  # tells the server why we hung up (e.g. its cert)
                raise
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        watched = _WatchedStream(stream)
        session = s.AgentSession(self.node_id, self.make_hello)
        path, headers = session.upgrade_request()
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(CONNECT_TIMEOUT_S), trio.CancelScope() as upgrade:
                    watched.on_failure = upgrade.cancel
                    ws = await trio_websocket.wrap_client_stream(
                        nursery, watched, self.target.host, path, extra_headers=headers
                    )
                if upgrade.cancelled_caught:
                    raise watched.failure
                watched.on_failure = None
                try:
                    await self._converse(ws, session)
                finally:
                    with trio.move_on_after(1) as cleanup:
                        cleanup.shield = True
                        await ws.aclose()
                nursery.cancel_scope.cancel()
        finally:
            self.state.connected = False

    async def _converse(self, ws: trio_websocket.WebSocketConnection, session: s.AgentSession) -> None:
        await ws.send_message(session.start())
        welcomed = await self._receive(ws, session)
        assert isinstance(welcomed, s.WelcomeReceived)  # the session refuses anything else first
        self.state.connected = True
        self.state.sessions += 1
        self._ws, self._session = ws, session
        log.info("link_up", server=f"{self.target.host}:{self.target.port}", node=self.node_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, ws, session, welcomed.welcome.heartbeat_interval_s)
            while True:
                event = await self._receive(ws, session)
                if isinstance(event, s.LogsRequested):
                    reply = self.answer_logs(event.request)
                    if session.can_send(w.LogsReply):
                        await ws.send_message(session.send(reply))
                elif isinstance(event, s.DesiredStateReceived):
                    self.state.desired = event.desired
                    self._desired_changed.set()
                    self._desired_changed = trio.Event()

    async def desired_changed(self) -> None:
        """Return when the next desired state arrives."""
        await self._desired_changed.wait()

    async def send(self, message: w.AgentMessage) -> bool:
        """Send on the current session, if one is up; False if not (the next hello carries it)."""
        ws, session = self._ws, self._session
        if ws is None or session is None or not self.state.connected or not session.can_send(type(message)):
            return False
        frame = session.send(message)
        # A write cancelled halfway would leave half a frame on the TLS stream and break the link
        # for everyone (an install's progress reporter is cancelled when the install ends): the
        # write is shielded from the caller's cancellation, and bounded by its own deadline.
        with trio.CancelScope(shield=True), trio.move_on_after(SEND_TIMEOUT_S) as deadline:
            try:
                await ws.send_message(frame)
            except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return not deadline.cancelled_caught

    async def _receive(self, ws: trio_websocket.WebSocketConnection, session: s.AgentSession) -> s.Event:
        """The next event; `SessionRefused` when the control plane closes the link or sends what
        the session refuses (it is told why first)."""
        try:
            received = session.receive(await ws.get_message())
        except WireError as exc:
            goodbye = session.close(exc.code, str(exc))
            if goodbye is not None:
                await ws.send_message(goodbye)
            raise SessionRefused(f"the control plane sent something this agent does not understand: {exc}") from None
        if isinstance(received.event, s.Closed):
            raise SessionRefused(f"the control plane closed the link: {received.event.message}")
        for frame in received.send:
            await ws.send_message(frame)
        return received.event

    async def _heartbeats(
        self, ws: trio_websocket.WebSocketConnection, session: s.AgentSession, interval: float
    ) -> None:
        while session.can_send(w.Heartbeat):
            await ws.send_message(session.heartbeat())
            await trio.sleep(interval)


class _WatchedStream(trio.abc.Stream):
    """The TLS stream, reporting its first failure to whoever waits on the WebSocket upgrade.

    In TLS 1.3 the server judges our certificate after our side of the handshake is done, so a
    refusal arrives as an alert on the first read, inside trio-websocket's reader task, which
    does not wake the upgrade waiting for a response (trio-websocket issue 199): the agent would
    hang until its timeout. This wrapper cancels the wait and keeps the error for the reason.
    """

    def __init__(self, inner: trio.SSLStream) -> None:
        self.inner = inner
        self.failure: BaseException | None = None
        self.on_failure = None

    def _failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            if self.on_failure is not None:
                self.on_failure()

    async def send_all(self, data) -> None:
        try:
            await self.inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        try:
            data = await self.inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise
        if not data:
            self._failed(trio.BrokenResourceError("the control plane closed the connection during the upgrade"))
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


def describe_failure(exc: BaseException, target: Target) -> str:
    """One line for the operator: what failed and what to do."""
    where = f"{target.host}:{target.port}"
    tls = describe_tls_failure(exc, side="client")
    if tls:
        return tls
    root = _root_cause(exc)
    if isinstance(root, ConnectionRefusedError):
        return f"nothing listens at {where}: is `llmgw server` running there, and agent_listen set to this port?"
    if isinstance(root, trio.TooSlowError):
        return f"no answer from {where} within {CONNECT_TIMEOUT_S:g} s: check the address, routes and firewalls"
    if isinstance(root, OSError):
        return f"cannot reach {where}: {root.strerror or root}"
    return f"the link to {where} failed: {root!r}"


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        group = getattr(exc, "exceptions", None)  # an exception group (3.10 has only the backport)
        if group:
            exc = group[0]  # trio's happy eyeballs: every address failed, the first says how
            continue
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc
