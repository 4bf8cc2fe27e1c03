"""Two standalone gateways behind Debian's HAProxy, configured as docs/gateway.md shows ("Behind a
load balancer"): one SIGKILLed under load fails no non-streamed request, and once started again on
its port HAProxy puts it back in rotation.

Real processes on loopback: two sim engines (each request takes ~160 ms, so requests are in
flight on the gateway that dies), two gateway processes in front of both (`testlib.gatewayproc`),
HAProxy in front of the gateways (`testlib.haproxy`), and 8 clients sending non-streamed requests
to HAProxy, each on a fresh connection (`testlib.load`: bounded in count and time), so no client
ever sends a request again: whatever is retried, HAProxy retried. HAProxy's stats page says what it
sees of each gateway; each gateway's /metrics says what it answered and has in flight.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib.cluster import free_port, wait_until
from testlib.gateway import Sim, chat
from testlib.gatewayproc import GatewayProcess, start_gateway
from testlib.haproxy import CONFIG, HAProxy
from testlib.load import Load
from testlib.proc import build_root

CLIENTS = 8
TOKEN = "llmgw-haproxy-test-key"
TOKEN_MS = "20"  # 8 tokens a request: ~160 ms each, so every gateway always has requests in flight
DETECT_S = 20.0  # HAProxy checks every 1 s and acts after 2: generous for a loaded machine


@pytest.fixture
def sims() -> Iterator[list[Sim]]:
    started = [Sim(f"sim-{i}", "chat", "--output-token-ms", TOKEN_MS) for i in range(2)]
    try:
        for sim in started:
            sim.wait_serving()
        yield started
    finally:
        for sim in started:
            sim.stop()


def stream_through(port: int) -> tuple[float, float, bytes]:
    """A streamed chat request: when its first event came and when its end came (seconds from
    the request), and the whole body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        started = time.monotonic()
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(chat(stream=True)).encode(),
            headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
        body = response.readline()
        first_s = time.monotonic() - started
        body += response.read()
        return first_s, time.monotonic() - started, body
    finally:
        conn.close()


def test_a_gateway_killed_under_load_fails_no_request_and_comes_back_into_rotation(
    tmp_path: Path, sims: list[Sim]
) -> None:
    endpoints = [sim.endpoint() for sim in sims]
    ports = (free_port(), free_port())
    gateways: dict[str, GatewayProcess] = {}
    loads: list[Load] = []
    haproxy: HAProxy | None = None

    def report() -> str:
        parts = [g.tail() for g in gateways.values()]
        if haproxy is not None:
            parts.append(haproxy.tail())
        return "\n".join(parts)

    def start(name: str, port: int) -> None:
        gateways[name] = start_gateway(tmp_path, name, port=port, endpoints=endpoints, token=TOKEN)

    try:
        start("gw-a", ports[0])
        start("gw-b", ports[1])
        haproxy = HAProxy(tmp_path, ports)
        proxy = haproxy

        def every_server_up() -> bool:
            return all(s.up for s in proxy.servers().values())

        wait_until("HAProxy to see both gateways UP", every_server_up, timeout=DETECT_S, last_seen=proxy.servers)

        # A stream passes through as it comes (HAProxy holds no answer back): its first event
        # arrives while the sim is still pacing out the other tokens, 20 ms apart.
        first_s, last_s, body = stream_through(proxy.port)
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"finish_reason":"length"') == 1, body
        assert last_s - first_s >= 0.1, (first_s, last_s)

        loads = [Load(port=proxy.port, token=TOKEN).start() for _ in range(CLIENTS)]

        def answered() -> int:
            return sum(load.ok for load in loads)

        def failures() -> list[str]:
            return [f for load in loads for f in load.failures]

        wait_until(
            "both gateways to answer requests through HAProxy",
            lambda: all(g.answered() >= 5 for g in gateways.values()),
            last_seen=proxy.servers,
        )

        # SIGKILL one while it has requests in flight: HAProxy sends those, and those it routes to
        # it before its checks fail, to the other gateway.
        wait_until("gw-a to have requests in flight", lambda: gateways["gw-a"].in_flight() > 0)
        gateways["gw-a"].kill()
        killed_at = answered()
        wait_until(
            "HAProxy to take gw-a out",
            lambda: proxy.servers()["gw-a"].down,
            timeout=DETECT_S,
            last_seen=proxy.servers,
        )
        wait_until("requests to go on through gw-b alone", lambda: answered() >= killed_at + 4 * CLIENTS)
        assert failures() == [], f"{failures()}\n{report()}"
        gone = proxy.servers()["gw-a"]
        assert gone.redispatches > 0, gone  # the kill did hit requests: they went to gw-b

        # Started again on its port: HAProxy's checks see it and it takes requests again.
        start("gw-a", ports[0])
        wait_until(
            "HAProxy to put gw-a back in rotation",
            every_server_up,
            timeout=DETECT_S,
            last_seen=proxy.servers,
        )
        picked = proxy.servers()["gw-a"].picked
        wait_until(
            "the restarted gw-a to answer requests through HAProxy",
            lambda: gateways["gw-a"].answered() >= 2 * CLIENTS and proxy.servers()["gw-a"].picked > picked,
            last_seen=proxy.servers,
        )
        for load in loads:
            load.finish()
        assert failures() == [], f"{len(failures())} failed requests: {failures()[:5]}\n{report()}"
        assert all(load.slowest_s < 10 for load in loads), [load.slowest_s for load in loads]
    finally:
        for load in loads:
            load.finish()
        if haproxy is not None:
            haproxy.stop()
        for gateway in gateways.values():
            gateway.stop()


def test_docs_show_the_haproxy_configuration_this_test_runs() -> None:
    """docs/gateway.md's HAProxy configuration is `testlib.haproxy.CONFIG`, placeholders and all."""
    page = (build_root() / "docs" / "gateway.md").read_text()
    section = page[page.index("## Behind a load balancer") :]
    shown = re.search(r"```haproxy\n(.*?)```", section, re.S)
    assert shown is not None, "no ```haproxy block under '## Behind a load balancer' in docs/gateway.md"
    assert shown.group(1) == CONFIG
