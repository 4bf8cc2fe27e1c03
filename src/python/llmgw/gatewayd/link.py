"""A gateway's side of the gateway link: its adapter on the link runtime both dialling ends share.

`llmgw.linkclient.LinkClient` dials the control plane (TCP, TLS with the gateway's certificate,
the WebSocket upgrade naming the gateway and this process: `GATEWAY_NAME_HEADER`,
`GATEWAY_INSTANCE_HEADER`), keeps the session up with backoff and full jitter, follows a standby
to the leader and dials again a control plane that falls silent for SILENT_HEARTBEATS of its
heartbeats (a half-open connection, a control plane that stopped); every rule of the link is
`llmgw.wire.gateway_session.GatewaySession`'s. This module is what a gateway does with it: its
hello, its heartbeats (with its load, and at once when it routes by a new rotation, holds new
keys or begins to hold a request for a model with no replica), its usage (`llmgw.gateway.usage`:
every USAGE_INTERVAL_S while there are counts, one report at a time, the unacknowledged one sent
again after every reconnect, whichever control plane leads then; at once when the worker stops,
`Usage.flush`), and what the control plane says
handed to a `TableSink` (`llmgw.wire.gateway_link`): each part of the table as it arrives, `heard` on every frame taken, `link_state(True, "")` once
welcomed and `link_state(False, why)` after every session or attempt that ended (so while the
control plane is away it is said again at each attempt, with the latest reason). The sink keeps
the table while the link is down; nothing here forgets it.

Between sessions the link waits with exponential backoff and full jitter (LINK_BACKOFF), short
enough that a gateway is back within a few seconds of its control plane's return (a revocation
made meanwhile then applies at once: the whole table comes with every Welcome); a TCP connect
unanswered for TCP_CONNECT_TIMEOUT_S is given up and made again, so that a path that returns
while a dial waits on the kernel's next SYN resend is found within seconds too. A failure is
logged loudly when its reason changes, quietly while it stays the same.

The certificate is read from a pki directory (`Credentials.load`: gateway.key, gateway.crt and
ca.crt, as `llmgw ca issue --gateway NAME --out DIR` writes them); its CN is the gateway's name.
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from llmgw import __version__
from llmgw.backoff import Backoff
from llmgw.gateway.budgets import Budgets
from llmgw.gateway.usage import Usage
from llmgw.linkclient import ConnectTCP, Dial, LinkClient
from llmgw.linkio import Target, Targets, Writer
from llmgw.log import get_logger
from llmgw.pki.ca import cert_info
from llmgw.pki.files import gateway_paths, load_cert
from llmgw.pki.tls import gateway_ssl_context
from llmgw.wakeup import any_of
from llmgw.wire import gateway_link as g
from llmgw.wire import gateway_session as gs

log = get_logger("llmgw.gatewayd.link")

# The TCP connect alone. The kernel sends an unanswered SYN again 1 s and 3 s after the first, then
# at 7 s: a path that returns after the 3 s resend is found sooner by a new dial (after at most
# LINK_BACKOFF's 3 s) than by the kernel's 7 s one. So a gateway cut off from its control plane
# sends a SYN at least every 3.5 s and is back within about that of the path's return, whatever
# the phase of its dial then (docs/gateway.md: a revocation made meanwhile applies within 5 s).
TCP_CONNECT_TIMEOUT_S = 3.5
# The largest frame taken from the control plane: the table is sent whole (every replica, every
# valid key: ~150 bytes each), so it may pass trio-websocket's default of 1 MiB on a big cluster.
MAX_TABLE_BYTES = 64 << 20

# Between sessions: 0.25 s doubling to 3 s, with full jitter, so that many gateways refused
# together (a control-plane restart) do not return together, and each is back within a few
# seconds of its return; a session that was up starts it again.
LINK_BACKOFF = Backoff(first_s=0.25, max_s=3.0, jitter=True)

# Usage reports: one every this while there are counts (and the last is acknowledged); a worker
# that stops sends its last at once (`Usage.flush`).
USAGE_INTERVAL_S = 2.0

# What each heartbeat says (its `seq` is the session's): the worker's load, and its figures
# (`metrics`) if asked, else None (a heartbeat sent at once leaves them out: `GatewayHeartbeat`).
Load = Callable[[bool], g.GatewayHeartbeat]
# Events set when what the load says should reach the control plane at once (`Gateway.at_once`).
AtOnce = Callable[[], Sequence[trio.Event]]


def no_load(metrics: bool) -> g.GatewayHeartbeat:
    return g.GatewayHeartbeat(seq=0, metrics=() if metrics else None)


@attrs.frozen(kw_only=True)
class Credentials:
    """What a gateway proves itself with: its name (its certificate's CN) and the TLS context
    that presents its certificate and trusts only the cluster's CA."""

    name: str
    ssl_context: ssl.SSLContext = attrs.field(repr=False)
    cert_serial: int

    @classmethod
    def load(cls, pki_dir: Path) -> Credentials:
        """From `pki_dir` (gateway.key, gateway.crt, ca.crt); a `MachineError` naming the file and
        the fix if one is missing, unreadable, open to others or not a gateway's certificate."""
        context = gateway_ssl_context(pki_dir)  # checks the files and the certificate's role first
        info = cert_info(load_cert(gateway_paths(pki_dir).cert))
        return cls(name=info.common_name, ssl_context=context, cert_serial=info.serial)


class GatewayLink(LinkClient):
    """One gateway process's link to the control plane, kept up forever (`serve`)."""

    log = get_logger("llmgw.gatewayd.link")
    who, tls_side, log_prefix = "gateway", "gateway", "gateway_"
    quiet_repeats = True
    max_message_size = MAX_TABLE_BYTES

    def __init__(
        self,
        *,
        target: Target | Targets,
        tls: ssl.SSLContext,
        name: str,
        instance: str,
        sink: g.TableSink,
        load: Load = no_load,
        at_once: AtOnce | None = None,
        tls_name: str = "",
        started_at: float | None = None,
        usage: Usage | None = None,
        usage_interval_s: float = USAGE_INTERVAL_S,
        budgets: Budgets | None = None,
        backoff: Backoff = LINK_BACKOFF,
        rng: random.Random | None = None,
        dial: Dial | None = None,
        connect_tcp: ConnectTCP = trio.open_tcp_stream,
    ) -> None:
        """`dial(target)`: how a session's stream is opened (default: TCP and TLS to `target`;
        memory streams in tests); `connect_tcp`: how the default dial opens TCP (tests: one that
        hangs). `tls_name`: the name the control plane's certificate must cover, if not the host
        dialled (the control plane's own workers dial it on loopback). `at_once()`: events one of
        which is set when what `load()` says should reach the control plane at once, which sends
        a heartbeat then (`Gateway.at_once`: the gateway routes by a new rotation, its version;
        a request began to wait for a model with no replica, the models' load). `target`: the
        control plane, or every one (`Targets`). `usage`: the worker's counts, which the link
        reports (None: none)."""
        super().__init__(
            target=target,
            ssl_context=tls,
            backoff=backoff,
            rng=rng,
            dial=dial,
            connect_tcp=connect_tcp,
            tcp_timeout_s=TCP_CONNECT_TIMEOUT_S,
            tls_name=tls_name,
        )
        self.at_once = at_once
        self.name = name
        self.instance = instance
        self.sink = sink
        self.load = load
        self.started_at = time.time() if started_at is None else started_at
        self.usage = usage
        self.usage_interval_s = usage_interval_s
        self.budgets = budgets
        if usage is not None:
            usage.linked = True

    def _new_session(self) -> gs.GatewaySession:
        return gs.GatewaySession(self.name, self.instance, self._hello)

    def _hello(self) -> g.GatewayHello:
        return g.GatewayHello(
            protocol_version=g.GATEWAY_PROTOCOL_VERSION,
            name=self.name,
            instance=self.instance,
            gateway_version=__version__,
            started_at=self.started_at,
        )

    async def _up(self, welcome: g.GatewayWelcome, writer: Writer, nursery: trio.Nursery) -> None:
        self.sink.link_state(True, "")
        self.log.info(
            "gateway_link_up",
            server=str(self.target),
            gateway=self.name,
            instance=self.instance,
            server_version=welcome.server_version,
        )
        nursery.start_soon(self._heartbeats, writer, welcome.heartbeat_interval_s)
        if self.usage is not None:
            nursery.start_soon(self._usage_reports, writer, self.usage)
        if self.budgets is not None:
            nursery.start_soon(self._budget_reports, writer, self.budgets)

    async def _on_event(self, event: gs.Event, writer: Writer) -> None:
        if isinstance(event, gs.TableChanged):
            self._apply(event.message)
            if isinstance(event.message, g.KeysChanged):
                self._beat(writer)  # the sink holds them now: say so at once
        elif isinstance(event, gs.UsageAcked) and self.usage is not None:
            self.usage.acked(event.seq)

    def _heard(self) -> None:
        self.sink.heard(trio.current_time())

    def _down(self, reason: str) -> None:
        self.sink.link_state(False, reason)

    def _apply(self, message: g.RotationChanged | g.KeysChanged | g.ShareChanged) -> None:
        if isinstance(message, g.RotationChanged):
            self.sink.rotation_changed(message)
        elif isinstance(message, g.KeysChanged):
            self.sink.keys_changed(message)
        elif isinstance(message, g.ShareChanged):
            self.sink.share_changed(message)
        elif isinstance(message, g.BudgetsChanged):
            self.sink.budgets_changed(message)
        else:
            self.sink.grants_changed(message)

    def _beat(self, writer: Writer, metrics: bool = False) -> None:
        session = writer.session
        assert isinstance(session, gs.GatewaySession)
        session.heartbeat(self.load(metrics))  # a newer replaces one unsent
        writer.wake()

    async def _heartbeats(self, writer: Writer, interval: float) -> None:
        """A heartbeat every `interval`, with the gateway's metrics, and one at once without them
        when the gateway routes by a new rotation or holds a request for a model with no replica
        (`at_once`), or holds new keys (`_on_event`): a move and a key's change wait for what they
        say (`llmgw.server.gatewaylinks`), a model on demand for its first request to be heard of."""
        due = trio.current_time()
        while writer.session.open:
            events = self.at_once() if self.at_once is not None else ()  # taken before the load is read
            timely = trio.current_time() >= due
            if timely:
                due = trio.current_time() + interval
            self._beat(writer, metrics=timely)
            with trio.move_on_after(due - trio.current_time()):
                await any_of(events)

    async def _budget_reports(self, writer: Writer, budgets: Budgets) -> None:
        """What it holds and wants of each budget: at once on a new link, then whenever that
        changes (`Budgets.due`: more wanted, a grant reserved from); an unsent one is replaced."""
        session = writer.session
        assert isinstance(session, gs.GatewaySession)
        while session.open:
            due = budgets.due.next()
            session.budget_report(budgets.report())
            writer.wake()
            await due.wait()

    async def _usage_reports(self, writer: Writer, usage: Usage) -> None:
        """The usage counted, reported every `usage_interval_s` (at once when asked: `Usage.flush`),
        one report at a time: the first is the one unacknowledged on an earlier link, if any."""
        session = writer.session
        assert isinstance(session, gs.GatewaySession)
        while session.open:
            flushing = usage.flushing.next()
            if not session.reporting and (report := usage.report()) is not None and session.report(report):
                writer.wake()
            with trio.move_on_after(self.usage_interval_s):
                await flushing.wait()


async def serve_gateway_link(
    server_url: str | Sequence[str],
    tls: ssl.SSLContext,
    *,
    name: str,
    instance: str,
    sink: g.TableSink,
    load: Load = no_load,
    at_once: AtOnce | None = None,
    tls_name: str = "",
    started_at: float | None = None,
    usage: Usage | None = None,
    budgets: Budgets | None = None,
    task_status: trio.TaskStatus[GatewayLink] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep this gateway process (`instance`, e.g. `llmgw.wire.gateway_session.new_instance()`)
    linked to the control plane at `server_url` (wss://HOST:PORT, its agent_listen; or every control
    plane's, when several share a store, dialled in turn and followed to the leader) as the gateway
    `name` (its certificate's CN; `Credentials.load` gives both it and `tls`), feeding `sink`
    forever; `load()` says what each heartbeat reports, and one goes at once when one of
    `at_once()` is set (`GatewayLink`); `tls_name`: the name the control plane's certificate must
    cover, if not the host of `server_url`; `usage`: the counts it reports. Started at once, with the link (its `state` says
    whether it is up); never returns."""
    link = GatewayLink(
        target=Targets.parse(server_url),
        tls=tls,
        name=name,
        instance=instance,
        sink=sink,
        load=load,
        at_once=at_once,
        tls_name=tls_name,
        started_at=started_at,
        usage=usage,
        budgets=budgets,
    )
    task_status.started(link)
    await link.serve()
