"""Connection budgets against a real cluster: `llmgw server` with its caps lowered in server.toml
(`[http] max_connections`, `max_agent_connections`), one `llmgw agent`, a real sim engine.

At its caps the newest client is still served: idle keep-alive connections make room for a
chat, and bare connections to the agent port (no TLS, or TLS without a certificate) make room
for an agent, each at once rather than when a slot frees a minute later. And a flood of bare
connections to the agent port is logged in a handful of lines, not one line each.

The gateway runs as one worker process (`gateway_workers = 1`): `[http] max_connections` is each
worker's cap, and the HTTP listener's figures are that worker's, which the control plane's
/metrics shows labelled `worker` as its heartbeats said them (read here without the label).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
from collections.abc import Iterator

import attrs
import pytest

from llmgw.server.links.agentlistener import UNPROVEN_SILENT_S
from llmgw.wire import agent_link as w
from testlib import hostile
from testlib.cluster import Cluster, NodeFiles, connection_metrics, wait_until

HTTP_CAP = 40
AGENT_CAP = 16  # so the unproven budget is 8 (fdlimits.unproven_budget)
HELD = 60  # idle keep-alive clients, and bare connections to the agent port: past each cap
FLOOD = 2000
WITHIN_S = 1.0  # the bound on how long the chat and the agent's link may take, held or not
MODEL = "sim-small"
CATALOG = f"""
[http]
max_connections = {HTTP_CAP}
max_agent_connections = {AGENT_CAP}

