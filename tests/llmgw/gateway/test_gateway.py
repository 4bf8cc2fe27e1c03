"""The gateway in front of sim engines (a static endpoint provider): their handlers in memory on
MockClock (`testlib.memnet`) for what is the gateway's own logic — relaying, errors, the queue,
keys, retries, a client gone — and real engine processes on loopback where real sockets are the
point (a killed engine's connections reset under the pool)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.http.limits import Limits
from testlib import memnet
from testlib.gateway import chat, parse_metrics, start_gateway

pytestmark = pytest.mark.trio


async def test_answers_streamed_and_whole_pass_through_with_the_gateways_headers(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    a, b = memnet.start_sims(net, 2)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(), b.endpoint()))
    status, headers, body = await gw.call("POST", "/v1/chat/completions", chat())
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert headers["x-llmgw-replica"] in (a.name, b.name)
    assert float(headers["x-llmgw-overhead-ms"]) >= 0
    assert "server" not in headers or "h11" not in headers["server"]

    # The same request straight to the engine: the relayed stream is byte for byte what it sent,
    # apart from the id and timestamp each answer gets.
    status, headers, streamed = await gw.call("POST", "/v1/chat/completions", chat(stream=True))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    direct = await net.connect(*a.address)
    _, _, straight = await memnet.request(direct, "POST", "/v1/chat/completions", chat(stream=True), token=a.key)
    assert streamed.endswith(b"data: [DONE]\n\n")
    strip = [
        [{k: v for k, v in json.loads(e[6:]).items() if k not in ("id", "created")} for e in s.split(b"\n\n")[:-2]]
        for s in (streamed, straight)
    ]
    assert strip[0] == strip[1] and len(strip[0]) > 3

    status, _, body = await gw.call("POST", "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 4})
    assert status == 200 and json.loads(body)["object"] == "text_completion"
    status, _, body = await gw.call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["chat"]
    # Keep-alive to the engines: later requests reuse connections.
    for _ in range(6):
        assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    assert gw.gateway.pool.stats.reused >= 4 and gw.gateway.pool.stats.opened <= 3
    assert gw.gateway.router.outstanding == {}


async def test_errors_in_openais_format_with_the_right_status(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(
        nursery,
        tmp_path,
        net,
        (a.endpoint(),),
        models=frozenset({"chat", "cold"}),
        limits=Limits(max_body_bytes=4096),
        queue_timeout_s=0.3,
    )

    async def error(status: int, code, *args, param=None, kind=None, **kw) -> tuple[str, dict]:
        """The error's message and headers, once its shape is checked against docs/gateway.md's table."""
        got, headers, body = await gw.call(*args, **kw)
        assert got == status, body
        err = json.loads(body)["error"]
        default = "server_error" if status >= 500 else "invalid_request_error"
        assert (err["type"], err["code"], err["param"]) == (kind or default, code, param), err
        assert err["message"] and headers["x-request-id"].startswith("req_")
        return err["message"], headers

    message, _ = await error(400, "invalid_json", "POST", "/v1/chat/completions", b'{"model": "chat",')
    assert "not valid JSON" in message and "line 1" in message
    message, _ = await error(
        400, "missing_required_parameter", "POST", "/v1/chat/completions", {"messages": []}, param="model"
    )
    assert "'model'" in message
    message, _ = await error(400, "invalid_type", "POST", "/v1/chat/completions", {"model": 7}, param="model")
    message, headers = await error(401, "invalid_api_key", "POST", "/v1/chat/completions", chat(), token=None)
    assert "llmgw ctl keys create" in message and headers["www-authenticate"] == "Bearer"
    await error(401, "invalid_api_key", "POST", "/v1/chat/completions", chat(), token="llmgw-wrong")
    message, _ = await error(
        404, "model_not_found", "POST", "/v1/chat/completions", {**chat(), "model": "nope"}, param="model"
    )
    assert "'nope'" in message and "chat, cold" in message
    message, _ = await error(413, "request_too_large", "POST", "/v1/chat/completions", chat("x" * 5000))
    assert "4096" in message
    started = trio.current_time()
    message, headers = await error(503, "model_not_ready", "POST", "/v1/chat/completions", {**chat(), "model": "cold"})
    assert "no ready replica of 'cold'" in message and headers["retry-after"] == "5"
    assert trio.current_time() - started == pytest.approx(0.3)  # the queue's timeout, not a moment more
    # The engine's own refusals are relayed, in the same shape.
    message, headers = await error(400, None, "POST", "/v1/chat/completions", {**chat(), "n": 3})
    assert "'n'" in message and headers["x-llmgw-replica"] == a.name
    await error(404, "unknown_url", "GET", "/v2/nothing")
    await error(405, "method_not_allowed", "GET", "/v1/chat/completions")

    metrics = parse_metrics((await gw.call("GET", "/metrics"))[2].decode())

    def count(model: str, status: int) -> float:
        return metrics.get(("llmgw_gateway_requests_total", frozenset({("model", model), ("status", str(status))})), 0)

    assert (count("-", 400), count("-", 401), count("-", 404), count("cold", 503), count("chat", 400)) == (
        3,
        2,
        1,
        1,
        1,
    )


async def test_a_request_waits_in_the_queue_for_a_replica_to_become_ready(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (), models=frozenset({"chat"}), queue_timeout_s=20)
    results = []

    async def ask() -> None:
        results.append(await gw.call("POST", "/v1/chat/completions", chat()))

    async with trio.open_nursery() as inner:
        inner.start_soon(ask)
        inner.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()  # both read, parsed and queued
        depth = parse_metrics(gw.gateway.render_metrics())
        assert depth[("llmgw_gateway_queue_depth", frozenset({("model", "chat")}))] == 2
        await trio.sleep(10)  # waiting half the queue's timeout
        assert results == []
        ready_at = trio.current_time()
        gw.provider.set((a.endpoint(),))  # cold start over
    assert [r[0] for r in results] == [200, 200]
    assert trio.current_time() - ready_at < 0.1  # answered as soon as the replica was there


async def test_a_revoked_key_is_refused_at_once_while_another_keeps_working(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),))
    _, other = await gw.keys.create("other")
    _, limited = await gw.keys.create("limited", rate_per_minute=1)
    _, narrow = await gw.keys.create("narrow", models=["embed"])
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    await gw.keys.revoke("tests")
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 401
    assert (await gw.call("POST", "/v1/chat/completions", chat(), token=other))[0] == 200
    assert (await gw.call("POST", "/v1/chat/completions", chat(), token=limited))[0] == 200
    status, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(), token=limited)
    assert status == 429 and int(headers["retry-after"]) >= 59
    status, _, body = await gw.call("POST", "/v1/chat/completions", chat(), token=narrow)
    assert status == 403 and b"may not use model 'chat'" in body


async def test_a_replica_gone_with_pooled_connections_costs_no_request_and_is_tried_once(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    a, b = memnet.start_sims(net, 2)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(), b.endpoint()))
    pool = gw.gateway.pool
    for _ in range(50):  # warm both: idle keep-alive connections to each (ties are picked at random)
        assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
        if pool.idle_count(*a.address) and pool.idle_count(*b.address):
            break
    assert pool.idle_count(*a.address) >= 1
    warm = net.connects.count(a.address)
    net.kill(a.address)  # its connections end under the pool; a new one is refused
    served = [(await gw.call("POST", "/v1/chat/completions", chat(f"q{i}")))[1]["x-llmgw-replica"] for i in range(50)]
    assert set(served) == {b.name}
    assert net.connects.count(a.address) - warm == 1  # its pooled connection failed, one fresh connect was refused
    await trio.sleep(2.5)  # fake time: a probe each second, each refused
    metrics = parse_metrics(gw.gateway.render_metrics())
    retries = sum(v for (name, _), v in metrics.items() if name == "llmgw_gateway_retries_total")
    assert retries == 1  # the dead replica was tried once: out of rotation while probes find nothing there
    assert metrics[("llmgw_gateway_probes_total", frozenset({("result", "failed")}))] == 2
    assert net.connects.count(a.address) - warm == 3  # then only the probes went there
    state = frozenset({("model", "chat"), ("replica", a.name), ("state", "down")})
    assert metrics[("llmgw_gateway_replica_state", state)] == 1


async def test_a_killed_engine_process_costs_no_request(tmp_path: Path, nursery: trio.Nursery, sims) -> None:
    """Real processes and sockets: the kernel resets a killed engine's pooled connections."""
    a, b = sims(2)
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(), b.endpoint()))
    for _ in range(4):  # warm both: idle keep-alive connections to each
        assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait(10)
    served = []
    for i in range(50):
        with trio.fail_after(10):
            status, headers, body = await gw.call("POST", "/v1/chat/completions", chat(f"q{i}"), timeout=10)
        assert status == 200, body
        served.append(headers["x-llmgw-replica"])
    assert set(served) == {b.name}
    metrics = parse_metrics(gw.gateway.render_metrics())
    retries = sum(v for (name, _), v in metrics.items() if name == "llmgw_gateway_retries_total")
    assert retries == 1  # the dead replica was tried once: out of rotation while probes find nothing there
    state = frozenset({("model", "chat"), ("replica", a.name), ("state", "down")})
    assert metrics[("llmgw_gateway_replica_state", state)] == 1
    ok = frozenset({("model", "chat"), ("status", "200")})
    assert metrics[("llmgw_gateway_requests_total", ok)] == 54


