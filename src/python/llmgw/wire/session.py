"""What every link session shares, both links and both ends, as state machines with no I/O
(after h11). The links' own rules are their modules': `llmgw.wire.agent_session` (the agent
link) and `llmgw.wire.gateway_session` (the gateway link), each its message tables and one
class per end, built on the two role bases here.

A session is told each frame its side receives (`receive`: the text, or a message) and answers
with what it meant (one event); what its side sends it queues in its outbox, whence the link's
one writer takes frames (`next_frame`). It never touches a socket, a clock or trio: the link
runtimes (`llmgw.server.links.linkserver` on the control plane, `llmgw.linkclient` on an agent or a
gateway) move frames between trio-websocket and the session, keep the deadlines and hand the
events to the link's adapter. Two sessions wired together in memory are each protocol's tests
(tests/llmgw/wire/test_session.py, test_gateway_session.py).

- `LinkSession` runs a link from its tables: `receives` and `sends` (state -> {message type:
  the state after it}) are the whole of its sequence; a frame they do not allow raises a
  `LinkProtocolError` (one that does not parse, a `WireError`) carrying the code and message of
  the LinkError to answer with, and the session is closed; `close` queues that LinkError.
- `ServingSession` is the control plane's end of either link: it judges the WebSocket upgrade
  (with the store's word on the certificate, `Standing`) before any frame, takes the hello and
  answers it with its Welcome and first state, or, on a control plane that does not lead, with
  where the leader is (`Redirect`) and its LinkError.
- `DialingSession` is the dialler's end (an agent's, a gateway's): its upgrade request, its
  hello first, the Welcome checked before anything else.

Sending is queueing (`llmgw.wire.outbox`): each link's tables say which kinds are coalesced (a
newer replacing an unsent older one) and which are bounded, so a link's memory stays bounded
whatever its peer does; a peer that takes nothing is cut by the runtime's send deadline.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from llmgw import __version__
from llmgw.errors import cut, shown
from llmgw.pki.ca import ROLE_NODE
from llmgw.wire import agent_link as w
from llmgw.wire.convert import TAG, encode, parse, structure, tag
from llmgw.wire.errors import LinkProtocolError, LocalLinkError, UpgradeRefused, WireError
from llmgw.wire.outbox import Outbox


class State(enum.Enum):
    UPGRADE = "upgrade"  # control plane: the WebSocket upgrade request not yet checked
    START = "start"  # agent or gateway: hello not yet sent
    AWAIT_HELLO = "await_hello"  # control plane: upgraded, waiting for the hello
    AWAIT_WELCOME = "await_welcome"  # agent or gateway: hello sent
    OPEN = "open"  # control plane: its answer to the hello queued; agent or gateway: welcomed
    CLOSED = "closed"  # a LinkError went either way, or a frame was refused


SERVER = "control plane"  # the role of the serving end, on either link
MIN_HEARTBEAT_INTERVAL_S = 0.01  # a Welcome asking for heartbeats more often is refused
# ... or, by an agent, less often: an hour is 180,000 agents at 50 heartbeats a second (llmgw.server.links.heartbeats)
MAX_HEARTBEAT_INTERVAL_S = 3600.0
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")  # PEP 440 and semantic versions, "dev", "test"


# -- what the control plane's adapter hands a session before any frame ---------------------


@attrs.frozen(kw_only=True)
class UpgradeRequest:
    """The peer's upgrade request as the adapter read it, before any WebSocket handling."""

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


# -- events every link gives -----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Closed:
    """The peer sent its LinkError: it closes the link, and says why."""

    code: str
    message: str


@attrs.frozen(kw_only=True)
class RedirectReceived:
    """The control plane does not lead: `leader` is where the leader is ("" when none is known
    now), and the link closes (either link's dialling end gives this event)."""

    leader: str
    message: str


# The events of the two frames every link has: its LinkError, and a standby's Redirect.
COMMON_EVENTS: dict[type, Callable[[Any], Any]] = {
    w.Redirect: lambda m: RedirectReceived(leader=m.leader, message=m.message),
    w.LinkError: lambda m: Closed(code=m.code, message=m.message),
}


@attrs.frozen
class Decoded:
    """A frame read already (`LinkSession.decode`): the message it held, or why it was refused."""

    message: Any = None
    error: WireError | None = None


