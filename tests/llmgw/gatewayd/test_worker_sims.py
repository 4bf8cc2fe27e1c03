"""Gateway workers on real sockets in front of real sim engine processes, fed through their
tables' sinks as the link client feeds them: two workers on one port (SO_REUSEPORT) both serve,
the link down changes nothing a client sees, and a key gone from a new table is refused at once.
(`tests/integration/test_gateway_process.py` runs `llmgw gateway` itself.)"""

from __future__ import annotations

import json

import pytest
import trio

from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.worker import GatewayWorker
from llmgw.wire.gateway_link import KeysChanged, RotationChanged, ShareChanged
from testlib.cluster import free_port
from testlib.gateway import chat, request
from testlib.gatewaytable import TOKEN, key, route, token_of

pytestmark = pytest.mark.trio

KEYS = (key("tests"), key("other"))


async def held(*, sink: GatewayTable, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A source that gives nothing: the test feeds the sink itself, as a link client would."""
    task_status.started()
    await trio.sleep_forever()


def feed(table: GatewayTable, sims, keys=KEYS) -> None:
    table.link_state(True, "")
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=tuple(route(s) for s in sims)))
    table.keys_changed(KeysChanged(keys=keys))
    table.share_changed(ShareChanged(index=0, count=1))
    table.heard(trio.current_time())


async def call(port: int, method: str, path: str, body=None, token: str | None = TOKEN):
    return await trio.to_thread.run_sync(lambda: request(port, method, path, body, token=token, timeout=15))


async def start_worker(nursery: trio.Nursery, port: int, instance: str) -> GatewayTable:
    table = GatewayTable(now=trio.current_time())
    worker = GatewayWorker(table, instance=instance)
    await nursery.start(
        lambda task_status: worker.serve(held, "127.0.0.1", port, reuse_port=True, task_status=task_status)
    )
    return table


async def test_two_workers_share_one_port_and_serve_real_engines(sims, nursery: trio.Nursery) -> None:
    engines = sims(2)
    port = free_port()
    tables = [await start_worker(nursery, port, f"w{i}") for i in range(2)]  # the second bind is SO_REUSEPORT's
    status, _, body = await call(port, "POST", "/v1/chat/completions", chat())
    assert status == 503 and b"no table from the control plane yet" in body
    for table in tables:
        feed(table, engines)
    seen_workers, seen_replicas = set(), set()
    for n in range(40):  # a fresh connection each: the kernel spreads them over both sockets
        status, _, body = await call(port, "GET", "/health", token=None)
        assert status == 200
        seen_workers.add(json.loads(body)["instance"])
        status, headers, body = await call(port, "POST", "/v1/chat/completions", chat(f"q{n}"))
        assert status == 200, body
        seen_replicas.add(headers["x-llmgw-replica"])
    assert seen_workers == {"w0", "w1"}
    assert seen_replicas == {e.name for e in engines}


async def test_the_link_down_changes_nothing_a_client_sees_and_a_removed_key_is_refused_at_once(
    sims, nursery: trio.Nursery
) -> None:
    engines = sims(2)
    port = free_port()
    table = await start_worker(nursery, port, "w0")
    feed(table, engines)
    assert (await call(port, "POST", "/v1/chat/completions", chat()))[0] == 200
    table.link_state(False, "connection refused")
    for n in range(5):
        assert (await call(port, "POST", "/v1/chat/completions", chat(f"away {n}")))[0] == 200
    status, _, body = await call(port, "GET", "/health", token=None)
    health = json.loads(body)
    assert status == 200 and health["link_up"] is False and health["staleness_s"] > 0
    table.keys_changed(KeysChanged(keys=(key("other"),)))  # the link is back with "tests" revoked
    status, _, body = await call(port, "POST", "/v1/chat/completions", chat())
    assert status == 401 and b"unknown or revoked" in body
    assert (await call(port, "POST", "/v1/chat/completions", chat(), token=token_of("other")))[0] == 200
