"""`llmgw gateway --server` in front of a real cluster on loopback (`llmgw server`, an agent, a sim
engine), its two workers linked to the control plane with a certificate from `llmgw ca issue
--gateway`: it serves what the control plane says; with the control plane stopped it keeps
serving under load from its last table, its staleness rising in /health and /metrics; once the
control plane is back each worker links again and a key revoked then is refused within 5 s."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib.cluster import Cluster, Proc, free_port, wait_until
from testlib.gateway import chat, parse_metrics, request

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""
READY_S = 60.0
OUTAGE_S = 8.0  # the control plane away while clients keep asking
REVOKED_WITHIN_S = 5.0  # the promise after the control plane's return


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    try:
        yield c
    finally:
        c.close()


class Clients:
    """Two clients asking the gateway with one key without pause, on fresh connections; every
    answer kept as (sent at, status, seconds it took)."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.answers: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(2)]

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                status = request(self.port, "POST", "/v1/chat/completions", chat(f"c{n} q{i}"), token=self.token)[0]
            except OSError:
                status = 0
            self.answers.append((sent, status, time.monotonic() - sent))
            i += 1

    def between(self, start: float, end: float) -> list[tuple[float, int, float]]:
        return [a for a in self.answers if start <= a[0] < end]


def health(port: int) -> dict:
    status, _, body = request(port, "GET", "/health")
    answer = json.loads(body)
    answer["http_status"] = status
    return answer


def every_worker(port: int, check, samples: int = 20) -> bool:
    """Whether `check(health)` holds on `samples` fresh connections (the kernel spreads them over
    the workers: with two, 20 in a row all reach one worker once in half a million)."""
    return all(check(health(port)) for _ in range(samples))


def test_a_standalone_gateway_serves_on_while_the_control_plane_is_away(cluster: Cluster, tmp_path: Path) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    cluster.add_node("node-a")
    pki = tmp_path / "gw-pki"
    cluster.llmgw("ca", "issue", "--gateway", "gw1", "--config", str(cluster.server_config), "--out", str(pki))
    cluster.start_server()
    cluster.start_agent("node-a")
    cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"], timeout=READY_S)
    alice = cluster.ctl("keys", "create", "alice")["token"]
    bob = cluster.ctl("keys", "create", "bob")["token"]

    port = free_port()
    args = ["--log-format", "json", "gateway", "--server", f"wss://127.0.0.1:{cluster.port}", "--pki-dir", str(pki)]
    gw = Proc("gateway", [*args, "--listen", f"127.0.0.1:{port}", "--workers", "2"], tmp_path / "gateway.log")
    cluster.procs.append(gw)
    wait_until("the gateway ready", lambda: gw.events("gateway_ready"), alive=[gw], timeout=READY_S)
    wait_until(
        "both workers serving the cluster's table",
        lambda: every_worker(port, lambda h: h["http_status"] == 200 and h["link_up"] and h["ready"] == {"chat": 1}),
        alive=[gw],
        timeout=READY_S,
    )
    assert request(port, "POST", "/v1/chat/completions", chat(), token=bob)[0] == 200

    with Clients(port, alice) as clients:
        time.sleep(1.0)
        stopped_at = time.monotonic()
        assert cluster.server is not None and cluster.server.stop(signal.SIGTERM) == 0, cluster.server.tail()
        wait_until("the workers see the link down", lambda: every_worker(port, lambda h: not h["link_up"]), procs=[gw])
        first = health(port)
        time.sleep(OUTAGE_S)
        later = health(port)
        back_at = time.monotonic()
        cluster.start_server()
        wait_until(
            "both workers linked again", lambda: every_worker(port, lambda h: h["link_up"]), alive=[gw], timeout=30
        )
        relinked_at = time.monotonic()
        time.sleep(1.0)

    outage = clients.between(stopped_at, back_at)
    assert len(outage) > 20 and [s for _, s, _ in outage if s != 200] == [], outage[-5:]
    assert max(took for *_, took in outage) < 1.0  # served from the table: nothing waits on the control plane
    assert later["http_status"] == 200 and later["ready"] == {"chat": 1}
    assert later["staleness_s"] >= first["staleness_s"] + OUTAGE_S - 1, (first, later)
    metrics = parse_metrics(request(port, "GET", "/metrics")[2].decode())
    assert metrics[("llmgw_gateway_link_up", frozenset())] == 1
    assert metrics[("llmgw_gateway_table_staleness_seconds", frozenset())] < 2.0
    after = clients.between(back_at, relinked_at + 1.0)
    print(f"\noutage: {len(outage)} requests, all 200; after the return: {sorted({s for _, s, _ in after})}")

    revoked_at = time.monotonic()
    cluster.ctl("keys", "revoke", "bob")
    wait_until(
        "bob refused by every worker",
        lambda: all(request(port, "POST", "/v1/chat/completions", chat(), token=bob)[0] == 401 for _ in range(20)),
        procs=[gw],
        timeout=REVOKED_WITHIN_S,
    )
    print(f"bob refused everywhere {time.monotonic() - revoked_at:.2f} s after its revocation")
    assert request(port, "POST", "/v1/chat/completions", chat(), token=alice)[0] == 200
    assert gw.stop(signal.SIGTERM, timeout=60) == 0, gw.tail()
