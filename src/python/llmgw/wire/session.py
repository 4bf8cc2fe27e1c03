"""The agent link's protocol, both ends, as state machines with no I/O (after h11).

Every rule of the link is here, and nowhere else: which upgrade request is accepted, which
frame may come when, what each side answers, which reply matches which request, what waits
for a slow reader. A session is told each frame its side receives (`receive`: the text, or a
message) and answers with what it meant (one event); what its side sends it queues in its
outbox, whence the link's one writer takes frames (`next_frame`). It never touches a socket, a
clock or trio: `llmgw.server.endpoint` and `agent.link` are the adapters that move frames
between trio-websocket and the session, keep the deadlines and act on the events. Two sessions
wired together in memory are the protocol's tests (tests/llmgw/wire/test_session.py).

    agent                                          control plane
    GET AGENT_PATH, NODE_ID_HEADER: node id  --->  `ServerSession.upgrade`: the certificate not
      (the WebSocket upgrade)                      revoked (the store's answer, `Standing`) and a
                                                   node's (not a gateway's: `check_node_role`), the
                                                   path, the claimed node id its CN, an opening
                                                   handshake (RFC 6455 §4.1, §4.2.1); else HTTP
                                                   403 or 503, 403, 404, 403, 400
    Hello  --------------------------------->  first; of PROTOCOL_VERSION, for that node id
           <---------------------------------  Welcome, then DesiredState: the hello's answer;
                                               or, from a control plane that does not lead,
                                               Redirect (where the leader is), LinkError, closed
    the Welcome is for our node id, names a server version and a heartbeat we can keep
    Heartbeat, InventoryChanged,
    EnginesChanged, ReplicasChanged  ------->
           <---------------------------------  DesiredState (`push`), LogsRequest (`request_logs`),
                                               ServerHeartbeat every heartbeat interval (`heartbeat`)
    LogsReply  ----------------------------->  to a request asked and not yet answered
    LinkError, either way: the sender's last frame before it closes (`close`).

RECEIVES and SENDS below are the whole of the sequence. A frame they do not allow raises a
`ProtocolError` (one that does not parse, a `WireError`) carrying the code and message of the
LinkError to answer with; the session is then closed, and `close` queues that LinkError.

Sending is queueing (`llmgw.wire.outbox`), and a link's memory stays bounded whatever its peer
does. When the peer reads slowly or not at all:

- coalesced, a newer replacing an unsent older one in its place: DesiredState, ServerHeartbeat,
  Heartbeat, InventoryChanged, EnginesChanged, ReplicasChanged (each says the whole of what it reports; a
  DesiredState is made by `desired_state` when the writer takes it, so it is the newest then);
- bounded: at most MAX_LOGS_ASKED LogsRequests asked and unanswered per link (past it
  `request_logs` gives None and the caller answers for the node), and as many LogsReplies unsent
  (the agent waits for room before answering another request, reading nothing meanwhile, which
  holds the control plane back);
- dropped: everything unsent when the link closes (`close`); a reconnect resends everything.

So a link holds at most its first frame, one message of each coalesced kind, MAX_LOGS_ASKED
requests or replies and its LinkError. A peer that takes nothing is cut by the adapter's send
deadline, not by memory.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from llmgw import __version__
from llmgw.errors import cut, shown
from llmgw.pki.ca import ROLE_NODE
from llmgw.wire import agent_link as w
from llmgw.wire.convert import TAG, encode, parse, structure, tag
from llmgw.wire.errors import LocalProtocolError, ProtocolError, UpgradeRefused, WireError
from llmgw.wire.gateway_link import GATEWAY_PATH
from llmgw.wire.outbox import Outbox


class State(enum.Enum):
    UPGRADE = "upgrade"  # control plane: the WebSocket upgrade request not yet checked
    START = "start"  # agent: hello not yet sent
    AWAIT_HELLO = "await_hello"  # control plane: upgraded, waiting for the hello
    AWAIT_WELCOME = "await_welcome"  # agent: hello sent
    OPEN = "open"  # control plane: Welcome and DesiredState queued; agent: welcomed
    CLOSED = "closed"  # a LinkError went either way, or a frame was refused


AGENT, SERVER = "agent", "control plane"
_REPORTS = (w.Heartbeat, w.InventoryChanged, w.EnginesChanged, w.ReplicasChanged, w.LogsReply)
MAX_LOGS_ASKED = 8  # LogsRequests asked and unanswered on one link; LogsReplies unsent
MIN_HEARTBEAT_INTERVAL_S = 0.01  # a Welcome asking for heartbeats more often is refused
# ... or less often: an hour is 180,000 agents at 50 heartbeats a second (llmgw.server.heartbeats)
MAX_HEARTBEAT_INTERVAL_S = 3600.0
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")  # PEP 440 and semantic versions, "dev", "test"

# role -> state -> {message type that side may receive: the state after it}
RECEIVES: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {
        State.AWAIT_HELLO: {w.Hello: State.OPEN, w.LinkError: State.CLOSED},
        State.OPEN: {**{t: State.OPEN for t in _REPORTS}, w.LinkError: State.CLOSED},
    },
    AGENT: {
        State.AWAIT_WELCOME: {w.Welcome: State.OPEN, w.Redirect: State.CLOSED, w.LinkError: State.CLOSED},
        State.OPEN: {
            w.DesiredState: State.OPEN,
            w.LogsRequest: State.OPEN,
            w.ServerHeartbeat: State.OPEN,
            w.LinkError: State.CLOSED,
        },
    },
}
# role -> state -> {message type that side may send: the state after it}. The control plane's
# Welcome and first DesiredState are its answer to the hello, queued by `receive`; a LinkError
# may be sent once in any state (`close`).
SENDS: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {
        State.OPEN: {w.DesiredState: State.OPEN, w.LogsRequest: State.OPEN, w.ServerHeartbeat: State.OPEN},
    },
    AGENT: {
        State.START: {w.Hello: State.AWAIT_WELCOME},
        State.OPEN: {t: State.OPEN for t in _REPORTS},
    },
}
# role -> (kinds of which only the newest unsent is kept, {kind: most unsent at once})
OUTBOX: dict[str, tuple[frozenset[type], dict[type, int]]] = {
    SERVER: (frozenset({w.DesiredState, w.ServerHeartbeat}), {w.LogsRequest: MAX_LOGS_ASKED}),
    AGENT: (
        frozenset({w.Heartbeat, w.InventoryChanged, w.EnginesChanged, w.ReplicasChanged}),
        {w.LogsReply: MAX_LOGS_ASKED},
    ),
}


# -- what the control plane's adapter hands the session before any frame -----------------


@attrs.frozen(kw_only=True)
class UpgradeRequest:
    """The agent's upgrade request as the adapter read it, before any WebSocket handling."""

    method: bytes
    target: bytes
    http_version: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    early: int = 0  # bytes that came after the request, before the control plane's 101


