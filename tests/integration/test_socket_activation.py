"""A control plane restarted under socket activation loses no request.

The test owns the listening sockets, as a systemd .socket unit does, and passes them to each
`llmgw server` it starts (`testlib.activation`). Under a steady load of non-streamed requests
through the gateway, the server is stopped (SIGTERM) and started again: the old one stops
accepting and finishes what it has, connections made meanwhile wait in the socket's backlog,
and the new one answers them once its agents are back. The client is an ordinary keep-alive
HTTP client: it retries a request once only when a connection it *reused* fails before any
byte of an answer (the server may close an idle connection at any time, RFC 9112 §9.3.1),
the rule llmgw's own upstream pool follows.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
from pathlib import Path

from testlib.cluster import Cluster, wait_until
from testlib.load import Load

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 2
args = ["--output-token-ms", "20"]
"""
CLIENT_TIMEOUT_S = 30.0


def _stream(port: int, token: str, started: threading.Event) -> tuple[int, bytes]:
    body = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        first = response.read1()  # the stream is flowing before we return to stop the server
        started.set()
        return response.status, first + response.read()
    finally:
        conn.close()


def test_a_socket_activated_restart_loses_no_request(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, socket_activation=True, heartbeat_interval_s=0.5, heartbeat_ttl_s=10)
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        for node in ("node-a", "node-b"):
            cluster.add_node(node)
        first = cluster.start_server()
        for node in ("node-a", "node-b"):
            cluster.start_agent(node)
        cluster.wait_replicas("two ready replicas", lambda rs: sum(r["state"] == "ready" for r in rs) == 2)
        token = cluster.ctl("keys", "create", "load")["token"]
        load = Load(port=cluster.http_port, token=token, keep_alive=True)
        streamed: list[tuple[int, bytes]] = []
        started = threading.Event()
        load.start()
        try:
            wait_until("the load to run", lambda: load.ok >= 20, procs=[first])
            stream = threading.Thread(target=lambda: streamed.append(_stream(cluster.http_port, token, started)))
            stream.start()  # about 2 s of tokens, in flight when the server is told to stop
            wait_until("the stream to start", started.is_set, procs=[first])
            assert first.stop(signal.SIGTERM) == 0
            stream.join(CLIENT_TIMEOUT_S)
            before_restart = load.ok
            second = cluster.start_server()
            wait_until("requests answered by the new server", lambda: load.ok >= before_restart + 20, procs=[second])
        finally:
            load.finish()
        assert load.failures == [], load.failures
        [(status, body)] = streamed
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-300:]  # finished by the old server
        assert [e["socket_activation"] for e in (*first.events("server_ready"), *second.events("server_ready"))] == [
            True,
            True,
        ]
        # Clients waited in the backlog while no process served: a bounded wait, not an error.
        assert load.slowest_s < 15, load.slowest_s
    finally:
        cluster.close()
