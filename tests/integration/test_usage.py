"""Who used what, on real processes (issue 48): a control plane (SQLite), an agent with the sim
engine, a standalone gateway (`llmgw gateway --server`) and the control plane's own gateway
worker; keys of a team and of none.

- Answers streamed and not, with and without the client's `stream_options.include_usage`: the
  client sees exactly what it asked for, and `llmgw ctl usage` counts every answer with the
  tokens the engine said (the sim's usage, read from the answers that carry it).
- The gateway stopped (SIGTERM) right after answering: its last counts are flushed before it
  exits; started again, and the control plane restarted: nothing lost, nothing counted twice.
- A client that reads 3 tokens of a stream and closes its connection is counted the tokens it
  was sent (at least 3) and the prompt as the body's bytes / 3, marked in the gateway's
  `llmgw_gateway_usage_estimated_total` (the sim sends a token each 20 ms).
- `ctl usage --team`, `--by`, `--csv`; `ctl teams remove` refused while a key belongs to the team;
  the gateway's Prometheus counters.

`ctl` runs in this process (`testlib.proc.llmgw_here`: the command's own code), also where the
test polls the ledger: a `llmgw ctl` process costs 0.2-0.3 CPU-s. The two refusals run as
processes, for their exit status and what they print.
"""

from __future__ import annotations

import csv
import io
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw import paths
from testlib import gatewayd
from testlib.cluster import Cluster, wait_until
from testlib.gateway import chat, parse_metrics, request, summed
from testlib.proc import llmgw_here

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
args = ["--output-token-ms", "20"]
"""
READY_S = 60.0
COUNTED_S = 15.0  # a report every 2 s, written at once


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0)
    try:
        yield c
    finally:
        c.close()


def events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]


def tokens(usage: dict[str, int]) -> tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


def ctl_here(cluster: Cluster, *args: str) -> str:
    """What `llmgw ctl ARGS` prints against the cluster's control plane, run in this process."""
    return llmgw_here("ctl", *args, "--state-dir", str(cluster.state))


def ctl(cluster: Cluster, *args: str) -> Any:
    """`llmgw ctl ARGS --json`, run in this process, parsed."""
    return json.loads(ctl_here(cluster, *args, "--json"))


def usage_of(cluster: Cluster, *args: str) -> dict[str, Any]:
    return ctl(cluster, "usage", *args)


def totals(cluster: Cluster, key: str) -> tuple[int, int, int] | None:
    rows = usage_of(cluster, "--key", key, "--by", "key")["usage"]
    return (rows[0]["requests"], rows[0]["prompt_tokens"], rows[0]["completion_tokens"]) if rows else None


def counted(cluster: Cluster, key: str, expected: tuple[int, int, int], procs: list) -> None:
    wait_until(
        f"the ledger to hold {expected} for {key}",
        lambda: totals(cluster, key) == expected,
        procs=procs,
        timeout=COUNTED_S,
        last_seen=lambda: totals(cluster, key),
    )


