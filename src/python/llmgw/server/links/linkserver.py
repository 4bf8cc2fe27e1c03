"""The control plane's end of a link, once for both links: the agent link's (`agentlinks`) and
the gateway link's (`gatewayfeed`) are this runtime with their session and what they do with its
events. Every rule of a link is its session's (`llmgw.wire.agent_session`,
`llmgw.wire.gateway_session`); the port that accepts the connections, does the TLS handshake and
routes the request (`agentlistener`) hands a link's request to `LinkServer.link` with itself, the
`Port`. For one link, in order:

1. `link`: while this control plane leads, the session judges the upgrade with the store's word
   on the certificate (`Port.standing`); refused, the request is answered in plain HTTP saying
   why (`Port.refuse`), accepted, with an `Upgrade` (`Port.upgrade`: what the peer does to the
   connection from then on ends it alone). While it does not lead (`leading()`), the same checks
   are made and the hello is answered with where the leader is (`redirect_link`), nothing else.
2. `serve_link`: the WebSocket is accepted and its first frame given to the session within
   HELLO_TIMEOUT_S; a refused hello is told why (its LinkError) and logged as a refusal of the
   port. Taken, the adapter records the peer (`_joined`), then the link's one writer
   (`linkio.Writer`) writes what the session queued in answer, and once the Welcome is out the
   link is published in `links` (`_published`; a newer link of the same peer replaces the older).
3. The receive loop gives every later frame to the session and its event to the adapter
   (`_on_event`); a heartbeat goes every interval the link was told (`_beat`). A link silent past
   `_silence_s` (in the registry's stall-aware clock: a stall of our own loop is not the peer's
   silence), one whose certificate expires and one whose peer takes no frame within
   SEND_TIMEOUT_S are closed, each with its LinkError; then the adapter forgets it (`_removed`).

Only the writer writes: whoever sends queues in the session and wakes it (`ServedLink.push`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Hashable
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio
import trio_websocket

from llmgw import linkio
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Upgrade
from llmgw.log import Logger
from llmgw.looplag import StallClock
from llmgw.pki.ca import CertInfo
from llmgw.server.links import agentport
from llmgw.wire import agent_link as w
from llmgw.wire.errors import UpgradeRefused, WireError
from llmgw.wire.session import Closed, ServingSession, Standing

HELLO_TIMEOUT_S = 10.0  # a link's first frame, the hello, must come within this of its upgrade
# A frame to a peer must be taken within this; a peer that stops reading is cut off (its link is
# closed), and until then what waits for it is bounded by its session's outbox.
SEND_TIMEOUT_S = 10.0
REFUSAL_SEND_S = 1.0  # a refused or closed peer is told why within this, then the connection closes
NOT_LEADING = w.Redirect(leader="", message="this control plane does not lead")


class Port(Protocol):
    """What a link needs of the port its request came on (`agentlistener.AgentListener`)."""

    async def standing(self, cert: CertInfo) -> Standing:
        """What the store says of `cert`, with its role."""
        ...

    def refuse(self, cert: CertInfo, address: str, exc: UpgradeRefused) -> HTTPError:
        """A refused request, counted and logged; the answer saying why, to raise."""
        ...

    def upgrade(
        self, run: Callable[[trio.abc.Stream, bytes], Awaitable[None]], cert: CertInfo, address: str
    ) -> Upgrade:
        """The answer that hands the connection to `run`, contained."""
        ...

    def log_refusal(self, level: str, event: str, address: str, kind: str, **fields: Any) -> None:
        """A refusal, logged among the port's (a flood of them is summarised)."""
        ...


class Named(Protocol):
    """A link's end as its log lines name it (`LinkServer`, `StandbyEnd`): the peer (`who`:
    "agent", "gateway"; events such as `agent_refused`), the field for its CN, the logger."""

    who: str
    who_field: str
    log: Logger


@attrs.define(kw_only=True, eq=False)
class ServedLink:
    """One peer's link, once its hello was taken: what the runtime needs of it; the adapter's
    subclass adds what it keeps of the peer."""

    session: ServingSession
    writer: linkio.Writer
    cert: CertInfo
    address: str
    interval_s: float  # the heartbeat interval its peer was told last
    heard_at: float = attrs.field(factory=time.time)  # unix time of its last frame
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def key(self) -> Hashable:
        """Which peer: a peer has one link, the newest."""
        raise NotImplementedError

    @property
    def fields(self) -> dict[str, str]:
        """The peer, in the link's log lines."""
        raise NotImplementedError


