"""A gateway worker fed through its table's sink, as its link client feeds it, serving sim engines
on MockClock (`testlib.memnet`: engines' handlers and the worker over memory streams): before
its first table, serving, the link down (staleness rising in /health and /metrics), a key gone
from a new table, its share of a key's limits, and its own failed connections."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.gateway.keys import ALONE
from llmgw.gateway.services import serve_services
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.worker import GatewayWorker
from llmgw.http.limits import Limits
from llmgw.http.messages import Request, Response
from llmgw.http.openai import error_body
from llmgw.http.relay import Relay
from llmgw.http.server import serve_connection
from llmgw.http.unixsocket import serve_http_unix
from llmgw.wire.gateway_link import KeysChanged, ModelLoad, ReplicaLoad, RotationChanged, ShareChanged
from testlib import memnet
from testlib.gateway import chat, parse_metrics
from testlib.gatewaytable import TOKEN, key, route, token_of

pytestmark = pytest.mark.trio

KEYS = (key("tests"),)


class Worker:
    """A `GatewayWorker` whose engines are on `net`, its rotation and prober running; called
    over memory streams."""

    def __init__(self, nursery: trio.Nursery, net: memnet.MemoryNet) -> None:
        self.nursery = nursery
        self.table = GatewayTable(now=trio.current_time())
        self.worker = GatewayWorker(self.table, instance="gw-0-test", connect=net.connect)

    async def start(self) -> Worker:
        await self.nursery.start(serve_services, self.worker.gateway)
        return self

    def feed(self, sims: list[memnet.MemSim], keys=KEYS, share=ALONE, version: int = 0) -> None:
        """The whole table, as the link sends it after its Welcome."""
        self.table.link_state(True, "")
        rotation = RotationChanged(models=("chat",), endpoints=tuple(route(s) for s in sims), version=version)
        self.table.rotation_changed(rotation)
        self.table.keys_changed(KeysChanged(keys=tuple(keys), version=version))
        self.table.share_changed(share)
        self.table.heard(trio.current_time())

    async def call(self, method: str, path: str, body=None, *, token: str | None = TOKEN):
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(
            partial(serve_connection, self.worker.handle, server, limits=Limits(), errors=error_body)
        )
        return await memnet.request(client, method, path, body, token=token)

    async def health(self) -> tuple[int, dict]:
        status, _, body = await self.call("GET", "/health", token=None)
        return status, json.loads(body)

    async def metrics(self) -> dict:
        status, _, body = await self.call("GET", "/metrics", token=None)
        assert status == 200
        return parse_metrics(body.decode())


async def started(nursery: trio.Nursery, n: int = 2, **sim_options) -> tuple[memnet.MemoryNet, list, Worker]:
    net = memnet.MemoryNet(nursery)
    sims = memnet.start_sims(net, n, **sim_options)
    return net, sims, await Worker(nursery, net).start()


async def test_before_its_first_table_a_worker_answers_503_saying_why(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, _, w = await started(nursery)
    w.table.link_state(False, "connection refused")
    status, health = await w.health()
    assert status == 503 and health["status"] == "no_table"
    assert "no table from the control plane yet" in health["reason"] and "connection refused" in health["reason"]
    status, headers, body = await w.call("POST", "/v1/chat/completions", chat())
    assert status == 503 and headers["retry-after"] == "5"
    assert "no table from the control plane yet (connection refused)" in json.loads(body)["error"]["message"]
    metrics = await w.metrics()
    assert metrics[("llmgw_gateway_table_received", frozenset())] == 0
    assert metrics[("llmgw_gateway_link_up", frozenset())] == 0


async def test_with_the_link_down_it_serves_from_its_last_table_and_its_staleness_rises(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, sims, w = await started(nursery)
    w.feed(sims)
    await trio.testing.wait_all_tasks_blocked()
    status, headers, _ = await w.call("POST", "/v1/chat/completions", chat())
    assert status == 200 and headers["x-llmgw-replica"] in {"chat-0", "chat-1"}
    status, health = await w.health()
    assert status == 200 and health["link_up"] is True and health["staleness_s"] < 1
    assert health["ready"] == {"chat": 2} and health["instance"] == "gw-0-test"

    w.table.link_state(False, "the control plane closed the connection")
    lost_at = trio.current_time()
    await trio.sleep(120)
    for n in range(6):
        status, _, _ = await w.call("POST", "/v1/chat/completions", chat(f"while away {n}"))
        assert status == 200
    status, health = await w.health()
    staleness = trio.current_time() - lost_at
    assert status == 200 and health["link_up"] is False
    assert health["link_detail"] == "the control plane closed the connection"
    assert health["staleness_s"] == pytest.approx(staleness, abs=0.01) and staleness >= 120
    metrics = await w.metrics()
    assert metrics[("llmgw_gateway_table_staleness_seconds", frozenset())] == pytest.approx(staleness, abs=0.01)
    assert metrics[("llmgw_gateway_link_up", frozenset())] == 0
    assert metrics[("llmgw_gateway_requests_total", frozenset({("model", "chat"), ("status", "200")}))] == 7

    w.table.link_state(True, "")  # back: the control plane is heard again
    w.table.heard(trio.current_time())
    status, health = await w.health()
    assert health["link_up"] is True and health["staleness_s"] == 0


async def test_a_key_missing_from_a_new_table_is_refused_at_its_next_request(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, sims, w = await started(nursery)
    w.feed(sims, keys=(key("tests"), key("other")))
    await trio.testing.wait_all_tasks_blocked()
    assert (await w.call("POST", "/v1/chat/completions", chat()))[0] == 200
    w.table.keys_changed(KeysChanged(keys=(key("other"),)))  # "tests" revoked on the control plane
    status, _, body = await w.call("POST", "/v1/chat/completions", chat())
    assert status == 401 and b"unknown or revoked" in body
    assert (await w.call("POST", "/v1/chat/completions", chat(), token=token_of("other")))[0] == 200


async def test_it_admits_its_share_of_a_keys_concurrency(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, sims, w = await started(nursery, output_token_ms=100)  # 8 tokens: 0.8 s a request
    # A key of 3 in flight across two instances: this one, index 1, admits 1 (the other 2).
    w.feed(sims, keys=(key("tests", max_concurrency=3),), share=ShareChanged(index=1, count=2))
    await trio.testing.wait_all_tasks_blocked()
    answers: list[tuple[int, bytes]] = []

    async def one() -> None:
        status, _, body = await w.call("POST", "/v1/chat/completions", chat())
        answers.append((status, body))

    async with trio.open_nursery() as clients:
        clients.start_soon(one)
        await trio.sleep(0.1)
        clients.start_soon(one)
    assert sorted(status for status, _ in answers) == [200, 429]
    refused = next(body for status, body in answers if status == 429)
    assert b"its share of the key's limit of 3 across 2 instances" in refused
    w.table.share_changed(ShareChanged(index=0, count=1))  # alone now: the whole limit
    async with trio.open_nursery() as clients:
        for _ in range(3):
            clients.start_soon(one)
    assert [status for status, _ in answers[2:]] == [200, 200, 200]


async def test_cut_off_it_takes_a_dead_replica_out_and_probes_it_back(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, sims, w = await started(nursery)
    w.feed(sims)
    w.table.link_state(False, "connection refused")
    await trio.testing.wait_all_tasks_blocked()
    net.kill(sims[0].address)
    # Ties are broken at random: requests until one has tried the dead replica (each does with
    # probability 1/2; six in a row missing it failed one CI run in about 60), every one answered.
    for n in range(40):
        status, headers = (await w.call("POST", "/v1/chat/completions", chat(f"q{n}")))[:2]
        assert status == 200 and headers["x-llmgw-replica"] == "chat-1"
        if (await w.health())[1]["ready"] == {"chat": 1}:
            break
    assert (await w.health())[1]["ready"] == {"chat": 1}
    net.serve(sims[0].address, sims[0].engine.handle)  # the engine is back
    await trio.sleep(2 * w.worker.gateway.options.probe_interval_s)
    assert (await w.health())[1]["ready"] == {"chat": 2}


async def test_its_heartbeat_says_the_versions_it_holds_its_requests_on_each_replica_and_model_and_its_metrics(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    _, sims, w = await started(nursery, 1, output_token_ms=1000)
    assert (w.worker.load().rotation_version, w.worker.load().keys_version) == (0, 0)  # nothing yet
    applied = w.worker.gateway.applied.next()
    w.feed(sims, version=3)
    await applied.wait()  # the gateway routes by it: what sends a heartbeat at once
    beat = w.worker.load()
    assert (beat.rotation_version, beat.keys_version, beat.outstanding, beat.models) == (3, 3, (), ())
    async with trio.open_nursery() as calls:
        calls.start_soon(w.call, "POST", "/v1/chat/completions", chat(max_tokens=3))
        await trio.sleep(1.5)  # its tokens come a second apart
        assert w.worker.load().outstanding == (ReplicaLoad(replica_id="chat-0", outstanding=1),)
        assert w.worker.load().in_flight == 1
        assert w.worker.load().models == (ModelLoad(model="chat", in_flight=1, requests_total=1),)
    beat = w.worker.load()
    assert beat.outstanding == () and beat.requests_total == 1
    assert beat.models == (ModelLoad(model="chat", requests_total=1),)  # each model's, by name
    families = {f.name: f for f in beat.metrics}
    # Everything its own /metrics has, family by family.
    assert [f.name for f in beat.metrics] == [
        line.split()[2] for line in w.worker.render_metrics().splitlines() if line.startswith("# TYPE")
    ]
    [requests] = families["llmgw_gateway_requests_total"].samples
    assert (requests.labels, requests.value) == (("chat", "200"), 1)
    [duration] = families["llmgw_gateway_request_duration_seconds"].samples
    assert sum(duration.counts) == 1 and duration.sum >= 3
    assert families["llmgw_gateway_link_up"].samples[0].value == 1


async def test_a_worker_of_the_control_plane_relays_its_routes_and_listens_once_its_table_came(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`relay` and `table_first`, as `llmgw.server.gateways.workers` runs its workers: what is not the
    gateway's goes to the control plane's socket; no connection is taken before the table."""
    net = memnet.MemoryNet(nursery)
    sims = memnet.start_sims(net, 1)

    async def control_plane(request: Request) -> Response:
        return Response.json(200, {"path": request.path, "client": request.client})

    socket_path = tmp_path / "admin.sock"
    await nursery.start(partial(serve_http_unix, control_plane, socket_path, limits=Limits(), errors=error_body))
    w = Worker(nursery, net)
    w.worker.plane_routes = Relay(socket_path).handle
    fed = trio.Event()

    async def source(*, sink, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await fed.wait()
        w.feed(sims)

    listening: list = []

    async def serve() -> None:
        listening.append(await nursery.start(partial(w.worker.serve, source, "127.0.0.1", 0, table_first=True)))

    nursery.start_soon(serve)
    await trio.testing.wait_all_tasks_blocked()
    assert listening == []  # no table yet: not listening
    fed.set()
    while not listening:
        await trio.sleep(0.01)
    status, _, body = await w.call("GET", "/admin/v1/nodes", token=None)
    assert status == 200 and json.loads(body)["path"] == "/admin/v1/nodes"  # relayed
    status, _, body = await w.call("GET", "/metrics", token=None)
    assert status == 200 and json.loads(body)["path"] == "/metrics"  # the control plane's, relayed too
    status, health = await w.health()
    assert status == 200 and health["instance"] == "gw-0-test"  # the gateway's own
