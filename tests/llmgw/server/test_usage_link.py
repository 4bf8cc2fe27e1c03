"""Usage reports over the gateway link, both adapters against each other over memory streams on
MockClock (as test_gatewayfeed.py): a gateway's counts (`llmgw.gateway.usage.Usage`) reported by
its link (`llmgw.gatewayd.link`), written by the control plane (`llmgw.server.links.usagereports`)
and acknowledged; a report whose acknowledgement was lost sent again on the next link and counted
once; a store that refuses a write tried again; the gateway on the control plane's own loop."""

from __future__ import annotations

import random
import ssl
import time

import pytest
import trio
import trio.testing

from llmgw.backoff import Backoff
from llmgw.gateway.routing import Endpoint, Rotation
from llmgw.gateway.usage import Usage
from llmgw.gatewayd import link as gl
from llmgw.looplag import StallClock
from llmgw.server.errors import StoreBusy
from llmgw.server.links.agentlistener import AgentListener
from llmgw.server.links.gatewaylinks import GatewayFeed
from llmgw.server.links.usagereports import UsageReports
from llmgw.server.store.ledger import REPORTS_KEPT_S
from llmgw.wakeup import Wakeup
from testlib.memlink import gated_pair, gateway_cert

pytestmark = pytest.mark.trio

CERT = gateway_cert()
HOUR = 1765080000


