"""Two `llmgw server` processes on one real PostgreSQL (testlib.postgres, testlib.planes), with
real agents running sim engines (agent.toml naming both control planes) and a standalone gateway
given both (`--server` twice):

- the standby answers an admin write with 503 and where the leader is, and `llmgw ctl` run with
  the standby's state directory follows it to the leader;
- the leader SIGKILLed: the standby leads within 10 s, the agents and the gateway reconnect to
  it, no replica is restarted (the same engine processes, adopted as after a restart) and the
  placements, keys and cordons written before are there; the gateway keeps serving;
- the leader SIGSTOPped past its lease: the standby takes over and the agents leave the silent
  leader for it; SIGCONT: the old leader's admin write, sent while it was stopped, is refused (by
  the epoch, or by the standby it has become), nothing of it lands in the store, and it stands
  by, naming the new leader.

Leases are short here (`testlib.planes.LEASE_TTL_S`), so each case takes seconds. The figures of
a takeover under load are the chaos bench's (docs/high-availability.md).
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testlib import gatewayd
from testlib.cluster import wait_until
from testlib.planes import LEASE_TTL_S, Plane, Planes, at
from testlib.postgres import Database, PostgresServer, postgres_db, postgres_server  # noqa: F401 - fixtures

TAKEOVER_S = 10.0  # the issue's bound: the standby leads within this of the leader's death


@pytest.fixture
def planes(tmp_path: Path, postgres_db: Database) -> Iterator[Planes]:  # noqa: F811 - the fixture
    # An agent whose link to the killed leader was backing off comes back up to 30 s later (its
    # backoff's ceiling; seen in CI: 30.2 s): the new leader waits that long and more for the nodes
    # it knew before it calls them lost and rebuilds their replicas (the product's default is 35 s).
    p = Planes(tmp_path, postgres_db, reconnect_grace_s=40.0)
    try:
        yield p
    finally:
        p.close()


def post(plane: Plane, path: str, token: str, timeout: float = 30) -> tuple[int, dict[str, Any]]:
    """One admin call to `plane` itself, as a client that follows nothing."""
    conn = http.client.HTTPConnection("127.0.0.1", plane.http_port, timeout=timeout)
    try:
        conn.request("POST", path, headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def unread(port: int) -> int:
    """The bytes the kernel holds for connections to `port` here that no process has read yet: a
    request waiting in a stopped process's backlog."""
    out = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, check=True
    ).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


def test_the_leader_killed_the_standby_leads_within_10_s_and_nothing_restarts(planes: Planes) -> None:
    a, b = planes.start_two_nodes()
    pki = gatewayd.issue_certificate(planes.cluster, "gw1")
    before = planes.two_ready(a)
    engines = {rid: r["pids"] for rid, r in before.items()}
    token = planes.ctl(a, "keys", "create", "alice")["token"]
    gw = gatewayd.start(planes.cluster, "gw1", pki, server=planes.agent_urls)
    gw.wait_serving()
    assert gw.ask(token)[0] == 200

    # The standby changes nothing and says where the leader is; `ctl` on its machine follows.
    admin_token = (b.state / "admin.token").read_text().strip()
    status, body = post(b, "/admin/v1/nodes/node-b/cordon", admin_token)
    assert status == 503 and body["error"]["code"] == "not_leader"
    assert body["error"]["leader"]["admin_url"] == a.admin_url and body["error"]["leader"]["agent_url"] == a.agent_url
    assert planes.ctl(b, "cordon", "node-b")["cordoned"] is True  # followed to the leader, which did it
    assert planes.nodes(a)["node-b"]["cordoned"] is True

    killed = time.monotonic()
    a.proc.popen.send_signal(signal.SIGKILL)
    a.proc.popen.wait(10)
    planes.wait_leads(b, timeout=TAKEOVER_S + 20)
    took = time.monotonic() - killed
    [taken] = b.events("leadership_taken")
    print(f"\ntakeover: the standby led {took:.2f} s after the leader was killed (epoch {taken['epoch']})")
    assert took < TAKEOVER_S, f"the standby took {took:.1f} s to lead"

    # The agents reconnect to the new leader, which adopts their engines: nothing restarts.
    wait_until(
        "both agents linked to the new leader",
        lambda: {n: v["state"] for n, v in planes.nodes(b).items()} == {"node-a": "joined", "node-b": "joined"},
        procs=planes.procs(),
        timeout=60,
    )
    print(f"both agents linked to the new leader {time.monotonic() - killed:.2f} s after the kill")
    after = planes.two_ready(b)
    assert {rid: r["pids"] for rid, r in after.items()} == engines  # the same engine processes
    assert {rid: r["nodes"] for rid, r in after.items()} == {rid: r["nodes"] for rid, r in before.items()}
    assert planes.nodes(b)["node-b"]["cordoned"] is True  # written before the kill, read by the new leader
    # The gateway follows too: linked to the new leader, serving with the key made before.
    wait_until("the gateway linked to the new leader", lambda: planes.gateways(b), procs=planes.procs())
    assert gw.ask(token)[0] == 200