L = TypeVar("L", bound=ServedLink)


class LinkServer(Generic[L]):
    """The control plane's end of one link, for every peer of it. A subclass is the link's
    adapter: its session (`_session`), what a hello records (`_joined`), what each event does
    (`_on_event`), its heartbeat (`_beat`), how long a peer may be silent (`_silence_s`), and what
    publishing and forgetting a link change (`_published`, `_removed`)."""

    log: Logger
    who = "agent"  # the peer, in log events (`agent_refused`, `gateway_link_silent`)
    who_field = "node"  # the field naming the peer by its certificate's CN in log lines

    def __init__(
        self,
        *,
        clock: StallClock,
        heartbeat_interval_s: float,
        silence_timeout_s: float = 0.0,
        leading: Callable[[], bool] = lambda: True,
        redirect: Callable[[], w.Redirect] | None = None,
    ) -> None:
        """`clock`: the registry's, whose time a stall of the loop does not count as silence;
        `silence_timeout_s`: a link silent this long is closed (0: never; tests of other things).
        `leading()`: whether this control plane leads now (its term's); while it does not, a new
        link is answered with `redirect()` (where the leader is)."""
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_timeout_s = silence_timeout_s
        self.leading = leading
        self.redirect = redirect or (lambda: NOT_LEADING)
        self.links: dict[Any, L] = {}  # key -> its link, once the Welcome is written, in the order published

    # -- the hooks of an adapter --------------------------------------------------------------

    def _session(self, cert: CertInfo, *, standby: Callable[[], w.Redirect] | None = None) -> ServingSession:
        """A session for a peer with `cert` (`standby`: one that answers with a Redirect)."""
        raise NotImplementedError

    async def _joined(
        self, event: Any, session: ServingSession, writer: linkio.Writer, cert: CertInfo, address: str
    ) -> L:
        """The hello was taken (`event`): record the peer; its link, not yet published."""
        raise NotImplementedError

    def _on_event(self, link: L, event: Any) -> None:
        """What the control plane does with what a peer said."""

    def _beat(self, link: L) -> None:
        """Queue a heartbeat on `link` (its session's), told the interval to keep."""
        raise NotImplementedError

    def _expired(self, link: L) -> str:
        """The LinkError's words when the peer's certificate expires: which, and how to renew it."""
        raise NotImplementedError

    def _silence_s(self, link: L) -> float:
        """How long `link` may be silent before it is closed."""
        return self.silence_timeout_s or math.inf

    def _published(self, link: L) -> None:
        """`link` was published (a replaced one is being cancelled)."""

    def _removed(self, link: L, published: bool) -> None:
        """`link` ended (`published`: it was still the peer's link in `links`)."""

    # -- one link ---------------------------------------------------------------------------

    async def link(self, port: Port, request: Request, cert: CertInfo, address: str) -> Upgrade:
        """A link's request on `port`: the session judges it with the store's word on the
        certificate (a refusal is answered in plain HTTP, saying why); accepted, the connection
        is handed to the WebSocket (`serve_link`). Not leading: `redirect_link`."""
        if not self.leading():
            return await redirect_link(port, self._session(cert, standby=self.redirect), request, cert, address, self)
        session = self._session(cert)
        try:
            session.upgrade(agentport.upgrade_request(request), await port.standing(cert))
        except UpgradeRefused as exc:
            raise port.refuse(cert, address, exc) from None
        return port.upgrade(partial(self.serve_link, port, session, cert, address), cert, address)

    async def serve_link(
        self, port: Port, session: ServingSession, cert: CertInfo, address: str, stream: trio.abc.Stream, prefix: bytes
    ) -> None:
        """The link on `stream`, its request judged (`prefix`: the bytes the port had read), until it ends."""
        async with trio.open_nursery() as nursery:  # trio-websocket's reader, which ends with the link
            with trio.fail_after(HELLO_TIMEOUT_S):
                ws = await agentport.accept_link(nursery, stream, prefix)
            writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
            event = await hello(port, ws, writer, cert, address, self)
            if event is not None:
                link = await self._joined(event, session, writer, cert, address)
                with link.cancel_scope:
                    try:
                        await self._run(link, ws)
                    finally:
                        published = self.links.get(link.key) is link
                        if published:
                            del self.links[link.key]
                        self._removed(link, published)
            nursery.cancel_scope.cancel()

    async def _run(self, link: L, ws: trio_websocket.WebSocketConnection) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._write, link, ws)  # the Welcome is written: published
            nursery.start_soon(self._heartbeats, link)
            # A certificate is good until its notAfter, not until the link happens to close.
            cert = link.cert
            with trio.move_on_at(trio.current_time() + (cert.not_after.timestamp() - time.time())) as expiry:
                await self._receive_loop(link, ws)
            if expiry.cancelled_caught:
                peer = {self.who_field: cert.common_name}
                self.log.warning(f"{self.who}_certificate_expired", **peer, serial=f"{cert.serial:x}")
                await link.writer.close(w.CERT_EXPIRED, self._expired(link), timeout_s=REFUSAL_SEND_S)
            nursery.cancel_scope.cancel()

    async def _write(self, link: L, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        """The link's one writer; the link is published once its first frame, the Welcome, is out."""
        try:
            await link.writer.serve(ws, on_first=partial(self._publish, link), task_status=task_status)
        except trio.TooSlowError:
            # It does not read what we send: a link in name only. Its peer dials again.
            self.log.warning(f"{self.who}_link_not_reading", **link.fields, after_s=SEND_TIMEOUT_S)
            raise

    def _publish(self, link: L) -> None:
        old = self.links.pop(link.key, None)
        self.links[link.key] = link
        if old is not None:
            old.cancel_scope.cancel()  # a peer has one link; the newest wins
        self._published(link)

    async def _heartbeats(self, link: L) -> None:
        """A heartbeat every interval the link was told, so that its peer notices a control plane
        that stopped (its kernel would still take the peer's frames) and dials the next."""
        while True:
            await trio.sleep(link.interval_s)
            self._beat(link)
            link.writer.wake()

    async def _receive_loop(self, link: L, ws: trio_websocket.WebSocketConnection) -> None:
        # Silence is counted in liveness time, as the registry counts it: the timer that fires
        # when the loop resumes from a stall reads the clock, which credits the stall, and waits
        # on (the peer's heartbeats are in the socket buffer, read next).
        heard = self.clock.now()
        while True:
            timeout = self._silence_s(link)
            try:
                with trio.move_on_at(self.clock.loop_time(heard + timeout)) as silence:
                    text = await ws.get_message()  # cancel-safe: a message not taken stays queued
            except trio_websocket.ConnectionClosed:
                if link.session.goodbye is not None:
                    return  # we closed it, and the peer answered
                raise
            if link.session.goodbye is not None:
                # We are closing it (a node removed, a leader stepping down): what came meanwhile
                # is moot, and our LinkError goes out before the link ends.
                with trio.move_on_after(REFUSAL_SEND_S):
                    await link.writer.finished.wait()
                return
            if silence.cancelled_caught and self.clock.now() - heard < (timeout := self._silence_s(link)):
                # A stall moved the deadline, or the peer was told a longer interval meanwhile
                # (the cluster grew) while this waited on the shorter one.
                continue
            if silence.cancelled_caught:
                reason = f"nothing received for {timeout:g} s (heartbeats stopped); closing the link"
                self.log.warning(f"{self.who}_link_silent", **link.fields, after_s=timeout)
                await link.writer.close(w.SILENT, reason, timeout_s=REFUSAL_SEND_S)
                return
            heard = self.clock.now()
            link.heard_at = time.time()
            frame = await linkio.readable(link.session, text)  # a long one read in a thread
            peer = {self.who_field: link.cert.common_name}
            try:
                event = link.session.receive(frame)
            except WireError as exc:
                self.log.warning(f"{self.who}_bad_message", **peer, code=exc.code, reason=str(exc))
                await link.writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S)
                return
            if isinstance(event, Closed):
                self.log.warning(f"{self.who}_reported_error", **peer, code=event.code, reason=event.message)
                return
            self._on_event(link, event)

    # -- every link ---------------------------------------------------------------------------

    async def close(self, link: L, code: str, message: str) -> None:
        """End `link`, telling its peer why (a hung peer is not waited for past REFUSAL_SEND_S)."""
        await link.writer.close(code, message, timeout_s=REFUSAL_SEND_S)
        link.cancel_scope.cancel()

    async def close_all(self, code: str, message: str) -> int:
        """End every open link, telling each peer why (a leader stepping down); how many."""
        closing = list(self.links.values())
        async with trio.open_nursery() as nursery:  # each bounded by REFUSAL_SEND_S, all at once
            for link in closing:
                nursery.start_soon(self.close, link, code, message)
        return len(closing)


