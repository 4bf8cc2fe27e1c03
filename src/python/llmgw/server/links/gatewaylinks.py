"""The gateway link's end on the control plane: the gateway instances connected, the table each
is sent (`llmgw.wire.gateway_link`: the rotation and the valid API keys as `gatewaytable` says
them, and its share of the keys' limits), and what their heartbeats say. The link itself (the
upgrade judged, the hello within its deadline, the one writer, the receive loop, silence, expiry,
redirecting while not leading) is the link runtime's, `llmgw.server.links.linkserver`; every rule of the
protocol is `llmgw.wire.gateway_session.GatewayServerSession`'s.

- Each part of the table is sent again whole when what it says changed, to every instance; each
  instance's share is renumbered as instances come and go (index: the order they were published
  in). Every part is made when the writer takes it: a slow instance gets the newest, no backlog.
- Token budgets (`llmgw.server.state.budgetring.BudgetRing`): every instance is sent the budgets
  (`BudgetsChanged`, again whole when they change) and its own grants (`GrantsChanged`, when the
  ring hands it more or says a budget is exhausted); its reports (`BudgetReport`) go to the ring,
  and so do its link's coming (published) and going.
- Each instance's last heartbeat is kept on its link (`LinkedGateway.last`): its figures
  (`llmgw.server.gateways.figures`), the rotation version it routes by and its requests on each
  replica, which `quiesce` waits on when a move takes a replica out of rotation, and the keys
  version it holds, which `keys_reached` waits on when the admin API makes or revokes a key.
- Each instance's usage reports go to the ledger (`usage`, `llmgw.server.links.usagereports`),
  which acknowledges each on the link it came by once it is written.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import trio

from llmgw import linkio
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo
from llmgw.server.links.gatewaytable import TableSource
from llmgw.server.links.linkserver import LinkServer, ServedLink
from llmgw.server.links.usagereports import UsageReports
from llmgw.server.state.budgetring import BudgetRing
from llmgw.server.state.keys import KeyRing
from llmgw.server.state.rotation import GatewayEndpoints
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire import gateway_session as gs
from llmgw.wire.session import State

log = get_logger("llmgw.gatewayfeed")


@attrs.define(kw_only=True, eq=False)
class LinkedGateway(ServedLink):
    """One gateway instance's link, once its hello was taken."""

    instance: str
    gateway_version: str
    connected_at: float = attrs.field(factory=time.time)  # unix time
    last: g.GatewayHeartbeat = g.GatewayHeartbeat(seq=0, metrics=())  # its last heartbeat (never without metrics)

    @property
    def name(self) -> str:
        return self.cert.common_name  # the session checked the hello's against it

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.instance

    @property
    def fields(self) -> dict[str, str]:
        return {"gateway": self.name, "instance": self.instance}

    def acknowledge(self, seq: int) -> None:
        """Its usage report `seq` is in the ledger."""
        self.session.ack(seq)  # type: ignore[attr-defined]
        self.writer.wake()

    @property
    def gone(self) -> bool:
        return self.session.state is State.CLOSED

    def push(self, kind: type) -> None:
        self.session.push(kind)  # type: ignore[call-arg]
        self.writer.wake()


