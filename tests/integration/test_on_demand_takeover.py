"""A scale-up across a change of leader: two `llmgw server` processes on one real PostgreSQL
(testlib.planes), two agents with sim engines, a gateway of its own given both. Requests held for
a model on demand make the leader start one replica; the leader is SIGKILLed while that replica
is still starting; the standby leads, keeps the count the store holds (one, not zero: it starts
no second replica and stops none), and the held requests are answered by that replica."""

from __future__ import annotations

import http.client
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testlib import gatewayd
from testlib.cluster import wait_until
from testlib.planes import Planes
from testlib.postgres import Database, postgres_db, postgres_server  # noqa: F401 - fixtures

CATALOG = """
[[models]]
name = "cold"
engine = "sim"
min_replicas = 0
max_replicas = 2
replicas = 0
queue_timeout_s = 120.0
args = ["--startup-delay-s", "6"]
"""


@pytest.fixture
def planes(tmp_path: Path, postgres_db: Database) -> Iterator[Planes]:  # noqa: F811 - the fixture
    p = Planes(tmp_path, postgres_db, reconnect_grace_s=40.0)  # agents backing off return up to 30 s later
    try:
        yield p
    finally:
        p.close()


def ask(port: int, token: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=150)
    try:
        body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, response.read()
    except OSError as exc:
        return 0, str(exc).encode()
    finally:
        conn.close()


def test_a_scale_up_begun_by_a_leader_killed_is_kept_by_the_next(planes: Planes) -> None:
    a, b = planes.start_two_nodes(CATALOG)
    wait_until(
        "both nodes joined",
        lambda: {n: v["state"] for n, v in planes.nodes(a).items()} == {"node-a": "joined", "node-b": "joined"} or None,
        procs=planes.procs(),
    )
    token = planes.ctl(a, "keys", "create", "alice")["token"]
    gw = gatewayd.start(
        planes.cluster, "gw1", gatewayd.issue_certificate(planes.cluster, "gw1"), server=planes.agent_urls
    )
    wait_until("the gateway serving", gw.serves, alive=[gw.proc], timeout=60)

    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(ask(gw.port, token)), daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until("a's decision", lambda: a.events("autoscale_decision"), procs=planes.procs(), timeout=30)
    placed = wait_until(
        "the replica placed", lambda: [r for r in planes.replicas_by_id(a).values() if r["model"] == "cold"], timeout=30
    )
    assert [r["state"] for r in placed] != ["ready"]  # still starting (6 s)
    [decision] = a.events("autoscale_decision")
    assert (decision["kind"], decision["after"]) == ("start", 1)

    a.proc.popen.send_signal(signal.SIGKILL)
    a.proc.popen.wait(10)
    planes.wait_leads(b, timeout=40)
    for t in threads:
        t.join(150)
    assert [status for status, _ in answers] == [200, 200, 200], answers

    # The new leader took the count from the store: the same one replica, none started or stopped.
    after = [r for r in planes.replicas_by_id(b).values() if r["model"] == "cold"]
    assert [r["replica"] for r in after] == [placed[0]["replica"]] and after[0]["state"] == "ready"
    assert b.events("autoscale_decision") == []
    [model] = [m for m in planes.ctl(b, "models") if m["model"] == "cold"]
    assert model["scale"]["wanted"] == 1
