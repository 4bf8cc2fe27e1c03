"""The gateway link's protocol, both ends, as state machines with no I/O (after h11).

What every link shares (the sequencing by table, the outbox, closing, the role bases of the two
ends) is `llmgw.wire.session`'s; the tables below are the whole of this link's sequence. It never
touches a socket, a clock or trio: `llmgw.server.gatewaylinks` and `llmgw.gatewayd.link` are the
adapters, each on its end's link runtime. Two sessions wired together in memory are the
protocol's tests (tests/llmgw/wire/test_gateway_session.py).

    gateway                                        control plane
    GET GATEWAY_PATH, GATEWAY_NAME_HEADER: the --> `GatewayServerSession.upgrade`: the certificate
      name, GATEWAY_INSTANCE_HEADER: the process   a gateway's and not revoked (`Standing`), the
      (the WebSocket upgrade)                      path, the claimed name its CN, an instance
                                                   token, an opening handshake (RFC 6455); else
                                                   HTTP 403, 503 or 403, 404, 403, 400, 400
    GatewayHello  -------------------------------> first; of GATEWAY_PROTOCOL_VERSION, for that
                                                   name and instance
                  <------------------------------- GatewayWelcome, then the whole table:
                                                   RotationChanged, KeysChanged, ShareChanged;
                                                   or, from a control plane that does not lead,
                                                   Redirect (where the leader is), LinkError, closed
    the Welcome is for our name and instance, names a server version and a heartbeat we can keep
    GatewayHeartbeat  ---------------------------> (`GatewaySession.heartbeat`)
                  <------------------------------- a part of the table again, whole, when it
                                                   changes (`push`); TableHeartbeat (`heartbeat`)
    UsageReport  --------------------------------> (`GatewaySession.report`) one at a time: the
                                                   next only once this one is acknowledged
                  <------------------------------- UsageAck of that report (`GatewayServerSession.ack`),
                                                   once it is in the ledger
    LinkError, either way: the sender's last frame before it closes (`close`).

What waits for a slow reader: every kind the control plane sends after its Welcome is coalesced,
a newer replacing an unsent older one in its place (each says the whole of what it reports; a
part of the table is made by the session's `table` when the writer takes it, so it is the newest
then), and so is the gateway's heartbeat; a usage report and its acknowledgement go one at a
time (the rule above). A link holds at most its first frame, one message of each kind and its
LinkError, whatever its peer does; a peer that takes nothing is cut by the runtime's send
deadline, not by memory.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable
from typing import Any

import attrs

from llmgw import __version__
from llmgw.errors import cut, shown
from llmgw.pki.ca import ROLE_GATEWAY
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire.errors import LinkProtocolError, LocalLinkError, UpgradeRefused, WireError
from llmgw.wire.session import (
    COMMON_EVENTS,
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

GATEWAY = "gateway"
# The parts of the table, in the order first sent; the grants are this instance's own.
TABLE = (g.RotationChanged, g.KeysChanged, g.ShareChanged, g.BudgetsChanged, g.GrantsChanged)
_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a token per process: `new_instance`
INSTANCE_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"

# role -> state -> {message type that side may receive: the state after it}
RECEIVES: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {
        State.AWAIT_HELLO: {g.GatewayHello: State.OPEN, w.LinkError: State.CLOSED},
        State.OPEN: {
            g.GatewayHeartbeat: State.OPEN,
            g.UsageReport: State.OPEN,
            g.BudgetReport: State.OPEN,
            w.LinkError: State.CLOSED,
        },
    },
    GATEWAY: {
        State.AWAIT_WELCOME: {g.GatewayWelcome: State.OPEN, w.Redirect: State.CLOSED, w.LinkError: State.CLOSED},
        State.OPEN: {
            **{t: State.OPEN for t in TABLE},
            g.TableHeartbeat: State.OPEN,
            g.UsageAck: State.OPEN,
            w.LinkError: State.CLOSED,
        },
    },
}
# role -> state -> {message type that side may send: the state after it}. The control plane's
# Welcome and first table are its answer to the hello, queued by `receive`; a LinkError may be
# sent once in any state (`close`).
SENDS: dict[str, dict[State, dict[type, State]]] = {
    SERVER: {State.OPEN: {**{t: State.OPEN for t in TABLE}, g.TableHeartbeat: State.OPEN, g.UsageAck: State.OPEN}},
    GATEWAY: {
        State.START: {g.GatewayHello: State.AWAIT_WELCOME},
        State.OPEN: {g.GatewayHeartbeat: State.OPEN, g.UsageReport: State.OPEN, g.BudgetReport: State.OPEN},
    },
}
# role -> (kinds of which only the newest unsent is kept, {kind: most unsent at once})
OUTBOX: dict[str, tuple[frozenset[type], dict[type, int]]] = {
    SERVER: (frozenset({*TABLE, g.TableHeartbeat}), {g.UsageAck: 1}),
    GATEWAY: (frozenset({g.GatewayHeartbeat, g.BudgetReport}), {g.UsageReport: 1}),
}
# The rows of one usage report: a gateway's rows are the hours x keys x models it served, merged;
# past this a report is refused as a bug (a gateway sends what it counted, not a flood).
MAX_USAGE_ROWS = 100_000


def check_gateway_standing(name: str, standing: Standing) -> None:
    """`UpgradeRefused` unless the certificate is a gateway's (a node's cannot act as one) and
    known not to be revoked. A store that cannot answer fails closed: 503, and the gateway retries."""
    if standing.role != ROLE_GATEWAY:
        raise UpgradeRefused(
            403,
            f"the certificate of {name!r} (serial {standing.serial:x}) is not a gateway certificate (its role: "
            f"{cut(standing.role, 40)}), and only a gateway's may open the gateway link; issue this gateway its own "
            "on the control plane with `llmgw ca issue --gateway NAME`",
        )
    if standing.unknown:
        raise store_unknown(standing, "gateway")
    if standing.revoked:
        raise UpgradeRefused(
            403,
            f"the certificate of gateway {name!r} (serial {standing.serial:x}) was revoked; issue a new one with "
            f"`llmgw ca issue --gateway {name}` and install it on the gateway",
        )


# -- events: what a received frame meant ---------------------------------------------------


@attrs.frozen(kw_only=True)
class GatewayJoined:
    """The gateway said hello; the Welcome and the whole table are queued."""

    hello: g.GatewayHello


@attrs.frozen(kw_only=True)
class GatewayHeartbeatReceived:
    heartbeat: g.GatewayHeartbeat


@attrs.frozen(kw_only=True)
class Welcomed:
    welcome: g.GatewayWelcome


@attrs.frozen(kw_only=True)
class TableChanged:
    """A part of the table, whole: it replaces the gateway's part of its kind."""

    message: g.RotationChanged | g.KeysChanged | g.ShareChanged