@attrs.frozen(kw_only=True)
class Standing:
    """What the control plane knows of the certificate a peer connected with: its role (the
    certificate's own, `llmgw.pki.ca.CertInfo.role`) and what the store says of its serial (the
    lookup is the adapter's I/O)."""

    serial: int
    revoked: bool = False
    unknown: str = ""  # the store could not answer: why
    role: str = ROLE_NODE


def check_standing(node_id: str, standing: Standing) -> None:
    """`UpgradeRefused` unless the certificate is known not to be revoked (the link's rule, and
    the artifact mirror's). A store that cannot answer fails closed: 503, and the agent retries."""
    if standing.unknown:
        raise UpgradeRefused(
            503,
            f"the control plane's database is busy or failing, so the revocation of certificate {standing.serial:x} "
            f"cannot be checked; this connection is refused and the agent retries by itself ({standing.unknown})",
        )
    if standing.revoked:
        raise UpgradeRefused(
            403,
            f"the certificate of node {node_id!r} (serial {standing.serial:x}) was revoked by `llmgw node remove`; "
            "add the node again with `llmgw node add USER@HOST --reissue` to issue a new one",
        )


def check_node_role(node_id: str, standing: Standing) -> None:
    """`UpgradeRefused(403)` unless the certificate is a node's: a gateway's may not act as a
    node, on the agent link or at the artifact mirror."""
    if standing.role != ROLE_NODE:
        raise UpgradeRefused(
            403,
            f"the certificate of {node_id!r} (serial {standing.serial:x}) is not a node certificate (its role: "
            f"{cut(standing.role, 40)}), and only a node's may act as a node here; a gateway connects at "
            f"{GATEWAY_PATH} (run `llmgw gateway` with its certificate), and a node gets its own certificate with "
            "`llmgw node add USER@HOST --reissue`",
        )


