"""The gateway link's protocol without sockets: a gateway session wired to a control-plane session
in memory, every frame passed as the text the WebSocket would carry. The sequence, every
refusal (the certificate's role, the upgrade, the first message, the version, malformed frames)
and what waits for a slow reader are here; tests/llmgw/server/test_gatewayfeed.py has the real
sockets and TLS."""

from __future__ import annotations

import json

import attrs
import pytest

from llmgw.errors import shown
from llmgw.pki.ca import ROLE_GATEWAY, ROLE_NODE
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire import gateway_session as gs
from llmgw.wire import session as ls
from llmgw.wire.convert import decode, encode, tag
from llmgw.wire.errors import LinkProtocolError, LocalLinkError, UpgradeRefused, WireError

GOOD = ls.Standing(serial=0xABC, role=ROLE_GATEWAY)  # a gateway's certificate, not revoked
WEBSOCKET = (
    (b"host", b"cp"),
    (b"upgrade", b"websocket"),
    (b"connection", b"Upgrade"),
    (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
    (b"sec-websocket-version", b"13"),
)
ENDPOINT = g.RouteEndpoint(replica_id="r1", model="chat", host="10.0.0.1", port=8000, api_key="k")
KEY = g.GatewayKey(name="alice", token_sha256="ab" * 32, models=("chat",), rate_per_minute=60)


def hello(name: str = "gw1", instance: str = "i1", **changes) -> g.GatewayHello:
    made = g.GatewayHello(
        protocol_version=g.GATEWAY_PROTOCOL_VERSION,
        name=name,
        instance=instance,
        gateway_version="test",
        started_at=1.0,
    )
    return attrs.evolve(made, **changes)


def upgrade(path: str = g.GATEWAY_PATH, headers=(), **changes) -> ls.UpgradeRequest:
    request = ls.UpgradeRequest(
        method=b"GET",
        target=path.encode(),
        http_version=b"1.1",
        headers=WEBSOCKET + tuple((k.encode() if isinstance(k, str) else k, v) for k, v in headers),
    )
    return attrs.evolve(request, **changes)


NAMED = ((g.GATEWAY_NAME_HEADER, b"gw1"), (g.GATEWAY_INSTANCE_HEADER, b"i1"))


BUDGET = g.GatewayBudget(id="key:k1::day", scope_kind="key", scope="k1", period="day", tokens=1000)


class Table:
    """The control plane's table, each part made when its frame is taken (counted in `made`)."""

    def __init__(self) -> None:
        self.rotation = g.RotationChanged(models=("chat",), endpoints=(ENDPOINT,))
        self.keys = g.KeysChanged(keys=(KEY,))
        self.share = g.ShareChanged(index=0, count=1)
        self.budgets = g.BudgetsChanged(budgets=(BUDGET,), version=1)
        self.grants = g.GrantsChanged(grants=(g.BudgetGrant(budget_id=BUDGET.id, period_start=0, tokens=100),))
        self.made: list[type] = []

    def __call__(self, kind: type):
        self.made.append(kind)
        return {
            g.RotationChanged: self.rotation,
            g.KeysChanged: self.keys,
            g.ShareChanged: self.share,
            g.BudgetsChanged: self.budgets,
            g.GrantsChanged: self.grants,
        }[kind]


def server(table=None, name: str = "gw1") -> gs.GatewayServerSession:
    return gs.GatewayServerSession(name, heartbeat_interval_s=5.0, table=table or Table(), server_version="test")


def drain(side: ls.LinkSession) -> list[str]:
    frames = []
    while (frame := side.next_frame()) is not None:
        frames.append(frame)
    return frames


class Pair:
    """Both ends of one gateway link; `flush` hands every frame a side queued to the other,
    recording each side's events."""

    def __init__(self, *, name: str = "gw1", instance: str = "i1", cert_cn: str | None = None, make_hello=None):
        self.gateway = gs.GatewaySession(name, instance, make_hello or (lambda: hello(name, instance)))
        self.table = Table()
        self.server = server(self.table, cert_cn or name)
        self.events: dict[str, list] = {gs.GATEWAY: [], gs.SERVER: []}

    def peer(self, side: ls.LinkSession) -> ls.LinkSession:
        return self.server if side is self.gateway else self.gateway

    def deliver(self, frame: str, to: ls.LinkSession):
        event = to.receive(frame)
        self.events[to.role].append(event)
        return event

    def flush(self) -> None:
        while True:
            moved = False
            for side in (self.gateway, self.server):
                for frame in drain(side):
                    self.deliver(frame, self.peer(side))
                    moved = True
            if not moved:
                return

    def upgrade(self) -> None:
        path, headers = self.gateway.upgrade_request()
        self.server.upgrade(upgrade(path, headers), GOOD)

    def connect(self):
        self.upgrade()
        self.gateway.start()
        [frame] = drain(self.gateway)
        return self.deliver(frame, self.server)

    def join(self) -> None:
        self.connect()
        self.flush()
        assert self.gateway.state is self.server.state is ls.State.OPEN

    def refused(self, frame: str, to: ls.LinkSession) -> WireError:
        with pytest.raises(WireError) as info:
            to.receive(frame)
        assert to.state is ls.State.CLOSED
        assert to.close(info.value.code, str(info.value))
        [goodbye] = drain(to)
        assert to.done
        assert self.deliver(goodbye, self.peer(to)) == ls.Closed(code=info.value.code, message=str(info.value))
        assert self.peer(to).state is ls.State.CLOSED
        return info.value


def table_of(events: list) -> list:
    return [e.message for e in events if isinstance(e, gs.TableChanged)]


# -- the sequence --------------------------------------------------------------------------


def test_a_hello_is_answered_with_the_welcome_then_the_whole_table_made_when_written() -> None:
    pair = Pair()
    assert pair.connect() == gs.GatewayJoined(hello=hello())
    assert pair.server.joined and pair.table.made == []  # queued, not yet made
    frames = drain(pair.server)
    assert [decode(f, g.ControlMessage) for f in frames] == [
        g.GatewayWelcome(name="gw1", instance="i1", server_version="test", heartbeat_interval_s=5.0),
        pair.table.rotation,
        pair.table.keys,
        pair.table.share,
        pair.table.budgets,
        pair.table.grants,
    ]
    assert pair.table.made == [g.RotationChanged, g.KeysChanged, g.ShareChanged, g.BudgetsChanged, g.GrantsChanged]
    for frame in frames:
        pair.deliver(frame, pair.gateway)
    assert pair.gateway.open
    assert pair.events[gs.GATEWAY][0] == gs.Welcomed(welcome=decode(frames[0], g.ControlMessage))
    assert table_of(pair.events[gs.GATEWAY]) == [
        pair.table.rotation,
        pair.table.keys,
        pair.table.share,
        pair.table.budgets,
        pair.table.grants,
    ]


def test_the_upgrade_names_the_gateway_and_its_instance() -> None:
    path, headers = gs.GatewaySession("gw1", "i1", hello).upgrade_request()
    assert path == g.GATEWAY_PATH == "/v1/gateway"
    assert headers == [(b"x-llmgw-gateway", b"gw1"), (b"x-llmgw-gateway-instance", b"i1")]


def test_a_change_pushes_the_newest_part_and_heartbeats_go_both_ways() -> None:
    pair = Pair()
    pair.join()
    pair.table.rotation = g.RotationChanged(models=("chat",), endpoints=())  # the replica left rotation
    pair.server.push(g.RotationChanged)
    pair.server.heartbeat()
    pair.gateway.heartbeat(g.GatewayHeartbeat(seq=0, in_flight=3, requests_total=10, rotation_version=4))
    pair.flush()
    assert pair.events[gs.GATEWAY][-2:] == [
        gs.TableChanged(message=g.RotationChanged(models=("chat",), endpoints=())),
        gs.TableHeartbeatReceived(seq=1),
    ]
    assert pair.events[gs.SERVER][-1] == gs.GatewayHeartbeatReceived(
        heartbeat=g.GatewayHeartbeat(seq=1, in_flight=3, requests_total=10, rotation_version=4)
    )


def test_a_heartbeat_without_metrics_that_replaces_an_unsent_one_keeps_its_metrics() -> None:
    """One sent at once (a new rotation) leaves the figures out; if it takes the place of a
    periodic one not yet written, the figures that one had still go."""
    pair = Pair()
    pair.join()
    figures = (g.MetricFamily(name="x", help="h", kind="gauge", samples=(g.Sample(value=2.0),)),)
    pair.gateway.heartbeat(g.GatewayHeartbeat(seq=0, rotation_version=1, metrics=figures))
    pair.gateway.heartbeat(g.GatewayHeartbeat(seq=0, rotation_version=2))
    pair.flush()
    pair.gateway.heartbeat(g.GatewayHeartbeat(seq=0, rotation_version=3))  # nothing unsent: none
    pair.flush()
    assert [e.heartbeat for e in pair.events[gs.SERVER][-2:]] == [
        g.GatewayHeartbeat(seq=2, rotation_version=2, metrics=figures),
        g.GatewayHeartbeat(seq=3, rotation_version=3, metrics=None),
    ]


def test_a_long_frame_is_read_the_same_off_the_loop_and_refused_the_same() -> None:
    """`Session.decode` touches nothing of the session (a thread runs it for a long frame,
    `llmgw.linkio.readable`): what `receive` makes of its answer is what it makes of the frame."""
    many = tuple(g.Sample(labels=("chat", f"r{i}"), value=float(i)) for i in range(2000))
    beat = encode(
        g.GatewayHeartbeat(
            seq=1,
            metrics=(g.MetricFamily(name="x", help="h", kind="gauge", labels=("model", "replica"), samples=many),),
        )
    )
    assert len(beat) > 64 * 1024
    pair, other = Pair(), Pair()
    pair.join(), other.join()
    decoded = pair.server.decode(beat)
    assert pair.server.state is other.server.state  # untouched
    assert pair.server.receive(decoded) == other.server.receive(beat)
    bad = beat.replace('"value":1999.0', '"value":"1999"')
    first, second = Pair(), Pair()
    first.join(), second.join()
    refused = first.refused(first.server.decode(bad), first.server)  # type: ignore[arg-type]
    assert str(refused) == str(second.refused(bad, second.server))
    assert "samples[1999]: value: expected a finite number, got '1999'" in str(refused)


def test_a_slow_reader_holds_one_of_each_kind_the_newest() -> None:
    pair = Pair()
    pair.join()
    for i in range(100):
        pair.table.keys = g.KeysChanged(keys=(attrs.evolve(KEY, rate_per_minute=i),))
        pair.server.push(g.KeysChanged)
        pair.server.push(g.ShareChanged)
        pair.server.push(g.RotationChanged)
        pair.server.heartbeat()
        pair.gateway.heartbeat(g.GatewayHeartbeat(seq=0, requests_total=i))
    assert len(pair.server.outbox) == 4 and len(pair.gateway.outbox) == 1
    pair.table.made.clear()
    pair.flush()
    assert pair.table.made == [g.KeysChanged, g.ShareChanged, g.RotationChanged]  # in the order first queued
    assert table_of(pair.events[gs.GATEWAY])[-3] == g.KeysChanged(keys=(attrs.evolve(KEY, rate_per_minute=99),))
    assert pair.events[gs.GATEWAY][-1] == gs.TableHeartbeatReceived(seq=100)
    assert pair.events[gs.SERVER][-1] == gs.GatewayHeartbeatReceived(
        heartbeat=g.GatewayHeartbeat(seq=100, requests_total=99)
    )


def test_budget_reports_keep_the_newest_unsent_and_grants_follow_a_push() -> None:
    pair = Pair()
    pair.join()
    for want in range(1, 50):
        pair.gateway.budget_report(
            g.BudgetReport(budgets=(g.BudgetUse(budget_id=BUDGET.id, period_start=0, want=want),))
        )
    assert len(pair.gateway.outbox) == 1
    pair.table.grants = g.GrantsChanged(grants=(g.BudgetGrant(budget_id=BUDGET.id, period_start=0, tokens=500),))
    pair.server.push(g.GrantsChanged)
    pair.flush()
    (reported,) = (e.report for e in pair.events[gs.SERVER] if isinstance(e, gs.BudgetReported))
    assert reported.budgets[0].want == 49  # only the newest went
    assert table_of(pair.events[gs.GATEWAY])[-1] == pair.table.grants


def test_nothing_of_the_table_before_the_hello_and_nothing_after_a_close() -> None:
    session = server()
    session.push(g.RotationChanged)
    session.heartbeat()
    session.upgrade(upgrade(headers=NAMED), GOOD)
    session.push(g.KeysChanged)
    session.heartbeat()
    assert len(session.outbox) == 0 and session.next_frame() is None
    session.receive(encode(hello()))
    session.receive(encode(w.LinkError(code="test", message="bye")))
    session.push(g.KeysChanged)  # a push racing the close changes nothing
    assert session.next_frame() is None and session.done
    with pytest.raises(LocalLinkError):
        session.push(g.TableHeartbeat)  # no part of the table: a bug of the caller's


@pytest.mark.parametrize("closer", [gs.GATEWAY, gs.SERVER])
def test_closing_drops_what_is_unsent_and_writes_the_link_error_last(closer: str) -> None:
    pair = Pair()
    pair.join()
    pair.server.push(g.RotationChanged)
    pair.server.heartbeat()
    pair.gateway.heartbeat()
    side = pair.gateway if closer == gs.GATEWAY else pair.server
    side.close("test", "going away")
    assert drain(side) == [encode(w.LinkError(code="test", message="going away"))]
    assert side.done


def test_a_standby_answers_the_hello_with_where_the_leader_is_and_closes() -> None:
    pair = Pair()
    leader = w.Redirect(leader="wss://cp-b:7443", message="this control plane is a standby; the leader is cp-b")
    pair.server = gs.GatewayServerSession(
        "gw1", heartbeat_interval_s=5.0, table=pair.table, server_version="test", standby=lambda: leader
    )
    assert pair.connect() == gs.GatewayJoined(hello=hello())  # the same checks as a leader's first
    frames = drain(pair.server)
    assert [decode(f, g.ControlMessage) for f in frames] == [
        leader,
        w.LinkError(code=w.NOT_LEADER, message=leader.message),
    ]
    assert pair.server.done and pair.table.made == []  # no welcome and nothing of the table
    assert pair.deliver(frames[0], pair.gateway) == ls.RedirectReceived(
        leader="wss://cp-b:7443", message=leader.message
    )
    assert pair.gateway.state is ls.State.CLOSED and not pair.gateway.open


def test_a_standby_refuses_an_older_gateway_by_its_version_before_any_redirect() -> None:
    """A gateway of the protocol before the redirect existed would not understand one: it is told
    the versions differ, as every control plane tells it, and nothing of a redirect is sent."""
    older = json.loads(encode(hello()))
    older["protocol_version"] = g.GATEWAY_PROTOCOL_VERSION - 1
    session = gs.GatewayServerSession(
        "gw1", heartbeat_interval_s=5.0, table=Table(), standby=lambda: w.Redirect(leader="wss://b:1", message="m")
    )
    session.upgrade(upgrade(headers=NAMED), GOOD)
    with pytest.raises(LinkProtocolError) as info:
        session.receive(json.dumps(older))
    assert info.value.code == w.PROTOCOL
    assert f"the gateway speaks gateway protocol {g.GATEWAY_PROTOCOL_VERSION - 1} and this control plane" in str(
        info.value
    )
    assert drain(session) == []


# -- what each side accepts in each state ----------------------------------------------------

GATEWAY_SENDS = {
    g.GatewayHello: hello(),
    g.GatewayHeartbeat: g.GatewayHeartbeat(seq=1),
    g.UsageReport: g.UsageReport(seq=1),
    g.BudgetReport: g.BudgetReport(budgets=(g.BudgetUse(budget_id="key:k1::day", period_start=0, want=10),)),
    w.LinkError: w.LinkError(code="test", message="bye"),
}
SERVER_SENDS = {
    g.GatewayWelcome: g.GatewayWelcome(name="gw1", instance="i1", server_version="test", heartbeat_interval_s=5.0),
    g.RotationChanged: g.RotationChanged(models=("chat",), endpoints=(ENDPOINT,)),
    g.KeysChanged: g.KeysChanged(keys=(KEY,)),
    g.ShareChanged: g.ShareChanged(index=1, count=2),
    g.BudgetsChanged: g.BudgetsChanged(budgets=()),
    g.GrantsChanged: g.GrantsChanged(),
    g.TableHeartbeat: g.TableHeartbeat(seq=1),
    g.UsageAck: g.UsageAck(seq=1),  # refused by a gateway that sent no report (`test_usage_...`)
    w.Redirect: w.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b"),
    w.LinkError: w.LinkError(code="test", message="bye"),
}
SERVER_ACCEPTS = {
    "await_hello": {"gateway_hello", "link_error"},
    "open": {"gateway_heartbeat", "usage_report", "budget_report", "link_error"},
    "closed": set(),
}
GATEWAY_ACCEPTS = {
    "await_welcome": {"gateway_welcome", "redirect", "link_error"},
    "open": {
        "rotation_changed",
        "keys_changed",
        "share_changed",
        "budgets_changed",
        "grants_changed",
        "table_heartbeat",
        "link_error",
    },
    "closed": set(),
}
# The agent link's messages are another link's: not known here at all.
AGENT_LINK = [w.Hello, w.Welcome, w.Heartbeat, w.DesiredState]


def server_in(state: str) -> gs.GatewayServerSession:
    session = server()
    if state != "closed":
        session.upgrade(upgrade(headers=NAMED), GOOD)
    if state == "open":
        session.receive(encode(hello()))
    if state == "closed":
        session.close("test", "closed")
    assert session.state.value == state
    return session


def gateway_in(state: str) -> gs.GatewaySession:
    session = gs.GatewaySession("gw1", "i1", hello)
    session.start()
    drain(session)
    if state == "open":
        session.receive(encode(SERVER_SENDS[g.GatewayWelcome]))
    if state == "closed":
        session.close("test", "closed")
    assert session.state.value == state
    return session


AGENT_LINK_MESSAGES = {
    w.Hello: w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id="gw1",
        agent_version="t",
        boot_id="b",
        started_at=1.0,
        inventory=w.Inventory(hostname="h", os="l", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1),
    ),
    w.Welcome: w.Welcome(node_id="gw1", server_version="t", heartbeat_interval_s=5.0),
    w.Heartbeat: w.Heartbeat(seq=1),
    w.DesiredState: w.DesiredState(generation=1),
}


