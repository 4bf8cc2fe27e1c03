"""The agent link's protocol, both ends, as state machines with no I/O (after h11).

A session is told each frame its side receives (`receive`: the text, or a message) and answers
with what happened (one event) and what to send back; every frame its side sends goes through it
too (`send`, `close`), so neither side can speak out of turn. It never touches a socket, a clock
or trio: `llmgw.server.endpoint` and `agent.link` are the adapters that move frames, keep the
deadlines and act on the events. Two sessions wired together in memory are the protocol's tests
(tests/llmgw/wire/test_session.py).

    agent                                          control plane
    GET AGENT_PATH, NODE_ID_HEADER: node id  --->  `ServerSession.upgrade`: the path, and the
      (the WebSocket upgrade)                      certificate's node id (else HTTP 404 / 403)
    Hello  --------------------------------->  first; of PROTOCOL_VERSION, for that node id
           <---------------------------------  Welcome, then DesiredState
    Heartbeat, InventoryChanged,
    EnginesChanged, ReplicasChanged  ------->
           <---------------------------------  DesiredState (whenever it changes), LogsRequest
    LogsReply ------------------------------>
    LinkError, either way: the sender's last frame before it closes (`close`).

RECEIVES and SENDS below are the whole of the sequence. A frame they do not allow raises a
`ProtocolError` (one that does not parse, a `WireError`) carrying the code and message of the
LinkError to answer with; the session is then closed and `close` gives that frame.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from llmgw import __version__
from llmgw.errors import shown
from llmgw.wire import agent_link as w
from llmgw.wire.convert import TAG, encode, parse, structure, tag
from llmgw.wire.errors import LocalProtocolError, ProtocolError, UpgradeRefused, WireError


class State(enum.Enum):
    UPGRADE = "upgrade"  # control plane: the WebSocket upgrade request not yet checked
    START = "start"  # agent: hello not yet sent
    AWAIT_HELLO = "await_hello"  # control plane: upgraded, waiting for the hello
    WELCOME = "welcome"  # control plane: hello taken, Welcome next
    WELCOMED = "welcomed"  # control plane: Welcome sent, DesiredState next
    AWAIT_WELCOME = "await_welcome"  # agent: hello sent
    OPEN = "open"
    CLOSED = "closed"  # a LinkError went either way, or a frame was refused


AGENT, SERVER = "agent", "control plane"
_REPORTS = (w.Heartbeat, w.InventoryChanged, w.EnginesChanged, w.ReplicasChanged, w.LogsReply)

# role -> state -> {message type that side may receive: the state after it}
RECEIVES: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {
        State.AWAIT_HELLO: {w.Hello: State.WELCOME, w.LinkError: State.CLOSED},
        State.WELCOMED: {**{t: State.WELCOMED for t in _REPORTS}, w.LinkError: State.CLOSED},
        State.OPEN: {**{t: State.OPEN for t in _REPORTS}, w.LinkError: State.CLOSED},
    },
    AGENT: {
        State.AWAIT_WELCOME: {w.Welcome: State.OPEN, w.LinkError: State.CLOSED},
        State.OPEN: {w.DesiredState: State.OPEN, w.LogsRequest: State.OPEN, w.LinkError: State.CLOSED},
    },
}
# role -> state -> {message type that side may send: the state after it}. A LinkError may be
# sent once in any state (`close`).
SENDS: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {
        State.WELCOME: {w.Welcome: State.WELCOMED},
        State.WELCOMED: {w.DesiredState: State.OPEN},
        State.OPEN: {w.DesiredState: State.OPEN, w.LogsRequest: State.OPEN},
    },
    AGENT: {
        State.START: {w.Hello: State.AWAIT_WELCOME},
        State.OPEN: {t: State.OPEN for t in _REPORTS},
    },
}


# -- events: what a received frame meant ---------------------------------------------------


@attrs.frozen(kw_only=True)
class Joined:
    """The agent said hello; the Welcome to send is in `Received.send`."""

    hello: w.Hello


@attrs.frozen(kw_only=True)
class HeartbeatReceived:
    seq: int


@attrs.frozen(kw_only=True)
class InventoryReported:
    inventory: w.Inventory


@attrs.frozen(kw_only=True)
class EnginesReported:
    engines: tuple[w.EngineStatus, ...]


@attrs.frozen(kw_only=True)
class ReplicasReported:
    replicas: tuple[w.ReplicaStatus, ...]


@attrs.frozen(kw_only=True)
class LogsAnswered:
    reply: w.LogsReply


@attrs.frozen(kw_only=True)
class WelcomeReceived:
    welcome: w.Welcome


@attrs.frozen(kw_only=True)
class DesiredStateReceived:
    desired: w.DesiredState


@attrs.frozen(kw_only=True)
class LogsRequested:
    request: w.LogsRequest


@attrs.frozen(kw_only=True)
class Closed:
    """The peer sent its LinkError: it closes the link, and says why."""

    code: str
    message: str


Event = (
    Joined
    | HeartbeatReceived
    | InventoryReported
    | EnginesReported
    | ReplicasReported
    | LogsAnswered
    | WelcomeReceived
    | DesiredStateReceived
    | LogsRequested
    | Closed
)

_EVENTS: dict[type, Callable[[Any], Event]] = {
    w.Hello: lambda m: Joined(hello=m),
    w.Heartbeat: lambda m: HeartbeatReceived(seq=m.seq),
    w.InventoryChanged: lambda m: InventoryReported(inventory=m.inventory),
    w.EnginesChanged: lambda m: EnginesReported(engines=m.engines),
    w.ReplicasChanged: lambda m: ReplicasReported(replicas=m.replicas),
    w.LogsReply: lambda m: LogsAnswered(reply=m),
    w.Welcome: lambda m: WelcomeReceived(welcome=m),
    w.DesiredState: lambda m: DesiredStateReceived(desired=m),
    w.LogsRequest: lambda m: LogsRequested(request=m),
    w.LinkError: lambda m: Closed(code=m.code, message=m.message),
}


@attrs.frozen(kw_only=True)
class Received:
    """What one received frame meant, and the frames to send now, in order."""

    event: Event
    send: tuple[str, ...] = ()


class _Session:
    role: str
    accepts: Any  # the union of message types this side receives

    def __init__(self, state: State) -> None:
        self.state = state
        self._said_goodbye = False

    def can_send(self, kind: type) -> bool:
        """Whether a message of `kind` may be sent now (a task that pushes asks first)."""
        return kind in SENDS[self.role].get(self.state, {})

    def send(self, message: Any) -> str:
        """The frame for `message`; `LocalProtocolError` if this side may not send it now."""
        after = SENDS[self.role].get(self.state, {}).get(type(message))
        if after is None:
            raise LocalProtocolError(
                f"the {self.role} may not send {type(message).__name__} in state {self.state.value}"
            )
        self.state = after
        return encode(message)

    def close(self, code: str, message: str) -> str | None:
        """The LinkError frame that ends the link (after a refusal: `exc.code`, `str(exc)`);
        None if this side already sent one."""
        self.state = State.CLOSED
        if self._said_goodbye:
            return None
        self._said_goodbye = True
        return encode(w.LinkError(code=code, message=message))

    def receive(self, frame: str | bytes | Any) -> Received:
        """One frame from the peer: its event and the frames to answer with; `WireError` (or its
        `ProtocolError`) if it is refused, and the session is closed."""
        if self.state in (State.UPGRADE, State.START):
            raise LocalProtocolError(f"the {self.role} received a frame before its side began ({self.state.value})")
        try:
            message = self._decode(frame if isinstance(frame, (str, bytes)) else encode(frame))
            after = RECEIVES[self.role].get(self.state, {}).get(type(message))
            if after is None:
                raise ProtocolError(w.UNEXPECTED, self._unexpected(message))
            self._check(message)
        except WireError:
            self.state = State.CLOSED
            raise
        self.state = after
        return Received(event=_EVENTS[type(message)](message), send=self._answer(message))

    def _decode(self, text: str | bytes) -> Any:
        return structure(parse(text), self.accepts)

    def _unexpected(self, message: Any) -> str:
        raise NotImplementedError

    def _check(self, message: Any) -> None:
        """Refuse what the tables allow by type but not by content."""

    def _answer(self, message: Any) -> tuple[str, ...]:
        return ()


class ServerSession(_Session):
    """The control plane's end of one agent's link; `expected_node_id` is the CN of the
    certificate the agent connected with."""

    role = SERVER
    accepts = w.AgentMessage

    def __init__(
        self, expected_node_id: str, *, heartbeat_interval_s: float, server_version: str = __version__
    ) -> None:
        super().__init__(State.UPGRADE)
        self.expected_node_id = expected_node_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.server_version = server_version

    @property
    def joined(self) -> bool:
        """The agent's hello was taken: a refusal now is of a message, not of the node."""
        return self.state in (State.WELCOME, State.WELCOMED, State.OPEN)

    def upgrade(self, path: str, headers: Iterable[tuple[bytes | str, bytes | str]]) -> None:
        """Check the WebSocket upgrade request; `UpgradeRefused` with the HTTP status if refused."""
        if self.state is not State.UPGRADE:
            raise LocalProtocolError(f"upgrade checked twice ({self.state.value})")
        self.state = State.CLOSED  # until it passes
        if path != w.AGENT_PATH:
            raise UpgradeRefused(404, f"no agent endpoint at {shown(path)}; agents connect to {w.AGENT_PATH}")
        claimed = _header(headers, w.NODE_ID_HEADER)
        if claimed != self.expected_node_id:
            raise UpgradeRefused(
                403,
                f"node id {shown(claimed)} does not match its certificate CN {self.expected_node_id!r}; set node_id in "
                "agent.toml to the certificate's CN, or reissue the certificate with `llmgw node add USER@HOST --reissue`",
            )
        self.state = State.AWAIT_HELLO

    def _decode(self, text: str | bytes) -> Any:
        data = parse(text)
        if data.get(TAG) == tag(w.Hello):
            # Before the rest: another version's hello may not parse as ours at all.
            self._check_version(data.get("protocol_version"))
        return structure(data, self.accepts)

    def _check_version(self, version: object) -> None:
        if version != w.PROTOCOL_VERSION:
            raise ProtocolError(
                w.PROTOCOL,
                f"the agent speaks protocol {version!r} and this control plane speaks {w.PROTOCOL_VERSION}; run the "
                "same llmgw release on both (reinstall the node's llmgw to upgrade the node)",
            )

    def _check(self, message: Any) -> None:
        if isinstance(message, w.Hello):
            self._check_version(message.protocol_version)
            if message.node_id != self.expected_node_id:
                raise ProtocolError(
                    w.NODE_ID_MISMATCH,
                    f"expected a hello from node {self.expected_node_id!r} (its certificate's CN), got hello for "
                    f"node {message.node_id!r}; set node_id in agent.toml to the certificate's CN",
                )

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_HELLO:
            return f"expected a hello from node {self.expected_node_id!r} (its certificate's CN), got {kind}"
        if isinstance(message, w.Hello):
            return f"a second hello on one link from node {self.expected_node_id!r}; an agent says hello once per connection"
        return f"unexpected {kind} ({self.state.value})"

    def _answer(self, message: Any) -> tuple[str, ...]:
        if isinstance(message, w.Hello):
            welcome = w.Welcome(
                node_id=self.expected_node_id,
                server_version=self.server_version,
                heartbeat_interval_s=self.heartbeat_interval_s,
            )
            return (self.send(welcome),)
        return ()