# -- events: what a received frame meant ---------------------------------------------------


@attrs.frozen(kw_only=True)
class Joined:
    """The agent said hello; the Welcome and the first DesiredState are queued."""

    hello: w.Hello


@attrs.frozen(kw_only=True)
class HeartbeatReceived:
    seq: int
    sent_at: float = 0.0  # by the agent's clock; 0: not said


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
    """The reply to a LogsRequest this control plane asked on this link."""

    reply: w.LogsReply


@attrs.frozen(kw_only=True)
class WelcomeReceived:
    welcome: w.Welcome


@attrs.frozen(kw_only=True)
class DesiredStateReceived:
    desired: w.DesiredState


@attrs.frozen(kw_only=True)
class ServerHeartbeatReceived:
    seq: int
    heartbeat_interval_s: float = 0.0  # the interval to keep from now on; 0: as it was


@attrs.frozen(kw_only=True)
class LogsRequested:
    request: w.LogsRequest


@attrs.frozen(kw_only=True)
class Closed:
    """The peer sent its LinkError: it closes the link, and says why."""

    code: str
    message: str


@attrs.frozen(kw_only=True)
class Redirected:
    """The control plane does not lead: `leader` is where the leader is ("" when none is known
    now), and the link closes (either link: the gateway link's sessions give this event too)."""

    leader: str
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
    | ServerHeartbeatReceived
    | Redirected
    | Closed
)

_EVENTS: dict[type, Callable[[Any], Event]] = {
    w.Hello: lambda m: Joined(hello=m),
    w.Heartbeat: lambda m: HeartbeatReceived(seq=m.seq, sent_at=m.sent_at),
    w.InventoryChanged: lambda m: InventoryReported(inventory=m.inventory),
    w.EnginesChanged: lambda m: EnginesReported(engines=m.engines),
    w.ReplicasChanged: lambda m: ReplicasReported(replicas=m.replicas),
    w.LogsReply: lambda m: LogsAnswered(reply=m),
    w.Welcome: lambda m: WelcomeReceived(welcome=m),
    w.DesiredState: lambda m: DesiredStateReceived(desired=m),
    w.LogsRequest: lambda m: LogsRequested(request=m),
    w.ServerHeartbeat: lambda m: ServerHeartbeatReceived(seq=m.seq, heartbeat_interval_s=m.heartbeat_interval_s),
    w.Redirect: lambda m: Redirected(leader=m.leader, message=m.message),
    w.LinkError: lambda m: Closed(code=m.code, message=m.message),
}


@attrs.frozen
class Decoded:
    """A frame read already (`Session.decode`): the message it held, or why it was refused."""

    message: Any = None
    error: WireError | None = None


