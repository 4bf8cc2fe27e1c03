"""A control plane that is stopped (cancelled, as SIGTERM does through `run_service`) drains its
gateway first: a stream in flight runs to its end, a new request meanwhile gets 503 with
Retry-After, and only then does the HTTP listener close. The control plane's listener is real
(its closing is the point); the engine is a sim's handler in memory (`testlib.memnet`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from llmgw.config import ServerConfig, ServerSection
from llmgw.gateway.upstream import UpstreamPool
from llmgw.server.app import ControlPlane
from testlib import memnet
from testlib.cluster import free_port
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.endpoints import StaticEndpoints
from testlib.gateway import chat, request
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


async def start_stream(port: int, token: str) -> tuple[trio.SocketStream, bytes]:
    """A streamed chat of about 2 s on a connection of its own, once its first events came."""
    client = await trio.open_tcp_stream("127.0.0.1", port)
    body = json.dumps(chat(stream=True, max_tokens=20, ignore_eos=True)).encode()  # ~2 s of tokens
    await client.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {token}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    with trio.fail_after(10):
        while got.count(b"data: ") < 3:
            got += await client.receive_some(65536)
    return client, got


async def finish_stream(client: trio.SocketStream, got: bytes) -> None:
    """The rest of the stream `start_stream` began, to its end: none of it cut."""
    with trio.fail_after(15):
        while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
            data = await client.receive_some(65536)
            assert data, f"the stream was cut during the drain: {got[-200:]!r}"
            got += data
    assert b"data: [DONE]" in got and got.count(b'"content":') >= 20


async def test_a_stopped_control_plane_lets_a_stream_finish_and_refuses_new_requests(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    net = memnet.MemoryNet(nursery)
    (sim,) = memnet.start_sims(net, 1, output_token_ms=100)
    state = tmp_path / "cp"
    make_state(state)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state), agent_listen=f"127.0.0.1:{free_port()}", http_listen="127.0.0.1:0"),
    )
    plane = ControlPlane.open(config, state)
    plane.gateway.provider = StaticEndpoints((sim.endpoint(),))  # the replica without an agent
    plane.gateway.pool = UpstreamPool(connect=net.connect)
    plane.shutdown_drain_s = 20
    _, token = await plane.keys.create("tests")
    stopped = trio.Event()
    plane_scope = trio.CancelScope()

    async def run_plane(*, task_status: trio.TaskStatus) -> None:
        with plane_scope:
            async with trio.open_nursery() as inner:
                task_status.started(await inner.start(plane.serve))
        stopped.set()

    port = (await nursery.start(run_plane)).http_address[1]

    client, got = await start_stream(port, token)

    plane_scope.cancel()  # what SIGTERM does to `llmgw server`
    await await_true(lambda: plane.gateway.draining, "the gateway draining", timeout=5)
    status, headers, refused = await trio.to_thread.run_sync(
        lambda: request(port, "POST", "/v1/chat/completions", chat(), token=token, timeout=5)
    )
    assert status == 503 and headers["retry-after"] and b"shutting down" in refused
    assert not stopped.is_set()

    await finish_stream(client, got)
    await client.aclose()
    with trio.fail_after(5):
        await stopped.wait()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_a_stopped_worker_on_a_shared_port_stops_accepting_and_finishes_what_it_has(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A gateway's worker whose port others serve too (SO_REUSEPORT: `llmgw gateway`'s workers,
    several gateways behind a balancer): stopped, it leaves the port at once — a new connection
    goes to the others, here none, so it is refused, which a balancer retries elsewhere — and
    its stream in flight runs to its end; nothing it is sent is answered 503."""
    from llmgw.gateway.app import Gateway
    from llmgw.gateway.front import serve_draining
    from llmgw.gateway.keys import KeyTable, token_hash
    from llmgw.http.limits import Limits
    from llmgw.http.listeners import ConnectionStats
    from llmgw.wire.gateway_link import GatewayKey

    net = memnet.MemoryNet(nursery)
    (sim,) = memnet.start_sims(net, 1, output_token_ms=100)
    token = "llmgw-shared-port-test"
    gateway = Gateway(
        StaticEndpoints((sim.endpoint(),)),
        KeyTable([GatewayKey(name="t", token_sha256=token_hash(token))]),
        pool=UpstreamPool(connect=net.connect),
    )
    await nursery.start(gateway.serve_rotation)
    port = free_port()
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def run(*, task_status: trio.TaskStatus) -> None:
        with scope:
            await serve_draining(
                gateway.handle,
                gateway,
                "127.0.0.1",
                port,
                limits=Limits(),
                stats=ConnectionStats(),
                drain_s=20,
                reuse_port=True,
                task_status=task_status,
            )
        stopped.set()

    await nursery.start(run)
    client, got = await start_stream(port, token)

    scope.cancel()
    await await_true(lambda: gateway.draining, "the gateway draining", timeout=5)
    with pytest.raises(OSError):  # left the port: refused, not a 503
        await trio.open_tcp_stream("127.0.0.1", port)
    await finish_stream(client, got)
    with trio.fail_after(5):
        assert await client.receive_some(65536) == b""  # and then its connection closes
    with trio.fail_after(5):
        await stopped.wait()