async def hello(
    port: Port, ws: trio_websocket.WebSocketConnection, writer: linkio.Writer, cert: CertInfo, address: str, by: Named
) -> Any | None:
    """The peer's hello, given to the session within HELLO_TIMEOUT_S: its event (the session
    queued its answer); None if it was refused (the peer told why, the port's refusal logged),
    not sent in time, or the peer closed instead. `by`: the link's end, for its log lines."""
    try:
        with trio.fail_after(HELLO_TIMEOUT_S):
            event = writer.session.receive(await ws.get_message())
    except trio.TooSlowError:
        why = f"no hello within {HELLO_TIMEOUT_S:g} s"
        await writer.close(w.BAD_MESSAGE, why, timeout_s=REFUSAL_SEND_S, ws=ws)  # the writer not started yet: `ws`
        return None
    except WireError as exc:
        port.log_refusal(
            "warning", f"{by.who}_refused", address, "hello", stage="hello", cn=cert.common_name, reason=str(exc)
        )
        await writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S, ws=ws)
        return None
    if isinstance(event, Closed):
        by.log.warning(
            f"{by.who}_reported_error", **{by.who_field: cert.common_name}, code=event.code, reason=event.message
        )
        return None
    return event


async def redirect_link(
    port: Port, session: ServingSession, request: Request, cert: CertInfo, address: str, by: Named
) -> Upgrade:
    """A link's request to a control plane that does not lead: `session` (made with its
    `standby`) judges the upgrade with the store's word on the certificate, then the hello,
    which it answers with the Redirect; nothing is recorded and nothing else is sent. `by`: the
    link's end, a leader's that leads no more or a standby's."""
    try:
        session.upgrade(agentport.upgrade_request(request), await port.standing(cert))
    except UpgradeRefused as exc:
        raise port.refuse(cert, address, exc) from None

    async def answer(stream: trio.abc.Stream, prefix: bytes) -> None:
        async with trio.open_nursery() as nursery:  # trio-websocket's reader, which ends with the link
            with trio.fail_after(HELLO_TIMEOUT_S):
                ws = await agentport.accept_link(nursery, stream, prefix)
            writer = linkio.Writer(session, send_timeout_s=REFUSAL_SEND_S)
            if await hello(port, ws, writer, cert, address, by) is not None:
                redirect = session.goodbye
                by.log.info(
                    "link_redirected", address=address, cn=cert.common_name, reason=redirect and redirect.message
                )
                with trio.move_on_after(REFUSAL_SEND_S):
                    await writer.serve(ws)  # the Redirect, its LinkError, the close
            nursery.cancel_scope.cancel()

    return port.upgrade(answer, cert, address)


class StandbyEnd:
    """A link's end on a control plane that does not lead at all (`standby`): every request is
    answered with where the leader is, `redirect()`, after the checks a leader makes. `session(cn,
    standby)` makes the link's session for it."""

    def __init__(
        self,
        session: Callable[[str, Callable[[], w.Redirect]], ServingSession],
        redirect: Callable[[], w.Redirect],
        *,
        who: str,
        who_field: str,
        log: Logger,
    ) -> None:
        self.session = session
        self.redirect = redirect
        self.who, self.who_field, self.log = who, who_field, log
        self.links: dict[Any, ServedLink] = {}  # a standby holds none

    async def link(self, port: Port, request: Request, cert: CertInfo, address: str) -> Upgrade:
        return await redirect_link(port, self.session(cert.common_name, self.redirect), request, cert, address, self)

    async def close_revoked(self, serials: set[int]) -> int:
        return 0  # a standby holds no link
