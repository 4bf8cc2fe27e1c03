"""What a gateway process serves from: the last table the control plane sent — the rotation, the
keys, this instance's share of their limits, the token budgets and its grants of them
(`budgets`, `llmgw.gateway.budgets.Budgets`) — and how fresh it is.

`GatewayTable` is the link client's sink (`llmgw.wire.gateway_link.TableSink`), and its
`endpoints` the gateway's endpoint provider (`llmgw.gateway.app.EndpointProvider`: a view of its
own, since both protocols name a method `rotation_changed`). Each message replaces its part whole
(the link is level-triggered), but for the replicas a rotation calls unknown: those the last
rotation had are kept (a control plane that has just started does not know them yet; dropping
them would leave the gateway nothing to serve while its nodes come back, up to 30 s). While the
link is down nothing is forgotten: the gateway routes from the last rotation (its `Router` still
takes replicas out on its own failed connections and probes them back), accepts the keys it
knew and keeps its last share; of its grants of day and month budgets it keeps none (the control
plane hands them out again once it is surely gone: `llmgw.server.state.budgets`). Its staleness is the time since the control plane was last heard
(trio's clock, `heard`), or since the table was made when it never was.

Synchronous and without I/O: the sink's methods are called on the gateway's loop, none blocks.
`health` is the answer of /health as data; the worker (`llmgw.gatewayd.worker`) sends it.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from llmgw.gateway.budgets import Budgets
from llmgw.gateway.keys import KeyTable
from llmgw.gateway.routing import Endpoint, Rotation
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import (
    BudgetsChanged,
    GrantsChanged,
    KeysChanged,
    RotationChanged,
    RouteEndpoint,
    ShareChanged,
)


def endpoint(ep: RouteEndpoint) -> Endpoint:
    return Endpoint(
        replica_id=ep.replica_id,
        model=ep.model,
        host=ep.host,
        port=ep.port,
        api_key=ep.api_key,
        draining=ep.draining,
        events_port=ep.events_port,
    )


def rotation(message: RotationChanged, last: Rotation) -> Rotation:
    """The rotation `message` says, with the endpoints of `last` whose replicas it calls unknown
    (a control plane just started, their node not back yet: they most likely serve on)."""
    endpoints = tuple(endpoint(ep) for ep in message.endpoints)
    if message.unknown:
        unknown = set(message.unknown) - {ep.replica_id for ep in endpoints}
        kept = tuple(ep for ep in last.endpoints if ep.replica_id in unknown)
        endpoints = tuple(sorted(endpoints + kept, key=lambda ep: ep.replica_id))
    return Rotation(
        models=frozenset(message.models), endpoints=endpoints, version=message.version, details=message.details
    )


class GatewayTable:
    """The rotation, the keys (`keys`, the table the gateway authenticates with) and the share
    last heard, with the link's state. `now` is trio's clock, given by the caller."""

    def __init__(self, keys: KeyTable | None = None, *, now: float = 0.0) -> None:
        self.keys = keys if keys is not None else KeyTable(clock=trio.current_time)
        self.budgets = Budgets()
        self.changed = Wakeup()  # the rotation was replaced: the gateway's rotation follows
        self.whole = trio.Event()  # the first whole table came (`received`)
        self._rotation = Rotation(models=frozenset(), endpoints=())
        self.has_rotation = False
        self.has_keys = False
        self.keys_version = 0  # of the keys held (`KeysChanged.version`)
        self.made_at = now
        self.last_heard: float | None = None
        self.link_up = False
        self.link_detail = "not connected yet"
        self.endpoints = TableEndpoints(self)

    # -- TableSink ------------------------------------------------------------------------

    def rotation_changed(self, message: RotationChanged) -> None:
        self._rotation = rotation(message, self._rotation)
        self.has_rotation = True
        self.changed.fire()
        self._check_whole()

    def keys_changed(self, message: KeysChanged) -> None:
        self.keys.replace(message.keys)
        self.has_keys = True
        self.keys_version = message.version
        self._check_whole()

    def _check_whole(self) -> None:
        if self.received:
            self.whole.set()

    def share_changed(self, message: ShareChanged) -> None:
        self.keys.set_share(message)
        self.budgets.set_share(message)

    def budgets_changed(self, message: BudgetsChanged) -> None:
        self.budgets.replace(message)

    def grants_changed(self, message: GrantsChanged) -> None:
        self.budgets.grants_changed(message)

    def heard(self, now: float) -> None:
        self.last_heard = now

    def link_state(self, connected: bool, detail: str) -> None:
        self.link_up = connected
        self.link_detail = detail
        self.budgets.set_link(connected)

    @property
    def rotation(self) -> Rotation:
        return self._rotation

    # -- freshness ------------------------------------------------------------------------

    @property
    def received(self) -> bool:
        """Whether a whole table came: the rotation and the keys (the share may stay 0 of 1)."""
        return self.has_rotation and self.has_keys

    def staleness(self, now: float) -> float:
        """Seconds since the control plane was last heard, or since this table was made."""
        return max(0.0, now - (self.made_at if self.last_heard is None else self.last_heard))

    def health(self, now: float, ready: Mapping[str, int], *, draining: bool) -> tuple[int, dict]:
        """/health's status and body: 200 while a table is held with a replica ready to serve, or
        a model on demand (whose requests it holds while a replica starts); 503 with `reason`
        otherwise. `ready`: replicas in rotation per model, as the gateway's
        router sees them (its own failures taken out)."""
        body: dict = {
            "status": "ok",
            "ready": dict(ready),
            "link_up": self.link_up,
            "link_detail": self.link_detail,
            "staleness_s": round(self.staleness(now), 3),
            "keys": len(self.keys),
            "share": {"index": self.keys.share.index, "count": self.keys.share.count},
        }
        reason = self._not_serving(ready, draining=draining)
        if reason is None:
            return 200, body
        status, why = reason
        return 503, {**body, "status": status, "reason": why}

    def _not_serving(self, ready: Mapping[str, int], *, draining: bool) -> tuple[str, str] | None:
        if draining:
            return "draining", "the gateway is shutting down; requests in flight finish"
        if not self.received:
            missing = " and ".join(
                part for part, has in (("rotation", self.has_rotation), ("keys", self.has_keys)) if not has
            )
            return (
                "no_table",
                f"no table from the control plane yet (missing: {missing}); the link: {self.link_detail or 'up'}",
            )
        if not any(ready.values()) and not any(d.on_demand for d in self.rotation.details):
            # A model on demand (min_replicas = 0) has none while unused, and its requests are held
            # while one starts: a gateway holding such a model serves.
            return "no_ready_replica", "the table holds no replica ready to serve (or every one failed here)"
        return None


class TableEndpoints:
    """A table as the gateway's `EndpointProvider`: its last rotation, and when it changes."""

    def __init__(self, table: GatewayTable) -> None:
        self._table = table

    def gateway_rotation(self) -> Rotation:
        return self._table.rotation

    def rotation_changed(self) -> trio.Event:
        return self._table.changed.next()
