"""The leader's lease and the fence of its writes in a real PostgreSQL (testlib.postgres): taking,
renewing and releasing judged by the database's clock, every write of a term refused once the
lease has passed to the next, a write that checked the fence finishing before a takeover can,
and a session stopped inside a write ended by PostgreSQL so that it holds no lock. The keeper's
timing is test_leadership.py's, on a fake clock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from llmgw.config import StoreSection
from llmgw.server.errors import NotLeader, StoreUnavailable
from llmgw.server.store import Store, lease, open_backend
from llmgw.server.store.lease import STANDBY, Fence, Holder
from testlib.postgres import Database, PostgresServer, expire_lease

A = Holder(id="a", agent_url="wss://cp-a:7443", admin_url="http://cp-a:8080")
B = Holder(id="b", agent_url="wss://cp-b:7443", admin_url="http://cp-b:8080")


def test_the_lease_is_taken_once_and_judged_by_the_databases_clock(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    db = open_backend(tmp_path, postgres_db.settings)
    try:
        assert lease.read(db).holder == "" and not lease.read(db).held  # made by the migration, never taken
        taken = lease.acquire(db, A, ttl_s=30.0)
        assert taken is not None and taken.epoch == 1 and taken.holder == "a" and taken.held
        assert 29.0 < taken.remaining_s <= 30.0
        assert lease.acquire(db, B, ttl_s=30.0) is None  # held: nobody else takes it
        row = lease.read(db)
        assert (row.holder, row.agent_url, row.admin_url, row.epoch) == ("a", "wss://cp-a:7443", "http://cp-a:8080", 1)
        with postgres_server.connect(postgres_db) as conn:  # the expiry is the database's clock's
            [(expires, now)] = conn.execute(
                "SELECT expires_at, EXTRACT(EPOCH FROM clock_timestamp()) FROM leader_lease"
            ).fetchall()
        assert 29.0 < expires - float(now) <= 30.0
    finally:
        db.close()


def test_a_renewal_extends_only_the_current_unexpired_term(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    db = open_backend(tmp_path, postgres_db.settings)
    try:
        lease.acquire(db, A, ttl_s=2.0)
        assert lease.renew(db, A, 1, ttl_s=30.0) and lease.read(db).remaining_s > 29.0
        assert not lease.renew(db, A, 2, ttl_s=30.0)  # another term's epoch
        assert not lease.renew(db, B, 1, ttl_s=30.0)  # another holder
        expire_lease(postgres_server, postgres_db)
        assert not lease.renew(db, A, 1, ttl_s=30.0)  # lapsed is lapsed, even with nobody taking it
        again = lease.acquire(db, A, ttl_s=30.0)
        assert again is not None and again.epoch == 2  # taken again only as a new term
    finally:
        db.close()


def test_after_expiry_the_next_taking_bumps_the_epoch_and_the_old_term_cannot_renew(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    db = open_backend(tmp_path, postgres_db.settings)
    try:
        lease.acquire(db, A, ttl_s=30.0)
        expire_lease(postgres_server, postgres_db)
        taken = lease.acquire(db, B, ttl_s=30.0)
        assert taken is not None and (taken.holder, taken.epoch, taken.agent_url) == ("b", 2, "wss://cp-b:7443")
        assert not lease.renew(db, A, 1, ttl_s=30.0)
        assert lease.release(db, A, 1) is None  # nor end its successor's lease
        assert lease.read(db).held
        left = lease.release(db, B, 2)  # its own, at once: what it had left said
        assert left is not None and 29.0 < left <= 30.0 and not lease.read(db).held
        assert lease.acquire(db, A, ttl_s=30.0).epoch == 3
    finally:
        db.close()


def test_every_write_of_a_term_is_refused_once_the_lease_passed_and_nothing_lands(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    db = open_backend(tmp_path, postgres_db.settings)
    old = new = None
    try:
        lease.acquire(db, A, ttl_s=30.0)
        old = Store.open(tmp_path, postgres_db.settings, fence=Fence(epoch=1))
        old.saw_node("node-a", "10.0.0.2", now=1)  # its term's writes land
        expire_lease(postgres_server, postgres_db)
        lease.acquire(db, B, ttl_s=30.0)
        new = Store.open(tmp_path, postgres_db.settings, fence=Fence(epoch=2))
        new.set_placements({"chat-0": {"nodes": ["node-a"]}})
        writes = [
            lambda: old.set_cordoned("node-a", True),
            lambda: old.set_placements({}),
            lambda: old.saw_node("node-b", "10.0.0.3"),
            lambda: old.record_issued(7, "node-b", 2e9),
            lambda: old.record_catalog({"chat": 5.0}),
        ]
        for write in writes:
            with pytest.raises(NotLeader) as info:
                write()
            assert info.value.epoch == 1 and info.value.found == 2 and info.value.retry_after_s > 0
            assert "lease (epoch 1) has passed to epoch 2" in str(info.value)
            assert "the leader's admin API is at http://cp-b:8080" in str(info.value)
        # Nothing the old term tried landed; the new term's state is whole.
        assert [(n.node_id, n.cordoned) for n in new.nodes()] == [("node-a", False)]
        assert new.placements() == {"chat-0": {"nodes": ["node-a"]}}
        assert new.certificate(7) is None and new.catalog_models() == {}
    finally:
        for s in (old, new):
            if s is not None:
                s.close()
        db.close()


def test_a_standbys_store_refuses_every_write(postgres_db: Database, tmp_path: Path) -> None:
    store = Store.open(tmp_path, postgres_db.settings, fence=STANDBY)
    try:
        with pytest.raises(NotLeader, match="this control plane is a standby, and only the leader writes"):
            store.saw_node("node-a", "10.0.0.2")
        assert store.nodes() == []  # reading is a standby's to do
    finally:
        store.close()


def test_a_write_that_checked_the_fence_commits_before_a_takeover_can_happen(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    """The row lock of the fence: a taking waits for a write of the old term that has checked,
    so that write lands before the new term begins, and the new term reads it."""
    db = open_backend(tmp_path, postgres_db.settings)
    other = open_backend(tmp_path, postgres_db.settings, busy_timeout_s=20.0)
    store = Store.open(tmp_path, postgres_db.settings, fence=Fence(epoch=1))
    try:
        lease.acquire(db, A, ttl_s=30.0)
        expire_lease(postgres_server, postgres_db)
        taken: list[object] = []
        with store._write() as tx:  # the fence checked: the row is held FOR SHARE
            tx.execute("INSERT INTO nodes (node_id, first_seen, last_seen) VALUES ('node-a', 1, 1)")
            taker = threading.Thread(target=lambda: taken.append(lease.acquire(other, B, ttl_s=30.0)))
            taker.start()
            wait_for_lock_waiters(postgres_server, postgres_db, 1)
            assert taken == []  # the taking waits for this write
        taker.join(20)
        assert [t.epoch for t in taken] == [2]  # then takes the lease
        assert [n.node_id for n in Store.open(tmp_path, postgres_db.settings).nodes()] == ["node-a"]
        with pytest.raises(NotLeader):  # and the old term's next write is refused
            store.saw_node("node-b", "x")
    finally:
        store.close()
        other.close()
        db.close()


def test_a_session_stopped_inside_a_write_is_ended_so_it_holds_no_lock(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    """A control plane paused in the middle of a write (SIGSTOP, here a transaction left open)
    would hold the fence's row lock and the write lock: PostgreSQL ends its session after half a
    lease, its write rolled back, and the next control plane takes the lease and writes."""
    settings = StoreSection(url=postgres_db.url, password_file=str(postgres_db.password_file), lease_ttl_s=1.0)
    db = open_backend(tmp_path, settings)
    paused = Store.open(tmp_path, settings, fence=Fence(epoch=1), server=True)  # idle timeout: 0.5 s
    try:
        lease.acquire(db, A, ttl_s=30.0)
        expire_lease(postgres_server, postgres_db)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            with paused._write() as tx:
                tx.execute("INSERT INTO nodes (node_id, first_seen, last_seen) VALUES ('node-a', 1, 1)")
                wait_until_gone(postgres_server, postgres_db, "llmgw-server")
                # The process resumes: its COMMIT finds the session gone, the write rolled back.
        assert time.monotonic() - started < 10
        taken = lease.acquire(db, B, ttl_s=30.0)
        assert taken is not None and taken.epoch == 2
        new = Store.open(tmp_path, settings, fence=Fence(epoch=2))
        new.saw_node("node-b", "x")
        assert [n.node_id for n in new.nodes()] == ["node-b"]  # the paused write never landed
        new.close()
    finally:
        paused.close()
        db.close()


def wait_for_lock_waiters(pg: PostgresServer, db: Database, count: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        with pg.connect(db) as conn:
            waiting = conn.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'", (db.name,)
            ).fetchone()[0]
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"{count} sessions waiting for a lock"
        time.sleep(0.02)


def wait_until_gone(pg: PostgresServer, db: Database, application: str) -> None:
    """Until PostgreSQL has ended the session of `application` (an idle transaction's timeout)."""
    deadline = time.monotonic() + 20
    while True:
        with pg.connect(db) as conn:
            left = conn.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (db.name, application),
            ).fetchone()[0]
        if not left:
            return
        assert time.monotonic() < deadline, f"the session of {application} was not ended"
        time.sleep(0.05)