@pytest.mark.parametrize("state", sorted(SERVER_ACCEPTS))
@pytest.mark.parametrize("kind", [*GATEWAY_SENDS, *SERVER_SENDS, *AGENT_LINK], ids=lambda k: k.__name__)
def test_what_the_control_plane_accepts_in_each_state(state: str, kind: type) -> None:
    message = GATEWAY_SENDS.get(kind) or SERVER_SENDS.get(kind) or AGENT_LINK_MESSAGES[kind]
    session = server_in(state)
    if tag(kind) in SERVER_ACCEPTS[state]:
        session.receive(encode(message))
        return
    with pytest.raises(WireError) as info:
        session.receive(encode(message))
    expected = w.UNEXPECTED if kind in GATEWAY_SENDS else w.UNKNOWN_TYPE
    assert info.value.code == expected, info.value
    assert session.state is ls.State.CLOSED


@pytest.mark.parametrize("state", sorted(GATEWAY_ACCEPTS))
@pytest.mark.parametrize("kind", [*SERVER_SENDS, *GATEWAY_SENDS, *AGENT_LINK], ids=lambda k: k.__name__)
def test_what_the_gateway_accepts_in_each_state(state: str, kind: type) -> None:
    message = SERVER_SENDS.get(kind) or GATEWAY_SENDS.get(kind) or AGENT_LINK_MESSAGES[kind]
    session = gateway_in(state)
    if tag(kind) in GATEWAY_ACCEPTS[state]:
        session.receive(encode(message))
        return
    with pytest.raises(WireError) as info:
        session.receive(encode(message))
    expected = w.UNEXPECTED if kind in SERVER_SENDS else w.UNKNOWN_TYPE
    assert info.value.code == expected, info.value
    assert session.state is ls.State.CLOSED


