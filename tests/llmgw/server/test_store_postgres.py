"""What is PostgreSQL's own in the store, against a real cluster (testlib.postgres): the
connection lost and found again, the password and where it may come from, migrations of two
control planes starting at once, and the scrub. (What both backends share is test_store.py's.)"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from llmgw.config import StoreSection
from llmgw.errors import MachineError
from llmgw.private import NotPrivate
from llmgw.server.errors import StoreBusy, StoreUnavailable
from llmgw.server.store import Store, open_backend, schema
from llmgw.server.store.postgres import SERVING_LOCK, WRITE_LOCK
from testlib.postgres import ROLE, Database, PostgresServer


def redacted(pg: PostgresServer, db: Database) -> str:
    return f"postgresql://127.0.0.1:{pg.port}/{db.name}"


def test_the_next_call_after_a_restart_succeeds(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = Store.open(tmp_path, postgres_db.settings)
    store.saw_node("a", "10.0.0.2", now=1)
    postgres_server.restart()  # every session ends: the store's connection is dead, and does not know it yet
    assert [n.node_id for n in store.nodes()] == ["a"]  # a read finds it dead, connects again, reads
    postgres_server.restart()
    store.set_cordoned("a", True)  # and so does a write, at its BEGIN
    assert [n.cordoned for n in store.nodes()] == [True]
    reconnects = [r for r in caplog.records if r.getMessage() == "store_reconnecting"]
    assert len(reconnects) == 2 and reconnects[0].llmgw_fields["store"] == redacted(postgres_server, postgres_db)


def test_while_postgres_is_down_each_call_fails_at_once_and_the_first_after_works(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    store = Store.open(tmp_path, postgres_db.settings)
    store.saw_node("a", "10.0.0.2", now=1)
    postgres_server.stop()
    try:
        for call in (store.nodes, lambda: store.set_cordoned("a", True), lambda: store.record_issued(5, "a", 2e9)):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert time.monotonic() - started < 5  # refused, not waited for
            message = str(info.value)
            assert message.startswith(f"the control plane's database {redacted(postgres_server, postgres_db)} cannot")
            assert "nothing changed" in message and "The next call connects again" in message
            assert info.value.retry_after_s > 0 and not info.value.outcome_unknown
            assert postgres_server.password not in message and ROLE not in message
    finally:
        postgres_server.start()
    store.set_cordoned("a", True)
    assert [n.cordoned for n in store.nodes()] == [True] and store.certificate(5) is None


def test_the_password_comes_from_the_file_and_is_never_said(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-it\n")
    wrong.chmod(0o600)
    with pytest.raises(StoreUnavailable) as info:
        Store.open(tmp_path, StoreSection(url=postgres_db.url, password_file=str(wrong)))
    assert "password authentication failed" in str(info.value) and "not-it" not in str(info.value)

    wrong.chmod(0o644)  # open to others: refused before it is read
    with pytest.raises(NotPrivate) as refused:
        Store.open(tmp_path, StoreSection(url=postgres_db.url, password_file=str(wrong)))
    assert "chmod 600" in str(refused.value)
    with pytest.raises(MachineError, match="does not exist; write the store's PostgreSQL password into it"):
        Store.open(tmp_path, StoreSection(url=postgres_db.url, password_file=str(tmp_path / "missing")))
    with pytest.raises(StoreUnavailable, match="no password supplied"):
        Store.open(tmp_path, StoreSection(url=postgres_db.url))  # no file, no ~/.pgpass here


def test_libpqs_own_password_file_is_read_when_there_is_no_password_file(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"127.0.0.1:{postgres_server.port}:*:{ROLE}:{postgres_server.password}\n")
    pgpass.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(pgpass))
    store = Store.open(tmp_path, StoreSection(url=postgres_db.url))
    store.saw_node("a", "x")
    assert [n.node_id for n in store.nodes()] == ["a"]


def test_two_control_planes_starting_at_once_migrate_once(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    """Both openers wait behind a write lock another session holds, so they start migrating at
    the same moment once it goes: the advisory lock has them take turns, and the second finds
    the migrations applied (without it, two CREATE TABLEs of one name race and one fails)."""
    opened: list[object] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:
            opened.append(open_backend(tmp_path, postgres_db.settings, busy_timeout_s=1.0, server=True))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            failed.append(exc)

    with postgres_server.connect(postgres_db) as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(%s, %s)", WRITE_LOCK)
        threads = [threading.Thread(target=start) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while _waiting_for_the_write_lock(postgres_server, postgres_db) < 2:
            assert time.monotonic() < deadline, "both openers wait for the write lock"
            time.sleep(0.02)
        holder.execute("ROLLBACK")
    for t in threads:
        t.join(timeout=30)
    assert failed == [] and len(opened) == 2
    with postgres_server.connect(postgres_db) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert versions == [v for v, _ in schema.MIGRATIONS]
    assert tables == {"schema_version", "leader_lease", *schema.TABLES}
    for db in opened:
        db.close()


def _waiting_for_the_write_lock(pg: PostgresServer, db: Database) -> int:
    with pg.connect(db) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = %s AND objid = %s",
            WRITE_LOCK,
        ).fetchone()[0]


def test_a_migration_waits_for_the_lock_longer_than_a_call_but_not_forever(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw.server.store import backend

    monkeypatch.setattr(backend, "MIGRATION_WAIT_S", 0.5)
    with postgres_server.connect(postgres_db) as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(%s, %s)", WRITE_LOCK)
        with pytest.raises(StoreBusy, match="a psql session in a transaction"):
            open_backend(tmp_path, postgres_db.settings, busy_timeout_s=0.1)
        holder.execute("ROLLBACK")


def test_a_running_control_plane_holds_the_serving_lock_while_connected(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    server = open_backend(tmp_path, postgres_db.settings, server=True)
    cli = open_backend(tmp_path, postgres_db.settings)
    assert cli.claim() is False  # what migrate-store asks
    postgres_server.restart()
    server.rows("SELECT 1")  # connected again: the lock is taken again with the connection
    cli.close()
    cli = open_backend(tmp_path, postgres_db.settings)
    assert cli.claim() is False
    server.close()
    # The server's session ends when PostgreSQL's backend has seen the connection close, a moment
    # after the client closed it: its lock goes with it.
    deadline = time.monotonic() + 10
    while not cli.claim():
        assert time.monotonic() < deadline, "the serving lock was not released with the session"
        time.sleep(0.02)
    with postgres_server.connect(postgres_db) as conn:
        held = conn.execute(
            "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s", SERVING_LOCK
        ).fetchall()
    assert held == [("ExclusiveLock",)]
    cli.close()


def test_a_scrub_rewrites_the_placements_table(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    store = Store.open(tmp_path, postgres_db.settings)
    store.set_placements({"r-1": {"secret": "S3CRET-OLD-KEY"}})

    def table_file() -> bytes:
        with postgres_server.connect(postgres_db) as conn:
            conn.execute("CHECKPOINT")
            path = conn.execute("SELECT pg_relation_filepath('placements')").fetchone()[0]
        return (postgres_server.data / path).read_bytes()

    assert b"S3CRET-OLD-KEY" in table_file()
    assert store.scrub_placements({"r-1": {"secret": "sealed-new"}}) is True
    assert b"S3CRET-OLD-KEY" not in table_file() and b"sealed-new" in table_file()
    assert store.placements() == {"r-1": {"secret": "sealed-new"}}