class LinkSession:
    """One end of a link: the rules are the subclass's tables (`receives`, `sends`,
    `outbox_kinds` and `events`); the sequencing, the outbox and the closing are the same for
    every link."""

    role: str
    accepts: Any  # the union of message types this side receives
    receives: dict[State, dict[type, State]]  # state -> {message type received: the state after it}
    sends: dict[State, dict[type, State]]  # state -> {message type sent: the state after it}
    outbox_kinds: tuple[frozenset[type], dict[type, int]]  # (coalesced kinds, {kind: most unsent at once})
    events: dict[type, Callable[[Any], Any]]  # message type received -> its event

    def __init__(self, state: State) -> None:
        self.state = state
        self.goodbye: w.LinkError | None = None  # the LinkError this side queued, once
        latest, limits = self.outbox_kinds
        self.outbox = Outbox(latest=latest, limits=limits)

    def can_send(self, kind: type) -> bool:
        """Whether a message of `kind` may be queued now (a task that pushes asks first)."""
        return kind in self.sends.get(self.state, {}) and self.outbox.room(kind)

    def send(self, message: Any) -> None:
        """Queue `message` for the writer; `LocalLinkError` if this side may not send it now."""
        kind = type(message)
        after = self.sends.get(self.state, {}).get(kind)
        if after is None:
            raise LocalLinkError(f"the {self.role} may not send {kind.__name__} in state {self.state.value}")
        if not self.outbox.room(kind):
            raise LocalLinkError(
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

    def receive(self, frame: str | bytes | Any) -> Any:
        """One frame from the peer: what it meant (answers are queued); `WireError` (or its
        `LinkProtocolError`) if it is refused, and the session is closed."""
        if self.state in (State.UPGRADE, State.START):
            raise LocalLinkError(f"the {self.role} received a frame before its side began ({self.state.value})")
        try:
            if isinstance(frame, Decoded):
                if frame.error is not None:
                    raise frame.error
                message = frame.message
            else:
                message = self._decode(frame if isinstance(frame, (str, bytes)) else encode(frame))
            after = self.receives.get(self.state, {}).get(type(message))
            if after is None:
                raise LinkProtocolError(w.UNEXPECTED, self._unexpected(message))
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


class ServingSession(LinkSession):
    """The control plane's end of a link, for the peer whose certificate's CN is `expected`:
    `upgrade` judges the request before any frame (`_check_upgrade`), the hello (`hello_type`,
    of `protocol_version`, checked before the rest of it parses) is answered by `_welcome`, or,
    with `standby` (this control plane does not lead), by the `Redirect` it makes, after the same
    checks of the upgrade and the hello a leader makes."""

    role = SERVER
    hello_type: type
    protocol_version: int

    def __init__(
        self,
        expected: str,
        *,
        heartbeat_interval_s: float,
        server_version: str = __version__,
        standby: Callable[[], w.Redirect] | None = None,
    ) -> None:
        super().__init__(State.UPGRADE)
        self.expected = expected
        self.heartbeat_interval_s = heartbeat_interval_s
        self.server_version = server_version
        self.standby = standby

    @property
    def joined(self) -> bool:
        """The peer's hello was taken: a refusal now is of a message, not of the peer."""
        return self.state is State.OPEN

    def upgrade(self, request: UpgradeRequest, standing: Standing) -> None:
        """Check the WebSocket upgrade request, and the certificate's role and standing in the
        store; `UpgradeRefused` with the HTTP status to answer if refused."""
        if self.state is not State.UPGRADE:
            raise LocalLinkError(f"upgrade checked twice ({self.state.value})")
        self.state = State.CLOSED  # until it passes
        self._check_upgrade(request, standing)
        self.state = State.AWAIT_HELLO

    def _check_upgrade(self, request: UpgradeRequest, standing: Standing) -> None:
        raise NotImplementedError

    def _decode(self, text: str | bytes) -> Any:
        data = parse(text)
        if data.get(TAG) == tag(self.hello_type):
            # Before the rest: another version's hello may not parse as ours at all.
            self._check_version(data.get("protocol_version"))
        return structure(data, self.accepts)

    def _check_version(self, version: object) -> None:
        if version != self.protocol_version:
            raise LinkProtocolError(w.PROTOCOL, self._other_version(version))

    def _other_version(self, version: object) -> str:
        raise NotImplementedError

    def _answer(self, message: Any) -> None:
        if isinstance(message, self.hello_type) and self.standby is not None:
            self.redirect(self.standby())
        elif isinstance(message, self.hello_type):
            self._welcome(message)

    def _welcome(self, hello: Any) -> None:
        """Queue the answer to `hello`: the Welcome, then the first state, made when written."""
        raise NotImplementedError


class DialingSession(LinkSession):
    """The dialling end of a link (an agent's, a gateway's): `make_hello` is called once, by
    `start`; the first frame taken is the control plane's `welcome_type`, or its Redirect."""

    welcome_type: type

    def __init__(self, make_hello: Callable[[], Any]) -> None:
        super().__init__(State.START)
        self.make_hello = make_hello

    @property
    def open(self) -> bool:
        """Welcomed and not closed: this side may send what it reports."""
        return self.state is State.OPEN

    def upgrade_request(self) -> tuple[str, list[tuple[bytes, bytes]]]:
        """The path and extra headers of the WebSocket upgrade."""
        raise NotImplementedError

    def start(self) -> None:
        """Queue the hello, the first frame this side sends."""
        hello = self.make_hello()
        self._check_hello(hello)
        self.send(hello)

    def _check_hello(self, hello: Any) -> None:
        """`LocalLinkError` if `hello` is not this link's (a bug of ours)."""

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_WELCOME:
            return f"expected a welcome from the control plane, got {kind}"
        if isinstance(message, self.welcome_type):
            return "a second welcome on one link from the control plane"
        return f"unexpected {kind} from the control plane ({self.state.value})"

    def _check_server_version(self, version: str) -> None:
        if not _VERSION.fullmatch(version):
            raise WireError(
                w.BAD_MESSAGE,
                f"the control plane's welcome names no server version this {self.role} can read "
                f"({shown(version)}); run an llmgw release on the control plane",
            )


# -- the upgrade's rules, which both links keep -----------------------------------------------


def store_unknown(standing: Standing, who: str) -> UpgradeRefused:
    """The refusal of a peer (`who`: "agent", "gateway") whose certificate's revocation the
    store could not say: the check fails closed, 503, and the peer retries."""
    return UpgradeRefused(
        503,
        f"the control plane's database is busy or failing, so the revocation of certificate {standing.serial:x} "
        f"cannot be checked; this connection is refused and the {who} retries by itself ({standing.unknown})",
    )


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