# -- refusals ----------------------------------------------------------------------------------


def test_a_message_before_the_hello_is_refused() -> None:
    pair = Pair()
    pair.upgrade()
    pair.gateway.start()  # a hello this gateway does not send first: a heartbeat instead
    refusal = pair.refused(encode(g.GatewayHeartbeat(seq=1)), pair.server)
    assert isinstance(refusal, LinkProtocolError) and refusal.code == w.UNEXPECTED
    assert "expected a hello from gateway 'gw1', got GatewayHeartbeat" in str(refusal)


def test_a_second_hello_is_refused() -> None:
    pair = Pair()
    pair.join()
    refusal = pair.refused(encode(hello()), pair.server)
    assert refusal.code == w.UNEXPECTED and "a second hello on one link" in str(refusal)


@pytest.mark.parametrize(
    ("said", "says"),
    [
        (hello(name="gw2"), "got hello for gateway 'gw2', instance 'i1'"),
        (hello(instance="i2"), "got hello for gateway 'gw1', instance 'i2'"),
    ],
)
def test_a_hello_for_another_gateway_or_instance_is_refused(said: g.GatewayHello, says: str) -> None:
    pair = Pair()
    pair.upgrade()
    pair.gateway.start()
    refusal = pair.refused(encode(said), pair.server)
    assert refusal.code == g.NAME_MISMATCH
    assert "expected a hello from gateway 'gw1' (its certificate's CN), instance 'i1'" in str(refusal)
    assert says in str(refusal)


