"""The gateway link's two adapters against each other over memory streams on MockClock: the
control plane's (`llmgw.server.links.gatewaylinks`, behind the agent port's routes) and a gateway's
(`llmgw.gatewayd.link`) feeding a recording sink. The whole table on connect, each part again
when it changes and only then, the shares renumbered as instances come and go, heartbeats both
ways, a silent peer cut by either side, and a gateway that dials again with backoff and gets the
whole table anew. The real sockets, TLS and the role checks are test_gateway_roles.py's."""

from __future__ import annotations

import random
import ssl

import attrs
import pytest
import trio
import trio.testing

from llmgw import linkclient
from llmgw.backoff import Backoff
from llmgw.gateway.routing import Endpoint, Rotation
from llmgw.gatewayd import link as gl
from llmgw.looplag import StallClock
from llmgw.server.links.agentlistener import AgentListener
from llmgw.server.links.gatewaylinks import GatewayFeed
from llmgw.server.links.gatewaytable import keys_message, rotation_message
from llmgw.server.store import KeyRow
from llmgw.wakeup import Wakeup
from llmgw.wire import gateway_link as g
from testlib.memlink import Gate, gated_pair, gateway_cert

pytestmark = pytest.mark.trio

CERT = gateway_cert()
EP = Endpoint(replica_id="r1", model="chat", host="10.0.0.1", port=8000, api_key="k1")
ALICE = KeyRow(
    name="alice",
    token_sha256="a" * 64,
    models=("chat",),
    rate_per_minute=60,
    max_concurrency=4,
    created_at=0.0,
    revoked_at=None,
)
HEARTBEAT_S = 1.0
TTL_S = 3.0


class Store:
    async def is_revoked(self, serial: int) -> bool:
        await trio.lowlevel.checkpoint()
        return False


class Endpoints:
    """The rotation the feed reads (`GatewayEndpoints`' two calls)."""

    def __init__(self) -> None:
        self.rotation = Rotation(models=frozenset({"chat"}), endpoints=(EP,))
        self.changed = Wakeup()

    def gateway_rotation(self) -> Rotation:
        return self.rotation

    def rotation_changed(self) -> trio.Event:
        return self.changed.next()

    def set(self, rotation: Rotation) -> None:
        self.rotation = rotation
        self.changed.fire()


class Keys:
    """The key ring's two calls the feed makes."""

    def __init__(self) -> None:
        self.rows = [ALICE]
        self.changed = Wakeup()

    def valid(self) -> list[KeyRow]:
        return list(self.rows)


