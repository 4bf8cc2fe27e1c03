"""The agent link's protocol without sockets: an agent session wired to a control-plane session
in memory (like h11's ConnectionPair), every frame passed as the text the WebSocket would carry.
Every sequence, refusal and version mismatch is here; tests/agent/test_link.py keeps what needs
TLS and the real endpoint."""

from __future__ import annotations

import json

import attrs
import pytest

from llmgw.wire import agent_link as w
from llmgw.wire import session as s
from llmgw.wire.convert import decode, encode, tag
from llmgw.wire.errors import LocalProtocolError, ProtocolError, UpgradeRefused, WireError

INVENTORY = w.Inventory(hostname="node-a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
STATUS = w.ReplicaStatus(replica_id="r1", model="m", state=w.READY, port=8000)


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
    w.LinkError: w.LinkError(code="test", message="bye"),
}


class Pair:
    """Both ends of one link; `deliver` hands a frame to one side and whatever that side answers
    to the other, recording each side's events."""

    def __init__(self, *, node_id: str = "node-a", cert_cn: str | None = None, make_hello=None) -> None:
        self.agent = s.AgentSession(node_id, make_hello or (lambda: hello(node_id)))
        self.server = s.ServerSession(cert_cn or node_id, heartbeat_interval_s=5.0, server_version="test")
        self.events: dict[str, list[s.Event]] = {s.AGENT: [], s.SERVER: []}

    def peer(self, side: s._Session) -> s._Session:
        return self.server if side is self.agent else self.agent

    def deliver(self, frame: str, to: s._Session) -> s.Event:
        received = to.receive(frame)
        self.events[to.role].append(received.event)
        for answer in received.send:
            self.deliver(answer, self.peer(to))
        return received.event

    def connect(self) -> s.Event:
        """Upgrade and hello: the control plane's event for the hello."""
        path, headers = self.agent.upgrade_request()
        self.server.upgrade(path, headers)
        return self.deliver(self.agent.start(), self.server)

    def join(self) -> None:
        """Upgrade, hello, welcome and the first desired state: both ends open."""
        self.connect()
        self.deliver(self.server.send(w.DesiredState(generation=1)), self.agent)
        assert self.agent.state is self.server.state is s.State.OPEN

    def refused(self, frame: str, to: s._Session) -> WireError:
        """`frame` refused by `to`, whose LinkError reaches the peer as a `Closed` event."""
        with pytest.raises(WireError) as info:
            to.receive(frame)
        assert to.state is s.State.CLOSED
        goodbye = to.close(info.value.code, str(info.value))
        assert goodbye is not None
        assert self.deliver(goodbye, self.peer(to)) == s.Closed(code=info.value.code, message=str(info.value))
        assert self.peer(to).state is s.State.CLOSED
        return info.value


# -- the sequence --------------------------------------------------------------------------


def test_a_hello_is_welcomed_then_sent_the_desired_state() -> None:
    pair = Pair()
    assert pair.connect() == s.Joined(hello=hello())
    [welcomed] = pair.events[s.AGENT]
    assert welcomed == s.WelcomeReceived(
        welcome=w.Welcome(node_id="node-a", server_version="test", heartbeat_interval_s=5.0)
    )
    # Welcome, then DesiredState: nothing else may come between.
    assert not pair.server.can_send(w.LogsRequest)
    with pytest.raises(LocalProtocolError):
        pair.server.send(w.LogsRequest(request_id=1, replica_id="r1"))
    event = pair.deliver(pair.server.send(w.DesiredState(generation=1, cordoned=True)), pair.agent)
    assert event == s.DesiredStateReceived(desired=w.DesiredState(generation=1, cordoned=True))
    assert pair.agent.open and pair.server.joined


def test_every_report_of_the_agent_is_an_event_of_the_control_plane() -> None:
    pair = Pair()
    pair.join()
    assert pair.deliver(pair.agent.heartbeat(), pair.server) == s.HeartbeatReceived(seq=1)
    assert pair.deliver(pair.agent.heartbeat(), pair.server) == s.HeartbeatReceived(seq=2)
    sent = pair.agent.send(w.InventoryChanged(inventory=INVENTORY))
    assert pair.deliver(sent, pair.server) == s.InventoryReported(inventory=INVENTORY)
    engines = (w.EngineStatus(name="sim", version="1", ok=False, detail="no"),)
    assert pair.deliver(pair.agent.send(w.EnginesChanged(engines=engines)), pair.server) == s.EnginesReported(
        engines=engines
    )
    assert pair.deliver(pair.agent.send(w.ReplicasChanged(replicas=(STATUS,))), pair.server) == s.ReplicasReported(
        replicas=(STATUS,)
    )
    assert pair.server.state is s.State.OPEN


def test_a_logs_request_is_answered() -> None:
    pair = Pair()
    pair.join()
    request = w.LogsRequest(request_id=7, replica_id="r1", lines=3)
    assert pair.deliver(pair.server.send(request), pair.agent) == s.LogsRequested(request=request)
    reply = w.LogsReply(request_id=7, replica_id="r1", text="a\nb\nc\n")
    assert pair.deliver(pair.agent.send(reply), pair.server) == s.LogsAnswered(reply=reply)


