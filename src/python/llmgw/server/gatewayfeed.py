"""The control plane's end of the gateway link: the gateway instances connected, and the table
each is sent (`llmgw.wire.gateway_link`: the rotation, the valid API keys, its share of their
limits). Every rule of the link is `llmgw.wire.gateway_session.GatewayServerSession`'s; this
module moves its frames and decides what the table holds.

1. `link` (the agent port's GATEWAY route, `llmgw.server.agentlistener`): the session judges the
   upgrade with the certificate's role and the store's word on it; refused, it is answered in
   plain HTTP saying why, accepted, with an `Upgrade`.
2. The hello within HELLO_TIMEOUT_S; then the link's one writer (`linkio.Writer`) writes the
   Welcome and the whole table, and once the Welcome is out the instance is published in
   `links` (a newer link of the same gateway and instance replaces the older).
3. The table follows its sources as they change: the rotation (`changes.rotation`, as the
   control plane's own gateway follows it) and the keys (`KeyRing.changed`), each sent again
   whole when what it says changed, to every instance; each instance's share is renumbered as
   instances come and go (index: the order they were published in). Every part is made when
   the writer takes it, so a slow instance gets the newest and never a backlog.
4. A TableHeartbeat every heartbeat interval; a link silent past the heartbeat TTL (in the
   registry's stall-aware clock, as agents' links are judged), one whose certificate expires
   and one whose gateway takes no frame within SEND_TIMEOUT_S are closed.
5. Each instance's heartbeats say how it is doing; the last is kept on its link (`GatewayLink.last`):
   its figures, which the cluster page's history and /metrics show (`llmgw.server.gatewayfigures`),
   the rotation version it routes by and its requests on each replica, which `quiesce` waits on
   when a move takes a replica out of rotation, and the keys version it holds, which
   `keys_reached` waits on when the admin API makes or revokes a key.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import attrs
import trio
import trio_websocket

from llmgw import linkio
from llmgw.gateway.routing import Rotation
from llmgw.http.messages import Request, Upgrade
from llmgw.log import get_logger
from llmgw.looplag import StallClock
from llmgw.pki.ca import CertInfo
from llmgw.server import agentport
from llmgw.server.agentlistener import REFUSAL_SEND_S, AgentListener
from llmgw.server.changes import rest
from llmgw.server.endpoint import HELLO_TIMEOUT_S, SEND_TIMEOUT_S
from llmgw.server.keys import KeyRing, gateway_key
from llmgw.server.store import KeyRow
from llmgw.server.views import GatewayEndpoints
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire import gateway_session as gs
from llmgw.wire.errors import UpgradeRefused, WireError

log = get_logger("llmgw.gatewayfeed")


def rotation_message(rotation: Rotation, version: int = 0) -> g.RotationChanged:
    """The rotation as the gateway link says it: the catalog's models, sorted, the replicas
    ready now, in the order `gateway_rotation` gives them (by replica id), and those whose state
    is not known yet, sorted."""
    return g.RotationChanged(
        version=version,
        models=tuple(sorted(rotation.models)),
        unknown=tuple(sorted(rotation.unknown)),
        details=tuple(sorted(rotation.details, key=lambda d: d.name)),
        endpoints=tuple(
            g.RouteEndpoint(
                replica_id=e.replica_id,
                model=e.model,
                host=e.host,
                port=e.port,
                api_key=e.api_key,
                draining=e.draining,
                events_port=e.events_port,
            )
            for e in rotation.endpoints
        ),
    )


def keys_message(rows: Iterable[KeyRow], version: int = 0) -> g.KeysChanged:
    """The valid keys as the gateway link says them (the hash of each token, never the token), by name."""
    return g.KeysChanged(keys=tuple(gateway_key(r) for r in sorted(rows, key=lambda r: r.name)), version=version)


@attrs.define(kw_only=True, eq=False)
class GatewayLink:
    """One gateway instance's link, once its hello was taken."""

    name: str  # its certificate's CN
    instance: str
    address: str
    cert_serial: int
    session: gs.GatewayServerSession
    writer: linkio.Writer
    gateway_version: str
    connected_at: float  # unix time
    heard_at: float  # unix time of its last frame
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    last: g.GatewayHeartbeat = g.GatewayHeartbeat(seq=0, metrics=())  # its last heartbeat (never without metrics)

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.instance

    def push(self, kind: type) -> None:
        self.session.push(kind)
        self.writer.wake()


