"""Replicas on a real cluster on loopback: `llmgw server`, three `llmgw agent` processes on one
simulated InfiniBand fabric, and real sim engines, driven only through what an operator uses
(`ctl nodes|replicas|reload|drain`, signals) and observed through `ctl`, /proc and the logs.

The fabric is the recorded `one-fabric` tree with its stand-in `sminfo`: every node sees the
same subnet manager, so the three form one fabric `ib-a` by name and identity. Each agent dials
from its own loopback address (127.0.0.2, .3, .4), as separate machines would.

One story, in order, because each step starts from what the previous one left: a two-node
replica placed on the fabric answers with its own key; an engine killed is restarted; a node
that dies has its replicas rebuilt elsewhere (the two-node one as a whole) and, back, runs
nothing stale; a drain moves replicas one at a time, each replacement ready before its original
stops; a control-plane restart restarts no engine. Every wait is a bounded poll
(`testlib.cluster`); a failure prints what `ctl` last said and the processes' log tails.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.replica_logs import log_path
from testlib.cluster import Cluster, wait_until
from testlib.hardware import ib_root, sminfo

NODES = ("node-a", "node-b", "node-c")
IB_CASE = "one-fabric"
IDENTITY = "ib-sm:0x0002c90300a1b2c3"  # the subnet manager GUID the fixture's sminfo answers
FABRIC_KEY = f"ib-a@{IDENTITY}"
WANTED = {"big": 1, "small": 2}
CATALOG = """
[[models]]
name = "big"
engine = "sim"
nodes_per_replica = 2
replicas = 1