class Session:
    """One end of a link: the rules are the subclass's tables (`receives`, `sends`, `outbox_kinds`
    and `events`: this module's for the agent link, `llmgw.wire.gateway_session`'s for the gateway
    link); the sequencing, the outbox and the closing are the same for every link."""

    role: str
    accepts: Any  # the union of message types this side receives
    receives: dict[State, dict[type, State]]  # RECEIVES[role]
    sends: dict[State, dict[type, State]]  # SENDS[role]
    outbox_kinds: tuple[frozenset[type], dict[type, int]]  # OUTBOX[role]
    events: dict[type, Callable[[Any], Any]]  # message type received -> its event

    def __init__(self, state: State) -> None:
        self.state = state
        self.goodbye: w.LinkError | None = None  # the LinkError this side queued, once
        latest, limits = self.outbox_kinds
        self.outbox = Outbox(latest=latest, limits=limits)
        # request id -> replica: LogsRequests asked (control plane) or received (agent), unanswered
        self._logs: dict[int, str] = {}

    def can_send(self, kind: type) -> bool:
        """Whether a message of `kind` may be queued now (a task that pushes asks first)."""
        return kind in self.sends.get(self.state, {}) and self.outbox.room(kind)

    def send(self, message: Any) -> None:
        """Queue `message` for the writer; `LocalProtocolError` if this side may not send it now."""
        kind = type(message)
        after = self.sends.get(self.state, {}).get(kind)
        if after is None:
            raise LocalProtocolError(f"the {self.role} may not send {kind.__name__} in state {self.state.value}")
        if not self.outbox.room(kind):
            raise LocalProtocolError(
                f"{self.outbox.limits[kind]} {kind.__name__} wait to be written already; ask `can_send` first"
            )
        self._check_send(message)
        self.outbox.put(kind, message)
        self.state = after

    def close(self, code: str, message: str) -> bool:
        """End the link: drop what is unsent and queue the LinkError that ends it (after a
        refusal: `exc.code`, `str(exc)`); False if this side already queued one."""
        self.state = State.CLOSED
        if self.goodbye is not None:
            return False
        self.goodbye = w.LinkError(code=code, message=message)
        self.outbox.clear()
        self.outbox.put(w.LinkError, self.goodbye)
        return True

    def redirect(self, redirect: w.Redirect) -> None:
        """A control plane that does not lead answers the hello with where the leader is, then
        ends the link: drops what is unsent, queues `redirect` and the LinkError (NOT_LEADER)
        that closes it."""
        self.close(w.NOT_LEADER, redirect.message)
        self.outbox.clear()
        self.outbox.put(w.Redirect, redirect)
        self.outbox.put(w.LinkError, self.goodbye)

    def next_frame(self) -> str | None:
        """The next frame for the writer, in the order queued; None if nothing waits. Once the
        link is closed, only this side's last frames (a Redirect, its LinkError) are still written."""
        if self.state is State.CLOSED and self.goodbye is None:
            return None
        taken = self.outbox.take()
        if taken is None:
            return None
        kind, item = taken
        return encode(self._made(kind, item))

    @property
    def done(self) -> bool:
        """Nothing more will be written: closed, and this side's LinkError (if any) taken."""
        return self.state is State.CLOSED and (self.goodbye is None or not len(self.outbox))

    def receive(self, frame: str | bytes | Any) -> Event:
        """One frame from the peer: what it meant (answers are queued); `WireError` (or its
        `ProtocolError`) if it is refused, and the session is closed."""
        if self.state in (State.UPGRADE, State.START):
            raise LocalProtocolError(f"the {self.role} received a frame before its side began ({self.state.value})")
        try:
            if isinstance(frame, Decoded):
                if frame.error is not None:
                    raise frame.error
                message = frame.message
            else:
                message = self._decode(frame if isinstance(frame, (str, bytes)) else encode(frame))
            after = self.receives.get(self.state, {}).get(type(message))
            if after is None:
                raise ProtocolError(w.UNEXPECTED, self._unexpected(message))
            self._check(message)
        except WireError:
            self.state = State.CLOSED
            raise
        self.state = after
        self._answer(message)
        return self.events[type(message)](message)

    def decode(self, frame: str | bytes) -> Decoded:
        """What `frame` holds, for `receive` to take; touches nothing of the session, so that a
        thread may run it (`llmgw.linkio.readable`)."""
        try:
            return Decoded(self._decode(frame))
        except WireError as exc:
            return Decoded(error=exc)

    def _decode(self, text: str | bytes) -> Any:
        return structure(parse(text), self.accepts)

    def _made(self, kind: type, item: Any) -> Any:
        return item

    def _unexpected(self, message: Any) -> str:
        raise NotImplementedError

    def _check(self, message: Any) -> None:
        """Refuse what the tables allow by type but not by content."""

    def _check_send(self, message: Any) -> None:
        """Refuse what our own side may not send by content (a bug of ours)."""

    def _answer(self, message: Any) -> None:
        """Queue what the protocol answers to `message`."""