class GatewayFeed:
    """The gateway instances connected to this control plane, and the table each is sent."""

    def __init__(
        self,
        *,
        listener: AgentListener,
        endpoints: GatewayEndpoints,
        keys: KeyRing,
        clock: StallClock,
        heartbeat_interval_s: float,
        silence_timeout_s: float = 0.0,
        leading: Callable[[], bool] = lambda: True,
        redirect: Callable[[], w.Redirect] | None = None,
    ) -> None:
        """`listener`: the agent port's (its budgets, refusals and containment serve this link
        too); `clock`: the registry's, whose time a stall of the loop does not count as silence.
        `leading()`: whether this control plane leads now; while it does not, the table is sent
        no more and a new link is answered with `redirect()` (where the leader is)."""
        self.listener = listener
        self.leading = leading
        self.redirect = redirect or (lambda: w.Redirect(leader="", message="this control plane does not lead"))
        self.endpoints = endpoints
        self.keys = keys
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_timeout_s = silence_timeout_s  # 0 = never (tests of other things)
        self.links: dict[tuple[str, str], GatewayLink] = {}  # (name, instance) -> link, in the order published
        self._index: dict[tuple[str, str], int] = {}  # each published link's share index
        self._rotation = rotation_message(endpoints.gateway_rotation(), version=1)
        self._keys = keys_message(keys.valid(), version=1)
        self.heard = Wakeup()  # a heartbeat came, an instance left or the rotation changed: `quiesce` looks again

    # -- the table ----------------------------------------------------------------------------

    def share(self, key: tuple[str, str]) -> g.ShareChanged:
        """The share of the instance `key`: its place among those published (the last place
        while it is not yet published: it will be, before its share is written)."""
        count = max(1, len(self.links) + (key not in self.links))
        return g.ShareChanged(index=self._index.get(key, count - 1), count=count)

    def _part(self, session: gs.GatewayServerSession, kind: type) -> Any:
        if kind is g.RotationChanged:
            return self._rotation
        if kind is g.KeysChanged:
            return self._keys
        return self.share((session.expected_name, session.instance))

    def _push_all(self, kind: type) -> None:
        if not self.leading():
            return  # what a control plane that leads no more knows is not news
        for link in self.links.values():
            link.push(kind)

    def _renumber(self) -> None:
        self._index = {key: i for i, key in enumerate(self.links)}
        self._push_all(g.ShareChanged)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the table's sources, and send heartbeats, until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._follow_rotation)
            await nursery.start(self._follow_keys)
            nursery.start_soon(self._heartbeats)
            task_status.started()

    async def _follow_rotation(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # `changes.rotation` fires on every agent heartbeat too: a part is sent only when what it
        # says changed.
        started = False
        while True:
            changed = self.endpoints.rotation_changed()
            began = time.perf_counter()
            rotation = rotation_message(self.endpoints.gateway_rotation(), version=self._rotation.version)
            took = time.perf_counter() - began
            if rotation != self._rotation:
                self._rotation = attrs.evolve(rotation, version=rotation.version + 1)
                self._push_all(g.RotationChanged)
                self.heard.fire()
            if not started:
                started = True
                task_status.started()
            await changed.wait()
            # The rotation is a look over every node and replica: while nodes keep joining, the
            # changes meanwhile are taken in one (`changes.rest`; after a millisecond's look, 3 ms).
            await rest(took)

    async def _follow_keys(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            changed = self.keys.changed.next()
            keys = keys_message(self.keys.valid(), version=self._keys.version)
            if keys != self._keys:
                self._keys = attrs.evolve(keys, version=keys.version + 1)
                self._push_all(g.KeysChanged)
                self.heard.fire()
            if not started:
                started = True
                task_status.started()
            await changed.wait()

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(self.heartbeat_interval_s)
            for link in self.links.values():
                link.session.heartbeat()
                link.writer.wake()

    # -- the links ----------------------------------------------------------------------------

    async def link(self, request: Request, cert: CertInfo, address: str) -> Upgrade:
        """The gateway link's request: the session judges it with the certificate's role and the
        store's word on it (a refusal is answered in plain HTTP, saying why); accepted, the
        connection is handed to the WebSocket (`_serve_link`)."""

        def table(kind: type) -> Any:
            return self._part(session, kind)

        if not self.leading():
            standby = gs.GatewayServerSession(
                cert.common_name, heartbeat_interval_s=self.heartbeat_interval_s, table=table, standby=self.redirect
            )
            return await self.listener.answer_standby(standby, request, cert, address)
        session = gs.GatewayServerSession(cert.common_name, heartbeat_interval_s=self.heartbeat_interval_s, table=table)
        try:
            session.upgrade(agentport.upgrade_request(request), await self.listener.standing(cert))
        except UpgradeRefused as exc:
            raise self.listener.refuse(cert, address, exc) from None
        return self.listener.upgrade(partial(self._serve_link, session, cert, address), cert, address)

    async def _serve_link(
        self, session: gs.GatewayServerSession, cert: CertInfo, address: str, stream: trio.abc.Stream, prefix: bytes
    ) -> None:
        async with trio.open_nursery() as nursery:  # trio-websocket's reader, which ends with the link
            with trio.fail_after(HELLO_TIMEOUT_S):
                ws = await agentport.accept_link(nursery, stream, prefix)
            await self._run_link(ws, session, cert, address)
            nursery.cancel_scope.cancel()

    async def _run_link(
        self, ws: trio_websocket.WebSocketConnection, session: gs.GatewayServerSession, cert: CertInfo, address: str
    ) -> None:
        writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
        hello = await self._hello(ws, writer, cert, address)
        if hello is None:
            return
        now = time.time()
        link = GatewayLink(
            name=hello.name,
            instance=hello.instance,
            address=address,
            cert_serial=cert.serial,
            session=session,
            writer=writer,
            gateway_version=hello.gateway_version,
            connected_at=now,
            heard_at=now,
        )
        log.info("gateway_connected", gateway=link.name, instance=link.instance, address=address)
        with link.cancel_scope:
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._write, link, ws)  # the Welcome is written: published
                    await self._until_expiry(link, ws, cert)
                    nursery.cancel_scope.cancel()
            finally:
                self._remove(link)

    async def _hello(
        self, ws: trio_websocket.WebSocketConnection, writer: linkio.Writer, cert: CertInfo, address: str
    ) -> g.GatewayHello | None:
        """The gateway's hello, taken (the Welcome and the table queued); None if refused or not sent."""
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                event = writer.session.receive(await ws.get_message())
        except trio.TooSlowError:
            why = f"no hello within {HELLO_TIMEOUT_S:g} s"
            await writer.close(w.BAD_MESSAGE, why, timeout_s=REFUSAL_SEND_S, ws=ws)  # not started yet: `ws`
            return None
        except WireError as exc:
            self.listener.log_refusal(
                "warning", "gateway_refused", address, "hello", stage="hello", cn=cert.common_name, reason=str(exc)
            )
            await writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S, ws=ws)
            return None
        if isinstance(event, gs.Closed):
            log.warning("gateway_reported_error", gateway=cert.common_name, code=event.code, reason=event.message)
            return None
        assert isinstance(event, gs.GatewayJoined)
        return event.hello

    async def _until_expiry(self, link: GatewayLink, ws: trio_websocket.WebSocketConnection, cert: CertInfo) -> None:
        # A certificate is good until its notAfter, not until the link happens to close.
        with trio.move_on_at(trio.current_time() + (cert.not_after.timestamp() - time.time())) as expiry:
            await self._receive_loop(link, ws)
        if expiry.cancelled_caught:
            message = (
                f"the certificate of gateway {link.name!r} (serial {cert.serial:x}) expired at "
                f"{cert.not_after:%Y-%m-%d %H:%M:%S} UTC; issue a new one with `llmgw ca issue --gateway {link.name}`"
            )
            log.warning("gateway_certificate_expired", gateway=link.name, serial=f"{cert.serial:x}")
            await link.writer.close(w.CERT_EXPIRED, message, timeout_s=REFUSAL_SEND_S)

    async def _write(self, link: GatewayLink, ws: trio_websocket.WebSocketConnection, *, task_status) -> None:
        """The link's one writer; the instance is published once its first frame, the Welcome, is out."""
        try:
            await link.writer.serve(ws, on_first=partial(self._publish, link), task_status=task_status)
        except trio.TooSlowError:
            # It does not read what we send: a link in name only. Its gateway reconnects.
            log.warning("gateway_link_not_reading", gateway=link.name, instance=link.instance, after_s=SEND_TIMEOUT_S)
            raise

    def _publish(self, link: GatewayLink) -> None:
        old = self.links.pop(link.key, None)
        self.links[link.key] = link
        if old is not None:
            old.cancel_scope.cancel()  # an instance has one link; the newest wins
        self._renumber()

    def _remove(self, link: GatewayLink) -> None:
        if self.links.get(link.key) is link:
            del self.links[link.key]
            self._renumber()
            self.heard.fire()
            log.info("gateway_left", gateway=link.name, instance=link.instance, gateways=len(self.links))

    async def _receive_loop(self, link: GatewayLink, ws: trio_websocket.WebSocketConnection) -> None:
        # Silence is counted in liveness time, as an agent's is: the timer that fires when the
        # loop resumes from a stall reads the clock, which credits the stall, and waits on.
        timeout = self.silence_timeout_s or math.inf
        heard = self.clock.now()
        while True:
            try:
                with trio.move_on_at(self.clock.loop_time(heard + timeout)) as silence:
                    text = await ws.get_message()  # cancel-safe: a message not taken stays queued
            except trio_websocket.ConnectionClosed:
                if link.session.goodbye is not None:
                    return  # we closed it, and the gateway answered
                raise
            if link.session.goodbye is not None:
                # We are closing it (a node removed, a leader stepping down): what came meanwhile
                # is moot, and our LinkError goes out before the link ends.
                with trio.move_on_after(REFUSAL_SEND_S):
                    await link.writer.finished.wait()
                return
            if silence.cancelled_caught and self.clock.now() - heard < timeout:
                continue  # a stall moved the deadline
            if silence.cancelled_caught:
                reason = f"nothing received for {self.silence_timeout_s:g} s (heartbeats stopped); closing the link"
                log.warning("gateway_link_silent", gateway=link.name, instance=link.instance, after_s=timeout)
                await link.writer.close(w.SILENT, reason, timeout_s=REFUSAL_SEND_S)
                return
            heard = self.clock.now()
            link.heard_at = time.time()
            frame = await linkio.readable(link.session, text)
            try:
                event = link.session.receive(frame)
            except WireError as exc:
                log.warning("gateway_bad_message", gateway=link.name, code=exc.code, reason=str(exc))
                await link.writer.close(exc.code, str(exc), timeout_s=REFUSAL_SEND_S)
                return
            if isinstance(event, gs.Closed):
                log.warning("gateway_reported_error", gateway=link.name, code=event.code, reason=event.message)
                return
            if isinstance(event, gs.GatewayHeartbeatReceived):
                beat = event.heartbeat
                if beat.metrics is None:  # sent at once, for a new rotation or keys: the figures are as they were
                    beat = attrs.evolve(beat, metrics=link.last.metrics)
                link.last = beat
                self.heard.fire()

    async def close_all(self, code: str, message: str) -> int:
        """End every instance's link, telling each why (a leader stepping down); how many."""
        closing = list(self.links.values())
        async with trio.open_nursery() as nursery:  # each bounded by REFUSAL_SEND_S, all at once
            for link in closing:
                nursery.start_soon(self._close, link, code, message)
        return len(closing)

    async def _close(self, link: GatewayLink, code: str, message: str) -> None:
        await link.writer.close(code, message, timeout_s=REFUSAL_SEND_S)
        link.cancel_scope.cancel()

    async def close_revoked(self, serials: set[int]) -> int:
        """Close the links of the instances whose certificate is one of `serials` (just revoked),
        telling each why; how many were closed."""
        closing = [link for link in self.links.values() if link.cert_serial in serials]
        for link in closing:
            message = (
                f"the certificate of gateway {link.name!r} (serial {link.cert_serial:x}) was revoked; issue a new one "
                f"with `llmgw ca issue --gateway {link.name}` and install it on the gateway"
            )
            await link.writer.close(w.REVOKED, message, timeout_s=REFUSAL_SEND_S)  # a hung gateway is not waited for
            link.cancel_scope.cancel()
            log.warning("gateway_revoked", gateway=link.name, instance=link.instance, serial=f"{link.cert_serial:x}")
        return len(closing)

    # -- moves --------------------------------------------------------------------------------

    async def quiesce(self, replica_id: str, timeout_s: float) -> bool:
        """Wait until no gateway instance connected has a request on `replica_id`, which the
        caller takes out of rotation first, for at most `timeout_s`; whether it got there. An
        instance is quiet on it once a heartbeat says it routes by a rotation without it (or
        with it draining) and has no request on it; one that leaves is not waited for."""
        out_since: int | None = None  # the first version of the rotation sent without it
        with trio.move_on_after(timeout_s):
            while True:
                heard = self.heard.next()
                if out_since is None and not self._routes_to(replica_id):
                    out_since = self._rotation.version
                links = list(self.links.values())
                if not links or (out_since is not None and all(_quiet(k.last, replica_id, out_since) for k in links)):
                    return True
                await heard.wait()
        return False

    async def keys_reached(self, name: str, timeout_s: float) -> bool:
        """Wait until every instance of the gateway `name` connected holds the valid keys as they
        are now (a key just made or revoked among them), as its heartbeat says, for at most
        `timeout_s`; whether they got there. The admin API waits so for the control plane's own
        workers: once it answers, http_listen knows the change."""
        now = keys_message(self.keys.valid())
        target = self._keys.version + (self._keys.keys != now.keys)  # not sent yet: the next version has it
        with trio.move_on_after(timeout_s):
            while True:
                heard = self.heard.next()
                if all(k.last.keys_version >= target for k in self.links.values() if k.name == name):
                    return True
                await heard.wait()
        return False

    def _routes_to(self, replica_id: str) -> bool:
        return any(e.replica_id == replica_id and not e.draining for e in self._rotation.endpoints)

    def outstanding(self, replica_id: str) -> int:
        """Requests on `replica_id` as the instances' last heartbeats said, all together."""
        loads = (o for link in self.links.values() for o in link.last.outstanding)
        return sum(o.outstanding for o in loads if o.replica_id == replica_id)

    # -- what the admin API shows ---------------------------------------------------------------

    def views(self) -> list[dict[str, Any]]:
        """The gateway instances connected, in their share order."""
        now = time.time()
        return [
            {
                "name": link.name,
                "instance": link.instance,
                "address": link.address,
                "gateway_version": link.gateway_version,
                "connected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(link.connected_at)),
                "last_heard_age_s": round(max(0.0, now - link.heard_at), 3),
                "in_flight": link.last.in_flight,
                "requests_total": link.last.requests_total,
                "share": {"index": self._index.get(link.key, 0), "count": len(self.links)},
                "cert_serial": f"{link.cert_serial:x}",
            }
            for link in self.links.values()
        ]


def _quiet(heartbeat: g.GatewayHeartbeat, replica_id: str, out_since: int) -> bool:
    busy = any(o.replica_id == replica_id for o in heartbeat.outstanding)
    return heartbeat.rotation_version >= out_since and not busy
