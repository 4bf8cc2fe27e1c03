"""The gateway in front of real sim engine processes on loopback (a static endpoint provider)."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
import trio

from llmgw.http.limits import Limits
from testlib.gateway import chat, parse_metrics, request, start_gateway

pytestmark = pytest.mark.trio


async def test_answers_streamed_and_whole_pass_through_with_the_gateways_headers(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    a, b = sims(2)
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(), b.endpoint()))
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
    direct = await trio.to_thread.run_sync(
        lambda: request(a.port, "POST", "/v1/chat/completions", chat(stream=True), token=a.key)
    )
    assert streamed.endswith(b"data: [DONE]\n\n")
    strip = [
        [{k: v for k, v in json.loads(e[6:]).items() if k not in ("id", "created")} for e in s.split(b"\n\n")[:-2]]
        for s in (streamed, direct[2])
    ]
    assert strip[0] == strip[1] and len(strip[0]) > 3

    status, _, body = await gw.call("POST", "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 4})
    assert status == 200 and json.loads(body)["object"] == "text_completion"
    status, _, body = await gw.call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["chat"]
    # Keep-alive to the engines: later requests reuse connections.
    for _ in range(6):
        assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    assert gw.gateway.pool.stats.reused >= 4
    assert gw.gateway.router.outstanding == {}


async def test_errors_in_openais_format_with_the_right_status(tmp_path: Path, nursery: trio.Nursery, sims) -> None:
    (a,) = sims(1)
    gw = await start_gateway(
        nursery,
        tmp_path,
        (a.endpoint(),),
        models=frozenset({"chat", "cold"}),
        limits=Limits(max_body_bytes=4096),
        queue_timeout_s=0.3,
    )

    async def error(status: int, *args, **kw) -> tuple[str, dict]:
        got, headers, body = await gw.call(*args, **kw)
        assert got == status, body
        err = json.loads(body)["error"]
        assert err["code"] == status and err["message"]
        return err["message"], headers

    message, _ = await error(400, "POST", "/v1/chat/completions", b'{"model": "chat",')
    assert "not valid JSON" in message and "line 1" in message
    message, _ = await error(400, "POST", "/v1/chat/completions", {"messages": []})
    assert "'model'" in message
    message, headers = await error(401, "POST", "/v1/chat/completions", chat(), token=None)
    assert "llmgw ctl keys create" in message and headers["www-authenticate"] == "Bearer"
    await error(401, "POST", "/v1/chat/completions", chat(), token="llmgw-wrong")
    message, _ = await error(404, "POST", "/v1/chat/completions", {**chat(), "model": "nope"})
    assert "'nope'" in message and "chat, cold" in message
    message, _ = await error(413, "POST", "/v1/chat/completions", chat("x" * 5000))
    assert "4096" in message
    message, headers = await error(503, "POST", "/v1/chat/completions", {**chat(), "model": "cold"})
    assert "no ready replica of 'cold'" in message and headers["retry-after"] == "5"
    # The engine's own refusals are relayed as they are.
    message, headers = await error(400, "POST", "/v1/chat/completions", {**chat(), "n": 3})
    assert "'n'" in message and headers["x-llmgw-replica"] == a.name
    await error(404, "GET", "/v2/nothing")

    metrics = parse_metrics((await gw.call("GET", "/metrics"))[2].decode())

    def count(model: str, status: int) -> float:
        return metrics.get(("llmgw_gateway_requests_total", frozenset({("model", model), ("status", str(status))})), 0)

    assert (count("-", 400), count("-", 401), count("-", 404), count("cold", 503), count("chat", 400)) == (
        2,
        2,
        1,
        1,
        1,
    )


async def test_a_request_waits_in_the_queue_for_a_replica_to_become_ready(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    (a,) = sims(1)
    gw = await start_gateway(nursery, tmp_path, (), models=frozenset({"chat"}), queue_timeout_s=20)
    results = []

    async def ask() -> None:
        results.append(await gw.call("POST", "/v1/chat/completions", chat()))

    async with trio.open_nursery() as inner:
        inner.start_soon(ask)
        inner.start_soon(ask)
        with trio.fail_after(10):
            while sum(gw.gateway.queued.values()) < 2:
                await trio.sleep(0.01)
        depth = parse_metrics(gw.gateway.render_metrics())
        assert depth[("llmgw_gateway_queue_depth", frozenset({("model", "chat")}))] == 2
        gw.provider.set((a.endpoint(),))  # cold start over
    assert [r[0] for r in results] == [200, 200]


async def test_a_revoked_key_is_refused_at_once_while_another_keeps_working(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    (a,) = sims(1)
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(),))
    _, other = await gw.gateway.keys.create("other")
    _, limited = await gw.gateway.keys.create("limited", rate_per_minute=1)
    _, narrow = await gw.gateway.keys.create("narrow", models=["embed"])
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    await gw.gateway.keys.revoke("tests")
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 401
    assert (await gw.call("POST", "/v1/chat/completions", chat(), token=other))[0] == 200
    assert (await gw.call("POST", "/v1/chat/completions", chat(), token=limited))[0] == 200
    status, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(), token=limited)
    assert status == 429 and int(headers["retry-after"]) >= 59
    status, _, body = await gw.call("POST", "/v1/chat/completions", chat(), token=narrow)
    assert status == 403 and b"may not use model 'chat'" in body


async def test_a_killed_replica_costs_no_request(tmp_path: Path, nursery: trio.Nursery, sims) -> None:
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


def _established_to(port: int) -> int:
    """TCP connections in ESTABLISHED state to or from a local port (Linux's /proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and port in (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)):
            count += 1
    return count


async def test_a_client_gone_mid_stream_cancels_the_upstream_request(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    (a,) = sims(1, "--output-token-ms", "100")
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(),))
    client = await trio.open_tcp_stream("127.0.0.1", gw.port)
    body = json.dumps(chat(stream=True, max_tokens=200)).encode()  # 20 s of tokens
    await client.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {gw.token}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    with trio.fail_after(10):
        while got.count(b"data: ") < 3:
            got += await client.receive_some(65536)
    assert b" 200 " in got.split(b"\r\n")[0] and _established_to(a.port) == 2
    await client.aclose()
    with trio.fail_after(5):
        while _established_to(a.port) or gw.gateway.router.outstanding:
            await trio.sleep(0.02)
    assert gw.gateway.in_flight == {"chat": 0} and gw.gateway.pool.idle_count("127.0.0.1", a.port) == 0
    metrics = parse_metrics(gw.gateway.render_metrics())
    assert metrics[("llmgw_gateway_requests_total", frozenset({("model", "chat"), ("status", "499")}))] == 1


async def test_the_key_and_its_limits_are_decided_before_the_body(tmp_path: Path, nursery: trio.Nursery, sims) -> None:
    (a,) = sims(1)
    gw = await start_gateway(nursery, tmp_path, (a.endpoint(),), models=frozenset({"chat", "other"}))
    _, limited = await gw.gateway.keys.create("one-a-minute", models=["other"], rate_per_minute=1)

    # One request a minute: the first is let in and refused for its model; every later one is
    # 429 whatever its body says, even one that is not JSON at all.
    status, _, body = await gw.call("POST", "/v1/chat/completions", chat(), token=limited)
    assert status == 403 and b"may not use model 'chat'" in body
    for body_sent in (chat(), b"not json", b'{"model": "other"'):
        status, headers, body = await gw.call("POST", "/v1/chat/completions", body_sent, token=limited)
        assert status == 429 and int(headers["retry-after"]) > 0, body
    assert gw.gateway.keys._in_flight.get("one-a-minute", 0) == 0  # the refused ones are not held

    # Without a key the body is never read: the answer comes while the body is still unsent.
    def head_only() -> bytes:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 8000000\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            return answer

    answer = await trio.to_thread.run_sync(head_only)
    assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" in answer