def test_desired_state_goes_out_whenever_it_changes() -> None:
    pair = Pair()
    pair.join()
    for generation in (2, 3, 4):
        pair.deliver(pair.server.send(w.DesiredState(generation=generation)), pair.agent)
    assert [e.desired.generation for e in pair.events[s.AGENT] if isinstance(e, s.DesiredStateReceived)] == [
        1,
        2,
        3,
        4,
    ]


@pytest.mark.parametrize("closer", ["agent", "control plane"])
def test_a_link_error_either_way_closes_both_ends(closer: str) -> None:
    pair = Pair()
    pair.join()
    side = pair.agent if closer == "agent" else pair.server
    goodbye = side.close("test", "going away")
    assert side.close("test", "again") is None  # said once
    assert pair.deliver(goodbye, pair.peer(side)) == s.Closed(code="test", message="going away")
    assert pair.agent.state is pair.server.state is s.State.CLOSED
    assert not pair.agent.can_send(w.Heartbeat) and not pair.server.can_send(w.DesiredState)


def test_messages_decoded_elsewhere_are_taken_as_their_frames_would_be() -> None:
    pair = Pair()
    pair.server.upgrade(*pair.agent.upgrade_request())
    received = pair.server.receive(hello())
    assert received.event == s.Joined(hello=hello()) and len(received.send) == 1
    with pytest.raises(ProtocolError):
        pair.server.receive(hello())


# -- what each side accepts in each state: the protocol's table, spelled out -----------------

SERVER_ACCEPTS = {
    "await_hello": {"hello", "link_error"},
    "welcomed": {"heartbeat", "inventory_changed", "engines_changed", "replicas_changed", "logs_reply", "link_error"},
    "open": {"heartbeat", "inventory_changed", "engines_changed", "replicas_changed", "logs_reply", "link_error"},
    "closed": set(),
}
AGENT_ACCEPTS = {
    "await_welcome": {"welcome", "link_error"},
    "open": {"desired_state", "logs_request", "link_error"},
    "closed": set(),
}


def server_in(state: str) -> s.ServerSession:
    pair = Pair()
    if state != "closed":
        pair.server.upgrade(*pair.agent.upgrade_request())
    if state in ("welcomed", "open"):
        pair.server.receive(encode(hello()))
    if state == "open":
        pair.server.send(w.DesiredState(generation=1))
    if state == "closed":
        pair.server.close("test", "closed")
    assert pair.server.state.value == state
    return pair.server


def agent_in(state: str) -> s.AgentSession:
    agent = s.AgentSession("node-a", hello)
    agent.start()
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
    assert session.state is s.State.CLOSED


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
    assert session.state is s.State.CLOSED


# -- refusals ----------------------------------------------------------------------------------


def test_a_message_before_the_hello_is_refused() -> None:
    pair = Pair()
    pair.server.upgrade(*pair.agent.upgrade_request())
    pair.agent.start()  # a hello this agent does not send first: a heartbeat instead
    refusal = pair.refused(encode(w.Heartbeat(seq=1)), pair.server)
    assert isinstance(refusal, ProtocolError) and refusal.code == w.UNEXPECTED
    assert "expected a hello from node 'node-a' (its certificate's CN), got Heartbeat" in str(refusal)


def test_a_second_hello_is_refused() -> None:
    pair = Pair()
    pair.join()
    refusal = pair.refused(encode(hello()), pair.server)
    assert refusal.code == w.UNEXPECTED and "a second hello on one link" in str(refusal)


def test_a_hello_for_another_node_is_refused() -> None:
    # The upgrade named the certificate's node; the hello names another.
    pair = Pair(node_id="node-a", make_hello=lambda: hello("node-a"))
    pair.server = s.ServerSession("node-b", heartbeat_interval_s=5.0)
    pair.server.upgrade(w.AGENT_PATH, [(w.NODE_ID_HEADER.encode(), b"node-b")])
    refusal = pair.refused(pair.agent.start(), pair.server)
    assert refusal.code == w.NODE_ID_MISMATCH
    assert "expected a hello from node 'node-b' (its certificate's CN), got hello for node 'node-a'" in str(refusal)
    # The agent hears why, in the words it logs.
    [closed] = pair.events[s.AGENT]
    assert isinstance(closed, s.Closed) and closed.code == w.NODE_ID_MISMATCH


@pytest.mark.parametrize("version", [w.PROTOCOL_VERSION - 1, w.PROTOCOL_VERSION + 1, "2", None])
def test_another_protocol_version_is_refused_before_the_rest_of_its_hello(version) -> None:
    future = json.loads(encode(hello()))
    future["protocol_version"] = version
    future["a_field_from_the_future"] = {}  # would be a bad message, were the version not checked first
    pair = Pair()
    pair.server.upgrade(*pair.agent.upgrade_request())
    pair.agent.start()
    refusal = pair.refused(json.dumps(future), pair.server)
    assert isinstance(refusal, ProtocolError) and refusal.code == w.PROTOCOL
    assert f"the agent speaks protocol {version!r} and this control plane speaks {w.PROTOCOL_VERSION}" in str(refusal)
    assert "run the same llmgw release on both" in str(refusal)