class Ledger:
    """The store's calls: the ledger as `record_usage` keeps it (a report's seq once), and a
    write refused `refuse` times first."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.rows: dict[tuple, list[int]] = {}
        self.refuse = 0
        self.calls = 0
        self.pruned: list[float] = []

    async def prune_usage_reports(self, before: float) -> int:
        await trio.lowlevel.checkpoint()
        self.pruned.append(before)
        return 0

    async def is_revoked(self, serial: int) -> bool:
        await trio.lowlevel.checkpoint()
        return False

    async def record_usage(self, instance: str, seq: int, rows) -> bool:
        await trio.lowlevel.checkpoint()
        self.calls += 1
        if self.refuse:
            self.refuse -= 1
            raise StoreBusy("ledger.db", 1.0)
        if seq <= self.seq.get(instance, 0):
            return False
        self.seq[instance] = seq
        for r in rows:
            counts = self.rows.setdefault((r.hour, r.key, r.team, r.model), [0, 0, 0, 0])
            for i, n in enumerate((r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens)):
                counts[i] += n
        return True


class Endpoints:
    def __init__(self) -> None:
        self.changed = Wakeup()

    def gateway_rotation(self) -> Rotation:
        return Rotation(
            models=frozenset({"chat"}),
            endpoints=(Endpoint(replica_id="r1", model="chat", host="10.0.0.1", port=8000, api_key="k"),),
        )

    def rotation_changed(self) -> trio.Event:
        return self.changed.next()


class Keys:
    def __init__(self) -> None:
        self.changed = Wakeup()

    def valid(self) -> list:
        return []


class Sink:
    def rotation_changed(self, message) -> None: ...
    def keys_changed(self, message) -> None: ...
    def share_changed(self, message) -> None: ...
    def budgets_changed(self, message) -> None: ...
    def grants_changed(self, message) -> None: ...
    def heard(self, now: float) -> None: ...
    def link_state(self, connected: bool, detail: str) -> None: ...


class Plane:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.listener = AgentListener(store=ledger, max_connections=8)
        self.feed = GatewayFeed(
            endpoints=Endpoints(), keys=Keys(), clock=StallClock(), heartbeat_interval_s=1.0, silence_timeout_s=3.0
        )
        self.reports = UsageReports(ledger, backoff=Backoff(first_s=0.5, max_s=2.0))  # type: ignore[arg-type]
        self.feed.usage = self.reports
        self.listener.gateways = self.feed

    def connect(self, nursery: trio.Nursery, usage: Usage):
        """One session of a gateway whose counts are `usage`; (its link, gates, its end)."""
        a, b, to_server, to_gateway = gated_pair()
        link = gl.GatewayLink(
            target=gl.Target(host="cp", port=1),
            tls=ssl.create_default_context(),
            name="gw1",
            instance="i1",
            sink=Sink(),
            rng=random.Random(7),
            usage=usage,
            usage_interval_s=2.0,
        )
        ended = trio.Event()

        async def run() -> None:
            try:
                await link.run_on(a)
            except Exception:  # noqa: BLE001 - the session broke: what the test waits for
                pass
            ended.set()

        nursery.start_soon(self.listener.serve_peer, b, CERT, "10.0.0.5")
        nursery.start_soon(run)
        return link, to_server, to_gateway, ended


@pytest.fixture
async def plane(nursery: trio.Nursery) -> Plane:
    made = Plane(Ledger())
    await nursery.start(made.feed.serve)
    await nursery.start(made.reports.serve)
    return made


def _usage() -> Usage:
    return Usage(wall=lambda: HOUR + 5.0)


async def until(predicate, step_s: float = 0.05, limit_s: float = 60.0) -> None:
    with trio.fail_after(limit_s):
        while not predicate():
            await trio.sleep(step_s)


async def test_counts_are_reported_acknowledged_and_a_report_sent_again_counted_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    usage = _usage()
    link, _, to_gateway, ended = plane.connect(nursery, usage)
    usage.record("alice", "t", "chat", 10, 2, 5)
    usage.record("alice", "t", "chat", 1, 0, 1)
    await until(lambda: not usage.unreported)
    assert plane.ledger.rows == {(HOUR, "alice", "t", "chat"): [2, 11, 2, 6]} and plane.ledger.seq == {"i1": 1}
    # The next report is written, but its acknowledgement does not reach the gateway: the link
    # falls silent and ends, and the report stays the one unacknowledged.
    to_gateway.close()
    usage.record("bob", "", "chat", 3, 0, 3)
    await until(lambda: plane.ledger.seq["i1"] == 2)
    assert usage.unacked is not None and usage.unacked.seq == 2
    usage.record("bob", "", "chat", 1, 0, 1)  # counted meanwhile: waits in `pending`
    await ended.wait()
    # The next link sends it again first: acknowledged, not counted twice; then the rest.
    plane.connect(nursery, usage)
    await until(lambda: not usage.unreported)
    assert plane.ledger.seq == {"i1": 3}
    assert plane.ledger.rows[(HOUR, "bob", "", "chat")] == [2, 4, 0, 4]
    assert plane.reports.reports.values == {("added",): 3.0, ("again",): 1.0}
    assert plane.reports.tokens.values[("completion",)] == 10


async def test_a_write_the_store_refuses_is_tried_again(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    plane.ledger.refuse = 2
    usage = _usage()
    plane.connect(nursery, usage)
    usage.record("alice", "", "chat", 1, 0, 1)
    await until(lambda: not usage.unreported)
    assert plane.ledger.calls == 3 and plane.ledger.rows == {(HOUR, "alice", "", "chat"): [1, 1, 0, 1]}
    assert plane.reports.reports.values[("failed",)] == 2


async def test_a_stopping_gateway_flushes_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    usage = _usage()
    plane.connect(nursery, usage)
    await trio.sleep(2.5)  # the link's first look found nothing: the next is 2 s away
    usage.record("alice", "", "chat", 1, 0, 1)
    started = trio.current_time()
    await usage.flushed()
    assert trio.current_time() - started < 0.5 and plane.ledger.seq == {"i1": 1}


async def test_the_gateway_on_the_control_planes_loop_is_written_directly(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    usage = _usage()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            await inner.start(plane.reports.serve_local, usage)
            usage.record("alice", "", "chat", 1, 0, 1)
            await until(lambda: not usage.unreported)
            usage.record("alice", "", "chat", 2, 0, 2)  # the last, written when it stops
            scope.cancel()
    [instance] = plane.ledger.seq
    assert instance.startswith("own-") and plane.ledger.seq[instance] == 2
    assert plane.ledger.rows[(HOUR, "alice", "", "chat")] == [2, 3, 0, 3]


async def test_the_sequences_of_gateways_long_gone_are_forgotten_once_a_day(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    await trio.sleep(3599)
    assert plane.ledger.pruned == []  # not at a start
    await trio.sleep(2)
    [before] = plane.ledger.pruned
    assert abs(time.time() - REPORTS_KEPT_S - before) < 60
    await trio.sleep(86400)
    assert len(plane.ledger.pruned) == 2