class Sink:
    """A `TableSink` that records every call, with trio's time; `until` waits on them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.heard_at: list[float] = []
        self._called = trio.lowlevel.ParkingLot()

    def _record(self, kind: str, what: object) -> None:
        self.calls.append((kind, what))
        self._called.unpark_all()

    def rotation_changed(self, message: g.RotationChanged) -> None:
        self._record("rotation", message)

    def keys_changed(self, message: g.KeysChanged) -> None:
        self._record("keys", message)

    def share_changed(self, message: g.ShareChanged) -> None:
        self._record("share", message)

    def budgets_changed(self, message: g.BudgetsChanged) -> None:
        self._record("budgets", message)

    def grants_changed(self, message: g.GrantsChanged) -> None:
        self._record("grants", message)

    def heard(self, now: float) -> None:
        self.heard_at.append(now)
        self._called.unpark_all()

    def link_state(self, connected: bool, detail: str) -> None:
        self._record("link", (connected, detail))

    def last(self, kind: str):
        return next((what for k, what in reversed(self.calls) if k == kind), None)

    def of(self, kind: str) -> list:
        return [what for k, what in self.calls if k == kind]

    async def until(self, predicate) -> None:
        while not predicate():
            await self._called.park()


@attrs.define
class Gateway:
    link: gl.GatewayLink
    sink: Sink
    to_server: Gate | None = None
    to_gateway: Gate | None = None
    ended: list[str] = attrs.field(factory=list)
    done: trio.Event = attrs.field(factory=trio.Event)


class Plane:
    def __init__(self) -> None:
        self.endpoints = Endpoints()
        self.keys = Keys()
        self.listener = AgentListener(store=Store(), max_connections=8)
        self.feed = GatewayFeed(
            endpoints=self.endpoints,
            keys=self.keys,
            clock=StallClock(),
            heartbeat_interval_s=HEARTBEAT_S,
            silence_timeout_s=TTL_S,
        )
        self.listener.gateways = self.feed

    def gateway(self, instance: str, **kw) -> Gateway:
        sink = Sink()
        link = gl.GatewayLink(
            target=gl.Target(host="cp", port=1),
            tls=ssl.create_default_context(),
            name="gw1",
            instance=instance,
            sink=sink,
            rng=random.Random(7),
            **kw,
        )
        return Gateway(link=link, sink=sink)

    def connect(self, nursery: trio.Nursery, instance: str, **kw) -> Gateway:
        """One session of a gateway over gated memory streams."""
        a, b, to_server, to_gateway = gated_pair()
        gateway = self.gateway(instance, **kw)
        gateway.to_server, gateway.to_gateway = to_server, to_gateway

        async def run() -> None:
            try:
                await gateway.link.run_on(a)
                gateway.ended.append("ended")
            except Exception as exc:  # noqa: BLE001 - what the gateway would log
                gateway.ended.append(gateway.link.reason_of(exc))
            gateway.done.set()

        nursery.start_soon(self.listener.serve_peer, b, CERT, "10.0.0.5")
        nursery.start_soon(run)
        return gateway

    async def join(self, nursery: trio.Nursery, instance: str, **kw) -> Gateway:
        gateway = self.connect(nursery, instance, **kw)
        await gateway.sink.until(lambda: gateway.sink.last("grants") is not None)
        return gateway


@pytest.fixture
async def plane(nursery: trio.Nursery) -> Plane:
    made = Plane()
    await nursery.start(made.feed.serve)
    return made


async def test_a_gateway_gets_the_whole_table_once_welcomed(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    gateway = await plane.join(nursery, "i1")
    assert [kind for kind, _ in gateway.sink.calls] == ["link", "rotation", "keys", "share", "budgets", "grants"]
    assert gateway.sink.calls[0] == ("link", (True, ""))
    assert gateway.sink.last("rotation") == g.RotationChanged(
        models=("chat",),
        endpoints=(g.RouteEndpoint(replica_id="r1", model="chat", host="10.0.0.1", port=8000, api_key="k1"),),
        version=1,
    )
    assert gateway.sink.last("keys") == g.KeysChanged(
        keys=(
            g.GatewayKey(name="alice", token_sha256="a" * 64, models=("chat",), rate_per_minute=60, max_concurrency=4),
        ),
        version=1,
    )
    assert gateway.sink.last("share") == g.ShareChanged(index=0, count=1)
    assert len(gateway.sink.heard_at) == 6  # the Welcome and the five parts
    assert gateway.link.state.connected and gateway.link.state.server_version
    [view] = plane.feed.views()
    assert (view["name"], view["instance"], view["address"], view["share"]) == (
        "gw1",
        "i1",
        "10.0.0.5",
        {"index": 0, "count": 1},
    )


async def test_each_part_is_sent_again_when_it_changes_and_only_then(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    gateway = await plane.join(nursery, "i1")
    sink = gateway.sink
    plane.endpoints.changed.fire()  # an agent's heartbeat: the rotation did not change
    plane.keys.changed.fire()
    await trio.sleep(0.5)
    assert len(sink.of("rotation")) == len(sink.of("keys")) == 1
    left = Rotation(models=frozenset({"chat"}), endpoints=())  # the replica left rotation
    changed_at = trio.current_time()
    plane.endpoints.set(left)
    await sink.until(lambda: len(sink.of("rotation")) == 2)
    # A new version of the rotation: what a gateway's heartbeats say it routes by. Sent at once
    # but for the rest after the last look (`changes.rest`: three times a look of microseconds).
    assert sink.last("rotation") == rotation_message(left, version=2)
    assert trio.current_time() - changed_at < 0.05
    plane.keys.rows = []  # alice revoked
    changed_at = trio.current_time()
    plane.keys.changed.fire()
    await sink.until(lambda: len(sink.of("keys")) == 2)
    assert sink.last("keys") == g.KeysChanged(keys=(), version=2) and trio.current_time() == changed_at
    drained = Rotation(models=frozenset({"chat"}), endpoints=(attrs.evolve(EP, draining=True),))
    plane.endpoints.set(drained)
    await sink.until(lambda: len(sink.of("rotation")) == 3)
    assert sink.last("rotation").endpoints[0].draining


async def test_shares_are_renumbered_as_instances_come_and_go(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    gateways = [await plane.join(nursery, f"i{n}") for n in range(3)]
    for gateway in gateways:
        await gateway.sink.until(lambda gw=gateway: gw.sink.last("share").count == 3)
    assert [gw.sink.last("share") for gw in gateways] == [g.ShareChanged(index=i, count=3) for i in range(3)]
    assert [v["share"] for v in plane.feed.views()] == [{"index": i, "count": 3} for i in range(3)]
    # The second leaves: the others are 0 and 1 of 2.
    gateways[1].to_server.close()
    gateways[1].to_gateway.close()
    plane.feed.links["gw1", "i1"].cancel_scope.cancel()
    for gateway in (gateways[0], gateways[2]):
        await gateway.sink.until(lambda gw=gateway: gw.sink.last("share").count == 2)
    assert [gateways[0].sink.last("share"), gateways[2].sink.last("share")] == [
        g.ShareChanged(index=0, count=2),
        g.ShareChanged(index=1, count=2),
    ]
    assert sorted(plane.feed.links) == [("gw1", "i0"), ("gw1", "i2")]


async def test_heartbeats_go_both_ways_and_say_the_gateways_load(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    gateway = plane.gateway("i1", load=lambda metrics: g.GatewayHeartbeat(seq=0, in_flight=3, requests_total=42))
    a, b = trio.testing.memory_stream_pair()
    nursery.start_soon(plane.listener.serve_peer, b, CERT, "10.0.0.5")
    nursery.start_soon(gateway.link.run_on, a)
    await gateway.sink.until(lambda: gateway.sink.last("grants") is not None)
    heard = len(gateway.sink.heard_at)
    await trio.sleep(10 * HEARTBEAT_S + 0.5)
    assert len(gateway.sink.heard_at) - heard == 10  # a TableHeartbeat a second, and nothing else
    assert len(gateway.sink.calls) == 6
    [view] = plane.feed.views()
    assert (view["in_flight"], view["requests_total"]) == (3, 42)


async def test_the_metrics_come_once_a_heartbeat_interval_and_a_heartbeat_sent_at_once_leaves_them_out(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    """They hold a series per replica: a key change (or a new rotation) is said at once, without
    them, and the control plane keeps the figures of the last heartbeat that had them."""
    asked: list[bool] = []

    def load(metrics: bool) -> g.GatewayHeartbeat:
        asked.append(metrics)
        family = g.MetricFamily(name="beats", help="h", kind="counter", samples=(g.Sample(value=len(asked)),))
        return g.GatewayHeartbeat(seq=0, keys_version=len(asked), metrics=(family,) if metrics else None)

    await plane.join(nursery, "i1", load=load)
    [link] = plane.feed.links.values()
    began = trio.current_time()
    for i in range(10):  # ten key changes within the next two intervals, each said at once
        plane.keys.rows = [] if i % 2 == 0 else [ALICE]
        plane.keys.changed.fire()
        await trio.sleep(HEARTBEAT_S / 5)
        [value] = [f.samples[0].value for f in link.last.metrics]  # never none: those of one that had them
        assert asked[int(value) - 1] is True
    await trio.sleep(HEARTBEAT_S / 10)
    assert link.last.keys_version == len(asked)  # the newest heartbeat has come
    [value] = [f.samples[0].value for f in link.last.metrics]
    assert value == len(asked) - asked[::-1].index(True)  # with the figures of the newest that had them
    assert asked.count(False) >= 10
    assert asked.count(True) == 1 + int((trio.current_time() - began) / HEARTBEAT_S)  # the first, then one an interval


async def test_a_silent_gateway_is_cut_at_the_ttl_and_told_why(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = await plane.join(nursery, "i1")
    gateway.to_server.close()  # its heartbeats stop reaching the control plane
    stopped = trio.current_time()
    await gateway.done.wait()
    assert TTL_S <= trio.current_time() - stopped <= TTL_S + HEARTBEAT_S
    assert gateway.ended == [
        "the control plane closed the link: nothing received for 3 s (heartbeats stopped); closing the link"
    ]
    assert plane.feed.links == {}
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("gateway_link_silent")]


async def test_a_gateway_whose_control_plane_falls_silent_ends_the_session(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    gateway = await plane.join(nursery, "i1")
    gateway.to_gateway.close()  # the control plane's frames stop reaching the gateway
    stopped = trio.current_time()
    await gateway.done.wait()
    silence = max(linkclient.SILENT_HEARTBEATS * HEARTBEAT_S, linkclient.MIN_SILENCE_S)
    assert trio.current_time() - stopped == pytest.approx(silence, abs=HEARTBEAT_S)
    assert gateway.ended == [
        f"nothing from the control plane for {silence:g} s (its heartbeats stopped); dialling again"
    ]


async def test_a_newer_link_of_the_same_instance_replaces_the_older(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    first = await plane.join(nursery, "i1")
    second = await plane.join(nursery, "i1")
    await first.done.wait()
    assert list(plane.feed.links) == [("gw1", "i1")] and plane.feed.links["gw1", "i1"].session is not None
    assert second.sink.last("share") == g.ShareChanged(index=0, count=1)


async def test_a_gateway_dials_again_with_backoff_and_gets_the_whole_table_anew(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    sessions: list[trio.testing.StapledStream] = []
    refuse = [True]

    async def dial(target: gl.Target) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        if refuse[0]:
            raise ConnectionRefusedError(111, "Connection refused")
        a, b = trio.testing.memory_stream_pair()
        sessions.append(b)
        nursery.start_soon(plane.listener.serve_peer, b, CERT, "10.0.0.5")
        return a

    gateway = plane.gateway("i1", dial=dial, backoff=Backoff(first_s=0.25, max_s=3.0, jitter=True))
    await nursery.start(gateway.link.serve)
    sink = gateway.sink
    await sink.until(lambda: len(sink.of("link")) >= 3)
    refused = sink.of("link")
    assert refused[0] == (
        False,
        "nothing listens at cp:1: is `llmgw server` running there, and agent_listen set to this port?",
    )
    assert len(set(refused)) == 1 and gateway.link.state.attempts >= 3
    # The control plane comes back: the gateway is back within the backoff's ceiling, table and all.
    plane.keys.rows = []  # a key revoked while it was away
    plane.keys.changed.fire()
    refuse[0] = False
    back = trio.current_time()
    await sink.until(lambda: sink.last("link") == (True, ""))
    assert trio.current_time() - back <= gl.LINK_BACKOFF.max_s
    await sink.until(lambda: sink.last("share") is not None)
    assert sink.last("keys") == g.KeysChanged(keys=(), version=2)
    # The link drops: down with why, then up again with the whole table.
    plane.feed.links["gw1", "i1"].cancel_scope.cancel()
    await sink.until(lambda: sink.last("link") == (True, "") and len(sink.of("share")) == 2)
    downs = [state for state in sink.of("link") if not state[0]]
    assert downs[-1] == (False, "the link closed: CloseReason<code=1006, name=ABNORMAL_CLOSURE, reason=None>")
    assert len(sink.of("rotation")) == len(sink.of("keys")) == 2


async def test_the_rotation_says_which_replicas_are_not_known_yet() -> None:
    rotation = Rotation(models=frozenset({"chat"}), endpoints=(EP,), unknown=frozenset({"r3", "r2"}))
    message = rotation_message(rotation)
    assert [e.replica_id for e in message.endpoints] == ["r1"] and message.unknown == ("r2", "r3")


async def test_what_the_table_says_of_the_keys_is_their_hashes_by_name() -> None:
    bob = attrs.evolve(ALICE, name="bob", token_sha256="b" * 64, models=(), rate_per_minute=0)
    said = keys_message([bob, ALICE])
    assert [k.name for k in said.keys] == ["alice", "bob"]
    assert said.keys[1] == g.GatewayKey(name="bob", token_sha256="b" * 64, max_concurrency=4)


@attrs.define
class Held:
    """What a gateway's heartbeats say, as the test sets it: the versions it holds (None: those
    its sink last took) and its requests on each replica."""

    sink: Sink | None = None
    rotation_version: int | None = None
    keys_version: int | None = None
    outstanding: dict[str, int] = attrs.field(factory=dict)

    def load(self, metrics: bool) -> g.GatewayHeartbeat:
        assert self.sink is not None
        rotation, keys = self.sink.last("rotation"), self.sink.last("keys")
        held = sorted((r, n) for r, n in self.outstanding.items() if n)
        return g.GatewayHeartbeat(
            seq=0,
            rotation_version=_or(self.rotation_version, rotation.version if rotation else 0),
            keys_version=_or(self.keys_version, keys.version if keys else 0),
            outstanding=tuple(g.ReplicaLoad(replica_id=r, outstanding=n) for r, n in held),
        )


def _or(given: int | None, taken: int) -> int:
    return taken if given is None else given


async def joined(plane: Plane, nursery: trio.Nursery, instance: str, held: Held) -> Gateway:
    gateway = plane.connect(nursery, instance, load=held.load)
    held.sink = gateway.sink
    await gateway.sink.until(lambda: gateway.sink.last("grants") is not None)
    return gateway


async def test_a_move_waits_until_every_gateway_routes_without_the_replica_and_has_no_request_on_it(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    busy, behind = Held(outstanding={"r1": 1}), Held(rotation_version=1)  # a stream on r1; a gateway a rotation behind
    await joined(plane, nursery, "i1", busy)
    await joined(plane, nursery, "i2", behind)
    plane.endpoints.set(Rotation(models=frozenset({"chat"}), endpoints=(attrs.evolve(EP, draining=True),)))
    said: list[bool] = []

    async def quiesce() -> None:
        said.append(await plane.feed.quiesce("r1", 60.0))

    nursery.start_soon(quiesce)
    await trio.sleep(5 * HEARTBEAT_S)  # heartbeats came from both meanwhile
    assert said == [] and plane.feed.outstanding("r1") == 1
    busy.outstanding["r1"] = 0  # the stream finished
    await trio.sleep(5 * HEARTBEAT_S)
    assert said == []  # i2 says no request on r1, but from a rotation that still routes to it
    behind.rotation_version = None  # i2 takes the new rotation
    caught_up = trio.current_time()
    while not said:
        await trio.sleep(0.1)
    assert said == [True] and trio.current_time() - caught_up <= HEARTBEAT_S + 0.1
    assert await plane.feed.quiesce("r2", 0.0)  # a replica no gateway routes to: at once


async def test_a_move_stops_waiting_at_its_grace_and_for_no_gateway_at_all(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    assert await plane.feed.quiesce("r1", 0.0)  # no gateway connected: nothing to wait for
    await joined(plane, nursery, "i1", Held(outstanding={"r1": 2}))
    plane.endpoints.set(Rotation(models=frozenset({"chat"}), endpoints=()))
    started = trio.current_time()
    assert not await plane.feed.quiesce("r1", 30.0)
    assert trio.current_time() - started == pytest.approx(30.0)


async def test_a_key_change_reaches_the_gateway_at_once_and_a_stuck_one_is_waited_for_no_longer_than_asked(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    await joined(plane, nursery, "i1", Held())
    plane.keys.rows = []  # alice revoked
    plane.keys.changed.fire()
    started = trio.current_time()
    assert await plane.feed.keys_reached("gw1", 5.0)
    assert trio.current_time() - started < HEARTBEAT_S  # the gateway said so at once, not at its next beat
    assert await plane.feed.keys_reached("gw-other", 0.0)  # no instance of that gateway: nothing to wait for
    await joined(plane, nursery, "i2", Held(keys_version=1))  # never takes a newer version
    plane.keys.rows = [ALICE]
    plane.keys.changed.fire()
    started = trio.current_time()
    assert not await plane.feed.keys_reached("gw1", 2.0)
    assert trio.current_time() - started == pytest.approx(2.0)


async def test_once_the_term_is_over_the_table_is_news_no_more_and_a_new_link_is_sent_to_the_leader(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    """A leader whose lease has passed on (several control planes on one store) stops sending
    the table and answers a gateway's hello with where the leader is; `close_all` sends the
    gateways linked to it away (`llmgw.server.leadership.seat`'s step-down)."""
    from llmgw.wire import agent_link as w

    leading = [True]
    plane.feed.leading = lambda: leading[0]
    plane.feed.redirect = lambda: w.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b")
    first = await plane.join(nursery, "i1")
    leading[0] = False
    plane.endpoints.set(Rotation(models=frozenset({"chat"}), endpoints=()))  # a change: not sent
    await trio.sleep(HEARTBEAT_S / 2)
    assert len(first.sink.of("rotation")) == 1
    second = plane.connect(nursery, "i2")
    await second.done.wait()
    assert second.ended == ["the leader is cp-b"] and second.sink.of("rotation") == []
    assert [v["instance"] for v in plane.feed.views()] == ["i1"]
    assert await plane.feed.close_all(w.NOT_LEADER, "this control plane leads no more") == 1
    await first.done.wait()
    assert first.ended == ["the control plane closed the link: this control plane leads no more"]