class ServerSession(Session):
    """The control plane's end of one agent's link; `expected_node_id` is the CN of the
    certificate the agent connected with, `desired_state` makes that node's DesiredState.
    `standby`: this control plane does not lead, and answers the hello with the `Redirect` it
    makes (after the same checks of the upgrade and the hello a leader makes)."""

    role = SERVER
    accepts = w.AgentMessage
    receives, sends, outbox_kinds, events = RECEIVES[SERVER], SENDS[SERVER], OUTBOX[SERVER], _EVENTS

    def __init__(
        self,
        expected_node_id: str,
        *,
        heartbeat_interval_s: float,
        desired_state: Callable[[], w.DesiredState],
        server_version: str = __version__,
        standby: Callable[[], w.Redirect] | None = None,
    ) -> None:
        super().__init__(State.UPGRADE)
        self.standby = standby
        self.expected_node_id = expected_node_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.desired_state = desired_state
        self.server_version = server_version
        self._next_request = 0
        self._seq = 0

    @property
    def joined(self) -> bool:
        """The agent's hello was taken: a refusal now is of a message, not of the node."""
        return self.state is State.OPEN

    def upgrade(self, request: UpgradeRequest, standing: Standing) -> None:
        """Check the WebSocket upgrade request, and the certificate's standing in the store;
        `UpgradeRefused` with the HTTP status to answer if refused."""
        if self.state is not State.UPGRADE:
            raise LocalProtocolError(f"upgrade checked twice ({self.state.value})")
        self.state = State.CLOSED  # until it passes
        check_standing(self.expected_node_id, standing)
        check_node_role(self.expected_node_id, standing)
        path = request.target.decode("latin-1")
        if path != w.AGENT_PATH:
            raise UpgradeRefused(404, f"no agent endpoint at {shown(path)}; agents connect to {w.AGENT_PATH}")
        claimed = header(request.headers, w.NODE_ID_HEADER)
        if claimed != self.expected_node_id:
            raise UpgradeRefused(
                403,
                f"node id {shown(claimed)} does not match its certificate CN {self.expected_node_id!r}; set node_id in "
                "agent.toml to the certificate's CN, or reissue the certificate with `llmgw node add USER@HOST --reissue`",
            )
        check_opening_handshake(request, w.AGENT_PATH)
        self.state = State.AWAIT_HELLO

    def push(self) -> None:
        """The node's desired state changed: a fresh one goes next (made when written, in the
        place of one still unsent). Nothing before the hello: its answer carries the first."""
        if self.state is State.OPEN:
            self.outbox.put(w.DesiredState, None)

    def heartbeat(self, interval_s: float = 0.0) -> None:
        """Queue a ServerHeartbeat, if the link is open (an unsent one is replaced), telling the
        agent the heartbeat interval to keep (`interval_s`; 0: as it was)."""
        if self.can_send(w.ServerHeartbeat):
            self._seq += 1
            self.send(w.ServerHeartbeat(seq=self._seq, heartbeat_interval_s=interval_s))

    def request_logs(self, replica_id: str, lines: int) -> int | None:
        """Queue a LogsRequest; its request id, or None if the link is not open or
        MAX_LOGS_ASKED requests are unanswered (the caller answers for the node)."""
        if not self.can_send(w.LogsRequest) or len(self._logs) >= MAX_LOGS_ASKED:
            return None
        self._next_request += 1
        self.send(w.LogsRequest(request_id=self._next_request, replica_id=replica_id, lines=lines))
        return self._next_request

    @property
    def logs_unanswered(self) -> int:
        return len(self._logs)

    def _check_send(self, message: Any) -> None:
        if isinstance(message, w.LogsRequest):
            if message.request_id in self._logs:
                raise LocalProtocolError(f"logs request {message.request_id} is already asked")
            self._logs[message.request_id] = message.replica_id

    def _made(self, kind: type, item: Any) -> Any:
        return self.desired_state() if kind is w.DesiredState and item is None else item

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
                f"the agent speaks protocol {shown(version)} and this control plane speaks {w.PROTOCOL_VERSION}; run "
                "the same llmgw release on both (reinstall the node's llmgw to upgrade the node)",
            )

    def _check(self, message: Any) -> None:
        if isinstance(message, w.Hello):
            self._check_version(message.protocol_version)
            if message.node_id != self.expected_node_id:
                raise ProtocolError(
                    w.NODE_ID_MISMATCH,
                    f"expected a hello from node {self.expected_node_id!r} (its certificate's CN), got hello for "
                    f"node {shown(message.node_id)}; set node_id in agent.toml to the certificate's CN",
                )
        elif isinstance(message, w.LogsReply):
            asked = self._logs.get(message.request_id)
            if asked is None or asked != message.replica_id:
                raise ProtocolError(
                    w.UNEXPECTED,
                    f"a logs reply for request {message.request_id} (replica {shown(message.replica_id)}), which this "
                    f"control plane did not ask or was answered already (unanswered: {sorted(self._logs)})",
                )
            del self._logs[message.request_id]

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_HELLO:
            return f"expected a hello from node {self.expected_node_id!r} (its certificate's CN), got {kind}"
        if isinstance(message, w.Hello):
            return f"a second hello on one link from node {self.expected_node_id!r}; an agent says hello once per connection"
        return f"unexpected {kind} ({self.state.value})"

    def _answer(self, message: Any) -> None:
        if isinstance(message, w.Hello) and self.standby is not None:
            self.redirect(self.standby())
        elif isinstance(message, w.Hello):
            welcome = w.Welcome(
                node_id=self.expected_node_id,
                server_version=self.server_version,
                heartbeat_interval_s=self.heartbeat_interval_s,
            )
            self.outbox.put(w.Welcome, welcome)
            self.outbox.put(w.DesiredState, None)  # made when written: after the node is recorded