@attrs.frozen(kw_only=True)
class TableHeartbeatReceived:
    seq: int


@attrs.frozen(kw_only=True)
class BudgetReported:
    """What the instance holds, uses and wants of each day or month budget (`llmgw.server.state.budgets`)."""

    report: g.BudgetReport


@attrs.frozen(kw_only=True)
class UsageReported:
    """A usage report: the control plane adds it to the ledger, then acknowledges it (`ack`)."""

    report: g.UsageReport


@attrs.frozen(kw_only=True)
class UsageAcked:
    """The control plane holds the report `seq` sent on this link."""

    seq: int


Event = (
    GatewayJoined
    | GatewayHeartbeatReceived
    | Welcomed
    | TableChanged
    | TableHeartbeatReceived
    | UsageReported
    | UsageAcked
    | BudgetReported
    | RedirectReceived
    | Closed
)

_EVENTS: dict[type, Callable[[Any], Event]] = {
    g.GatewayHello: lambda m: GatewayJoined(hello=m),
    g.GatewayHeartbeat: lambda m: GatewayHeartbeatReceived(heartbeat=m),
    g.GatewayWelcome: lambda m: Welcomed(welcome=m),
    **{t: (lambda m: TableChanged(message=m)) for t in TABLE},
    g.TableHeartbeat: lambda m: TableHeartbeatReceived(seq=m.seq),
    g.UsageReport: lambda m: UsageReported(report=m),
    g.UsageAck: lambda m: UsageAcked(seq=m.seq),
    g.BudgetReport: lambda m: BudgetReported(report=m),
    **COMMON_EVENTS,
}