@pytest.mark.parametrize("version", [g.GATEWAY_PROTOCOL_VERSION + 1, 0, "1", None])
def test_another_protocol_version_is_refused_before_the_rest_of_its_hello(version) -> None:
    future = json.loads(encode(hello()))
    future["protocol_version"] = version
    future["a_field_from_the_future"] = {}  # would be a bad message, were the version not checked first
    pair = Pair()
    pair.upgrade()
    pair.gateway.start()
    refusal = pair.refused(json.dumps(future), pair.server)
    assert refusal.code == w.PROTOCOL
    assert (
        f"the gateway speaks gateway protocol {shown(version)} and this control plane speaks {g.GATEWAY_PROTOCOL_VERSION}"
        in str(refusal)
    )
    assert "run the same llmgw release on both" in str(refusal)


@pytest.mark.parametrize(
    ("frame", "code", "says"),
    [
        ("not json", w.BAD_MESSAGE, "frame is not JSON"),
        ("[1, 2]", w.BAD_MESSAGE, "frame is a JSON list, expected an object"),
        ('{"type": "nothing_we_know"}', w.UNKNOWN_TYPE, "unknown message type 'nothing_we_know'"),
        ('{"type": "gateway_heartbeat"}', w.BAD_MESSAGE, "malformed gateway_heartbeat"),
        ('{"type": "gateway_heartbeat", "seq": -1}', w.BAD_MESSAGE, "expected a whole number from 0"),
        ('{"type": "gateway_heartbeat", "seq": 1, "extra": 2}', w.BAD_MESSAGE, "extra"),
        (
            '{"type": "gateway_heartbeat", "seq": 1, "metrics": [{"name": "x", "help": "h", "kind": "histogram", '
            '"labels": ["model"], "buckets": [0.1, 1.0], "samples": [{"labels": ["chat"], "counts": [1, 2]}]}]}',
            w.BAD_MESSAGE,
            "has a series with 2 counts for 2 buckets and the one above them",
        ),
        (
            '{"type": "gateway_heartbeat", "seq": 1, "metrics": [{"name": "x 1\\ny 2", "help": "h", "kind": "gauge"}]}',
            w.BAD_MESSAGE,
            "has a name that is not a Prometheus name",
        ),
        (
            '{"type": "gateway_heartbeat", "seq": 1, "metrics": [{"name": "x", "help": "h\\n# TYPE y gauge", '
            '"kind": "gauge"}]}',
            w.BAD_MESSAGE,
            "help on more than one line",
        ),
        (
            '{"type": "gateway_heartbeat", "seq": 1, "metrics": [{"name": "x", "help": "h", "kind": "gauge", '
            '"labels": ["a"], "samples": [{"labels": []}]}]}',
            w.BAD_MESSAGE,
            "a series with 0 label values for 1 labels",
        ),
    ],
)
def test_a_malformed_frame_from_the_gateway_is_refused(frame: str, code: str, says: str) -> None:
    pair = Pair()
    pair.join()
    refusal = pair.refused(frame, pair.server)
    assert refusal.code == code and says in str(refusal), refusal


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (g.ShareChanged(index=2, count=2), "share 2 of 2, which is none"),
        (g.ShareChanged(index=0, count=0), "share 0 of 0, which is none"),
        (
            g.RotationChanged(models=("chat",), endpoints=(attrs.evolve(ENDPOINT, port=70000),)),
            "replica 'r1' in the rotation has port 70000",
        ),
        (
            g.RotationChanged(models=("chat",), endpoints=(attrs.evolve(ENDPOINT, port=0),)),
            "has port 0",
        ),
    ],
)
def test_a_table_the_gateway_cannot_use_is_refused(message, says: str) -> None:
    pair = Pair()
    pair.join()
    refusal = pair.refused(encode(message), pair.gateway)
    assert refusal.code == w.BAD_MESSAGE and says in str(refusal)
    assert pair.events[gs.SERVER][-1] == ls.Closed(code=w.BAD_MESSAGE, message=str(refusal))