def test_a_decoded_hello_of_another_version_is_refused_too() -> None:
    server = s.ServerSession("node-a", heartbeat_interval_s=5.0)
    server.upgrade(w.AGENT_PATH, [(w.NODE_ID_HEADER, "node-a")])
    with pytest.raises(ProtocolError) as info:
        server.receive(hello(protocol_version=w.PROTOCOL_VERSION + 1))
    assert info.value.code == w.PROTOCOL


def test_the_agent_refuses_anything_but_a_welcome_first_and_a_second_welcome() -> None:
    pair = Pair()
    pair.server.upgrade(*pair.agent.upgrade_request())
    pair.server.receive(pair.agent.start())  # its Welcome is lost; a desired state comes first
    refusal = pair.refused(encode(w.DesiredState(generation=1)), pair.agent)
    assert refusal.code == w.UNEXPECTED and "expected a welcome from the control plane, got DesiredState" in str(
        refusal
    )
    again = agent_in("open")
    with pytest.raises(ProtocolError) as info:
        again.receive(encode(SERVER_SENDS[w.Welcome]))
    assert "a second welcome" in str(info.value)


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
    with pytest.raises(ProtocolError):
        pair.server.receive(pair.agent.heartbeat())
    assert not pair.server.can_send(w.DesiredState)
    with pytest.raises(LocalProtocolError):
        pair.server.send(w.DesiredState(generation=2))


# -- the upgrade -------------------------------------------------------------------------------


def test_the_upgrade_names_the_certificates_node_on_the_agent_path() -> None:
    agent = s.AgentSession("node-a", hello)
    path, headers = agent.upgrade_request()
    assert (path, headers) == ("/v1/agent", [(b"x-llmgw-node-id", b"node-a")])
    server = s.ServerSession("node-a", heartbeat_interval_s=5.0)
    server.upgrade(path, [(b"X-LLMGW-Node-Id", b"node-a")])  # header names are case-insensitive
    assert server.state is s.State.AWAIT_HELLO


@pytest.mark.parametrize(
    ("path", "headers", "status", "says"),
    [
        ("/elsewhere", [(b"x-llmgw-node-id", b"node-a")], 404, "no agent endpoint at '/elsewhere'"),
        ("/v1/agent", [(b"x-llmgw-node-id", b"node-b")], 403, "node id 'node-b' does not match its certificate CN"),
        ("/v1/agent", [], 403, "node id '' does not match its certificate CN 'node-a'"),
    ],
)
def test_an_upgrade_for_another_path_or_node_is_refused(path, headers, status: int, says: str) -> None:
    server = s.ServerSession("node-a", heartbeat_interval_s=5.0)
    with pytest.raises(UpgradeRefused) as info:
        server.upgrade(path, headers)
    assert info.value.status == status and says in str(info.value)
    with pytest.raises(ProtocolError):
        server.receive(encode(hello()))  # and no hello gets in after


# -- what our own code may not do ----------------------------------------------------------


def test_the_agent_sends_nothing_but_its_hello_until_welcomed() -> None:
    agent = s.AgentSession("node-a", hello)
    assert not agent.can_send(w.Heartbeat)
    with pytest.raises(LocalProtocolError):
        agent.heartbeat()
    with pytest.raises(LocalProtocolError):
        agent.receive(encode(SERVER_SENDS[w.Welcome]))  # nothing can arrive before our hello
    agent.start()
    with pytest.raises(LocalProtocolError):
        agent.start()
    assert not agent.can_send(w.ReplicasChanged)


def test_a_hello_for_another_node_is_not_sent() -> None:
    agent = s.AgentSession("node-a", lambda: hello("node-b"))
    with pytest.raises(LocalProtocolError):
        agent.start()


def test_the_control_plane_sends_nothing_before_the_hello_and_welcomes_once() -> None:
    server = s.ServerSession("node-a", heartbeat_interval_s=5.0)
    with pytest.raises(LocalProtocolError):
        server.receive(encode(hello()))  # the upgrade comes first
    server.upgrade(w.AGENT_PATH, [(w.NODE_ID_HEADER, "node-a")])
    assert not server.can_send(w.DesiredState)
    server.receive(encode(hello()))
    with pytest.raises(LocalProtocolError):
        server.send(SERVER_SENDS[w.Welcome])


def test_frames_are_the_wire_encoding() -> None:
    pair = Pair()
    pair.server.upgrade(*pair.agent.upgrade_request())
    frame = pair.agent.start()
    assert decode(frame, w.AgentMessage) == hello()
    [welcome] = pair.server.receive(frame).send
    assert decode(welcome, w.ServerMessage) == w.Welcome(
        node_id="node-a", server_version="test", heartbeat_interval_s=5.0
    )