def read_then_close(port: int, token: str, body: bytes, tokens: int) -> int:
    """POST a streamed chat `body` on a raw socket, read until `tokens` events with content came,
    then close the connection; how many came."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    seen, got = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + body)
        while seen < tokens:
            piece = sock.recv(65536)
            assert piece, f"the stream ended after {seen} tokens: {got[-500:]!r}"
            got += piece
            seen = got.count(b'"content":"') - got.count(b'"content":""')
    return seen


def own_gateway_port(cluster: Cluster) -> int:
    url = paths.admin_url_path(cluster.state).read_text().strip()
    return int(url.split("//", 1)[1].rsplit(":", 1)[1].strip("/"))


def test_usage_is_counted_once_through_gateway_and_control_plane_restarts(cluster: Cluster) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    cluster.add_node("node-a")
    pki = gatewayd.issue_certificate(cluster, "gw-a")
    cluster.start_server()
    cluster.start_agent("node-a")
    cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"], timeout=READY_S)
    assert ctl(cluster, "teams", "create", "research")["team"]["name"] == "research"
    alice = ctl(cluster, "keys", "create", "alice", "--team", "research")
    assert alice["key"]["team"] == "research"
    bob = ctl(cluster, "keys", "create", "bob")["token"]
    dave = ctl(cluster, "keys", "create", "dave")["token"]
    refused = cluster.llmgw(
        "ctl", "keys", "create", "carol", "--team", "nobody", "--state-dir", str(cluster.state), ok=False
    )
    assert refused.returncode != 0 and "llmgw ctl teams create nobody" in refused.stderr
    gw = gatewayd.start(cluster, "gw-a", pki)
    gw.wait_serving()
    wait_until("gw-a holds the keys", lambda: gw.health()["keys"] == 3, procs=[gw.proc])
    token = alice["token"]

    # Not streamed: the usage is the answer's.
    status, _, body = gw.ask(token, "one two three", max_tokens=5)
    assert status == 200
    first = tokens(json.loads(body)["usage"])
    # Streamed, the client asking for the usage: it gets it, in the last event before [DONE].
    streamed = chat("four five", max_tokens=6, stream=True, stream_options={"include_usage": True})
    status, _, body = request(gw.port, "POST", "/v1/chat/completions", streamed, token=token, timeout=60)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    [usage] = [e["usage"] for e in events(body) if e.get("usage")]
    second = tokens(usage)
    # Streamed without asking (the same request, so the engine's usage is the same): none reaches
    # the client, and it is counted all the same.
    del streamed["stream_options"]
    status, _, body = request(gw.port, "POST", "/v1/chat/completions", streamed, token=token, timeout=60)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert [e for e in events(body) if "usage" in e] == [] and b'"usage"' not in body
    # The control plane's own gateway worker counts too.
    status, _, body = request(own_gateway_port(cluster), "POST", "/v1/chat/completions", chat("hi"), token=bob)
    assert status == 200
    bobs = tokens(json.loads(body)["usage"])

    expected = (3, first[0] + 2 * second[0], first[1] + 2 * second[1])
    counted(cluster, "alice", expected, [gw.proc, cluster.server])
    counted(cluster, "bob", (1, *bobs), [cluster.server])
    by_team = usage_of(cluster, "--team", "research", "--by", "team")["usage"]
    assert [(r["team"], r["requests"]) for r in by_team] == [("research", 3)]
    metrics = gw.metrics()
    assert summed(metrics, "llmgw_gateway_tokens_total", model="chat", kind="completion") == expected[2]
    plane = parse_metrics(request(own_gateway_port(cluster), "GET", "/metrics")[2].decode())
    assert plane[("llmgw_usage_reports_total", frozenset({("outcome", "added")}))] >= 2  # gw-a's and the worker's
    assert plane[("llmgw_usage_tokens_total", frozenset({("kind", "completion")}))] == expected[2] + bobs[1]

    # A client gone after 3 tokens of a stream: what it was sent, and the prompt's estimate.
    body = json.dumps(chat("count the sea", max_tokens=200, stream=True)).encode()
    seen = read_then_close(gw.port, dave, body, 3)
    assert seen == 3
    wait_until(
        "dave's cut stream in the ledger",
        lambda: totals(cluster, "dave") is not None,
        procs=[gw.proc, cluster.server],
        timeout=COUNTED_S,
    )
    requests, prompt, completion = totals(cluster, "dave") or (0, 0, 0)
    assert (requests, prompt) == (1, len(body) // 3) and 3 <= completion < 200, (requests, prompt, completion)
    assert summed(gw.metrics(), "llmgw_gateway_usage_estimated_total", model="chat", reason="client_gone") == 1

    # The gateway answers twice more and is stopped at once: its last counts go before it exits.
    for _ in range(2):
        assert gw.ask(token, "one two three", max_tokens=5)[0] == 200
    assert gw.proc.stop(signal.SIGTERM, timeout=60) == 0, gw.proc.tail()
    expected = (5, expected[1] + 2 * first[0], expected[2] + 2 * first[1])
    assert totals(cluster, "alice") == expected  # already: flushed before the gateway exited
    gw = gatewayd.start(cluster, "gw-a", pki)
    gw.wait_serving()
    assert gw.ask(token, "one two three", max_tokens=5)[0] == 200
    expected = (6, expected[1] + first[0], expected[2] + first[1])
    counted(cluster, "alice", expected, [gw.proc, cluster.server])

    # The control plane restarted: the ledger is as it was; the gateway links again and counts on.
    assert cluster.server is not None and cluster.server.stop(signal.SIGTERM, timeout=60) == 0
    cluster.start_server()
    assert totals(cluster, "alice") == expected and totals(cluster, "bob") == (1, *bobs)
    gw.wait_serving()
    assert gw.ask(token, "one two three", max_tokens=5)[0] == 200
    expected = (7, expected[1] + first[0], expected[2] + first[1])
    counted(cluster, "alice", expected, [gw.proc, cluster.server])

    # The other ways to read it, and a team with a key stays.
    text = ctl_here(cluster, "usage", "--csv")
    rows = {r["key"]: r for r in csv.DictReader(io.StringIO(text))}
    assert rows["alice"]["team"] == "research" and int(rows["alice"]["requests"]) == 7
    assert int(rows["bob"]["total_tokens"]) == sum(bobs)
    table = ctl_here(cluster, "usage")
    assert "alice" in table and "research" in table and "total" in table
    removing = cluster.llmgw("ctl", "teams", "remove", "research", "--state-dir", str(cluster.state), ok=False)
    assert removing.returncode != 0 and "still has 1 valid key(s): alice" in removing.stderr
    assert ctl(cluster, "teams", "list") == [{"name": "research", "created_at": pytest.approx(0, abs=1e10), "keys": 1}]
