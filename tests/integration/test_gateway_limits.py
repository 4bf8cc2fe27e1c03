"""A key's limits across two standalone gateways (`llmgw gateway --server`, one worker each) in
front of one real control plane, by the rule `llmgw.wire.gateway_link` states: each of N
instances linked enforces rate/N a minute with a burst of max(1, rate/N), and its share of the
concurrency.

- A key limited to 60 requests a minute, asked in a burst through both gateways at once: about
  60 are admitted in all (not 120), about 30 by each, and every refusal is a 429 with a
  Retry-After.
- A key limited to 2 in flight, asked with slow requests (the sim engine takes --output-token-ms
  per token): one in flight on each gateway; a second on either is a 429.
- One gateway stopped: the survivor's share becomes the whole (1 of 1) within seconds, and it
  admits the whole limit: 2 in flight, and a burst of 60.

The figures are printed (run with `-- -s` to see them); docs/gateway.md quotes the rule.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib import gatewayd
from testlib.cluster import Cluster, wait_until
from testlib.gateway import summed
from testlib.gatewayd import Standalone

TOKEN_MS = 100  # the sim engine's time per output token
CATALOG = f"""
[[models]]
name = "chat"
engine = "sim"
replicas = 1
args = ["--output-token-ms", "{TOKEN_MS}"]
"""
READY_S = 60.0
RATE = 60  # requests a minute
CONCURRENCY = 2
BURST = 90  # requests sent to each gateway in the rate burst: more than the whole limit
HELD_TOKENS = 40  # a held request's tokens: 4 s in the engine
SHARE_WITHIN_S = 3.0  # the survivor's share is the whole, after the other stopped


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # The control plane's own gateway on its loop (`gateway_workers = 0`): its worker processes
    # would be instances of their own among those sharing the key's limits, and the instances
    # counted here are the two gateways alone.
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0, server_toml="gateway_workers = 0\n")
    try:
        yield c
    finally:
        c.close()


def burst(gateways: list[Standalone], token: str, per_gateway: int, threads: int = 6) -> list[list[tuple[int, dict]]]:
    """`per_gateway` fast requests to each gateway at once, from `threads` threads each: each
    gateway's answers, (status, headers)."""
    answers: list[list[tuple[int, dict]]] = [[] for _ in gateways]

    def ask(i: int, gw: Standalone, count: int) -> None:
        for n in range(count):
            status, headers, _ = gw.ask(token, f"burst {n}", max_tokens=1)
            answers[i].append((status, headers))

    workers = [
        threading.Thread(target=ask, args=(i, gw, per_gateway // threads + (t < per_gateway % threads)))
        for i, gw in enumerate(gateways)
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    return answers


class Held:
    """Slow requests in flight, each in a thread of its own; `results` once they are answered."""

    def __init__(self, gw: Standalone, token: str, count: int) -> None:
        self.results: list[tuple[int, dict, bytes]] = []
        self._threads = [
            threading.Thread(target=lambda n=n: self.results.append(gw.ask(token, f"held {n}", max_tokens=HELD_TOKENS)))
            for n in range(count)
        ]
        for t in self._threads:
            t.start()

    def wait(self) -> list[int]:
        for t in self._threads:
            t.join(120)
        return sorted(status for status, *_ in self.results)


def in_flight(gw: Standalone) -> float:
    return summed(gw.metrics(), "llmgw_gateway_in_flight", model="chat")  # every worker's


def admitted(answers: list[tuple[int, dict]]) -> int:
    return sum(1 for status, _ in answers if status == 200)


def assert_refusals_are_429_with_retry_after(answers: list[tuple[int, dict]]) -> None:
    refused = [(status, headers) for status, headers in answers if status != 200]
    assert {status for status, _ in refused} <= {429}, refused[:3]
    assert all(int(headers["retry-after"]) >= 1 for _, headers in refused), refused[:3]


def test_two_gateways_share_a_keys_limits_and_the_survivor_takes_the_whole(cluster: Cluster) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    cluster.add_node("node-a")
    pkis = {name: gatewayd.issue_certificate(cluster, name) for name in ("gw-a", "gw-b")}
    cluster.start_server()
    cluster.start_agent("node-a")
    cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"], timeout=READY_S)
    a, b = (gatewayd.start(cluster, name, pki, workers=1) for name, pki in pkis.items())
    for gw in (a, b):
        gw.wait_serving(share_count=2)
    assert {(h["share"]["index"], h["share"]["count"]) for h in (a.health(), b.health())} == {(0, 2), (1, 2)}
    rated = cluster.ctl("keys", "create", "rated", "--rate-per-minute", str(RATE))["token"]
    held = cluster.ctl("keys", "create", "held", "--max-concurrency", str(CONCURRENCY))["token"]
    spare = cluster.ctl("keys", "create", "spare", "--rate-per-minute", str(RATE))["token"]  # for the survivor
    for gw in (a, b):
        wait_until(f"{gw.name} holds the three keys", lambda gw=gw: gw.health()["keys"] == 3, procs=[gw.proc])
    measured: dict[str, object] = {}

    # The rate: 60 a minute across two gateways is 30 a minute each, with a burst of 30.
    started = time.monotonic()
    answers = burst([a, b], rated, BURST)
    elapsed = time.monotonic() - started
    each = [admitted(x) for x in answers]
    refill = elapsed * RATE / 60  # what the buckets refilled in all while the burst ran
    measured["rate"] = {"admitted": each, "sent": [len(x) for x in answers], "burst_s": round(elapsed, 2)}
    for got in each:
        assert RATE / 2 <= got <= RATE / 2 + refill / 2 + 1, measured
    assert RATE <= sum(each) <= RATE + refill + 2, measured
    for x in answers:
        assert_refusals_are_429_with_retry_after(x)
    waits = {h["retry-after"] for x in answers for status, h in x if status == 429}
    assert waits <= {"1", "2"} and "2" in waits, waits  # 30 a minute on each: a token every 2 s

    # The concurrency: 2 in flight across two gateways is 1 on each.
    first = [Held(gw, held, 1) for gw in (a, b)]
    for gw in (a, b):
        wait_until(f"a held request in flight on {gw.name}", lambda gw=gw: in_flight(gw) == 1, procs=[gw.proc])
    more = [gw.ask(held, "one more", max_tokens=1) for gw in (a, b)]
    assert [status for status, *_ in more] == [429, 429], more
    assert all(headers["retry-after"] == "1" for _, headers, _ in more)
    assert b"its share of the key's limit of 2 across 2 instances" in more[0][2], more[0][2]
    assert [h.wait() for h in first] == [[200], [200]]

    # One gateway leaves: the other's share is the whole.
    stopped_at = time.monotonic()
    assert b.proc.stop(signal.SIGTERM, timeout=60) == 0, b.proc.tail()
    wait_until(
        "gw-a's share the whole",
        lambda: a.health()["share"] == {"index": 0, "count": 1},
        procs=[a.proc],
        timeout=SHARE_WITHIN_S,
        last_seen=a.health,
    )
    measured["whole_share_after_s"] = round(time.monotonic() - stopped_at, 2)
    both = Held(a, held, CONCURRENCY)
    wait_until("both held requests in flight on gw-a", lambda: in_flight(a) == CONCURRENCY, procs=[a.proc])
    status, headers, body = a.ask(held, "one more", max_tokens=1)
    assert status == 429 and b"has 2 requests in flight, its limit" in body, body
    assert both.wait() == [200, 200]

    started = time.monotonic()
    [answers] = burst([a], spare, BURST)
    elapsed = time.monotonic() - started
    measured["survivor_rate"] = {"admitted": admitted(answers), "sent": len(answers), "burst_s": round(elapsed, 2)}
    assert RATE <= admitted(answers) <= RATE + elapsed * RATE / 60 + 1, measured
    assert_refusals_are_429_with_retry_after(answers)
    print(f"\na key's limits across two gateways: {json.dumps(measured)}")
    assert a.proc.stop(signal.SIGTERM, timeout=60) == 0, a.proc.tail()
