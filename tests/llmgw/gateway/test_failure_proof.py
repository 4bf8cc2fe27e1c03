"""No request lost while the rotation changes under load: two real sim replicas behind the
gateway, a bounded load (4 clients x 50 requests, each with a timeout), and in the middle of it
an engine killed, a replica drained, or a key revoked.

(test_gateway.py covers the same events with nothing else in flight.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from testlib.gateway import GW, chat, start_gateway

pytestmark = pytest.mark.trio

CLIENTS, PER_CLIENT = 4, 50


class Load:
    """`CLIENTS` clients sending `PER_CLIENT` requests each; every answer is kept with the time
    its request was sent."""

    def __init__(self, gw: GW, token: str | None = None) -> None:
        self.gw, self.token = gw, token or gw.token
        self.answers: list[tuple[float, int, str, bytes]] = []  # (sent at, status, replica, body)

    async def client(self, n: int, per_client: int = PER_CLIENT) -> None:
        for i in range(per_client):
            sent = trio.current_time()
            status, headers, body = await self.gw.call(
                "POST", "/v1/chat/completions", chat(f"c{n} q{i}"), token=self.token, timeout=20
            )
            self.answers.append((sent, status, headers.get("x-llmgw-replica", ""), body))
            if status == 401:
                return  # this client's key is gone

    async def done(self, count: int) -> None:
        with trio.fail_after(30):
            while len(self.answers) < count:
                await trio.sleep(0.01)

    def failed(self) -> list[tuple[int, bytes]]:
        return [(status, body[:200]) for _, status, _, body in self.answers if status != 200]


async def test_an_engine_killed_mid_load_costs_no_request(tmp_path: Path, nursery: trio.Nursery, sims) -> None:
    a, b = sims(2, "--output-token-ms", "5")  # ~40 ms a request: some are always on `a` when it dies
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(), b.endpoint()))
    load = Load(gw)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS):
            clients.start_soon(load.client, n)
        await load.done(40)
        with trio.fail_after(10):  # kill it with a request on it
            while not gw.gateway.router.outstanding.get(a.name):
                await trio.sleep(0)
        os.kill(a.proc.pid, signal.SIGKILL)
        killed_at = trio.current_time()
    assert len(load.answers) == CLIENTS * PER_CLIENT and load.failed() == []
    assert {replica for sent, _, replica, _ in load.answers if sent > killed_at + 0.5} == {b.name}


async def test_a_replica_drained_under_load_gets_no_new_request_and_none_fails(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    a, b = sims(2, "--output-token-ms", "5")
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(), b.endpoint()))
    load = Load(gw)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS):
            clients.start_soon(load.client, n)
        await load.done(40)
        # As the control plane's drain does: marked draining at once, removed once its requests finished.
        gw.provider.set((a.endpoint(draining=True), b.endpoint()))
        marked_at = trio.current_time()
        with trio.fail_after(10):
            while gw.gateway.router.outstanding.get(a.name):
                await trio.sleep(0.005)
        gw.provider.set((b.endpoint(),))
    assert len(load.answers) == CLIENTS * PER_CLIENT and load.failed() == []
    before = [replica for sent, _, replica, _ in load.answers if sent < marked_at]
    after = [replica for sent, _, replica, _ in load.answers if sent > marked_at]
    assert a.name in before and b.name in before  # both served until the drain
    assert len(after) > 100 and set(after) == {b.name}


async def test_a_key_revoked_under_load_is_refused_at_its_next_request(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    a, b = sims(2, "--output-token-ms", "5")
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(), b.endpoint()))
    _, other = await gw.gateway.keys.create("other")
    revoked, kept = Load(gw), Load(gw, other)
    async with trio.open_nursery() as clients:
        for n in range(CLIENTS // 2):
            clients.start_soon(revoked.client, n)
            clients.start_soon(kept.client, n)
        await revoked.done(20)
        await gw.gateway.keys.revoke("tests")
        revoked_at = trio.current_time()
    assert len(kept.answers) == CLIENTS // 2 * PER_CLIENT and kept.failed() == []
    assert all(status == 200 for sent, status, _, _ in revoked.answers if sent < revoked_at - 0.5)
    # A request sent just before the revocation may be checked after it: every one sent after is
    # refused, and each client of that key stops at its first refusal.
    late = [(status, body) for sent, status, _, body in revoked.answers if sent > revoked_at]
    assert all(status == 401 and b"unknown or revoked" in body for status, body in late)
    statuses = sorted(status for _, status, _, _ in revoked.answers)
    assert statuses == [200] * (len(statuses) - CLIENTS // 2) + [401] * (CLIENTS // 2)