[[models]]
name = "{MODEL}"
engine = "sim"
replicas = 1
args = ["--output-token-ms", "5"]
"""


@attrs.frozen(kw_only=True)
class Live:
    cluster: Cluster
    http_port: int
    token: str
    spare_node: NodeFiles  # a certificate no agent uses, for a link of the test's own


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Cluster(tmp_path_factory.mktemp("budgets"), server_toml="gateway_workers = 1\n")
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        cluster.add_node("node-a")
        spare = cluster.add_node("node-b")
        server = cluster.start_server()
        cluster.start_agent("node-a")
        cluster.wait_replicas("the sim replica to serve", lambda rs: any(r["state"] == "ready" for r in rs))
        admin_url = server.events("server_ready")[0]["admin_url"]
        yield Live(
            cluster=cluster,
            http_port=int(admin_url.rsplit(":", 1)[1]),
            token=cluster.ctl("keys", "create", "budgets")["token"],
            spare_node=spare,
        )
    finally:
        cluster.close()


def metrics(live: Live) -> dict[str, float]:
    return connection_metrics(live.http_port)


def chat(live: Live) -> float:
    """A chat through the gateway on a new connection; the seconds it took."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=hostile.chat_body(MODEL, max_tokens=4),
            headers={"authorization": f"Bearer {live.token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == 200 and json.loads(body)["choices"][0]["message"]["content"], body
    return time.monotonic() - started


def agent_link(live: Live) -> float:
    """A certified agent's TLS handshake and WebSocket upgrade (node-b's certificate); the
    seconds until its 101."""
    files = live.spare_node
    started = time.monotonic()
    sock = hostile.tls_client(
        "127.0.0.1",
        live.cluster.port,
        ca=str(files.pki / "ca.crt"),
        cert=str(files.pki / "node.crt"),
        key=str(files.pki / "node.key"),
    )
    try:
        sock.sendall(
            (
                f"GET {w.AGENT_PATH} HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
                f"{w.NODE_ID_HEADER}: node-b\r\n\r\n"
            ).encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    finally:
        sock.close()
    assert hostile.status_of(answer) == 101, answer
    return time.monotonic() - started


def keep_alive_client(live: Live) -> http.client.HTTPConnection:
    """A client that made one request and keeps its connection open, idle."""
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=5)
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    return conn


def bare_tls(live: Live) -> socket.socket:
    """A TLS connection to the agent port without a certificate, then silence; if the server
    closed it for a newer one before its handshake ended, the plain socket."""
    sock = hostile.connect("127.0.0.1", live.cluster.port)
    ctx = ssl.create_default_context(cafile=str(live.cluster.state / "ca" / "ca.crt"))
    ctx.check_hostname = False
    try:
        return ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    except (ssl.SSLError, OSError):
        return sock


def test_at_the_caps_a_chat_and_an_agent_still_get_in_at_once(live: Live) -> None:
    baseline = (chat(live), agent_link(live))  # what they take on this machine, nothing held
    before = metrics(live)
    clients = [keep_alive_client(live) for _ in range(HELD)]
    bare: list[socket.socket] = []
    try:
        for i in range(HELD):  # half without TLS at all, half with TLS and no certificate
            bare.append(hostile.connect("127.0.0.1", live.cluster.port) if i % 2 else bare_tls(live))
        # Those in the unproven places are taken for idle once silent for UNPROVEN_SILENT_S (until
        # then a newcomer is turned away: it may be an agent whose handshake is merely slow).
        time.sleep(UNPROVEN_SILENT_S)
        took = (chat(live), agent_link(live))
        # The worker's figures come with its next heartbeat.
        shed = 'llmgw_connections_shed_total{listener="http",reason="idle"}'
        after = wait_until(
            "the worker's heartbeat to say it shed", lambda: (m := metrics(live)).get(shed, 0) >= HELD - HTTP_CAP and m
        )
    finally:
        for c in clients:
            c.close()
        for s in bare:
            s.close()
    assert took[0] < WITHIN_S + baseline[0], (took, baseline)
    assert took[1] < WITHIN_S + baseline[1], (took, baseline)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # The HTTP cap held: idle clients were closed, oldest first, to make room, none turned away.
    assert grew('llmgw_connections_shed_total{listener="http",reason="idle"}') >= HELD - HTTP_CAP
    assert grew('llmgw_connections_shed_total{listener="http",reason="busy"}') == 0
    assert after['llmgw_connections_open{listener="http"}'] <= HTTP_CAP + 1  # + the one closing for /metrics
    # The bare connections stayed in their own small budget; the agents' was never touched.
    limit = after['llmgw_connections_unproven_limit{listener="agent"}']
    assert limit == 8 and after['llmgw_connections_unproven{listener="agent"}'] <= limit
    assert grew('llmgw_connections_shed_total{listener="agent",reason="unproven"}') >= 1  # made room for the agent
    unproven_turned_away = grew('llmgw_connections_shed_total{listener="agent",reason="busy"}')
    assert (
        unproven_turned_away + grew('llmgw_connections_shed_total{listener="agent",reason="unproven"}') >= HELD - limit
    )
    assert grew('llmgw_connections_shed_total{listener="agent",reason="agents_full"}') == 0
    # Nothing died, the node stayed joined, no traceback.
    cluster = live.cluster
    assert cluster.server.returncode is None, cluster.server.tail()
    # The clients just closed: until the server has read their ends, its HTTP places may still be
    # full and the admin API answers 503 "retry in 1 s", which is what it should say then.
    nodes = wait_until("the admin API to answer once the clients closed", cluster.nodes, timeout=10)
    assert nodes["node-a"]["state"] == "joined", cluster.last_nodes
    assert "Traceback" not in cluster.server.log_path.read_text(errors="replace"), cluster.server.tail(80)


def test_two_thousand_bare_connections_to_the_agent_port_log_a_handful_of_lines(live: Live) -> None:
    server = live.cluster.server
    already = len(server.log_path.read_text(errors="replace").splitlines())
    summaries_before = len([e for e in server.events("connections_refused") if e.get("listener") == "agent"])
    for i in range(FLOOD):  # connect and leave, some after a TLS record of nonsense
        sock = hostile.connect("127.0.0.1", live.cluster.port)
        if i % 2:
            sock.sendall(b"\x16\x03\x01\x00\x05hello")
        sock.close()
    wait_until(
        "the agent listener's summary of connections refused",
        lambda: len([e for e in server.events("connections_refused") if e.get("listener") == "agent"])
        > summaries_before,
        procs=[server],
        timeout=40,  # the summary comes at the end of its interval (10 s)
    )
    lines = server.log_path.read_text(errors="replace").splitlines()[already:]
    events = [json.loads(line) for line in lines if line.startswith("{")]
    about_connections = [e for e in events if e.get("logger") in ("llmgw.endpoint", "llmgw.listeners")]
    assert len(about_connections) <= 25, about_connections
    summaries = [e for e in about_connections if e["event"] == "connections_refused"]
    assert summaries and all(e["level"] == "warning" for e in summaries)
    assert sum(e["count"] for e in summaries) >= FLOOD // 2, summaries
    assert set().union(*(e["networks"] for e in summaries)) == {"127.0.0.0/24"}, summaries
    nodes = live.cluster.nodes()
    assert nodes is not None and nodes["node-a"]["state"] == "joined", live.cluster.last_nodes
