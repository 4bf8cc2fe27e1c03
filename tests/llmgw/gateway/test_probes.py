"""The gateway's prober and drain on a fake clock (MockClock), with a scripted pool standing in
for the network: a down replica is probed once per interval for as long as it stays silent,
returns at the first probe that reaches it (waking a request queued for it), and is forgotten
when the control plane removes it; a drain ends when the last request does, not at a poll."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.config import GatewaySection
from llmgw.gateway.app import Gateway
from llmgw.gateway.cachewatch import CACHE_REPORT_INTERVAL_S
from llmgw.gateway.job import Job
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.wire.gateway_link import ModelInfo
from testlib.endpoints import StaticEndpoints
from testlib.gateway import parse_metrics

pytestmark = pytest.mark.trio

PROBE_S = 0.3  # how long a scripted probe takes


class ScriptedPool:
    """`probe` answers as `reachable` says at the time; every probe is recorded with its start."""

    def __init__(self) -> None:
        self.reachable: set[int] = set()
        self.probes: list[tuple[float, int]] = []

    async def probe(self, host: str, port: int) -> str | None:
        self.probes.append((trio.current_time(), port))
        await trio.sleep(PROBE_S)
        return None if port in self.reachable else "does not answer a probe: timed out"

    def close_idle(self, host: str, port: int) -> int:
        return 0


class NoKeys:
    def leave(self, key) -> None:
        pass


def endpoint(name: str, port: int) -> Endpoint:
    return Endpoint(replica_id=name, model="m", host="10.0.0.1", port=port)


async def gateway(nursery: trio.Nursery, *eps: Endpoint) -> tuple[Gateway, ScriptedPool, StaticEndpoints]:
    pool = ScriptedPool()
    provider = StaticEndpoints(tuple(eps))
    gw = Gateway(provider, NoKeys(), options=GatewaySection(probe_interval_s=1.0), pool=pool)
    await nursery.start(serve_services, gw)
    return gw, pool, provider


async def test_a_silent_replica_is_probed_each_interval_and_returns_at_the_first_probe_that_reaches_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    a, b = endpoint("a", 8001), endpoint("b", 8002)
    gw, pool, _ = await gateway(nursery, a, b)
    assert pool.probes == []  # nothing down, nothing probed

    went_down = trio.current_time()
    assert gw.replica_failed(a, "connect", client_saw_bytes=False).went_down
    await trio.sleep(10.5)
    # Down for 10.5 s: probed once a second (each probe's 0.3 s inside its interval), all failed.
    starts = [t - went_down for t, port in pool.probes]
    assert {port for _, port in pool.probes} == {8001}
    assert starts[0] == 1.0 and len(starts) == 10
    assert all(0.99 <= later - earlier <= 1.01 for earlier, later in zip(starts, starts[1:], strict=False))
    assert gw.router.state_of(a) == "down" and gw.router.in_rotation("m") == [b]

    pool.reachable.add(8001)
    await trio.sleep(1.0 + PROBE_S)
    assert gw.router.state_of(a) == "ready"
    metrics = parse_metrics(gw.render_metrics())
    assert metrics[("llmgw_gateway_probes_total", frozenset({("result", "failed")}))] == 10
    assert metrics[("llmgw_gateway_probes_total", frozenset({("result", "reached")}))] == 1
    assert metrics[("llmgw_gateway_replica_down_total", frozenset({("model", "m"), ("reason", "connect")}))] == 1
    state = frozenset({("model", "m"), ("replica", "a"), ("state", "ready")})
    assert metrics[("llmgw_gateway_replica_state", state)] == 1
    probes = len(pool.probes)
    await trio.sleep(10.0)
    assert len(pool.probes) == probes  # back in rotation: no more probes


async def test_a_request_queued_for_the_only_replica_is_woken_by_the_probe_that_brings_it_back(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    a = endpoint("a", 8001)
    gw, pool, _ = await gateway(nursery, a)
    gw.replica_failed(a, "first_byte", client_saw_bytes=False)
    picked: list[tuple[float, Endpoint | None]] = []

    async def queued() -> None:
        ep, _ = await gw._wait_for_endpoint("m", set(), None, trio.current_time() + 30.0)
        picked.append((trio.current_time(), ep))

    nursery.start_soon(queued)
    await trio.sleep(4.5)
    assert picked == [] and gw.queued == {"m": 1}
    pool.reachable.add(8001)
    returned_at = trio.current_time()
    await trio.sleep(2.0)
    [(at, ep)] = picked
    assert ep == a and at - returned_at <= 1.0 + PROBE_S  # at the next probe's answer, not at a poll


async def test_a_replica_the_control_plane_removes_is_no_longer_probed(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    a, b = endpoint("a", 8001), endpoint("b", 8002)
    gw, pool, provider = await gateway(nursery, a, b)
    gw.replica_failed(a, "connect", client_saw_bytes=False)
    await trio.sleep(3.1)
    assert len(pool.probes) == 3  # the third under way (until 3.3 s)
    provider.set((b,))
    await trio.sleep(0.01)  # serve_rotation applies it
    assert gw.router.down == {}
    await trio.sleep(10.0)
    assert len(pool.probes) == 3  # none after the removal; the one under way changed nothing
    provider.set((a, b))  # the same replica back: in rotation, not down
    await trio.sleep(0.01)
    assert gw.router.state_of(a) == "ready"


async def test_a_drain_ends_when_the_last_request_does(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    gw, _, _ = await gateway(nursery, endpoint("a", 8001))
    jobs = [Job(gw, key=None, model="m", started=0.0), Job(gw, key=None, model="m", started=0.0)]
    ended: list[tuple[float, bool]] = []

    async def drain() -> None:
        finished = await gw.drain(60.0)
        ended.append((trio.current_time(), finished))

    started = trio.current_time()
    nursery.start_soon(drain)
    await trio.sleep(3.0)
    jobs[0].finish(200)
    await trio.sleep(3.0)
    assert ended == [] and gw.draining
    jobs[1].finish(200)
    await trio.sleep(0.01)
    assert ended == [(started + 6.0, True)]  # the moment the count reached zero

    late = Job(gw, key=None, model="m", started=0.0)
    nursery.start_soon(drain)
    await trio.sleep(61.0)
    assert ended[1] == (pytest.approx(started + 6.01 + 60.0), False)  # the deadline, a request still in flight
    late.finish(None)


async def test_a_cache_report_that_fails_by_a_bug_of_ours_leaves_the_probes_running(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The scripted pool has no `send`: every llama.cpp /slots report of a model routed by
    prefix fails with an AttributeError. The reports are lost, the prober goes on."""
    a = endpoint("a", 8001)
    gw, pool, provider = await gateway(nursery, a)
    provider.set((a,), None, (ModelInfo(name="m", engine="llamacpp", routing="prefix"),))
    await trio.sleep(CACHE_REPORT_INTERVAL_S * 3)  # three rounds of reports, each failing
    gw.replica_failed(a, "first_byte", client_saw_bytes=False)
    pool.reachable.add(8001)
    await trio.sleep(1.0 + PROBE_S + 0.1)
    assert pool.probes and a.replica_id not in gw.router.down  # probed and back
