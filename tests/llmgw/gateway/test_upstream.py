"""The upstream pool through its connect factory, on MockClock: what a connect's failure becomes,
the connect timeout, and idle connections reused and closed (a sim engine's handler in memory)."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from llmgw.gateway.errors import UpstreamSilent, UpstreamUnavailable
from llmgw.gateway.upstream import UpstreamPool
from testlib import memnet

pytestmark = pytest.mark.trio

CHAT = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'


async def test_a_connect_that_fails_or_hangs_is_translated_once(autojump_clock: trio.testing.MockClock) -> None:
    async def refused(host: str, port: int) -> trio.abc.Stream:
        raise OSError(errno.ECONNREFUSED, "Connection refused")

    async def unreachable(host: str, port: int) -> trio.abc.Stream:
        raise OSError(errno.EHOSTUNREACH, "No route to host")

    async def hangs(host: str, port: int) -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    with pytest.raises(UpstreamUnavailable, match="cannot connect to 10.0.0.1:8000: Connection refused") as info:
        await UpstreamPool(connect=refused).send("10.0.0.1", 8000, "POST", "/v1/completions", [], b"{}")
    assert not isinstance(info.value, UpstreamSilent)  # refused: another replica is worth a try at once
    with pytest.raises(UpstreamSilent, match="No route to host"):
        await UpstreamPool(connect=unreachable).send("10.0.0.1", 8000, "POST", "/v1/completions", [], b"{}")
    started = trio.current_time()
    with pytest.raises(UpstreamSilent, match="timed out after 1.5 s"):
        await UpstreamPool(connect=hangs, connect_timeout_s=1.5).send("10.0.0.1", 8000, "GET", "/", [], b"")
    assert trio.current_time() - started == pytest.approx(1.5)
    assert await UpstreamPool(connect=refused).probe("10.0.0.1", 8000) == (
        "does not answer a probe: cannot connect to 10.0.0.1:8000: Connection refused"
    )


async def test_an_idle_connection_is_reused_then_closed_on_both_sides(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (sim,) = memnet.start_sims(net, 1)
    pool = UpstreamPool(connect=net.connect)
    headers = [(b"authorization", f"Bearer {sim.key}".encode()), (b"content-type", b"application/json")]
    for _ in range(3):
        response = await pool.send(sim.host, sim.port, "POST", "/v1/chat/completions", headers, CHAT)
        assert response.status == 200 and b'"chat.completion"' in await response.read(1 << 20)
        await response.aclose()
    assert (pool.stats.opened, pool.stats.reused, pool.idle_count(*sim.address)) == (1, 2, 1)
    assert net.connections(sim.address) == 1 and net.connects == [sim.address]
    assert pool.close_idle(*sim.address) == 1  # at once, without waiting
    await trio.testing.wait_all_tasks_blocked()
    assert net.connections(sim.address) == 0  # the engine saw it close
    assert pool.open_connections == 0 and pool.stats.discarded == 1
