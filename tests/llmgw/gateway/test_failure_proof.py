"""No request lost while the rotation changes under load: two sim replicas behind the gateway
(their handlers in memory, on MockClock: `testlib.memnet`), a bounded load (4 clients x 50
requests), and in the middle of it an engine gone, a replica drained, or a key revoked.

(test_gateway.py covers the same events with nothing else in flight, and a killed engine
process on real sockets.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.wakeup import Wakeup
from testlib import memnet
from testlib.gateway import chat
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

CLIENTS, PER_CLIENT = 4, 50


class Load:
    """`CLIENTS` clients sending `PER_CLIENT` requests each; every answer is kept with the time
    its request was sent."""

    def __init__(self, gw: memnet.MemGateway, token: str | None = None) -> None:
        self.gw, self.token = gw, token or gw.token
        self.answers: list[tuple[float, int, str, bytes]] = []  # (sent at, status, replica, body)
        self.answered = Wakeup()

    async def client(self, n: int, per_client: int = PER_CLIENT) -> None:
        for i in range(per_client):
            sent = trio.current_time()
            status, headers, body = await self.gw.call(
                "POST", "/v1/chat/completions", chat(f"c{n} q{i}"), token=self.token
            )
            self.answers.append((sent, status, headers.get("x-llmgw-replica", ""), body))
            self.answered.fire()
            if status == 401:
                return  # this client's key is gone

    async def done(self, count: int) -> None:
        await await_true(lambda: len(self.answers) >= count, f"{count} answers", changed=self.answered.next)

    def failed(self) -> list[tuple[int, bytes]]:
        return [(status, body[:200]) for _, status, _, body in self.answers if status != 200]


async def loaded_gateway(tmp_path: Path, nursery: trio.Nursery) -> tuple[memnet.MemoryNet, list, memnet.MemGateway]:
    net = memnet.MemoryNet(nursery)
    sims = memnet.start_sims(net, 2, output_token_ms=5)  # 45 ms a request: some are always on each
    gw = await memnet.start_gateway(nursery, tmp_path, net, tuple(s.endpoint() for s in sims))
    return net, sims, gw


async def test_an_engine_gone_mid_load_costs_no_request(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, (a, b), gw = await loaded_gateway(tmp_path, nursery)
    load = Load(gw)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS):
            clients.start_soon(load.client, n)
        await load.done(40)
        # Gone with a request on it (nothing announces a request taken: looked at each millisecond
        # of fake time, which costs no real time).
        outstanding = gw.gateway.router.outstanding
        await await_true(lambda: outstanding.get(a.name), "a request on a", poll_s=0.001)
        net.kill(a.address)
        killed_at = trio.current_time()
    assert len(load.answers) == CLIENTS * PER_CLIENT and load.failed() == []
    after = {replica for sent, _, replica, _ in load.answers if sent > killed_at}
    assert after == {b.name}  # out of rotation from its first failure on


async def test_a_replica_drained_under_load_gets_no_new_request_and_none_fails(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, (a, b), gw = await loaded_gateway(tmp_path, nursery)
    load = Load(gw)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS):
            clients.start_soon(load.client, n)
        await load.done(40)
        # As the control plane's drain does: marked draining at once, removed once its requests finished.
        gw.provider.set((a.endpoint(draining=True), b.endpoint()))
        marked_at = trio.current_time()
        outstanding = gw.gateway.router.outstanding
        await await_true(lambda: not outstanding.get(a.name), "a's requests finished", changed=gw.gateway.freed.next)
        gw.provider.set((b.endpoint(),))
    assert len(load.answers) == CLIENTS * PER_CLIENT and load.failed() == []
    before = [replica for sent, _, replica, _ in load.answers if sent < marked_at]
    after = [replica for sent, _, replica, _ in load.answers if sent > marked_at]
    assert a.name in before and b.name in before  # both served until the drain
    assert len(after) > 100 and set(after) == {b.name}


async def test_a_key_revoked_under_load_is_refused_at_its_next_request(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, _, gw = await loaded_gateway(tmp_path, nursery)
    _, other = await gw.keys.create("other")
    revoked, kept = Load(gw), Load(gw, other)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS // 2):
            clients.start_soon(revoked.client, n)
            clients.start_soon(kept.client, n)
        await revoked.done(20)
        revoking_at = trio.current_time()
        # The store is written first, in a thread, then the table in memory. While the thread
        # runs every task waits, and an autojumping clock would race through the clients'
        # remaining requests in virtual time (each is 45 ms of sleeps): it stands still meanwhile.
        autojump_clock.autojump_threshold = math.inf
        try:
            await gw.keys.revoke("tests")
        finally:
            autojump_clock.autojump_threshold = 0
        revoked_at = trio.current_time()
    assert len(kept.answers) == CLIENTS // 2 * PER_CLIENT and kept.failed() == []
    assert all(status == 200 for sent, status, _, _ in revoked.answers if sent < revoking_at)
    # Every request sent once the revocation returned is refused, and each client of that key
    # stops at its first refusal.
    late = [(status, body) for sent, status, _, body in revoked.answers if sent > revoked_at]
    assert all(status == 401 and b"unknown or revoked" in body for status, body in late)
    statuses = sorted(status for _, status, _, _ in revoked.answers)
    assert statuses == [200] * (len(statuses) - CLIENTS // 2) + [401] * (CLIENTS // 2)