def test_a_malformed_table_frame_is_refused_by_the_gateway() -> None:
    pair = Pair()
    pair.join()
    rotation = json.loads(encode(SERVER_SENDS[g.RotationChanged]))
    rotation["endpoints"][0]["port"] = "8000"
    refusal = pair.refused(json.dumps(rotation), pair.gateway)
    assert refusal.code == w.BAD_MESSAGE and "malformed rotation_changed" in str(refusal)


@pytest.mark.parametrize(
    ("welcome", "code", "says"),
    [
        (attrs.evolve(SERVER_SENDS[g.GatewayWelcome], name="gw2"), g.NAME_MISMATCH, "welcomed gateway 'gw2'"),
        (attrs.evolve(SERVER_SENDS[g.GatewayWelcome], instance="i9"), g.NAME_MISMATCH, "instance 'i9'"),
        (attrs.evolve(SERVER_SENDS[g.GatewayWelcome], server_version="a b"), w.BAD_MESSAGE, "no server version"),
        (attrs.evolve(SERVER_SENDS[g.GatewayWelcome], heartbeat_interval_s=0.0), w.BAD_MESSAGE, "every 0 s"),
    ],
)
def test_a_welcome_for_another_gateway_or_one_it_cannot_keep_is_refused(welcome, code: str, says: str) -> None:
    pair = Pair()
    pair.connect()
    drain(pair.server)
    refusal = pair.refused(encode(welcome), pair.gateway)
    assert refusal.code == code and says in str(refusal), refusal