class AgentSession(Session):
    """The agent's end of one connection; `make_hello` is called once, by `start`."""

    role = AGENT
    accepts = w.ServerMessage
    receives, sends, outbox_kinds, events = RECEIVES[AGENT], SENDS[AGENT], OUTBOX[AGENT], _EVENTS

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

    def start(self) -> None:
        """Queue the hello, the first frame this side sends."""
        hello = self.make_hello()
        if hello.node_id != self.node_id:
            raise LocalProtocolError(f"hello for node {hello.node_id!r} on the link of node {self.node_id!r}")
        self.send(hello)

    def heartbeat(self, sent_at: float = 0.0) -> None:
        """Queue a heartbeat; `sent_at`: now by the agent's clock (unix seconds), said in it."""
        self._seq += 1
        self.send(w.Heartbeat(seq=self._seq, sent_at=sent_at))

    def _check_send(self, message: Any) -> None:
        if isinstance(message, w.LogsReply):
            if self._logs.get(message.request_id) != message.replica_id:
                raise LocalProtocolError(
                    f"a logs reply for request {message.request_id} ({message.replica_id!r}), which was not asked "
                    f"or was answered already (unanswered: {sorted(self._logs)})"
                )
            del self._logs[message.request_id]

    def _check(self, message: Any) -> None:
        if isinstance(message, w.Welcome):
            if message.node_id != self.node_id:
                raise ProtocolError(
                    w.NODE_ID_MISMATCH,
                    f"the control plane welcomed node {shown(message.node_id)} on the link of node {self.node_id!r}; "
                    "check that `server` in agent.toml names this node's control plane and node_id its certificate's CN",
                )
            if not _VERSION.fullmatch(message.server_version):
                raise WireError(
                    w.BAD_MESSAGE,
                    f"the control plane's welcome names no server version this agent can read "
                    f"({shown(message.server_version)}); run an llmgw release on the control plane",
                )
            _check_interval(message.heartbeat_interval_s)
        elif isinstance(message, w.ServerHeartbeat):
            if message.heartbeat_interval_s != 0:
                _check_interval(message.heartbeat_interval_s)
        elif isinstance(message, w.LogsRequest):
            if message.request_id in self._logs:
                raise ProtocolError(
                    w.UNEXPECTED, f"logs request {message.request_id} asked again before this agent answered it"
                )
            self._logs[message.request_id] = message.replica_id

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_WELCOME:
            return f"expected a welcome from the control plane, got {kind}"
        if isinstance(message, w.Welcome):
            return "a second welcome on one link from the control plane"
        return f"unexpected {kind} from the control plane ({self.state.value})"