async def test_a_client_gone_mid_stream_cancels_the_upstream_request(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1, output_token_ms=100)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),))
    client = await gw.open()
    body = json.dumps(chat(stream=True, max_tokens=200)).encode()  # 20 s of tokens
    headers = [("content-type", "application/json"), ("authorization", f"Bearer {gw.token}")]
    await client.send_head("POST", "/v1/chat/completions", [*headers, ("content-length", str(len(body)))])
    await client.send_body(body)
    assert (await client.head())[0] == 200
    got = b""
    while got.count(b"data: ") < 3:
        got += await client.chunk()
    assert net.connections(a.address) == 1 and gw.gateway.router.outstanding == {a.name: 1}
    gone_at = trio.current_time()
    await client.stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    # At once, not at the next token: the engine's connection is closed and nothing is left over.
    assert trio.current_time() == gone_at
    assert net.connections(a.address) == 0 and gw.gateway.router.outstanding == {}
    assert gw.gateway.in_flight == {"chat": 0} and gw.gateway.pool.idle_count(*a.address) == 0
    metrics = parse_metrics(gw.gateway.render_metrics())
    assert metrics[("llmgw_gateway_requests_total", frozenset({("model", "chat"), ("status", "499")}))] == 1


async def test_the_key_and_its_limits_are_decided_before_the_body(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), models=frozenset({"chat", "other"}))
    _, limited = await gw.keys.create("one-a-minute", models=["other"], rate_per_minute=1)

    # One request a minute: the first is let in and refused for its model; every later one is
    # 429 whatever its body says, even one that is not JSON at all.
    status, _, body = await gw.call("POST", "/v1/chat/completions", chat(), token=limited)
    assert status == 403 and b"may not use model 'chat'" in body
    for body_sent in (chat(), b"not json", b'{"model": "other"'):
        status, headers, body = await gw.call("POST", "/v1/chat/completions", body_sent, token=limited)
        assert status == 429 and int(headers["retry-after"]) > 0, body
    assert gw.gateway.keys.in_flight("one-a-minute") == 0  # the refused ones are not held

    # Without a key the body is never read: the answer comes while the body is still unsent.
    client = await gw.open()
    await client.send_head("POST", "/v1/chat/completions", [("content-length", "8000000")])
    status, headers = await client.head()
    assert status == 401 and headers["connection"] == "close"
    while await client.chunk() is not None:
        pass
    assert await client.stream.receive_some(65536) == b""  # closed after the answer, the body unread
