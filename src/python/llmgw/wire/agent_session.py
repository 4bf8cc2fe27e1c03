"""The agent link's protocol, both ends, as state machines with no I/O (after h11).

Every rule of the agent link is here, and nowhere else: which upgrade request is accepted, which
frame may come when, what each side answers, which reply matches which request, what waits for
a slow reader. What every link shares (the sequencing by table, the outbox, closing, the role
bases of the two ends) is `llmgw.wire.session`'s; the adapters that act on the events are
`llmgw.server.links.agentlinks` and `agent.link`, each on its end's link runtime. Two sessions wired
together in memory are the protocol's tests (tests/llmgw/wire/test_session.py).

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
    Heartbeat, InventoryChanged, WeightsChanged,
    EnginesChanged, ReplicasChanged, SpeedsChanged  ->
           <---------------------------------  DesiredState (`push`), LogsRequest (`request_logs`),
                                               ServerHeartbeat every heartbeat interval (`heartbeat`)
    LogsReply  ----------------------------->  to a request asked and not yet answered
    LinkError, either way: the sender's last frame before it closes (`close`).

RECEIVES and SENDS below are the whole of the sequence. What waits for a slow reader, or one
that reads nothing:

- coalesced, a newer replacing an unsent older one in its place: DesiredState, ServerHeartbeat,
  Heartbeat, InventoryChanged, EnginesChanged, ReplicasChanged, WeightsChanged, SpeedsChanged (each says the whole of what it reports; a
  DesiredState is made by `desired_state` when the writer takes it, so it is the newest then);
- bounded: at most MAX_LOGS_ASKED LogsRequests asked and unanswered per link (past it
  `request_logs` gives None and the caller answers for the node), and as many LogsReplies unsent
  (the agent waits for room before answering another request, reading nothing meanwhile, which
  holds the control plane back);
- dropped: everything unsent when the link closes (`close`); a reconnect resends everything.

So a link holds at most its first frame, one message of each coalesced kind, MAX_LOGS_ASKED
requests or replies and its LinkError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from llmgw import __version__
from llmgw.errors import cut, shown
from llmgw.pki.ca import ROLE_NODE
from llmgw.wire import agent_link as w
from llmgw.wire.errors import LinkProtocolError, LocalLinkError, UpgradeRefused, WireError
from llmgw.wire.gateway_link import GATEWAY_PATH
from llmgw.wire.session import (
    COMMON_EVENTS,
    MAX_HEARTBEAT_INTERVAL_S,
    MIN_HEARTBEAT_INTERVAL_S,
    SERVER,
    Closed,
    DialingSession,
    RedirectReceived,
    ServingSession,
    Standing,
    State,
    UpgradeRequest,
    check_opening_handshake,
    header,
    store_unknown,
)

AGENT = "agent"
_REPORTS = (
    w.Heartbeat,
    w.InventoryChanged,
    w.EnginesChanged,
    w.ReplicasChanged,
    w.WeightsChanged,
    w.SpeedsChanged,
    w.LogsReply,
)
MAX_LOGS_ASKED = 8  # LogsRequests asked and unanswered on one link; LogsReplies unsent

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
        frozenset(
            {w.Heartbeat, w.InventoryChanged, w.EnginesChanged, w.ReplicasChanged, w.WeightsChanged, w.SpeedsChanged}
        ),
        {w.LogsReply: MAX_LOGS_ASKED},
    ),
}


def check_standing(node_id: str, standing: Standing) -> None:
    """`UpgradeRefused` unless the certificate is known not to be revoked (the link's rule, and
    the artifact mirror's). A store that cannot answer fails closed: 503, and the agent retries."""
    if standing.unknown:
        raise store_unknown(standing, "agent")
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


# -- events: what a received frame meant (and `Closed`, `RedirectReceived`: every link's) -----


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
class WeightsReported:
    weights: w.WeightsHeld


@attrs.frozen(kw_only=True)
class EnginesReported:
    engines: tuple[w.EngineStatus, ...]


@attrs.frozen(kw_only=True)
class SpeedsReported:
    speeds: tuple[w.BackendSpeed, ...]


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


Event = (
    Joined
    | HeartbeatReceived
    | InventoryReported
    | WeightsReported
    | EnginesReported
    | SpeedsReported
    | ReplicasReported
    | LogsAnswered
    | WelcomeReceived
    | DesiredStateReceived
    | LogsRequested
    | ServerHeartbeatReceived
    | RedirectReceived
    | Closed
)

_EVENTS: dict[type, Callable[[Any], Event]] = {
    w.Hello: lambda m: Joined(hello=m),
    w.Heartbeat: lambda m: HeartbeatReceived(seq=m.seq, sent_at=m.sent_at),
    w.InventoryChanged: lambda m: InventoryReported(inventory=m.inventory),
    w.WeightsChanged: lambda m: WeightsReported(weights=m.weights),
    w.EnginesChanged: lambda m: EnginesReported(engines=m.engines),
    w.ReplicasChanged: lambda m: ReplicasReported(replicas=m.replicas),
    w.SpeedsChanged: lambda m: SpeedsReported(speeds=m.speeds),
    w.LogsReply: lambda m: LogsAnswered(reply=m),
    w.Welcome: lambda m: WelcomeReceived(welcome=m),
    w.DesiredState: lambda m: DesiredStateReceived(desired=m),
    w.LogsRequest: lambda m: LogsRequested(request=m),
    w.ServerHeartbeat: lambda m: ServerHeartbeatReceived(seq=m.seq, heartbeat_interval_s=m.heartbeat_interval_s),
    **COMMON_EVENTS,
}


class ServerSession(ServingSession):
    """The control plane's end of one agent's link; `expected_node_id` is the CN of the
    certificate the agent connected with, `desired_state` makes that node's DesiredState.
    `standby`: this control plane does not lead, and answers the hello with the `Redirect` it
    makes (after the same checks of the upgrade and the hello a leader makes)."""

    accepts = w.AgentMessage
    receives, sends, outbox_kinds, events = RECEIVES[SERVER], SENDS[SERVER], OUTBOX[SERVER], _EVENTS
    hello_type, protocol_version = w.Hello, w.PROTOCOL_VERSION

    def __init__(
        self,
        expected_node_id: str,
        *,
        heartbeat_interval_s: float,
        desired_state: Callable[[], w.DesiredState],
        server_version: str = __version__,
        standby: Callable[[], w.Redirect] | None = None,
    ) -> None:
        super().__init__(
            expected_node_id, heartbeat_interval_s=heartbeat_interval_s, server_version=server_version, standby=standby
        )
        self.expected_node_id = expected_node_id
        self.desired_state = desired_state
        self._logs: dict[int, str] = {}  # request id -> replica: LogsRequests asked, unanswered
        self._next_request = 0
        self._seq = 0

    def _check_upgrade(self, request: UpgradeRequest, standing: Standing) -> None:
        check_standing(self.expected_node_id, standing)
        check_node_role(self.expected_node_id, standing)
        path = request.target.decode("latin-1")
        if path != w.AGENT_PATH:
            raise UpgradeRefused(404, f"no agent link at {shown(path)}; agents connect to {w.AGENT_PATH}")
        claimed = header(request.headers, w.NODE_ID_HEADER)
        if claimed != self.expected_node_id:
            raise UpgradeRefused(
                403,
                f"node id {shown(claimed)} does not match its certificate CN {self.expected_node_id!r}; set node_id in "
                "agent.toml to the certificate's CN, or reissue the certificate with `llmgw node add USER@HOST --reissue`",
            )
        check_opening_handshake(request, w.AGENT_PATH)

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
                raise LocalLinkError(f"logs request {message.request_id} is already asked")
            self._logs[message.request_id] = message.replica_id

    def _made(self, kind: type, item: Any) -> Any:
        return self.desired_state() if kind is w.DesiredState and item is None else item

    def _other_version(self, version: object) -> str:
        return (
            f"the agent speaks protocol {shown(version)} and this control plane speaks {w.PROTOCOL_VERSION}; run "
            "the same llmgw release on both (reinstall the node's llmgw to upgrade the node)"
        )

    def _check(self, message: Any) -> None:
        if isinstance(message, w.Hello):
            self._check_version(message.protocol_version)
            if message.node_id != self.expected_node_id:
                raise LinkProtocolError(
                    w.NODE_ID_MISMATCH,
                    f"expected a hello from node {self.expected_node_id!r} (its certificate's CN), got hello for "
                    f"node {shown(message.node_id)}; set node_id in agent.toml to the certificate's CN",
                )
        elif isinstance(message, w.LogsReply):
            asked = self._logs.get(message.request_id)
            if asked is None or asked != message.replica_id:
                raise LinkProtocolError(
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

    def _welcome(self, hello: w.Hello) -> None:
        welcome = w.Welcome(
            node_id=self.expected_node_id,
            server_version=self.server_version,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        self.outbox.put(w.Welcome, welcome)
        self.outbox.put(w.DesiredState, None)  # made when written: after the node is recorded


class AgentSession(DialingSession):
    """The agent's end of one connection; `make_hello` is called once, by `start`."""

    role = AGENT
    accepts = w.ServerMessage
    receives, sends, outbox_kinds, events = RECEIVES[AGENT], SENDS[AGENT], OUTBOX[AGENT], _EVENTS
    welcome_type = w.Welcome

    def __init__(self, node_id: str, make_hello: Callable[[], w.Hello]) -> None:
        super().__init__(make_hello)
        self.node_id = node_id
        self._logs: dict[int, str] = {}  # request id -> replica: LogsRequests received, unanswered
        self._seq = 0

    def upgrade_request(self) -> tuple[str, list[tuple[bytes, bytes]]]:
        return w.AGENT_PATH, [(w.NODE_ID_HEADER.encode(), self.node_id.encode())]

    def _check_hello(self, hello: w.Hello) -> None:
        if hello.node_id != self.node_id:
            raise LocalLinkError(f"hello for node {hello.node_id!r} on the link of node {self.node_id!r}")

    def heartbeat(self, sent_at: float = 0.0) -> None:
        """Queue a heartbeat; `sent_at`: now by the agent's clock (unix seconds), said in it."""
        self._seq += 1
        self.send(w.Heartbeat(seq=self._seq, sent_at=sent_at))

    def _check_send(self, message: Any) -> None:
        if isinstance(message, w.LogsReply):
            if self._logs.get(message.request_id) != message.replica_id:
                raise LocalLinkError(
                    f"a logs reply for request {message.request_id} ({message.replica_id!r}), which was not asked "
                    f"or was answered already (unanswered: {sorted(self._logs)})"
                )
            del self._logs[message.request_id]

    def _check(self, message: Any) -> None:
        if isinstance(message, w.Welcome):
            if message.node_id != self.node_id:
                raise LinkProtocolError(
                    w.NODE_ID_MISMATCH,
                    f"the control plane welcomed node {shown(message.node_id)} on the link of node {self.node_id!r}; "
                    "check that `server` in agent.toml names this node's control plane and node_id its certificate's CN",
                )
            self._check_server_version(message.server_version)
            _check_interval(message.heartbeat_interval_s)
        elif isinstance(message, w.ServerHeartbeat):
            if message.heartbeat_interval_s != 0:
                _check_interval(message.heartbeat_interval_s)
        elif isinstance(message, w.LogsRequest):
            if message.request_id in self._logs:
                raise LinkProtocolError(
                    w.UNEXPECTED, f"logs request {message.request_id} asked again before this agent answered it"
                )
            self._logs[message.request_id] = message.replica_id


def _check_interval(interval: float) -> None:
    """A heartbeat interval the control plane asks for (its Welcome's, or its heartbeat's)."""
    if not (math.isfinite(interval) and MIN_HEARTBEAT_INTERVAL_S <= interval <= MAX_HEARTBEAT_INTERVAL_S):
        raise WireError(
            w.BAD_MESSAGE,
            f"the control plane asks for a heartbeat every {interval:g} s, and this agent sends one every "
            f"{MIN_HEARTBEAT_INTERVAL_S:g} to {MAX_HEARTBEAT_INTERVAL_S:g} s; set heartbeat_interval_s and "
            "heartbeat_max_rate in server.toml to what fits (docs/configuration.md)",
        )