def check_opening_handshake(request: UpgradeRequest, path: str) -> None:
    """`UpgradeRefused(400)` unless the request is a WebSocket opening handshake (to `path`, as
    the refusal says it) trio-websocket will accept: then nothing the WebSocket library might
    refuse is left to it."""
    # RFC 6455 §4.1: the opening handshake is an HTTP/1.1 GET.
    if request.method != b"GET" or request.http_version != b"1.1":
        raise UpgradeRefused(
            400,
            f"expected a WebSocket upgrade (GET, HTTP/1.1) to {path}, got "
            f"{cut(request.method.decode('latin-1'), 20)} HTTP/{cut(request.http_version.decode('latin-1'), 10)}",
        )
    if request.early:
        # RFC 6455 §4.1: a client waits for the server's handshake before it sends a frame.
        raise UpgradeRefused(400, f"{request.early} bytes after the upgrade request, before the server's 101")
    # RFC 6455 §4.2.1: what makes a request an opening handshake.
    fields: dict[bytes, list[bytes]] = {}
    for name, value in request.headers:
        fields.setdefault(name.lower(), []).append(value)
    tokens = {t.strip().lower() for v in fields.get(b"connection", []) for t in v.split(b",")}
    problems = []
    if b"websocket" not in {v.strip().lower() for v in fields.get(b"upgrade", [])}:
        problems.append("no 'Upgrade: websocket'")
    if b"upgrade" not in tokens:
        problems.append("no 'Connection: Upgrade'")
    if len(fields.get(b"sec-websocket-key", [])) != 1:
        problems.append("not one Sec-WebSocket-Key")
    if fields.get(b"sec-websocket-version") != [b"13"]:
        problems.append("Sec-WebSocket-Version is not 13")
    if problems:
        raise UpgradeRefused(400, f"expected a WebSocket upgrade to {path}: {'; '.join(problems)}")


def header(headers: Iterable[tuple[bytes | str, bytes | str]], name: str) -> str:
    for key, value in headers:
        key = key.decode("latin-1") if isinstance(key, bytes) else key
        if key.lower() == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return ""


def _check_interval(interval: float) -> None:
    """A heartbeat interval the control plane asks for (its Welcome's, or its heartbeat's)."""
    if not (math.isfinite(interval) and MIN_HEARTBEAT_INTERVAL_S <= interval <= MAX_HEARTBEAT_INTERVAL_S):
        raise WireError(
            w.BAD_MESSAGE,
            f"the control plane asks for a heartbeat every {interval:g} s, and this agent sends one every "
            f"{MIN_HEARTBEAT_INTERVAL_S:g} to {MAX_HEARTBEAT_INTERVAL_S:g} s; set heartbeat_interval_s and "
            "heartbeat_max_rate in server.toml to what fits (docs/configuration.md)",
        )