def test_the_first_message_from_the_control_plane_must_be_the_welcome() -> None:
    pair = Pair()
    pair.connect()
    refusal = pair.refused(encode(SERVER_SENDS[g.RotationChanged]), pair.gateway)
    assert refusal.code == w.UNEXPECTED
    assert "expected a welcome from the control plane, got RotationChanged" in str(refusal)


NODE = ls.Standing(serial=0xABC)  # a node's certificate: no role in it, the node role


@pytest.mark.parametrize(
    ("request_", "standing", "status", "says"),
    [
        # The certificate first: its role, then its standing in the store.
        (
            upgrade(headers=NAMED),
            NODE,
            403,
            "'gw1' (serial abc) is not a gateway certificate (its role: llmgw-node), and only a gateway's may open "
            "the gateway link; issue this gateway its own on the control plane with `llmgw ca issue --gateway NAME`",
        ),
        (upgrade(headers=NAMED), attrs.evolve(GOOD, revoked=True), 403, "`llmgw ca issue --gateway gw1`"),
        (upgrade(headers=NAMED), attrs.evolve(GOOD, unknown="locked"), 503, "the gateway retries by itself"),
        (upgrade("/v1/agent", NAMED), GOOD, 404, "no gateway link at '/v1/agent'; gateways connect to /v1/gateway"),
        (
            upgrade(headers=[(g.GATEWAY_NAME_HEADER, b"gw2"), (g.GATEWAY_INSTANCE_HEADER, b"i1")]),
            GOOD,
            403,
            "gateway name 'gw2' does not match its certificate CN 'gw1'",
        ),
        (
            upgrade(headers=[(g.GATEWAY_NAME_HEADER, b"gw1")]),
            GOOD,
            400,
            "the gateway's instance '' (x-llmgw-gateway-instance)",
        ),
        (
            upgrade(headers=[(g.GATEWAY_NAME_HEADER, b"gw1"), (g.GATEWAY_INSTANCE_HEADER, b"a b")]),
            GOOD,
            400,
            "must be 1 to 64 letters",
        ),
        (
            upgrade(headers=NAMED, method=b"POST"),
            GOOD,
            400,
            "expected a WebSocket upgrade (GET, HTTP/1.1) to /v1/gateway",
        ),
        (upgrade(headers=NAMED, early=3), GOOD, 400, "3 bytes after the upgrade request"),
    ],
)
def test_an_upgrade_is_refused_for_its_certificate_path_name_instance_or_handshake(
    request_: ls.UpgradeRequest, standing: ls.Standing, status: int, says: str
) -> None:
    session = server()
    with pytest.raises(UpgradeRefused) as info:
        session.upgrade(request_, standing)
    assert info.value.status == status and says in str(info.value), info.value
    with pytest.raises(LinkProtocolError):
        session.receive(encode(hello()))  # and no hello gets in after


