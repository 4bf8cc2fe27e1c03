"""A stalled control plane evicts no healthy node: a real cluster on loopback (`llmgw server`, two
`llmgw agent` processes, real sim engines) whose control plane is held for longer than
`heartbeat_ttl_s`, while the agents go on heartbeating into its socket buffers.

One story, in order: the control plane's loop held computing by the stall diagnostic (`POST
/admin/v1/debug/stall`, allowed by `[debug] allow_stall`), then the whole process paused with
SIGSTOP. After each, no node was declared lost, no link was closed as silent, no replica moved
or restarted, and the lag was logged and shown in /metrics. Last, a node that really goes silent
during a stall (its agent stopped just before it) is declared lost a TTL of liveness time after
its last heartbeat — not at once when the loop resumes, as a wall-clock judge would.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from testlib.cluster import Cluster, wait_until
from testlib.proc import Proc

TTL_S = 3.0
INTERVAL_S = 0.2
STALL_S = TTL_S + 3
NODES = ("node-a", "node-b")
CATALOG = """
[debug]
allow_stall = true

[[models]]
name = "sim-small"
engine = "sim"
replicas = 2
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=INTERVAL_S, heartbeat_ttl_s=TTL_S)
    try:
        yield c
    finally:
        c.close()


def http_port(server: Proc) -> int:
    return int(server.events("server_ready")[-1]["admin_url"].rsplit(":", 1)[1])


def stall(cluster: Cluster, seconds: float) -> dict[str, Any]:
    """The stall diagnostic, with the admin credential; returns once the loop is let go."""
    token = (cluster.state / "admin.token").read_text().strip()
    conn = http.client.HTTPConnection("127.0.0.1", http_port(cluster.server), timeout=seconds + 30)
    try:
        conn.request("POST", f"/admin/v1/debug/stall?seconds={seconds}", headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        body = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 200, body
    return body


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_event_loop")
    }


def spread(replicas: list[dict[str, Any]]) -> bool:
    """Two replicas, ready, one on each node."""
    placed = [r for r in replicas if r["replica"] is not None]
    return (
        len(placed) == 2
        and all(r["state"] == "ready" and r["pids"] for r in placed)
        and sorted(n for r in placed for n in r["nodes"]) == list(NODES)
    )


def engines(replicas: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    return {r["replica"]: (r["nodes"][0], r["pids"][0]) for r in replicas if r["replica"] is not None}


def at(event: dict[str, Any]) -> float:
    return datetime.strptime(event["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def assert_nothing_moved(cluster: Cluster, before: dict[str, tuple[str, int]], links: int) -> None:
    """For more than a TTL after the stall, every poll finds both nodes joined; then the server
    logged no loss and no silent link, no agent reconnected, and every replica runs where it ran,
    in the same engine process."""
    server = cluster.server
    until = time.monotonic() + TTL_S + 1
    while time.monotonic() < until:  # an observation window: what must not happen, over a TTL
        nodes = cluster.nodes()
        assert nodes is not None and {k: n["state"] for k, n in nodes.items()} == dict.fromkeys(NODES, "joined")
        time.sleep(0.2)
    assert server.events("node_lost") == [] and server.events("agent_link_silent") == []
    assert len(server.events("agent_connected")) == links
    assert engines(cluster.replicas() or []) == before
    assert all(pid in cluster.engine_pids(node) for node, pid in before.values())


def test_a_stalled_or_paused_control_plane_loses_no_healthy_node_and_a_silent_one_after_its_ttl(
    cluster: Cluster,
) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    for node in NODES:
        cluster.add_node(node)
    server = cluster.start_server()
    for node in NODES:
        cluster.start_agent(node)
    replicas = cluster.wait_replicas("a replica on each node", spread, timeout=60)
    before, links = engines(replicas), len(server.events("agent_connected"))
    port = http_port(server)

    # 1. The loop held computing, as by a pathological request, for longer than the TTL.
    held = stall(cluster, STALL_S)
    assert held["stalled_s"] >= STALL_S
    lagged = wait_until("the lag to be logged", lambda: server.events("event_loop_lagged"), procs=[server])
    assert lagged[0]["lag_s"] >= STALL_S * 0.9
    assert_nothing_moved(cluster, before, links)
    figures = metrics(port)
    assert figures["llmgw_event_loop_lag_max_seconds"] >= STALL_S * 0.9
    assert figures["llmgw_event_loop_stalled_seconds_total"] >= STALL_S - 1

    # 2. The whole process paused (SIGSTOP) as long: nothing computes, nothing reads.
    os.kill(server.popen.pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(server.popen.pid, signal.SIGCONT)

    def pause_logged() -> list[dict[str, Any]]:
        # Its own line: more than the warnings' 10 s rate limit passed since the first.
        return [e for e in server.events("event_loop_lagged")[1:] if e["lag_s"] >= STALL_S * 0.9]

    [paused] = wait_until("the pause to be logged", pause_logged, procs=[server])
    assert paused["cause"] == "blocked_or_paused", paused  # neither computing nor waiting for a CPU
    assert_nothing_moved(cluster, before, links)

    # 3. A node that really goes silent during a stall: its agent stopped just before.
    silent = cluster.agents["node-b"]
    os.kill(silent.popen.pid, signal.SIGSTOP)
    try:
        stall(cluster, STALL_S)
        [done] = server.events("debug_stall_done")[-1:]
        lost = wait_until(
            "node-b to be declared lost", lambda: server.events("node_lost"), procs=[server], timeout=TTL_S + 20
        )
        assert [e["node"] for e in lost] == ["node-b"]
        # A TTL of liveness time after its last heartbeat, which came at most a heartbeat (and the
        # stall request's way to the server) before the stall: not as soon as the loop resumed, as
        # 6 s of wall-clock silence over a 3 s TTL would have had it.
        assert at(lost[0]) - at(done) >= TTL_S - 2.0, (lost[0]["ts"], done["ts"])
        nodes = cluster.nodes()
        assert nodes is not None and nodes["node-a"]["state"] == "joined"
        assert server.events("agent_link_silent") == [] or all(
            e["node"] == "node-b" for e in server.events("agent_link_silent")
        )
    finally:
        os.kill(silent.popen.pid, signal.SIGCONT)
    # The agent measures its own loop too: it was stopped, and says so once it runs again.
    agent_lag = wait_until(
        "node-b's agent to log its pause", lambda: silent.events("event_loop_lagged"), procs=[silent]
    )
    assert agent_lag[0]["lag_s"] >= STALL_S * 0.9 and agent_lag[0]["cause"] == "blocked_or_paused"
    # And the sim engine shows its own loop at /metrics.
    [engine_port] = [r["port"] for r in replicas if r["replica"] is not None and r["nodes"] == ["node-a"]]
    assert metrics(engine_port)["llmgw_event_loop_lag_seconds_count"] > 0