def test_a_leader_paused_past_its_lease_has_its_writes_refused_and_stands_by(
    planes: Planes,
    postgres_server: PostgresServer,  # noqa: F811 - the fixture
    postgres_db: Database,  # noqa: F811 - the fixture
) -> None:
    a, b = planes.start_two_nodes()
    planes.two_ready(a)
    admin_token = (a.state / "admin.token").read_text().strip()

    a.proc.popen.send_signal(signal.SIGSTOP)
    try:
        planes.wait_leads(b, timeout=LEASE_TTL_S + 30)
        # The agents leave the silent leader (its heartbeats stopped) for the new one.
        wait_until(
            "both agents linked to the new leader",
            lambda: {n: v["state"] for n, v in planes.nodes(b).items()} == {"node-a": "joined", "node-b": "joined"},
            procs=planes.procs(),
            timeout=60,
        )
        # An operator's write reaches the old leader while it is stopped: it waits in its backlog.
        answer: list[tuple[int, dict[str, Any]]] = []

        def cordon() -> None:
            try:
                answer.append(post(a, "/admin/v1/nodes/node-a/cordon", admin_token))
            except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
                answer.append((0, {"closed": repr(exc)}))

        writer = threading.Thread(target=cordon)
        writer.start()
        wait_until(
            "the request in the stopped leader's socket, unread",
            lambda: unread(a.http_port) > 0,
            procs=planes.procs(),
            last_seen=lambda: answer,
        )
    finally:
        a.proc.popen.send_signal(signal.SIGCONT)
    writer.join(60)
    [(status, body)] = answer
    print(f"\nthe write sent to the paused leader: {status} {json.dumps(body)[:300]}")
    # Refused by the fence (the old term's write), or by the standby the old leader has become, or
    # its connection closed with the listener when the old leader stepped down before reading it.
    assert status in (0, 503), body
    if status == 503:
        assert "has passed to epoch" in body["error"]["message"] or body["error"]["code"] == "not_leader", body

    wait_until("the old leader to step down", lambda: a.events("leadership_lost"), procs=planes.procs())
    wait_until("the old leader to stand by", lambda: len(a.events("server_standby")) >= 2, procs=planes.procs())
    [lost] = a.events("leadership_lost")
    print(f"\nthe old leader stepped down: {lost['reason']}")
    # Nothing the old leader tried after resuming landed: node-a is not cordoned in the store.
    with postgres_server.connect(postgres_db) as conn:
        [(cordoned,)] = conn.execute("SELECT cordoned FROM nodes WHERE node_id = 'node-a'").fetchall()
        [(epoch, holder_admin)] = conn.execute("SELECT epoch, admin_url FROM leader_lease").fetchall()
    assert cordoned == 0 and holder_admin == b.admin_url
    assert epoch == b.events("leadership_taken")[-1]["epoch"] > a.events("leadership_taken")[-1]["epoch"]
    # It stands by and names the new leader.
    status, body = post(a, "/admin/v1/nodes/node-a/cordon", admin_token)
    assert status == 503 and body["error"]["leader"]["admin_url"] == b.admin_url
    assert planes.nodes(b)["node-a"]["cordoned"] is False

    # The new leader stopped (SIGTERM, an upgrade): it releases its lease, and the old one, a
    # standby now, leads at its next try rather than a lease later.
    assert b.proc.stop(signal.SIGTERM) == 0
    planes.wait_leads(a, terms=2, timeout=30)
    [released] = b.events("lease_released")
    taken = a.events("leadership_taken")[-1]
    took = at(taken) - at(released)
    print(f"the leader stopped with SIGTERM released its lease; the standby took it {took:.2f} s later")
    # Its next try (every LEASE_RENEW_S), not once the lease it had left would have run out: the
    # bound is that, by the database's clock, as the release said it, not a guess of this host's
    # speed (on a busy 2-core host a try and its thread can take a second).
    assert 0 < released["cut_short_s"] <= LEASE_TTL_S
    assert 0 <= took < released["cut_short_s"]


def test_while_postgresql_is_away_both_control_planes_stay_up_and_one_leads_again_after(
    tmp_path: Path,
    postgres_server: PostgresServer,  # noqa: F811 - the fixture
    postgres_db: Database,  # noqa: F811 - the fixture
) -> None:
    """No control plane can renew or take the lease while the store is away: the leader steps
    down, both stand by and answer 503 with Retry-After, the engines go on; back, one leads,
    reads the state afresh, and the agents return to it with their engines adopted."""
    # After a while with no leader the agents dial up to 30 s apart: the product's grace covers it.
    planes = Planes(tmp_path / "away", postgres_db, reconnect_grace_s=35.0)
    try:
        a, b = planes.start_two_nodes()
        engines = {rid: r["pids"] for rid, r in planes.two_ready(a).items()}
        admin_token = (a.state / "admin.token").read_text().strip()
        postgres_server.stop()
        try:
            wait_until("the leader to step down", lambda: a.events("leadership_lost"), alive=[a.proc, b.proc])
            for plane in (a, b):
                wait_until(f"{plane.name} standing by", lambda p=plane: len(p.events("server_standby")) >= 1 + (p is a))
                status, body = post(plane, "/admin/v1/nodes/node-a/cordon", admin_token)
                assert status == 503 and body["error"]["code"] == "not_leader" and body["error"]["leader"] is None
            time.sleep(LEASE_TTL_S)  # away a while longer: both stay up
            assert a.proc.returncode is None and b.proc.returncode is None
        finally:
            postgres_server.start()
        wait_until(
            "a control plane to lead again",
            lambda: len(a.events("leadership_taken")) + len(b.events("leadership_taken")) >= 2,
            alive=[a.proc, b.proc],
            procs=planes.procs(),
            timeout=30,
        )
        leader = a if len(a.events("leadership_taken")) == 2 else b
        wait_until(
            "both agents back with the leader",
            lambda: {n: v["state"] for n, v in planes.nodes(leader).items()}
            == {"node-a": "joined", "node-b": "joined"},
            procs=planes.procs(),
            timeout=60,
        )
        assert {rid: r["pids"] for rid, r in planes.two_ready(leader).items()} == engines  # nothing restarted
    finally:
        planes.close()
