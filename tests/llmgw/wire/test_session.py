"""The agent link's protocol without sockets: an agent session wired to a control-plane session
in memory (like h11's ConnectionPair), every frame passed as the text the WebSocket would carry.
Every sequence, refusal and version mismatch is here, and what waits for a slow reader;
tests/agent/test_link.py keeps what needs TLS and the real endpoint, tests/llmgw/test_linkio.py
the writer that drains a session's outbox."""

from __future__ import annotations

import json

import attrs
import pytest

from llmgw.pki.ca import ROLE_GATEWAY
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire import session as ls
from llmgw.wire.convert import decode, encode, tag
from llmgw.wire.errors import LinkProtocolError, LocalLinkError, UpgradeRefused, WireError

INVENTORY = w.Inventory(hostname="node-a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
STATUS = w.ReplicaStatus(replica_id="r1", model="m", state=w.READY, port=8000)
GOOD = ls.Standing(serial=0xABC)  # the store knows the certificate, not revoked
WEBSOCKET = (
    (b"host", b"cp"),
    (b"upgrade", b"websocket"),
    (b"connection", b"Upgrade"),
    (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
    (b"sec-websocket-version", b"13"),
)


def hello(node_id: str = "node-a", **changes) -> w.Hello:
    made = w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="test",
        boot_id="boot",
        started_at=1.0,
        inventory=INVENTORY,
    )
    return attrs.evolve(made, **changes)


def upgrade(path: str = w.AGENT_PATH, headers=(), **changes) -> ls.UpgradeRequest:
    """An opening handshake as trio-websocket's client sends it, with `headers` added."""
    request = ls.UpgradeRequest(
        method=b"GET",
        target=path.encode(),
        http_version=b"1.1",
        headers=WEBSOCKET + tuple((k.encode() if isinstance(k, str) else k, v) for k, v in headers),
    )
    return attrs.evolve(request, **changes)


def upgrade_of(agent: s.AgentSession) -> ls.UpgradeRequest:
    path, headers = agent.upgrade_request()
    return upgrade(path, headers)


def server(node_id: str = "node-a", **kw) -> s.ServerSession:
    kw.setdefault("desired_state", lambda: w.DesiredState(generation=1))
    return s.ServerSession(node_id, heartbeat_interval_s=5.0, server_version="test", **kw)


def drain(side: ls.LinkSession) -> list[str]:
    frames = []
    while (frame := side.next_frame()) is not None:
        frames.append(frame)
    return frames


# One of every message, by the side that sends it.
AGENT_SENDS = {
    w.Hello: hello(),
    w.Heartbeat: w.Heartbeat(seq=1),
    w.InventoryChanged: w.InventoryChanged(inventory=INVENTORY),
    w.EnginesChanged: w.EnginesChanged(engines=(w.EngineStatus(name="sim", version="1", ok=True),)),
    w.ReplicasChanged: w.ReplicasChanged(replicas=(STATUS,)),
    w.LogsReply: w.LogsReply(request_id=1, replica_id="r1", text="line\n"),
    w.LinkError: w.LinkError(code="test", message="bye"),
}
SERVER_SENDS = {
    w.Welcome: w.Welcome(node_id="node-a", server_version="test", heartbeat_interval_s=5.0),
    w.DesiredState: w.DesiredState(generation=1),
    w.LogsRequest: w.LogsRequest(request_id=1, replica_id="r1", lines=10),
    w.ServerHeartbeat: w.ServerHeartbeat(seq=1),
    w.Redirect: w.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b"),
    w.LinkError: w.LinkError(code="test", message="bye"),
}


class Pair:
    """Both ends of one link: `flush` hands every frame a side queued to the other, and whatever
    that one queues in answer back, recording each side's events. The control plane's desired
    state is made when its frame is taken, generation 1, 2, ... (`made`)."""

    def __init__(self, *, node_id: str = "node-a", cert_cn: str | None = None, make_hello=None) -> None:
        self.agent = s.AgentSession(node_id, make_hello or (lambda: hello(node_id)))
        self.made = 0
        self.server = server(cert_cn or node_id, desired_state=self.desired)
        self.events: dict[str, list[s.Event]] = {s.AGENT: [], ls.SERVER: []}

    def desired(self) -> w.DesiredState:
        self.made += 1
        return w.DesiredState(generation=self.made)

    def peer(self, side: ls.LinkSession) -> ls.LinkSession:
        return self.server if side is self.agent else self.agent

    def deliver(self, frame: str, to: ls.LinkSession) -> s.Event:
        event = to.receive(frame)
        self.events[to.role].append(event)
        return event

    def flush(self) -> None:
        """Until both are quiet: every frame queued, delivered."""
        while True:
            moved = False
            for side in (self.agent, self.server):
                for frame in drain(side):
                    self.deliver(frame, self.peer(side))
                    moved = True
            if not moved:
                return

    def connect(self) -> s.Event:
        """Upgrade and hello: the control plane's event for the hello (its answer still queued)."""
        self.server.upgrade(upgrade_of(self.agent), GOOD)
        self.agent.start()
        [frame] = drain(self.agent)
        return self.deliver(frame, self.server)

    def join(self) -> None:
        """Upgrade, hello, welcome and the first desired state: both ends open."""
        self.connect()
        self.flush()
        assert self.agent.state is self.server.state is ls.State.OPEN

    def refused(self, frame: str, to: ls.LinkSession) -> WireError:
        """`frame` refused by `to`, whose LinkError reaches the peer as a `Closed` event."""
        with pytest.raises(WireError) as info:
            to.receive(frame)
        assert to.state is ls.State.CLOSED
        assert to.close(info.value.code, str(info.value))
        [goodbye] = drain(to)
        assert to.done
        assert self.deliver(goodbye, self.peer(to)) == ls.Closed(code=info.value.code, message=str(info.value))
        assert self.peer(to).state is ls.State.CLOSED
        return info.value


def desired_generations(events: list[s.Event]) -> list[int]:
    return [e.desired.generation for e in events if isinstance(e, s.DesiredStateReceived)]


# -- the sequence --------------------------------------------------------------------------


def test_a_hello_is_answered_with_the_welcome_then_the_desired_state_made_when_written() -> None:
    pair = Pair()
    assert pair.connect() == s.Joined(hello=hello())
    assert pair.server.joined and pair.made == 0  # queued, not yet made: the node is recorded first
    welcome, desired = drain(pair.server)
    assert decode(welcome, w.ServerMessage) == w.Welcome(
        node_id="node-a", server_version="test", heartbeat_interval_s=5
    )
    assert decode(desired, w.ServerMessage) == w.DesiredState(generation=1) and pair.made == 1
    assert pair.deliver(welcome, pair.agent) == s.WelcomeReceived(welcome=decode(welcome, w.ServerMessage))
    assert pair.deliver(desired, pair.agent) == s.DesiredStateReceived(desired=w.DesiredState(generation=1))
    assert pair.agent.open


def test_nothing_comes_between_the_welcome_and_the_first_desired_state() -> None:
    pair = Pair()
    pair.connect()
    rid = pair.server.request_logs("r1", 5)  # asked at once: it waits behind the session's answer
    pair.server.push()  # a change before the first desired state is written: that one is the newest
    kinds = [type(decode(f, w.ServerMessage)) for f in drain(pair.server)]
    assert kinds == [w.Welcome, w.DesiredState, w.LogsRequest] and rid == 1 and pair.made == 1


def test_every_report_of_the_agent_is_an_event_of_the_control_plane() -> None:
    pair = Pair()
    pair.join()
    pair.agent.heartbeat()
    pair.flush()
    pair.agent.heartbeat()
    pair.agent.send(w.InventoryChanged(inventory=INVENTORY))
    engines = (w.EngineStatus(name="sim", version="1", ok=False, detail="no"),)
    pair.agent.send(w.EnginesChanged(engines=engines))
    pair.agent.send(w.ReplicasChanged(replicas=(STATUS,)))
    pair.flush()
    assert pair.events[ls.SERVER][1:] == [
        s.HeartbeatReceived(seq=1),
        s.HeartbeatReceived(seq=2),
        s.InventoryReported(inventory=INVENTORY),
        s.EnginesReported(engines=engines),
        s.ReplicasReported(replicas=(STATUS,)),
    ]
    assert pair.server.state is ls.State.OPEN


def test_a_logs_request_is_answered() -> None:
    pair = Pair()
    pair.join()
    assert pair.server.request_logs("r1", 3) == 1
    [frame] = drain(pair.server)
    request = w.LogsRequest(request_id=1, replica_id="r1", lines=3)
    assert pair.deliver(frame, pair.agent) == s.LogsRequested(request=request)
    reply = w.LogsReply(request_id=1, replica_id="r1", text="a\nb\nc\n")
    pair.agent.send(reply)
    [frame] = drain(pair.agent)
    assert pair.deliver(frame, pair.server) == s.LogsAnswered(reply=reply)
    assert pair.server.logs_unanswered == 0
    assert pair.server.request_logs("r1", 3) == 2  # ids are the session's, one per request


def test_desired_state_goes_out_whenever_it_changes() -> None:
    pair = Pair()
    pair.join()
    for _ in range(3):
        pair.server.push()
        pair.flush()
    assert desired_generations(pair.events[s.AGENT]) == [1, 2, 3, 4]


@pytest.mark.parametrize("closer", ["agent", "control plane"])
def test_a_link_error_either_way_closes_both_ends(closer: str) -> None:
    pair = Pair()
    pair.join()
    side = pair.agent if closer == "agent" else pair.server
    assert side.close("test", "going away")
    assert not side.close("test", "again")  # said once
    [goodbye] = drain(side)
    assert side.done
    assert pair.deliver(goodbye, pair.peer(side)) == ls.Closed(code="test", message="going away")
    assert pair.agent.state is pair.server.state is ls.State.CLOSED
    assert not pair.agent.can_send(w.Heartbeat) and not pair.server.can_send(w.DesiredState)
    assert pair.peer(side).done and pair.peer(side).next_frame() is None  # it answers nothing


def test_messages_decoded_elsewhere_are_taken_as_their_frames_would_be() -> None:
    pair = Pair()
    pair.server.upgrade(upgrade_of(pair.agent), GOOD)
    assert pair.server.receive(hello()) == s.Joined(hello=hello())
    assert len(pair.server.outbox) == 2
    with pytest.raises(LinkProtocolError):
        pair.server.receive(hello())


# -- a slow reader: what is coalesced, what is bounded, what is dropped ----------------------


def test_unsent_desired_states_are_one_the_newest_made_once() -> None:
    pair = Pair()
    pair.join()
    for _ in range(1000):  # the agent reads nothing meanwhile
        pair.server.push()
    assert len(pair.server.outbox) == 1
    pair.flush()
    assert desired_generations(pair.events[s.AGENT]) == [1, 2] and pair.made == 2
    # A DesiredState given whole replaces an unsent one too, in its place.
    pair.server.send(w.DesiredState(generation=10))
    pair.server.request_logs("r1", 1)
    pair.server.send(w.DesiredState(generation=11))
    assert [decode(f, w.ServerMessage) for f in drain(pair.server)] == [
        w.DesiredState(generation=11),
        w.LogsRequest(request_id=1, replica_id="r1", lines=1),
    ]


def test_unsent_reports_of_the_agent_are_one_of_each_kind_the_newest() -> None:
    pair = Pair()
    pair.join()
    for i in range(100):
        pair.agent.heartbeat()
        status = attrs.evolve(STATUS, restarts=i)
        pair.agent.send(w.ReplicasChanged(replicas=(status,)))
        pair.agent.send(w.EnginesChanged(engines=(w.EngineStatus(name="sim", version=str(i), ok=True),)))
        pair.agent.send(w.InventoryChanged(inventory=attrs.evolve(INVENTORY, cpu_cores=i + 1)))
    assert len(pair.agent.outbox) == 4
    assert [decode(f, w.AgentMessage) for f in drain(pair.agent)] == [
        w.Heartbeat(seq=100),
        w.ReplicasChanged(replicas=(attrs.evolve(STATUS, restarts=99),)),
        w.EnginesChanged(engines=(w.EngineStatus(name="sim", version="99", ok=True),)),
        w.InventoryChanged(inventory=attrs.evolve(INVENTORY, cpu_cores=100)),
    ]


def test_log_requests_are_bounded_per_link() -> None:
    pair = Pair()
    pair.join()
    asked = [pair.server.request_logs(f"r{i}", 1) for i in range(s.MAX_LOGS_ASKED)]
    assert asked == list(range(1, s.MAX_LOGS_ASKED + 1))
    assert pair.server.request_logs("r-more", 1) is None  # the caller answers for the node
    assert not pair.server.can_send(w.LogsRequest)
    pair.flush()  # the agent has them all; it answers one
    pair.agent.send(w.LogsReply(request_id=3, replica_id="r2", text="x"))
    pair.flush()
    assert pair.server.logs_unanswered == s.MAX_LOGS_ASKED - 1
    assert pair.server.request_logs("r-more", 1) == s.MAX_LOGS_ASKED + 1


def test_unsent_log_replies_are_bounded_and_the_agent_asks_for_room() -> None:
    agent = agent_in("open")
    for i in range(1, s.MAX_LOGS_ASKED + 2):
        agent.receive(encode(w.LogsRequest(request_id=i, replica_id="r1")))
    for i in range(1, s.MAX_LOGS_ASKED + 1):
        assert agent.can_send(w.LogsReply)
        agent.send(w.LogsReply(request_id=i, replica_id="r1"))
    assert not agent.can_send(w.LogsReply)  # its adapter waits for the writer to make room
    with pytest.raises(LocalLinkError):
        agent.send(w.LogsReply(request_id=s.MAX_LOGS_ASKED + 1, replica_id="r1"))
    assert agent.next_frame() is not None and agent.can_send(w.LogsReply)
    agent.send(w.LogsReply(request_id=s.MAX_LOGS_ASKED + 1, replica_id="r1"))


@pytest.mark.parametrize("closer", ["agent", "control plane"])
def test_closing_drops_what_is_unsent_and_writes_the_link_error_last(closer: str) -> None:
    pair = Pair()
    pair.join()
    pair.server.push()
    pair.server.request_logs("r1", 1)
    pair.agent.heartbeat()
    pair.agent.send(w.ReplicasChanged(replicas=(STATUS,)))
    side = pair.agent if closer == "agent" else pair.server
    side.close("test", "going away")
    assert drain(side) == [encode(w.LinkError(code="test", message="going away"))]
    assert side.done and side.can_send(w.Heartbeat) is side.can_send(w.DesiredState) is False


def test_nothing_is_written_after_the_peer_closed() -> None:
    pair = Pair()
    pair.join()
    pair.server.push()
    assert pair.deliver(encode(w.LinkError(code="test", message="bye")), pair.server) == ls.Closed(
        code="test", message="bye"
    )
    assert pair.server.next_frame() is None and pair.server.done
    pair.server.push()  # a push racing the close changes nothing
    assert pair.server.next_frame() is None


def test_the_control_plane_heartbeats_an_open_link_the_newest_unsent_alone() -> None:
    pair = Pair()
    pair.server.heartbeat()  # before the hello: nothing
    pair.join()
    pair.server.heartbeat()
    pair.server.heartbeat()  # the agent reads slowly: one waits, the newest
    assert [decode(f, w.ServerMessage) for f in drain(pair.server)] == [w.ServerHeartbeat(seq=2)]
    pair.server.heartbeat()
    pair.flush()
    assert pair.events[s.AGENT][-1] == s.ServerHeartbeatReceived(seq=3)


def test_a_standby_answers_the_hello_with_where_the_leader_is_and_closes() -> None:
    pair = Pair()
    leader = w.Redirect(leader="wss://cp-b:7443", message="this control plane is a standby; the leader is cp-b")
    pair.server = server(desired_state=pair.desired, standby=lambda: leader)
    assert pair.connect() == s.Joined(hello=hello())  # the upgrade and the hello checked as a leader does
    frames = drain(pair.server)
    assert [decode(f, w.ServerMessage) for f in frames] == [
        leader,
        w.LinkError(code=w.NOT_LEADER, message=leader.message),
    ]
    assert pair.server.done and pair.made == 0  # no welcome, no desired state made
    assert pair.deliver(frames[0], pair.agent) == ls.RedirectReceived(leader="wss://cp-b:7443", message=leader.message)
    assert pair.agent.state is ls.State.CLOSED and not pair.agent.open


def test_a_standby_that_knows_no_leader_says_so() -> None:
    pair = Pair()
    none = w.Redirect(leader="", message="no control plane leads at the moment")
    pair.server = server(desired_state=pair.desired, standby=lambda: none)
    pair.connect()
    first = drain(pair.server)[0]
    assert pair.deliver(first, pair.agent) == ls.RedirectReceived(leader="", message=none.message)


def test_a_standby_refuses_an_older_agent_by_its_version_before_any_redirect() -> None:
    """An agent of the protocol before the redirect existed would not understand one: it hears
    that the versions differ, as from any control plane, and no redirect is sent."""
    older = json.loads(encode(hello()))
    older["protocol_version"] = w.PROTOCOL_VERSION - 1
    session = server(standby=lambda: w.Redirect(leader="wss://cp-b:7443", message="m"))
    session.upgrade(upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")]), GOOD)
    with pytest.raises(LinkProtocolError) as info:
        session.receive(json.dumps(older))
    assert info.value.code == w.PROTOCOL
    assert f"the agent speaks protocol {w.PROTOCOL_VERSION - 1} and this control plane speaks" in str(info.value)
    assert drain(session) == []


def test_no_desired_state_before_the_hello() -> None:
    session = server()
    session.push()
    session.upgrade(upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")]), GOOD)
    session.push()
    assert len(session.outbox) == 0 and session.request_logs("r1", 1) is None


# -- what each side accepts in each state: the protocol's table, spelled out -----------------

SERVER_ACCEPTS = {
    "await_hello": {"hello", "link_error"},
    "open": {"heartbeat", "inventory_changed", "engines_changed", "replicas_changed", "logs_reply", "link_error"},
    "closed": set(),
}
AGENT_ACCEPTS = {
    "await_welcome": {"welcome", "redirect", "link_error"},
    "open": {"desired_state", "logs_request", "server_heartbeat", "link_error"},
    "closed": set(),
}


def server_in(state: str) -> s.ServerSession:
    pair = Pair()
    if state != "closed":
        pair.server.upgrade(upgrade_of(pair.agent), GOOD)
    if state == "open":
        pair.server.receive(encode(hello()))
        pair.server.request_logs("r1", 10)  # so that the LogsReply of AGENT_SENDS answers something
    if state == "closed":
        pair.server.close("test", "closed")
    assert pair.server.state.value == state
    return pair.server


def agent_in(state: str) -> s.AgentSession:
    agent = s.AgentSession("node-a", hello)
    agent.start()
    drain(agent)  # the hello, written
    if state == "open":
        agent.receive(encode(SERVER_SENDS[w.Welcome]))
    if state == "closed":
        agent.close("test", "closed")
    assert agent.state.value == state
    return agent


@pytest.mark.parametrize("state", sorted(SERVER_ACCEPTS))
@pytest.mark.parametrize("kind", list(AGENT_SENDS) + list(SERVER_SENDS), ids=lambda k: k.__name__)
def test_what_the_control_plane_accepts_in_each_state(state: str, kind: type) -> None:
    message = AGENT_SENDS.get(kind) or SERVER_SENDS[kind]
    session = server_in(state)
    if tag(kind) in SERVER_ACCEPTS[state]:
        session.receive(encode(message))
        return
    with pytest.raises(WireError) as info:
        session.receive(encode(message))
    # The other side's messages are not ours to know; ours out of order are unexpected.
    expected = w.UNEXPECTED if kind in AGENT_SENDS else w.UNKNOWN_TYPE
    assert info.value.code == expected, info.value
    assert session.state is ls.State.CLOSED


@pytest.mark.parametrize("state", sorted(AGENT_ACCEPTS))
@pytest.mark.parametrize("kind", list(SERVER_SENDS) + list(AGENT_SENDS), ids=lambda k: k.__name__)
def test_what_the_agent_accepts_in_each_state(state: str, kind: type) -> None:
    message = SERVER_SENDS.get(kind) or AGENT_SENDS[kind]
    session = agent_in(state)
    if tag(kind) in AGENT_ACCEPTS[state]:
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
    pair.server.upgrade(upgrade_of(pair.agent), GOOD)
    pair.agent.start()  # a hello this agent does not send first: a heartbeat instead
    refusal = pair.refused(encode(w.Heartbeat(seq=1)), pair.server)
    assert isinstance(refusal, LinkProtocolError) and refusal.code == w.UNEXPECTED
    assert "expected a hello from node 'node-a' (its certificate's CN), got Heartbeat" in str(refusal)


def test_a_second_hello_is_refused() -> None:
    pair = Pair()
    pair.join()
    refusal = pair.refused(encode(hello()), pair.server)
    assert refusal.code == w.UNEXPECTED and "a second hello on one link" in str(refusal)


def test_a_hello_for_another_node_is_refused() -> None:
    # The upgrade named the certificate's node; the hello names another.
    pair = Pair(node_id="node-a", cert_cn="node-b")
    pair.server.upgrade(upgrade(headers=[(w.NODE_ID_HEADER, b"node-b")]), GOOD)
    pair.agent.start()
    [frame] = drain(pair.agent)
    refusal = pair.refused(frame, pair.server)
    assert refusal.code == w.NODE_ID_MISMATCH
    assert "expected a hello from node 'node-b' (its certificate's CN), got hello for node 'node-a'" in str(refusal)
    # The agent hears why, in the words it logs.
    [closed] = pair.events[s.AGENT]
    assert isinstance(closed, ls.Closed) and closed.code == w.NODE_ID_MISMATCH


@pytest.mark.parametrize("version", [w.PROTOCOL_VERSION - 1, w.PROTOCOL_VERSION + 1, "2", None])
def test_another_protocol_version_is_refused_before_the_rest_of_its_hello(version) -> None:
    future = json.loads(encode(hello()))
    future["protocol_version"] = version
    future["a_field_from_the_future"] = {}  # would be a bad message, were the version not checked first
    pair = Pair()
    pair.server.upgrade(upgrade_of(pair.agent), GOOD)
    pair.agent.start()
    refusal = pair.refused(json.dumps(future), pair.server)
    assert isinstance(refusal, LinkProtocolError) and refusal.code == w.PROTOCOL
    assert f"the agent speaks protocol {version!r} and this control plane speaks {w.PROTOCOL_VERSION}" in str(refusal)
    assert "run the same llmgw release on both" in str(refusal)


def test_a_decoded_hello_of_another_version_is_refused_too() -> None:
    session = server()
    session.upgrade(upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")]), GOOD)
    with pytest.raises(LinkProtocolError) as info:
        session.receive(hello(protocol_version=w.PROTOCOL_VERSION + 1))
    assert info.value.code == w.PROTOCOL


def test_the_agent_refuses_anything_but_a_welcome_first_and_a_second_welcome() -> None:
    pair = Pair()
    pair.connect()
    drain(pair.server)  # its Welcome is lost; a desired state comes first
    refusal = pair.refused(encode(w.DesiredState(generation=1)), pair.agent)
    assert refusal.code == w.UNEXPECTED and "expected a welcome from the control plane, got DesiredState" in str(
        refusal
    )
    again = agent_in("open")
    with pytest.raises(LinkProtocolError) as info:
        again.receive(encode(SERVER_SENDS[w.Welcome]))
    assert "a second welcome" in str(info.value)


@pytest.mark.parametrize(
    ("change", "code", "says"),
    [
        (
            {"node_id": "node-b"},
            w.NODE_ID_MISMATCH,
            "the control plane welcomed node 'node-b' on the link of node 'node-a'",
        ),
        ({"server_version": ""}, w.BAD_MESSAGE, "names no server version this agent can read ('')"),
        ({"server_version": "1.0 beta"}, w.BAD_MESSAGE, "names no server version this agent can read ('1.0 beta')"),
        ({"server_version": "9" * 65}, w.BAD_MESSAGE, "names no server version this agent can read"),
        ({"heartbeat_interval_s": 0.0}, w.BAD_MESSAGE, "asks for a heartbeat every 0 s"),
        ({"heartbeat_interval_s": 0.001}, w.BAD_MESSAGE, "sends one every 0.01 to 3600 s"),
        ({"heartbeat_interval_s": 3601.0}, w.BAD_MESSAGE, "asks for a heartbeat every 3601 s"),
    ],
)
def test_the_agent_refuses_a_welcome_for_another_node_or_without_a_version_or_heartbeat_it_can_keep(
    change: dict, code: str, says: str
) -> None:
    pair = Pair()
    pair.connect()
    welcome, _ = drain(pair.server)
    refusal = pair.refused(encode(attrs.evolve(decode(welcome, w.ServerMessage), **change)), pair.agent)
    assert refusal.code == code and says in str(refusal), refusal
    assert pair.events[ls.SERVER][-1] == ls.Closed(code=code, message=str(refusal))  # the control plane hears why


@pytest.mark.parametrize("version", ["0.1.0.dev0", "0.0.1-e2e", "1.2.3+local.7", "test"])
def test_the_agent_takes_any_release_version_of_its_protocol(version: str) -> None:
    # The protocol version is checked by the control plane on the hello; releases may differ.
    agent = s.AgentSession("node-a", hello)
    agent.start()
    welcome = attrs.evolve(SERVER_SENDS[w.Welcome], server_version=version)
    assert agent.receive(encode(welcome)) == s.WelcomeReceived(welcome=welcome)


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (w.LogsReply(request_id=9, replica_id="r1"), "a logs reply for request 9 (replica 'r1'), which this control"),
        (w.LogsReply(request_id=1, replica_id="r2"), "a logs reply for request 1 (replica 'r2')"),
    ],
)
def test_a_logs_reply_to_no_request_of_this_link_is_refused(reply: w.LogsReply, says: str) -> None:
    pair = Pair()
    pair.join()
    pair.server.request_logs("r1", 1)
    pair.flush()
    refusal = pair.refused(encode(reply), pair.server)
    assert refusal.code == w.UNEXPECTED and says in str(refusal), refusal
    assert "unanswered: [1]" in str(refusal)


def test_a_logs_reply_is_taken_once() -> None:
    pair = Pair()
    pair.join()
    pair.server.request_logs("r1", 1)
    pair.flush()
    reply = encode(w.LogsReply(request_id=1, replica_id="r1", text="x"))
    pair.deliver(reply, pair.server)
    refusal = pair.refused(reply, pair.server)
    assert "was answered already (unanswered: [])" in str(refusal)


def test_the_agent_refuses_a_logs_request_asked_twice_before_its_answer() -> None:
    agent = agent_in("open")
    request = encode(w.LogsRequest(request_id=4, replica_id="r1"))
    agent.receive(request)
    with pytest.raises(LinkProtocolError) as info:
        agent.receive(request)
    assert info.value.code == w.UNEXPECTED and "logs request 4 asked again" in str(info.value)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("not json", w.BAD_MESSAGE),
        ("[1, 2]", w.BAD_MESSAGE),
        ('{"type": "heartbeat"}', w.BAD_MESSAGE),
        ('{"type": "heartbeat", "seq": 1, "extra": true}', w.BAD_MESSAGE),
        ('{"type": "reboot_now"}', w.UNKNOWN_TYPE),
        ('{"seq": 1}', w.UNKNOWN_TYPE),
    ],
)
def test_frames_that_do_not_parse_are_refused_with_their_code(frame: str, code: str) -> None:
    pair = Pair()
    pair.join()
    assert pair.refused(frame, pair.server).code == code


