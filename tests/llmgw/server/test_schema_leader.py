"""Who migrates a store's schema, in a real PostgreSQL (testlib.postgres) and in SQLite: a shared
PostgreSQL store that has the lease is migrated by its leader only, under its term's fence;
anyone else (a command, a standby, a leader whose lease has passed on) is refused and changes
nothing; a store without the lease yet, `migrate-store` holding the serving lock, and a SQLite
file are migrated by whoever opens them; a control plane never takes the lease of a store that
a newer llmgw has migrated. "This llmgw's next version" is this one with a migration 3 added
(`newer_llmgw`); the processes of two versions side by side are
tests/integration/test_schema_upgrade.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from llmgw.server.errors import NotLeader, StoreSchemaBehind, StoreSchemaNewer
from llmgw.server.store import Store, lease, migrate, open_backend, schema
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.lease import Fence, Holder
from testlib import newer_llmgw
from testlib.postgres import Database, PostgresServer, expire_lease

A = Holder(id="a", agent_url="wss://cp-a:7443", admin_url="http://cp-a:8080")
B = Holder(id="b", agent_url="wss://cp-b:7443", admin_url="http://cp-b:8080")
NOW = schema.LATEST  # this llmgw's schema
NEXT = NOW + 1  # the newer llmgw's


@pytest.fixture
def newer() -> Iterator[None]:
    """This process becomes the newer llmgw for the test (its migration appended)."""
    with newer_llmgw.installed():
        yield


def version(pg: PostgresServer, db: Database) -> int:
    with pg.connect(db) as conn:
        return int(conn.execute(schema.CURRENT_VERSION).fetchall()[0][0])


def has_table(pg: PostgresServer, db: Database, name: str) -> bool:
    with pg.connect(db) as conn:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchall()[0][0]


def test_a_led_store_behind_is_migrated_by_no_command_and_no_standby(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    open_backend(tmp_path, postgres_db.settings).close()  # this llmgw's schema, the lease with it
    with newer_llmgw.installed():
        with pytest.raises(StoreSchemaBehind) as info:  # a command of the newer llmgw (`llmgw ca`, ...)
            Store.open(tmp_path, postgres_db.settings)
        message = str(info.value)
        assert f"has schema version {NOW}, and this llmgw needs {NEXT}" in message
        assert "migrated by its leader only, and nothing changed" in message
        assert "Start `llmgw server` of this llmgw on it" in message
        with pytest.raises(StoreSchemaBehind):  # a standby's store
            Store.open(tmp_path, postgres_db.settings, fence=lease.STANDBY)
        standby = AsyncStore.open_standby(tmp_path, postgres_db.settings)  # what a standby does: read as it is
        try:
            assert trio.run(standby.is_revoked, 7) is False
        finally:
            standby.close()
    assert version(postgres_server, postgres_db) == NOW
    assert not has_table(postgres_server, postgres_db, newer_llmgw.TABLE)


def test_the_leader_migrates_under_its_terms_fence_and_a_passed_term_changes_nothing(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    lease_db = open_backend(tmp_path, postgres_db.settings)
    try:
        assert lease.acquire(lease_db, A, ttl_s=30.0).epoch == 1
        expire_lease(postgres_server, postgres_db)
        assert lease.acquire(lease_db, B, ttl_s=30.0, knows=NEXT).epoch == 2
        with newer_llmgw.installed():
            with pytest.raises(NotLeader, match=r"lease \(epoch 1\) has passed to epoch 2"):
                Store.open(tmp_path, postgres_db.settings, fence=Fence(epoch=1))  # a deposed leader
            assert version(postgres_server, postgres_db) == NOW
            assert not has_table(postgres_server, postgres_db, newer_llmgw.TABLE)

            store = Store.open(tmp_path, postgres_db.settings, fence=Fence(epoch=2))  # the leader's term
            try:
                store.check()  # at this llmgw's schema now
                store.saw_node("node-a", "10.0.0.2")  # and its writes land
            finally:
                store.close()
    finally:
        lease_db.close()
    assert version(postgres_server, postgres_db) == NEXT
    assert has_table(postgres_server, postgres_db, newer_llmgw.TABLE)
    [migrated] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "store_migrated"]
    assert (migrated["from_version"], migrated["to_version"], migrated["epoch"]) == (NOW, NEXT, 2)
    assert migrated["store"].endswith(postgres_db.name)  # the database, named by its redacted url
    # This llmgw, older now, opens it no more, and takes no lease of it, lapsed or not.
    with pytest.raises(StoreSchemaNewer, match=f"has schema version {NEXT}, made by a newer llmgw"):
        Store.open(tmp_path, postgres_db.settings)
    expire_lease(postgres_server, postgres_db)
    lease_db = open_backend(tmp_path, postgres_db.settings, migrations=False)
    try:
        assert lease.acquire(lease_db, A, ttl_s=30.0) is None
        assert lease.schema_version(lease_db) == NEXT and not lease.read(lease_db).held
        assert lease.acquire(lease_db, A, ttl_s=30.0, knows=NEXT).epoch == 3  # one that knows it does
    finally:
        lease_db.close()


def test_a_store_without_the_lease_yet_is_migrated_by_whoever_opens_it(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path, newer: None
) -> None:
    # A new database: no lease, so no leader to wait for (the first control plane, or `server add`'s check).
    open_backend(tmp_path, postgres_db.settings).close()
    assert version(postgres_server, postgres_db) == NEXT
    assert has_table(postgres_server, postgres_db, newer_llmgw.TABLE)


def test_migrate_store_migrates_what_it_holds_alone(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    open_backend(tmp_path, postgres_db.settings).close()
    with newer_llmgw.installed():
        db = open_backend(tmp_path, postgres_db.settings, migrations=False)
        try:
            assert db.claim()  # the serving lock, exclusively: no control plane runs on it
            assert migrate(db, alone=True) == NEXT
        finally:
            db.close()
    assert version(postgres_server, postgres_db) == NEXT


def test_a_sqlite_file_is_migrated_by_whoever_opens_it(tmp_path: Path) -> None:
    Store(tmp_path / "llmgw.db").close()
    with newer_llmgw.installed():
        store = Store(tmp_path / "llmgw.db")  # its one control plane, or a command while none runs
        try:
            store.check()
            assert store._rows(f"SELECT count(*) FROM {newer_llmgw.TABLE}") == [(0,)]
        finally:
            store.close()
