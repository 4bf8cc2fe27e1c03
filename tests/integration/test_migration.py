"""Answers that survive, on real processes: `llmgw server` (its gateway in a worker process), two
agents (node-a, node-b) each running one replica of a sim model, streams in flight on both. One
replica's engine is SIGKILLed mid-answer, then the other's whole node dies (its agent and engine
killed): every stream ends whole, its text word for word what the same request gets
uninterrupted (the sim's answer is deterministic, and it continues a final assistant message or
a completions prompt from where it was), with one `id`, and the moved ones say so before
`[DONE]`; /metrics counts them."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from testlib.cluster import Cluster, wait_until

TOKENS = 60
CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 2
args = ["--output-token-ms", "40"]
"""


@attrs.frozen
class Live:
    cluster: Cluster
    port: int
    token: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Cluster(
        tmp_path_factory.mktemp("migration"),
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=5.0,
        server_toml="gateway_workers = 1\n",
    )
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        for node in ("node-a", "node-b"):
            cluster.add_node(node)
        server = cluster.start_server()
        for node in ("node-a", "node-b"):
            cluster.start_agent(node)
        cluster.wait_replicas(
            "a ready replica on each node",
            lambda rs: sorted(r["nodes"][0] for r in rs if r["state"] == "ready") == ["node-a", "node-b"],
            timeout=60,
        )
        [ready] = server.events("server_ready")
        token = cluster.ctl("keys", "create", "migration")["token"]
        yield Live(cluster=cluster, port=int(ready["admin_url"].rsplit(":", 1)[1]), token=token)
    finally:
        cluster.close()


def request_body(path: str, i: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "chat", "max_tokens": TOKENS, "ignore_eos": True, "stream": stream}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"tell me story {i}"}]
    else:
        body["prompt"] = f"Once upon a time, story {i}:"
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Stream:
    """One streamed request read in a thread: its replica, events, comments, whether it ended with [DONE]."""

    def __init__(self, live: Live, path: str, i: int) -> None:
        self.live, self.path, self.i = live, path, i
        self.replica = ""
        self.events: list[dict[str, Any]] = []
        self.comments: list[str] = []
        self.done = False
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.live.port, timeout=60)
        try:
            conn.request(
                "POST",
                self.path,
                body=json.dumps(request_body(self.path, self.i, True)),
                headers={"authorization": f"Bearer {self.live.token}", "content-type": "application/json"},
            )
            response = conn.getresponse()
            self.replica = response.getheader("x-llmgw-replica") or ""
            while line := response.readline():
                text = line.decode().rstrip("\r\n")
                if text.startswith(":"):
                    self.comments.append(text)
                elif text == "data: [DONE]":
                    self.done = True
                elif text.startswith("data: "):
                    self.events.append(json.loads(text[6:]))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = repr(exc)
        finally:
            conn.close()

    def text(self) -> str:
        chat = self.path == "/v1/chat/completions"
        out = []
        for e in self.events:
            for c in e.get("choices") or ():
                out.append(((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or ""))
        return "".join(out)

    def tokens_seen(self) -> int:
        return sum(1 for e in self.events if e.get("choices") and self._piece(e))

    def _piece(self, e: dict[str, Any]) -> str:
        c = e["choices"][0]
        return (c.get("delta") or {}).get("content") or c.get("text") or ""


def uninterrupted(live: Live, path: str, i: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(request_body(path, i, False)),
            headers={"authorization": f"Bearer {live.token}", "content-type": "application/json"},
        )
        answer = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    choice = answer["choices"][0]
    return choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]


def engine_pid(live: Live, node: str) -> int:
    [row] = [r for r in live.cluster.replicas() or [] if r["nodes"][0] == node and r["state"] == "ready"]
    return row["pids"][0]


def streams_on_both(live: Live, first: int) -> list[Stream]:
    paths = ["/v1/chat/completions", "/v1/completions"] * 4
    streams = [Stream(live, path, first + n) for n, path in enumerate(paths)]
    wait_until(
        "every stream a few tokens in",
        lambda: all(s.tokens_seen() >= 5 for s in streams) or None,
        timeout=30,
        last_seen=lambda: [(s.replica, s.tokens_seen(), s.error) for s in streams],
    )
    return streams


def check_whole(live: Live, streams: list[Stream], moved_from: str) -> int:
    for s in streams:
        s.thread.join(60)
        assert not s.thread.is_alive() and not s.error, (s.replica, s.error)
        assert s.done, (s.replica, s.events[-2:])
        assert s.text() == uninterrupted(live, s.path, s.i), (s.path, s.i, s.replica)
        assert len({e["id"] for e in s.events}) == 1
        [usage] = [e["usage"] for e in s.events if e.get("usage")]
        assert usage["completion_tokens"] == TOKENS
        assert s.comments == ([": llmgw migrated 1"] if s.replica == moved_from else []), s.replica
    return sum(1 for s in streams if s.replica == moved_from)


def migrations(live: Live) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_gateway_migrations_total{") and 'outcome="continued"' in line
    )


def test_a_killed_engine_and_a_dead_node_cut_no_stream(live: Live) -> None:
    streams = streams_on_both(live, 0)
    on_a = [s for s in streams if s.replica]
    victim = on_a[0].replica
    node = next(r["nodes"][0] for r in live.cluster.replicas() or [] if r["replica"] == victim)
    os.kill(engine_pid(live, node), signal.SIGKILL)
    moved = check_whole(live, streams, victim)
    assert moved >= 1
    wait_until("the killed engine back", lambda: engine_pid_or_none(live, node), timeout=60)
    time.sleep(1.5)  # the gateway's probe puts it back in rotation
    assert migrations(live) >= moved

    # The other node dies whole: its agent and its engine.
    streams = streams_on_both(live, 100)
    other = "node-b" if node == "node-a" else "node-a"
    victim = next(r["replica"] for r in live.cluster.replicas() or [] if r["nodes"][0] == other)
    live.cluster.kill_node(other)
    moved_now = check_whole(live, streams, victim)
    assert moved_now >= 1
    assert migrations(live) >= moved + moved_now


def engine_pid_or_none(live: Live, node: str) -> int | None:
    rows = [r for r in live.cluster.replicas() or [] if r["nodes"][0] == node and r["state"] == "ready"]
    return rows[0]["pids"][0] if rows else None