class GatewayFeed(LinkServer[LinkedGateway]):
    """The gateway instances connected to this control plane, and the table each is sent."""

    log = log
    who, who_field = "gateway", "gateway"

    def __init__(
        self, *, endpoints: GatewayEndpoints, keys: KeyRing, budgets: BudgetRing | None = None, **link: Any
    ) -> None:
        """`link`: the runtime's (`clock`: the registry's, whose time a stall of the loop does not
        count as silence; `heartbeat_interval_s`, `silence_timeout_s`, `leading`, `redirect`).
        While this control plane does not lead, the table is sent no more."""
        super().__init__(**link)
        self.table = TableSource(endpoints, keys, changed=self._changed)
        self._index: dict[tuple[str, str], int] = {}  # each published link's share index
        self.heard = Wakeup()  # a heartbeat came, an instance left or the rotation changed: `quiesce` looks again
        self.usage: UsageReports | None = None  # where usage reports go (`Gateways` sets it; None: dropped)
        self.budgets = budgets
        if budgets is not None:
            budgets.on_grants = self._push_grants

    # -- the table ----------------------------------------------------------------------------

    def share(self, key: tuple[str, str]) -> g.ShareChanged:
        """The share of the instance `key`: its place among those published (the last place
        while it is not yet published: it will be, before its share is written)."""
        count = max(1, len(self.links) + (key not in self.links))
        return g.ShareChanged(index=self._index.get(key, count - 1), count=count)

    def _part(self, session: gs.GatewayServerSession, kind: type) -> Any:
        if kind is g.RotationChanged:
            return self.table.rotation
        if kind is g.KeysChanged:
            return self.table.keys
        if kind is g.BudgetsChanged:
            return self.budgets.message() if self.budgets is not None else g.BudgetsChanged(budgets=())
        if kind is g.GrantsChanged:
            return self.budgets.grants(session.instance) if self.budgets is not None else g.GrantsChanged()
        return self.share((session.expected_name, session.instance))

    def _push_all(self, kind: type) -> None:
        if not self.leading():
            return  # what a control plane that leads no more knows is not news
        for link in self.links.values():
            link.push(kind)

    def _renumber(self) -> None:
        self._index = {key: i for i, key in enumerate(self.links)}
        self._push_all(g.ShareChanged)

    def _changed(self, kind: type) -> None:
        self._push_all(kind)
        self.heard.fire()

    def _push_grants(self, instances: Any) -> None:
        if not self.leading():
            return
        for link in self.links.values():
            if link.instance in instances:
                link.push(g.GrantsChanged)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the table's sources until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.table.serve)
            if self.budgets is not None:
                nursery.start_soon(self._follow_budgets, self.budgets)
            task_status.started()

    async def _follow_budgets(self, budgets: BudgetRing) -> None:
        while True:
            await budgets.changed.wait()
            self._push_all(g.BudgetsChanged)

    # -- the link runtime's hooks -------------------------------------------------------------

    def _session(self, cert: CertInfo, *, standby=None) -> gs.GatewayServerSession:
        session = gs.GatewayServerSession(
            cert.common_name,
            heartbeat_interval_s=self.heartbeat_interval_s,
            table=lambda kind: self._part(session, kind),  # each part made when the writer takes it
            standby=standby,
        )
        return session

    async def _joined(
        self,
        event: gs.GatewayJoined,
        session: gs.GatewayServerSession,
        writer: linkio.Writer,
        cert: CertInfo,
        address: str,
    ) -> LinkedGateway:
        link = LinkedGateway(
            instance=event.hello.instance,
            gateway_version=event.hello.gateway_version,
            session=session,
            writer=writer,
            cert=cert,
            address=address,
            interval_s=self.heartbeat_interval_s,
        )
        log.info("gateway_connected", gateway=link.name, instance=link.instance, address=address)
        return link

    def _expired(self, link: LinkedGateway) -> str:
        return (
            f"the certificate of gateway {link.name!r} (serial {link.cert.serial:x}) expired at "
            f"{link.cert.not_after:%Y-%m-%d %H:%M:%S} UTC; issue a new one with `llmgw ca issue --gateway {link.name}`"
        )

    def _beat(self, link: LinkedGateway) -> None:
        link.session.heartbeat()  # type: ignore[call-arg]

    def _published(self, link: LinkedGateway) -> None:
        if self.budgets is not None:
            self.budgets.link_opened(link.instance)
        self._renumber()

    def _removed(self, link: LinkedGateway, published: bool) -> None:
        if published:
            if self.budgets is not None:
                self.budgets.link_closed(link.instance)
            self._renumber()
            self.heard.fire()
            log.info("gateway_left", gateway=link.name, instance=link.instance, gateways=len(self.links))

    def _on_event(self, link: LinkedGateway, event: gs.Event) -> None:
        if isinstance(event, gs.GatewayHeartbeatReceived):
            beat = event.heartbeat
            if beat.metrics is None:  # sent at once, for a new rotation or keys: the figures are as they were
                beat = attrs.evolve(beat, metrics=link.last.metrics)
            link.last = beat
            self.heard.fire()
        elif isinstance(event, gs.UsageReported) and self.usage is not None:
            self.usage.received(link, event.report)
        elif isinstance(event, gs.BudgetReported) and self.budgets is not None:
            self.budgets.report(link.instance, event.report)

    async def close_revoked(self, serials: set[int]) -> int:
        """Close the links of the instances whose certificate is one of `serials` (just revoked),
        telling each why; how many were closed."""
        closing = [link for link in self.links.values() if link.cert.serial in serials]
        for link in closing:
            message = (
                f"the certificate of gateway {link.name!r} (serial {link.cert.serial:x}) was revoked; issue a new one "
                f"with `llmgw ca issue --gateway {link.name}` and install it on the gateway"
            )
            await self.close(link, w.REVOKED, message)  # a hung gateway is not waited for
            log.warning("gateway_revoked", gateway=link.name, instance=link.instance, serial=f"{link.cert.serial:x}")
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
                if out_since is None and not self.table.routes_to(replica_id):
                    out_since = self.table.rotation.version
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
        target = self.table.keys_due()
        with trio.move_on_after(timeout_s):
            while True:
                heard = self.heard.next()
                if all(k.last.keys_version >= target for k in self.links.values() if k.name == name):
                    return True
                await heard.wait()
        return False

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
                "cert_serial": f"{link.cert.serial:x}",
            }
            for link in self.links.values()
        ]


def _quiet(heartbeat: g.GatewayHeartbeat, replica_id: str, out_since: int) -> bool:
    busy = any(o.replica_id == replica_id for o in heartbeat.outstanding)
    return heartbeat.rotation_version >= out_since and not busy
