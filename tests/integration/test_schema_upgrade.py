"""An upgrade of control planes that share one real PostgreSQL store (testlib.postgres,
testlib.planes), as docs/high-availability.md's "Upgrading" says to do it: the newer llmgw
(`testlib.newer_llmgw`: this one with a schema migration added) is started beside a leader of
this llmgw and stands by without migrating; the leader stopped, it takes the lease and migrates
the store under its term, and the agent's engine goes on untouched; a standby of the older
llmgw never takes the lease of the migrated store (it says why, and names no leader), and one
started again refuses to, naming the fix.
"""

from __future__ import annotations

import http.client
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.server.store import schema
from testlib import newer_llmgw
from testlib.cluster import wait_until
from testlib.planes import Plane, Planes
from testlib.postgres import Database, PostgresServer, postgres_db, postgres_server  # noqa: F401 - fixtures

ONE_REPLICA = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""


@pytest.fixture
def planes(tmp_path: Path, postgres_db: Database) -> Iterator[Planes]:  # noqa: F811 - the fixture
    p = Planes(tmp_path, postgres_db, count=3)
    try:
        yield p
    finally:
        p.close()


def store_version(pg: PostgresServer, db: Database) -> tuple[int, bool]:
    """The store's schema version, and whether the newer llmgw's table is there."""
    with pg.connect(db) as conn:
        [(version, table)] = conn.execute(
            f"SELECT ({schema.CURRENT_VERSION}), to_regclass(%s) IS NOT NULL", (newer_llmgw.TABLE,)
        ).fetchall()
    return int(version), bool(table)


def lease_tries(plane: Plane) -> int:
    """A standby's tries at taking the lease so far (`llmgw_lease_tries_total` in its /metrics)."""
    conn = http.client.HTTPConnection("127.0.0.1", plane.http_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    [count] = [line.split()[1] for line in text.splitlines() if line.startswith("llmgw_lease_tries_total ")]
    return int(count)


def test_the_newer_llmgw_waits_for_the_lease_then_migrates_and_the_older_never_leads_again(
    planes: Planes,
    postgres_server: PostgresServer,  # noqa: F811 - the fixture
    postgres_db: Database,  # noqa: F811 - the fixture
) -> None:
    old, new, old_standby = planes[0], planes[1], planes[2]
    planes.init(ONE_REPLICA)
    planes.add_node("node-a")
    planes.start(old, leads=True)
    planes.start(new, leads=False, prefix=newer_llmgw.PREFIX)
    planes.start(old_standby, leads=False)
    planes.cluster.start_agent("node-a")
    [replica] = planes.cluster.wait_replicas("one ready replica", lambda rs: len(rs) == 1 and rs[0]["state"] == "ready")
    engine = replica["pids"]
    token = planes.ctl(old, "keys", "create", "alice")["token"]

    # The newer llmgw stands by beside the older leader and leaves the store as it is.
    [behind] = new.events("store_schema_behind")
    assert (behind["found"], behind["latest"]) == (schema.LATEST, schema.LATEST + 1)
    tried = lease_tries(new)
    wait_until("three more of its tries at the lease", lambda: lease_tries(new) >= tried + 3, procs=planes.procs())
    assert store_version(postgres_server, postgres_db) == (schema.LATEST, False)
    assert not new.events("leadership_taken") and not new.events("store_migrated")
    assert planes.ctl(old, "cordon", "node-a")["cordoned"] is True  # the older leader writes on

    # The leader stopped: the lease is released, and the newer llmgw takes it and migrates. The
    # older standby is paused meanwhile: the store is not migrated yet, so it could take the
    # lease as well as the newer one (an upgrade does the standbys first: docs/high-availability.md);
    # resumed after the migration, it is the older standby left over.
    old_standby.proc.popen.send_signal(signal.SIGSTOP)
    try:
        assert old.proc.stop(signal.SIGTERM) == 0
        planes.wait_leads(new, timeout=30)
    finally:
        old_standby.proc.popen.send_signal(signal.SIGCONT)
    assert store_version(postgres_server, postgres_db) == (schema.LATEST + 1, True)
    [migrated] = new.events("store_migrated")
    [taken] = new.events("leadership_taken")
    assert (migrated["from_version"], migrated["to_version"], migrated["epoch"]) == (
        schema.LATEST,
        schema.LATEST + 1,
        taken["epoch"],
    )
    assert not old_standby.events("leadership_taken")  # the older standby did not race it
    nodes = {n: v for n, v in planes.nodes(new).items()}
    assert nodes["node-a"]["cordoned"] is True  # what the older leader wrote is there
    assert [k["name"] for k in planes.ctl(new, "keys", "list")] == ["alice"] and token
    wait_until(
        "the replica ready under the new leader, the same engine",
        lambda: [r["pids"] for r in planes.replicas_by_id(new).values() if r["state"] == "ready"] == [engine],
        procs=planes.procs(),
        timeout=60,
    )

    # The newer leader stopped too: the older standby never takes the lease of the migrated store.
    assert new.proc.stop(signal.SIGTERM) == 0
    wait_until("the older standby to refuse the lease", lambda: old_standby.events("lease_refused"), timeout=30)
    tried = lease_tries(old_standby)
    wait_until(
        "three more of the older standby's tries at the free lease",
        lambda: lease_tries(old_standby) >= tried + 3,
        procs=planes.procs(),
    )
    assert not old_standby.events("leadership_taken") and old_standby.proc.returncode is None
    [refused] = old_standby.events("lease_refused")  # said once
    assert f"schema is at version {schema.LATEST + 1}, newer than this llmgw's {schema.LATEST}" in refused["reason"]
    assert "upgrade llmgw on this machine" in refused["fix"]
    status, _, body = planes.admin(old_standby, "POST", "/admin/v1/nodes/node-a/uncordon")
    assert status == 503 and body["error"]["code"] == "not_leader" and body["error"]["leader"] is None
    assert f"the store's schema (version {schema.LATEST + 1}) is newer" in body["error"]["message"]

    # The older llmgw started again refuses to run on it, and says what to do.
    proc = planes.start(old, leads=None)
    assert proc.popen.wait(60) != 0
    said = proc.log_path.read_text()
    assert f"has schema version {schema.LATEST + 1}, made by a newer llmgw" in said and "Run the newer llmgw" in said