class AgentSession(_Session):
    """The agent's end of one connection; `make_hello` is called once, by `start`."""

    role = AGENT
    accepts = w.ServerMessage

    def __init__(self, node_id: str, make_hello: Callable[[], w.Hello]) -> None:
        super().__init__(State.START)
        self.node_id = node_id
        self.make_hello = make_hello
        self._seq = 0

    @property
    def open(self) -> bool:
        """Welcomed and not closed: reports may be sent."""
        return self.state is State.OPEN

    def upgrade_request(self) -> tuple[str, list[tuple[bytes, bytes]]]:
        """The path and extra headers of the WebSocket upgrade."""
        return w.AGENT_PATH, [(w.NODE_ID_HEADER.encode(), self.node_id.encode())]

    def start(self) -> str:
        """The hello frame, the first this side sends."""
        hello = self.make_hello()
        if hello.node_id != self.node_id:
            raise LocalProtocolError(f"hello for node {hello.node_id!r} on the link of node {self.node_id!r}")
        return self.send(hello)

    def heartbeat(self) -> str:
        self._seq += 1
        return self.send(w.Heartbeat(seq=self._seq))

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_WELCOME:
            return f"expected a welcome from the control plane, got {kind}"
        if isinstance(message, w.Welcome):
            return "a second welcome on one link from the control plane"
        return f"unexpected {kind} from the control plane ({self.state.value})"


def _header(headers: Iterable[tuple[bytes | str, bytes | str]], name: str) -> str:
    for key, value in headers:
        key = key.decode("latin-1") if isinstance(key, bytes) else key
        if key.lower() == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return ""