def test_a_node_certificate_issued_before_roles_counts_as_a_node_and_is_refused() -> None:
    assert NODE.role == ROLE_NODE
    with pytest.raises(UpgradeRefused):
        gs.check_gateway_standing("node-a", NODE)
    gs.check_gateway_standing("gw1", GOOD)


# -- what our own code may not do ----------------------------------------------------------


def test_the_gateway_sends_nothing_but_its_hello_until_welcomed() -> None:
    session = gs.GatewaySession("gw1", "i1", hello)
    session.heartbeat()  # not open: nothing queued
    assert session.next_frame() is None
    with pytest.raises(LocalLinkError):
        session.receive(encode(SERVER_SENDS[g.GatewayWelcome]))  # nothing can arrive before our hello
    session.start()
    with pytest.raises(LocalLinkError):
        session.start()
    with pytest.raises(LocalLinkError):
        session.send(g.GatewayHeartbeat(seq=1))


def test_a_hello_for_another_gateway_is_not_sent() -> None:
    with pytest.raises(LocalLinkError):
        gs.GatewaySession("gw1", "i1", lambda: hello(instance="i2")).start()


def test_the_control_plane_checks_the_upgrade_once_and_sends_only_the_table() -> None:
    session = server()
    with pytest.raises(LocalLinkError):
        session.receive(encode(hello()))  # the upgrade comes first
    session.upgrade(upgrade(headers=NAMED), GOOD)
    with pytest.raises(LocalLinkError):
        session.upgrade(upgrade(headers=NAMED), GOOD)
    session.receive(encode(hello()))
    with pytest.raises(LocalLinkError):
        session.send(SERVER_SENDS[g.GatewayWelcome])