class GatewayServerSession(ServingSession):
    """The control plane's end of one gateway instance's link; `expected_name` is the CN of the
    certificate the gateway connected with, `table(kind)` makes the part of the table of `kind`
    (one of TABLE) as it is when the writer takes it. `standby`: this control plane does not
    lead, and answers the hello with the `Redirect` it makes (after the same checks)."""

    accepts = g.GatewayMessage
    receives, sends, outbox_kinds, events = RECEIVES[SERVER], SENDS[SERVER], OUTBOX[SERVER], _EVENTS
    hello_type, protocol_version = g.GatewayHello, g.GATEWAY_PROTOCOL_VERSION

    def __init__(
        self,
        expected_name: str,
        *,
        heartbeat_interval_s: float,
        table: Callable[[type], Any],
        server_version: str = __version__,
        standby: Callable[[], w.Redirect] | None = None,
    ) -> None:
        super().__init__(
            expected_name, heartbeat_interval_s=heartbeat_interval_s, server_version=server_version, standby=standby
        )
        self.expected_name = expected_name
        self.instance = ""  # the upgrade's GATEWAY_INSTANCE_HEADER, once checked
        self.table = table
        self._seq = 0
        self.reported = 0  # the seq of the usage report received and not yet acknowledged (0: none)

    def _check_upgrade(self, request: UpgradeRequest, standing: Standing) -> None:
        check_gateway_standing(self.expected_name, standing)
        path = request.target.decode("latin-1")
        if path != g.GATEWAY_PATH:
            raise UpgradeRefused(404, f"no gateway link at {shown(path)}; gateways connect to {g.GATEWAY_PATH}")
        claimed = header(request.headers, g.GATEWAY_NAME_HEADER)
        if claimed != self.expected_name:
            raise UpgradeRefused(
                403,
                f"gateway name {shown(claimed)} does not match its certificate CN {self.expected_name!r}; run the "
                "gateway with the name its certificate has, or issue one for its name with `llmgw ca issue --gateway NAME`",
            )
        instance = header(request.headers, g.GATEWAY_INSTANCE_HEADER)
        if not _INSTANCE.fullmatch(instance):
            raise UpgradeRefused(
                400,
                f"the gateway's instance {shown(instance)} ({g.GATEWAY_INSTANCE_HEADER}) must be {INSTANCE_RULE}; "
                "run the same llmgw release on the gateway and the control plane",
            )
        check_opening_handshake(request, g.GATEWAY_PATH)
        self.instance = instance

    def push(self, kind: type) -> None:
        """A part of the table changed: a fresh one of `kind` goes next (made when written, in the
        place of one still unsent). Nothing before the hello: its answer carries the whole table."""
        if kind not in TABLE:
            raise LocalLinkError(f"{kind.__name__} is no part of the table")
        if self.state is State.OPEN:
            self.outbox.put(kind, None)

    def heartbeat(self) -> None:
        """Queue a TableHeartbeat, if the link is open (an unsent one is replaced)."""
        if self.can_send(g.TableHeartbeat):
            self._seq += 1
            self.send(g.TableHeartbeat(seq=self._seq))

    def ack(self, seq: int) -> None:
        """Report `seq` is in the ledger: its UsageAck goes next, if the link is open (on a link
        closed meanwhile the gateway sends the report again on its next, and the ledger knows it)."""
        if seq != self.reported:
            raise LocalLinkError(f"usage report {seq} acknowledged, and the one waiting is {self.reported or 'none'}")
        if self.can_send(g.UsageAck):
            self.reported = 0
            self.send(g.UsageAck(seq=seq))

    def _made(self, kind: type, item: Any) -> Any:
        return self.table(kind) if item is None else item

    def _other_version(self, version: object) -> str:
        return (
            f"the gateway speaks gateway protocol {shown(version)} and this control plane speaks "
            f"{g.GATEWAY_PROTOCOL_VERSION}; run the same llmgw release on both"
        )

    def _check(self, message: Any) -> None:
        if isinstance(message, g.GatewayHeartbeat) and message.metrics is not None:
            check_metrics(message.metrics)
        if isinstance(message, g.UsageReport):
            if self.reported:
                raise LinkProtocolError(
                    w.UNEXPECTED,
                    f"usage report {message.seq} came before report {self.reported} was acknowledged; a gateway "
                    "sends one at a time (run the same llmgw release on the gateway and the control plane)",
                )
            check_usage(message)
            self.reported = message.seq
        if isinstance(message, g.GatewayHello):
            self._check_version(message.protocol_version)
            if message.name != self.expected_name or message.instance != self.instance:
                raise LinkProtocolError(
                    g.NAME_MISMATCH,
                    f"expected a hello from gateway {self.expected_name!r} (its certificate's CN), instance "
                    f"{self.instance!r} (its upgrade's), got hello for gateway {shown(message.name)}, instance "
                    f"{shown(message.instance)}",
                )

    def _unexpected(self, message: Any) -> str:
        kind = type(message).__name__
        if self.state is State.AWAIT_HELLO:
            return f"expected a hello from gateway {self.expected_name!r}, got {kind}"
        if isinstance(message, g.GatewayHello):
            return f"a second hello on one link from gateway {self.expected_name!r}; a gateway says hello once per connection"
        return f"unexpected {kind} ({self.state.value})"

    def _welcome(self, hello: g.GatewayHello) -> None:
        welcome = g.GatewayWelcome(
            name=self.expected_name,
            instance=self.instance,
            server_version=self.server_version,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        self.outbox.put(g.GatewayWelcome, welcome)
        for kind in TABLE:
            self.outbox.put(kind, None)  # made when written: the newest then


class GatewaySession(DialingSession):
    """The gateway's end of one connection, for the gateway `name` (its certificate's CN) and
    this process, `instance`; `make_hello` is called once, by `start`."""

    role = GATEWAY
    accepts = g.ControlMessage
    receives, sends, outbox_kinds, events = RECEIVES[GATEWAY], SENDS[GATEWAY], OUTBOX[GATEWAY], _EVENTS
    welcome_type = g.GatewayWelcome

    def __init__(self, name: str, instance: str, make_hello: Callable[[], g.GatewayHello]) -> None:
        super().__init__(make_hello)
        self.name = name
        self.instance = instance
        self._seq = 0
        self.reporting = 0  # the seq of the usage report sent on this link and not yet acknowledged (0: none)

    def upgrade_request(self) -> tuple[str, list[tuple[bytes, bytes]]]:
        return g.GATEWAY_PATH, [
            (g.GATEWAY_NAME_HEADER.encode(), self.name.encode()),
            (g.GATEWAY_INSTANCE_HEADER.encode(), self.instance.encode()),
        ]

    def _check_hello(self, hello: g.GatewayHello) -> None:
        if (hello.name, hello.instance) != (self.name, self.instance):
            raise LocalLinkError(
                f"hello for gateway {hello.name!r} ({hello.instance!r}) on the link of {self.name!r} ({self.instance!r})"
            )

    def heartbeat(self, load: g.GatewayHeartbeat | None = None) -> None:
        """Queue a GatewayHeartbeat saying `load` (its `seq` is the session's), if the link is
        open (an unsent one is replaced: if `load` leaves the metrics out, it keeps the unsent
        one's)."""
        if self.can_send(g.GatewayHeartbeat):
            load = load or g.GatewayHeartbeat(seq=0)
            pending = self.outbox.unsent(g.GatewayHeartbeat)
            if load.metrics is None and pending is not None:
                load = attrs.evolve(load, metrics=pending.metrics)
            self._seq += 1
            self.send(attrs.evolve(load, seq=self._seq))

    def budget_report(self, report: g.BudgetReport) -> None:
        """Queue `report` (of the budgets it holds), if the link is open (an unsent one is replaced)."""
        if self.can_send(g.BudgetReport):
            self.send(report)

    def report(self, report: g.UsageReport) -> bool:
        """Queue `report` if the link is open and none is waiting for its acknowledgement; whether
        it was."""
        if self.reporting or not self.can_send(g.UsageReport):
            return False
        self.send(report)
        self.reporting = report.seq
        return True

    def _check(self, message: Any) -> None:
        if isinstance(message, g.UsageAck):
            if message.seq != self.reporting:
                raise LinkProtocolError(
                    w.UNEXPECTED,
                    f"the control plane acknowledged usage report {message.seq}, and the one sent on this link is "
                    f"{self.reporting or 'none'}; run the same llmgw release on the gateway and the control plane",
                )
            self.reporting = 0
        if isinstance(message, g.GatewayWelcome):
            self._check_welcome(message)
        elif isinstance(message, g.ShareChanged):
            if not message.index < message.count:
                raise WireError(
                    w.BAD_MESSAGE,
                    f"the control plane gave this instance share {message.index} of {message.count}, which is none; "
                    "run the same llmgw release on the gateway and the control plane",
                )
        elif isinstance(message, g.RotationChanged):
            bad = next((e for e in message.endpoints if not 0 < e.port < 65536), None)
            if bad is not None:
                raise WireError(
                    w.BAD_MESSAGE, f"replica {shown(bad.replica_id)} in the rotation has port {bad.port}, which is none"
                )

    def _check_welcome(self, welcome: g.GatewayWelcome) -> None:
        if (welcome.name, welcome.instance) != (self.name, self.instance):
            raise LinkProtocolError(
                g.NAME_MISMATCH,
                f"the control plane welcomed gateway {shown(welcome.name)}, instance {shown(welcome.instance)}, on the "
                f"link of {self.name!r}, instance {self.instance!r}; check that --server names this cluster's control plane",
            )
        self._check_server_version(welcome.server_version)
        interval = welcome.heartbeat_interval_s
        if not (math.isfinite(interval) and interval >= MIN_HEARTBEAT_INTERVAL_S):
            raise WireError(
                w.BAD_MESSAGE,
                f"the control plane asks for a heartbeat every {interval:g} s, and this gateway sends one at most "
                f"every {MIN_HEARTBEAT_INTERVAL_S:g} s; set heartbeat_interval_s in server.toml to a few seconds",
            )


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,199}")  # Prometheus' names, bounded
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,99}")
KINDS = ("counter", "gauge", "histogram")