def test_after_a_refusal_everything_is_refused() -> None:
    pair = Pair()
    pair.join()
    with pytest.raises(WireError):
        pair.server.receive("not json")
    pair.agent.heartbeat()
    with pytest.raises(LinkProtocolError):
        pair.server.receive(pair.agent.next_frame())
    assert not pair.server.can_send(w.DesiredState)
    with pytest.raises(LocalLinkError):
        pair.server.send(w.DesiredState(generation=2))


# -- the upgrade -------------------------------------------------------------------------------


def test_the_upgrade_names_the_certificates_node_on_the_agent_path() -> None:
    agent = s.AgentSession("node-a", hello)
    path, headers = agent.upgrade_request()
    assert (path, headers) == ("/v1/agent", [(b"x-llmgw-node-id", b"node-a")])
    session = server()
    session.upgrade(upgrade(path, [(b"X-LLMGW-Node-Id", b"node-a")]), GOOD)  # header names are case-insensitive
    assert session.state is ls.State.AWAIT_HELLO


@pytest.mark.parametrize(
    ("request_", "standing", "status", "says"),
    [
        # The certificate first: a revoked node learns that, whatever else it asked.
        (upgrade("/elsewhere"), ls.Standing(serial=0xABC, revoked=True), 403, "(serial abc) was revoked"),
        (upgrade("/elsewhere"), ls.Standing(serial=0xABC, unknown="locked"), 503, "database is busy or failing"),
        # Then its role: a gateway's certificate cannot act as a node.
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")]),
            ls.Standing(serial=0xABC, role=ROLE_GATEWAY),
            403,
            "(serial abc) is not a node certificate (its role: llmgw-gateway), and only a node's may act as a node "
            "here; a gateway connects at /v1/gateway",
        ),
        (upgrade("/elsewhere", [(w.NODE_ID_HEADER, b"node-a")]), GOOD, 404, "no agent link at '/elsewhere'"),
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-b")]),
            GOOD,
            403,
            "node id 'node-b' does not match its certificate",
        ),
        (upgrade(), GOOD, 403, "node id '' does not match its certificate CN 'node-a'"),
        # Then RFC 6455's opening handshake (§4.1, §4.2.1), so trio-websocket refuses nothing.
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")], method=b"POST"),
            GOOD,
            400,
            "expected a WebSocket upgrade (GET, HTTP/1.1) to /v1/agent, got POST HTTP/1.1",
        ),
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")], http_version=b"1.0"),
            GOOD,
            400,
            "got GET HTTP/1.0",
        ),
        (
            ls.UpgradeRequest(
                method=b"GET",
                target=b"/v1/agent",
                http_version=b"1.1",
                headers=((w.NODE_ID_HEADER.encode(), b"node-a"),),
            ),
            GOOD,
            400,
            "no 'Upgrade: websocket'; no 'Connection: Upgrade'; not one Sec-WebSocket-Key; Sec-WebSocket-Version is not 13",
        ),
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-a"), (b"sec-websocket-key", b"again")]),
            GOOD,
            400,
            "not one Sec-WebSocket-Key",
        ),
        (
            upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")], early=13),
            GOOD,
            400,
            "13 bytes after the upgrade request, before the server's 101",
        ),
    ],
)
def test_an_upgrade_is_refused_for_its_certificate_path_node_or_handshake(
    request_: ls.UpgradeRequest, standing: ls.Standing, status: int, says: str
) -> None:
    session = server()
    with pytest.raises(UpgradeRefused) as info:
        session.upgrade(request_, standing)
    assert info.value.status == status and says in str(info.value), info.value
    with pytest.raises(LinkProtocolError):
        session.receive(encode(hello()))  # and no hello gets in after