def test_instances_are_distinct_tokens_the_upgrade_accepts() -> None:
    made = {gs.new_instance() for _ in range(50)}
    assert len(made) == 50
    for instance in made:
        server().upgrade(
            upgrade(headers=[(g.GATEWAY_NAME_HEADER, b"gw1"), (g.GATEWAY_INSTANCE_HEADER, instance.encode())]), GOOD
        )


# -- usage reports -----------------------------------------------------------------------------

ROW = g.UsageRow(hour=7200, key="alice", team="t", model="chat", requests=2, prompt_tokens=10, completion_tokens=4)


def test_usage_reports_go_one_at_a_time_each_acknowledged() -> None:
    pair = Pair()
    pair.join()
    first = g.UsageReport(seq=1, rows=(ROW,))
    assert pair.gateway.report(first)
    assert not pair.gateway.report(g.UsageReport(seq=2, rows=(ROW,)))  # not before the first is acknowledged
    pair.flush()
    assert pair.events[gs.SERVER][-1] == gs.UsageReported(report=first)
    with pytest.raises(LocalLinkError, match="the one waiting is 1"):
        pair.server.ack(2)
    pair.server.ack(1)
    pair.flush()
    assert pair.events[gs.GATEWAY][-1] == gs.UsageAcked(seq=1)
    assert pair.gateway.report(g.UsageReport(seq=2, rows=(ROW,)))
    pair.flush()
    assert pair.events[gs.SERVER][-1].report.seq == 2


def test_a_report_before_the_last_is_acknowledged_and_an_ack_of_another_are_refused() -> None:
    pair = Pair()
    pair.join()
    pair.server.receive(encode(g.UsageReport(seq=1, rows=(ROW,))))
    with pytest.raises(LinkProtocolError, match="before report 1 was acknowledged") as info:
        pair.server.receive(encode(g.UsageReport(seq=2)))
    assert info.value.code == w.UNEXPECTED and pair.server.state is ls.State.CLOSED
    other = Pair()
    other.join()
    assert other.gateway.report(g.UsageReport(seq=3))
    with pytest.raises(LinkProtocolError, match="acknowledged usage report 4, and the one sent on this link is 3"):
        other.gateway.receive(encode(g.UsageAck(seq=4)))


@pytest.mark.parametrize(
    "report",
    [
        g.UsageReport(seq=0),
        g.UsageReport(seq=1, rows=(attrs.evolve(ROW, hour=7201),)),
        g.UsageReport(seq=1, rows=(attrs.evolve(ROW, prompt_tokens=-1),)),
        g.UsageReport(seq=1, rows=(attrs.evolve(ROW, key=""),)),
    ],
)
def test_a_usage_report_the_ledger_cannot_take_is_refused(report: g.UsageReport) -> None:
    pair = Pair()
    pair.join()
    with pytest.raises(WireError) as info:
        pair.server.receive(encode(report))
    assert info.value.code == w.BAD_MESSAGE and "usage" in str(info.value)