def check_metrics(families: tuple[g.MetricFamily, ...]) -> None:
    """`WireError` unless every family of a heartbeat can be shown as Prometheus text as it is:
    names of metric and labels as Prometheus has them, help on one line, a known kind, each
    series with a value per label, each histogram's with a count per bucket and one above."""
    for f in families:
        bad = _bad_family(f) or next((why for s in f.samples if (why := _bad_sample(f, s))), None)
        if bad:
            raise WireError(
                w.BAD_MESSAGE,
                f"metric family {shown(f.name)} of the heartbeat {bad}; run the same llmgw release on the gateway "
                "and the control plane",
            )


def _bad_family(f: g.MetricFamily) -> str | None:
    if not _METRIC_NAME.fullmatch(f.name) or not all(_LABEL_NAME.fullmatch(label) for label in f.labels):
        return "has a name that is not a Prometheus name, or a label that is not"
    if "\n" in f.help or f.kind not in KINDS:
        return f"has help on more than one line, or a kind not one of {', '.join(KINDS)}"
    if f.kind != "histogram" and f.buckets:
        return "has buckets and is no histogram"
    return None


def _bad_sample(f: g.MetricFamily, s: g.Sample) -> str | None:
    if len(s.labels) != len(f.labels):
        return f"has a series with {len(s.labels)} label values for {len(f.labels)} labels"
    if f.kind == "histogram" and len(s.counts) != len(f.buckets) + 1:
        return f"has a series with {len(s.counts)} counts for {len(f.buckets)} buckets and the one above them"
    return None


def check_usage(report: g.UsageReport) -> None:
    """`WireError` unless a usage report can be added to the ledger as it is: a sequence from 1,
    at most MAX_USAGE_ROWS rows, each of an hour's start, a key and a model, with counts that are
    not negative."""
    if report.seq < 1 or len(report.rows) > MAX_USAGE_ROWS:
        raise WireError(
            w.BAD_MESSAGE,
            f"usage report {report.seq} with {len(report.rows)} rows: a report has a sequence from 1 and at most "
            f"{MAX_USAGE_ROWS} rows; run the same llmgw release on the gateway and the control plane",
        )
    for r in report.rows:
        counts = (r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens)
        if r.hour < 0 or r.hour % 3600 or min(counts) < 0 or not r.key or not r.model:
            raise WireError(
                w.BAD_MESSAGE,
                f"usage report {report.seq} has a row that is none (hour {r.hour}, key {shown(r.key)}, model "
                f"{shown(r.model)}, counts {counts}); run the same llmgw release on the gateway and the control plane",
            )


def new_instance() -> str:
    """A token naming one gateway process among its gateway's (a worker, a restart)."""
    return secrets.token_hex(8)