def test_the_mirror_asks_the_certificate_what_the_link_asks() -> None:
    s.check_standing("node-a", GOOD)
    s.check_node_role("node-a", GOOD)
    with pytest.raises(UpgradeRefused) as info:
        s.check_standing("node-a", ls.Standing(serial=0xABC, revoked=True))
    assert info.value.status == 403 and "`llmgw node add USER@HOST --reissue`" in str(info.value)
    with pytest.raises(UpgradeRefused) as info:
        s.check_node_role("gw1", ls.Standing(serial=0xABC, role=ROLE_GATEWAY))
    assert info.value.status == 403 and "`llmgw node add USER@HOST --reissue`" in str(info.value)


# -- what our own code may not do ----------------------------------------------------------


def test_the_agent_sends_nothing_but_its_hello_until_welcomed() -> None:
    agent = s.AgentSession("node-a", hello)
    assert not agent.can_send(w.Heartbeat)
    with pytest.raises(LocalLinkError):
        agent.heartbeat()
    with pytest.raises(LocalLinkError):
        agent.receive(encode(SERVER_SENDS[w.Welcome]))  # nothing can arrive before our hello
    agent.start()
    with pytest.raises(LocalLinkError):
        agent.start()
    assert not agent.can_send(w.ReplicasChanged)