[[models]]
name = "small"
engine = "sim"
replicas = 2
"""


def address_of(node_id: str) -> str:
    return f"127.0.0.{NODES.index(node_id) + 2}"


AGENT_TOML = (
    f'ib_root = "{ib_root(IB_CASE)}"\n'
    f'sminfo = "{sminfo(IB_CASE)}"\n'
    'fabrics = [{name = "ib-a", adapters = ["mlx5_0", "mlx5_1"]}]\n'
)
# Placement, engine start (a Python process each) and health checks, on a loaded CI machine.
READY_S = 30.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.5)
    try:
        yield c
    finally:
        c.close()  # every agent, server and engine process group, whatever the test did


# -- reading what ctl says -------------------------------------------------------------------


def placed(replicas: list[dict[str, Any]], model: str | None = None) -> list[dict[str, Any]]:
    return [r for r in replicas if r["replica"] is not None and (model is None or r["model"] == model)]


def settled(replicas: list[dict[str, Any]]) -> bool:
    """Every model has exactly its wanted replicas, each ready on every member, nothing pending."""
    if any(r["state"] == "pending" for r in replicas):
        return False
    for model, count in WANTED.items():
        mine = placed(replicas, model)
        if len(mine) != count or any(set(r["member_states"]) != {"ready"} or not r["port"] for r in mine):
            return False
    return True


def on_node(replicas: list[dict[str, Any]], node_id: str) -> list[str]:
    return [r["replica"] for r in placed(replicas) if node_id in r["nodes"]]


def engine_pids_of(replicas: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    return {(r["replica"], n): pid for r in placed(replicas) for n, pid in zip(r["nodes"], r["pids"], strict=True)}


def joined_on_fabric(node: dict[str, Any]) -> bool:
    return (
        node["state"] == "joined"
        and any(e["name"] == "sim" and e["ok"] for e in node["engines"])
        and [f"{f['name']}@{f['identity']}" for f in node["fabrics"]] == [FABRIC_KEY]
    )


# -- talking to a replica --------------------------------------------------------------------


def api_key(cluster: Cluster, replica_id: str) -> str:
    """The per-replica key, as the control plane holds it (sealed in its store)."""
    return cluster.engine_key(replica_id)


def complete(replica: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
    """A completion from the replica's rank 0 engine, where it listens: its node's own address."""
    conn = http.client.HTTPConnection(address_of(replica["nodes"][0]), replica["port"], timeout=10)
    try:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"model": "big", "prompt": "Say hello", "max_tokens": 8}),
            headers=headers,
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def test_replicas_are_placed_restarted_rebuilt_fenced_drained_and_survive_a_control_plane_restart(
    cluster: Cluster,
) -> None:
    # 1. Three nodes on one fabric. The catalog is applied once all three are joined, so that
    #    placement sees the whole cluster (it is stable: what it places first stays there).
    cluster.init_ca()
    for node_id in NODES:
        cluster.add_node(node_id, AGENT_TOML + f'source_address = "{address_of(node_id)}"\n')
    server = cluster.start_server()
    for node_id in NODES:
        cluster.start_agent(node_id)
    nodes = cluster.wait_nodes(
        "three nodes joined on ib-a with a working sim",
        lambda n: set(n) == set(NODES) and all(joined_on_fabric(x) for x in n.values()),
    )
    for node in nodes.values():
        assert node["fabrics"] == [{"name": "ib-a", "identity": IDENTITY, "adapters": ["mlx5_0", "mlx5_1"]}], node
        assert node["fabric_problems"] == [], node
        assert node["address"] == address_of(node["id"]), node
    cluster.set_catalog(CATALOG)
    reloaded = cluster.ctl("reload")
    assert reloaded["models"] == ["big", "small"], reloaded

    # 2. The two-node replica is on two nodes of the fabric, ready on both, and its rank 0
    #    answers with the replica's own key and refuses a request without it.
    replicas = cluster.wait_replicas("big and both small replicas ready", settled, timeout=READY_S)
    [big] = placed(replicas, "big")
    assert len(set(big["nodes"])) == 2 and set(big["nodes"]) <= set(NODES), big
    assert big["fabric"] == FABRIC_KEY, big
    assert big["member_states"] == ["ready", "ready"] and big["port"] > 0, big
    assert all(pid > 0 for pid in big["pids"]), big
    assert [e for e in server.events("replica_placed") if e["model"] == "big"][-1]["nodes"] == big["nodes"]
    key = api_key(cluster, big["replica"])
    status, body = complete(big, key)
    assert status == 200, body
    assert body["model"] == "big" and body["choices"][0]["text"], body
    status, body = complete(big, None)
    assert status == 401, body
    status, body = complete(big, key + "-wrong")
    assert status == 401, body

    # 3. An engine killed outright is restarted by its agent, on the same node, and is ready again.
    small = placed(replicas, "small")[0]
    [small_node], [small_pid] = small["nodes"], small["pids"]
    assert small_pid in cluster.engine_pids(small_node), (small, cluster.engine_pids(small_node))
    os.kill(small_pid, signal.SIGKILL)
    replicas = cluster.wait_replicas(
        f"{small['replica']} restarted and ready again",
        lambda rs: settled(rs)
        and any(
            r["replica"] == small["replica"] and r["nodes"] == [small_node] and r["restarts"] >= 1 for r in placed(rs)
        ),
        timeout=READY_S,
    )
    [again] = [r for r in placed(replicas) if r["replica"] == small["replica"]]
    assert again["pids"][0] not in (0, small_pid), again
    engine_log = log_path(cluster.nodes_files[small_node].state_dir / "logs", small["replica"], 0)
    assert "killed by SIGKILL" in engine_log.read_text(), engine_log.read_text()[-2000:]

    # 4. A node holding a member of "big" dies (agent and engines, as a machine would). Once its
    #    heartbeats are a TTL old it is lost, and "big" is rebuilt, as a whole, on the other two.
    victim = big["nodes"][-1]
    big_before = big
    killed = cluster.kill_node(victim)
    assert killed, f"{victim} held a member of {big['replica']} but ran no engine"
    survivors = sorted(set(NODES) - {victim})
    cluster.wait_nodes(f"{victim} lost", lambda n: n[victim]["state"] == "lost")
    replicas = cluster.wait_replicas(
        f"big rebuilt on {survivors} and every replica ready without {victim}",
        lambda rs: settled(rs) and sorted(placed(rs, "big")[0]["nodes"]) == survivors and not on_node(rs, victim),
        timeout=READY_S,
    )
    [big] = placed(replicas, "big")
    assert big["fabric"] == FABRIC_KEY, big
    assert not set(big["pids"]) & set(big_before["pids"]), (big_before, big)  # new processes on both members
    assert [e for e in server.events("node_lost") if e["node"] == victim], server.tail()
    assert cluster.engine_pids(victim) == [], "a dead machine's engines are gone"
    status, body = complete(big, api_key(cluster, big["replica"]))
    assert status == 200, body

    # 5. The dead node comes back with its certificate: it rejoins, and runs nothing: its old
    #    member is not in its desired state any more (fencing), and nothing moves back to it.
    agent = cluster.start_agent(victim)
    wait_until(f"{victim}'s link", lambda: agent.events("link_up"), procs=[server, agent], alive=[agent, server])
    nodes = cluster.wait_nodes(f"{victim} joined again", lambda n: n[victim]["state"] == "joined")
    assert nodes[victim]["replicas"] == [], nodes[victim]
    replicas = cluster.wait_replicas("every replica still ready", settled)
    assert not on_node(replicas, victim), replicas
    assert sorted(placed(replicas, "big")[0]["nodes"]) == survivors, replicas
    assert not agent.events("replica_assigned"), agent.tail()
    assert cluster.engine_pids(victim) == [], cluster.engine_pids(victim)

    # 6. Drain a node holding a "small" replica: each of its replicas gets a replacement that is
    #    ready before the original stops; the node ends cordoned and empty.
    drained = next(n for n in survivors if any(r["model"] == "small" for r in placed(replicas) if n in r["nodes"]))
    moving = sorted(on_node(replicas, drained))
    progress = cluster.ctl("drain", drained, "--wait")
    assert progress["done"] is True and progress["error"] is None, progress
    assert progress["total"] == len(moving) and progress["moved"] == len(moving), (progress, moving)
    events = server.events()
    [started] = [e for e in events if e.get("event") == "drain_started" and e["node"] == drained]
    assert sorted(started["replicas"]) == moving, started
    for rid in moving:
        ready = [i for i, e in enumerate(events) if e.get("event") == "move_replacement_ready" and e["replica"] == rid]
        stopped = [i for i, e in enumerate(events) if e.get("event") == "move_original_stopped" and e["replica"] == rid]
        assert len(ready) == 1 and len(stopped) == 1 and ready[0] < stopped[0], (rid, ready, stopped)
    nodes = cluster.wait_nodes(
        f"{drained} cordoned and empty",
        lambda n: n[drained]["cordoned"] and not n[drained]["draining"] and not n[drained]["replicas"],
    )
    replicas = cluster.wait_replicas(
        f"every replica ready, none on {drained}", lambda rs: settled(rs) and not on_node(rs, drained)
    )
    wait_until(f"{drained}'s engines stopped", lambda: not cluster.engine_pids(drained), procs=cluster.latest())

    # 7. The control plane restarts: the agents keep their engines, and the new control plane
    #    adopts them: the same processes, no restart counted.
    pids_before = engine_pids_of(replicas)
    restarts_before = {r["replica"]: r["restarts"] for r in placed(replicas)}
    running_before = {n: cluster.engine_pids(n) for n in NODES}
    assert sorted(pids_before.values()) == sorted(p for ps in running_before.values() for p in ps), (
        pids_before,
        running_before,
    )
    links_before = {n: len(cluster.agents[n].events("link_up")) for n in NODES}
    status = server.stop(signal.SIGTERM)
    assert status == 0, f"`llmgw server` on SIGTERM: exit status {status}\n{server.tail()}"
    server = cluster.start_server()
    for node_id in NODES:
        wait_until(
            f"{node_id}'s agent to reconnect",
            lambda a=cluster.agents[node_id], n=links_before[node_id]: len(a.events("link_up")) > n,
            procs=cluster.latest(),
            alive=[server, cluster.agents[node_id]],
        )
    cluster.wait_nodes("every node joined again", lambda n: all(x["state"] == "joined" for x in n.values()))
    # A node that reconnects later than one TTL after the restart must not be taken for lost: its
    # agent still runs its replicas, and moving them is exactly what a restart must not do.
    retries = {n: [e["retry_in_s"] for e in cluster.agents[n].events("link_down")][-3:] for n in NODES}
    moved = server.events("node_lost") + server.events("replica_placed") + server.events("replica_stopped")
    assert not moved, f"the restarted control plane moved replicas: {moved}\nagents' last reconnect delays: {retries}"
    replicas = cluster.wait_replicas("every replica ready after the restart", settled)
    assert engine_pids_of(replicas) == pids_before, (pids_before, replicas)
    assert {r["replica"]: r["restarts"] for r in placed(replicas)} == restarts_before, replicas
    assert {n: cluster.engine_pids(n) for n in NODES} == running_before
    assert (cluster.nodes() or {})[drained]["cordoned"] is True, cluster.last_nodes
