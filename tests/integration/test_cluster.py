"""A real cluster on loopback: `llmgw server` and two `llmgw agent` processes, driven and observed
only through the CLI an operator uses (`ca`, `agent csr`, `ctl nodes`, `node remove`).

The life of a node, end to end: it joins, it is lost when its agent dies, a live one rejoins by
itself after the control plane restarts while a dead one stays known but not joined, and a
removed one is forgotten and its certificate refused. Every wait is a bounded poll
(`testlib.cluster`); a failure prints what `ctl nodes` last said and the processes' log tails.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from testlib.cluster import Cluster, NodeFiles, wait_until


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.5)
    try:
        yield c
    finally:
        c.close()  # every process it started, whatever the test did


def states(nodes: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {node_id: n["state"] for node_id, n in nodes.items()}


def certificate(files: NodeFiles) -> x509.Certificate:
    return x509.load_pem_x509_certificate((files.pki / "node.crt").read_bytes())


def test_nodes_join_get_lost_rejoin_after_a_restart_and_a_removed_one_is_refused(cluster: Cluster) -> None:
    cluster.init_ca()
    files = {node_id: cluster.add_node(node_id) for node_id in ("node-a", "node-b")}
    certs = {node_id: certificate(f) for node_id, f in files.items()}
    for node_id, cert in certs.items():
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_id
    assert certs["node-a"].serial_number != certs["node-b"].serial_number
    assert (files["node-a"].pki / "node.key").read_bytes() != (files["node-b"].pki / "node.key").read_bytes()
    serials = {node_id: f"{cert.serial_number:x}" for node_id, cert in certs.items()}

    # Both join.
    server = cluster.start_server()
    agents = {node_id: cluster.start_agent(node_id) for node_id in files}
    for agent in agents.values():
        wait_until(f"{agent.name}'s link", lambda a=agent: a.events("link_up"), procs=[server], alive=[agent, server])
    nodes = cluster.wait_nodes("both nodes joined", lambda n: states(n) == {"node-a": "joined", "node-b": "joined"})
    for node_id, node in nodes.items():
        assert node["address"] == "127.0.0.1", node
        assert node["connected"] is True, node
        assert node["agent_version"], node
        assert node["cpu"] and node["cpu"]["cores"] >= 1, node
        assert node["last_heartbeat_age_s"] is not None, node
        assert node["cert_serial"] == serials[node_id], node  # each connected with its own certificate
        assert node["cert_not_after"] == certs[node_id].not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"), node
    agent_a_started = nodes["node-a"]["agent_started_at"]

    # node-b's agent dies: lost once its heartbeats are a TTL old; node-a is untouched.
    agents["node-b"].kill()
    cluster.wait_nodes("node-b lost, node-a joined", lambda n: states(n) == {"node-a": "joined", "node-b": "lost"})
    wait_until(
        "the server to log node-b lost",
        lambda: [e for e in server.events("node_lost") if e.get("node") == "node-b"],
        procs=[server],
    )

    # The control plane restarts. It stops cleanly on SIGTERM, and the new one listens where the
    # agents dial: node-a's same agent process reconnects by itself; node-b is known from the store.
    status = server.stop(signal.SIGTERM)
    assert (
        status == 0
    ), f"`llmgw server` on SIGTERM: exit status {status} (None: still running after 10 s)\n{server.tail()}"
    assert server.events("server_stopped"), server.tail()
    server = cluster.start_server()
    nodes = cluster.wait_nodes(
        "node-a rejoined after the restart, node-b listed",
        lambda n: n.get("node-a", {}).get("state") == "joined" and "node-b" in n,
    )
    assert nodes["node-b"]["state"] in ("unknown", "lost"), nodes["node-b"]
    assert nodes["node-a"]["agent_started_at"] == agent_a_started, "node-a's agent should not have restarted"
    assert agents["node-a"].returncode is None and len(agents["node-a"].events("link_up")) == 2
    cluster.wait_nodes("node-b lost after the first TTL", lambda n: states(n) == {"node-a": "joined", "node-b": "lost"})

    # Removing node-b forgets it and revokes the certificate `ca issue` recorded.
    removed = json.loads(cluster.llmgw("node", "remove", "node-b", "--state-dir", str(cluster.state), "--json").stdout)
    assert removed["removed"] == "node-b", removed
    assert removed["revoked_serials"] == [serials["node-b"]], removed
    assert removed["link_closed"] is False, removed  # its agent is dead: no link to close
    assert states(cluster.nodes() or {}) == {"node-a": "joined"}, cluster.last_nodes

    # node-b's agent comes back with the same certificate and is refused, on both sides.
    agent_b = cluster.start_agent("node-b")
    [down, *_] = wait_until(
        "node-b's agent to be refused as revoked",
        lambda: [e for e in agent_b.events("link_down") if "revoked" in e.get("reason", "")],
        procs=[server],
        alive=[agent_b, server],
    )
    assert "HTTP 403" in down["reason"] and serials["node-b"] in down["reason"], down
    [refused, *_] = wait_until(
        "the server to log node-b's refusal",
        lambda: [e for e in server.events("agent_refused") if e.get("cn") == "node-b" and "revoked" in e["reason"]],
        procs=[server, agent_b],
    )
    assert refused["stage"] == "identity" and serials["node-b"] in refused["reason"], refused
    assert not agent_b.events("link_up"), agent_b.tail()
    assert states(cluster.nodes() or {}) == {"node-a": "joined"}, cluster.last_nodes


def test_ctl_says_when_the_credential_is_wrong_or_no_control_plane_ran(cluster: Cluster, tmp_path: Path) -> None:
    cluster.init_ca()
    server = cluster.start_server()
    url = (cluster.state / "admin.url").read_text().strip()

    right = cluster.llmgw("ctl", "nodes", "--json", "--server", url, "--credential", str(cluster.state / "admin.token"))
    assert json.loads(right.stdout) == []

    wrong_token = tmp_path / "wrong.token"
    wrong_token.write_text("not-the-admin-token\n")
    wrong_token.chmod(0o644)  # a credential others may read is refused before it is sent
    loose = cluster.llmgw("ctl", "nodes", "--server", url, "--credential", str(wrong_token), ok=False)
    assert loose.returncode == 1 and f"`chmod 600 {wrong_token}`" in loose.stderr, loose.stderr
    wrong_token.chmod(0o600)
    wrong = cluster.llmgw("ctl", "nodes", "--server", url, "--credential", str(wrong_token), ok=False)
    assert wrong.returncode == 1, wrong
    assert "wrong admin credential" in wrong.stderr, wrong.stderr
    wait_until("the server to log the refusal", lambda: server.events("admin_credential_refused"), procs=[server])

    fresh = tmp_path / "no-control-plane"
    fresh.mkdir()
    missing = cluster.llmgw("ctl", "nodes", "--state-dir", str(fresh), ok=False)
    assert missing.returncode == 1, missing
    assert str(fresh / "admin.url") in missing.stderr and "is missing" in missing.stderr, missing.stderr