def test_a_hello_for_another_node_is_not_sent() -> None:
    agent = s.AgentSession("node-a", lambda: hello("node-b"))
    with pytest.raises(LocalLinkError):
        agent.start()


def test_the_agent_replies_only_to_what_it_was_asked() -> None:
    agent = agent_in("open")
    with pytest.raises(LocalLinkError):
        agent.send(w.LogsReply(request_id=1, replica_id="r1"))
    agent.receive(encode(w.LogsRequest(request_id=1, replica_id="r1")))
    with pytest.raises(LocalLinkError):
        agent.send(w.LogsReply(request_id=1, replica_id="r2"))
    agent.send(w.LogsReply(request_id=1, replica_id="r1"))
    with pytest.raises(LocalLinkError):
        agent.send(w.LogsReply(request_id=1, replica_id="r1"))  # answered once


def test_the_control_plane_sends_nothing_before_the_hello_and_welcomes_once() -> None:
    session = server()
    with pytest.raises(LocalLinkError):
        session.receive(encode(hello()))  # the upgrade comes first
    session.upgrade(upgrade(headers=[(w.NODE_ID_HEADER, b"node-a")]), GOOD)
    assert not session.can_send(w.DesiredState) and session.next_frame() is None
    session.receive(encode(hello()))
    with pytest.raises(LocalLinkError):
        session.send(SERVER_SENDS[w.Welcome])
    with pytest.raises(LocalLinkError):
        session.upgrade(upgrade(), GOOD)


def test_frames_are_the_wire_encoding() -> None:
    pair = Pair()
    pair.server.upgrade(upgrade_of(pair.agent), GOOD)
    pair.agent.start()
    [frame] = drain(pair.agent)
    assert decode(frame, w.AgentMessage) == hello()
    pair.server.receive(frame)
    welcome, _ = drain(pair.server)
    assert decode(welcome, w.ServerMessage) == w.Welcome(
        node_id="node-a", server_version="test", heartbeat_interval_s=5.0
    )


def test_speeds_are_reported_and_unsent_ones_are_the_newest_alone() -> None:
    pair = Pair()
    pair.join()
    for i in range(50):
        speed = w.BackendSpeed(engine="llamacpp", backend="cpu", state=w.SPEED_OK, gen_tps=float(i + 1))
        pair.agent.send(w.SpeedsChanged(speeds=(speed,)))
    assert len(pair.agent.outbox) == 1
    pair.flush()
    assert pair.events[ls.SERVER][1:] == [s.SpeedsReported(speeds=(speed,))]
    asked = w.DesiredState(generation=2, bench="bench-1")
    assert decode(encode(asked), w.ServerMessage).bench == "bench-1"
