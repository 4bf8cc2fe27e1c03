"""The control plane's store: what survives a restart (a new Store on the same state), in both
backends (`store_backend`: the state directory's SQLite file, and a real PostgreSQL database);
then what is SQLite's own (its file, its errors, its backups)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import attrs
import pytest

from llmgw.errors import MachineError, UsageError
from llmgw.server.store import (
    Store,
    StoreBusy,
    StoreCorrupt,
    StoreFailed,
    UnknownNode,
    store_error,
    store_path,
)
from llmgw.server.store.backup import backup
from testlib.stores import StoreUnderTest


def reopen(store: Store, backend: StoreUnderTest) -> Store:
    store.close()
    return backend.open()


def test_nodes_and_their_cordons_survive_a_restart(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.saw_node("b", "127.0.0.3", now=10)
    store.saw_node("a", "127.0.0.2", now=11)
    store.saw_node("a", "127.0.0.9", now=12)
    store.set_cordoned("a", True)
    store.set_draining("b", True)
    store = reopen(store, store_backend)
    a, b = store.nodes()
    assert (a.node_id, a.address, a.first_seen, a.last_seen, a.cordoned, a.draining) == (
        "a",
        "127.0.0.9",
        11,
        12,
        True,
        False,
    )
    assert (b.node_id, b.cordoned, b.draining) == ("b", False, True)


def test_cordoning_an_unknown_node_names_the_known_ones(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.saw_node("a", "x")
    with pytest.raises(UnknownNode) as info:
        store.set_cordoned("zz", True)
    assert "no node 'zz'" in str(info.value) and "known nodes: a" in str(info.value)


def test_removal_revokes_every_certificate_of_the_node_and_persists(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.saw_node("a", "x")
    store.record_issued(111, "a", not_after=2e9)
    store.record_issued(222, "a", not_after=2e9)
    store.record_issued(333, "b", not_after=2e9)
    assert sorted(store.remove_node("a")) == ["111", "222"]
    store = reopen(store, store_backend)
    assert store.nodes() == []
    assert store.is_revoked(111) and store.is_revoked(222)
    assert not store.is_revoked(333) and not store.is_revoked(444)
    assert sorted(store.revoked_serials()) == ["111", "222"]


def test_a_node_only_issued_a_certificate_can_be_removed(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.record_issued(5, "never-connected", not_after=2e9)
    assert store.remove_node("never-connected") == ["5"]
    with pytest.raises(UnknownNode):
        store.remove_node("never-connected")


def test_a_certificate_issued_revokes_the_node_ids_others_and_what_the_machine_held(
    store_backend: StoreUnderTest,
) -> None:
    store = store_backend.open()
    assert store.record_issued(111, "a", not_after=2e9) == []
    assert store.record_issued(333, "b", not_after=2e9) == []
    assert store.record_issued(222, "a", not_after=2e9, revoke_others=True, also_revoke=[2**150 + 7]) == [
        "111",
        str(2**150 + 7),  # never recorded here (another run of the CA's records, say): revoked all the same
    ]
    assert store.record_issued(222, "a", not_after=2e9, revoke_others=True, also_revoke=[222]) == []  # again: no-op
    store = reopen(store, store_backend)
    assert store.is_revoked(111) and store.is_revoked(2**150 + 7)
    assert not store.is_revoked(222) and not store.is_revoked(333)  # the new one, and another node id's
    row = store.certificate(222)
    assert row is not None and (row.node_id, row.not_after, row.revoked_at) == ("a", 2e9, None)
    assert store.certificate(111).revoked_at is not None and store.certificate(444) is None


def test_revoking_a_serial_never_recorded(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.revoke_serial(2**150 + 7, "a")  # x509 serials exceed SQLite's integers: stored as text
    assert reopen(store, store_backend).is_revoked(2**150 + 7)


def test_removal_also_revokes_the_certificate_the_node_connected_with(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.record_issued(111, "a", not_after=2e9)
    # Known to the registry only, connected with a certificate another CA run issued: still removable.
    assert sorted(store.remove_node("a", also_revoke=999)) == ["111", "999"]
    assert store.is_revoked(999) and store.is_revoked(111)
    assert store.remove_node("never-seen", also_revoke=5) == ["5"]


def test_recording_a_certificate_is_one_transaction(store_backend: StoreUnderTest) -> None:
    store = store_backend.open(busy_timeout_s=0.05)
    store.record_issued(111, "a", not_after=2e9)
    with store_backend.write_lock(), pytest.raises(StoreBusy, match="nothing changed; try again"):
        store.record_issued(222, "a", not_after=2e9, revoke_others=True)
    assert store.certificate(222) is None and not store.is_revoked(111)


def test_a_cli_call_under_the_lock_says_so_instead_of_a_traceback(store_backend: StoreUnderTest) -> None:
    store = store_backend.open(busy_timeout_s=0.05)
    with store_backend.write_lock(), pytest.raises(StoreBusy) as info:
        store.record_issued(1, "a", not_after=2e9)
    message = str(info.value)
    assert f"{store_backend.where} is locked by another process ({store_backend.holders}" in message
    assert isinstance(info.value, MachineError)  # the CLI says it and exits 1
    store.record_issued(1, "a", not_after=2e9)
    assert not store.is_revoked(1)


def test_reads_do_not_wait_for_a_writer(store_backend: StoreUnderTest) -> None:
    store = store_backend.open(busy_timeout_s=0.05)
    store.saw_node("a", "x", now=5)
    with store_backend.write_lock():
        assert [n.node_id for n in store.nodes()] == ["a"] and store.placements() == {} and store.api_keys() == []


def test_an_api_key_name_or_token_taken_is_refused_without_an_error(store_backend: StoreUnderTest) -> None:
    from llmgw.server.store import KeyRow

    store = store_backend.open()
    row = KeyRow(
        name="k",
        token_sha256="aa",
        models=("m",),
        rate_per_minute=1,
        max_concurrency=2,
        created_at=5.0,
        revoked_at=None,
    )
    assert store.add_api_key(row)
    assert not store.add_api_key(row)  # the name
    assert not store.add_api_key(attrs.evolve(row, name="other"))  # the token
    assert store.revoke_api_key("k", now=9.0) and not store.revoke_api_key("nobody")
    assert store.revoke_api_key("k", now=10.0)  # a second revocation keeps the first time
    [key] = reopen(store, store_backend).api_keys()
    assert (key.name, key.models, key.revoked_at) == ("k", ("m",), 9.0)


def test_the_catalog_keeps_each_models_first_time(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.record_catalog({"a": 1.5, "b": 2.0})
    store.record_catalog({"a": 9.0, "c": 3.0})
    assert reopen(store, store_backend).catalog_models() == {"a": 1.5, "b": 2.0, "c": 3.0}


def test_placements_are_replaced_whole_and_a_scrub_keeps_the_new_ones(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.set_placements({"r-1": {"secret": "old"}, "r-2": {"x": [1, 2]}})
    assert store.scrub_placements({"r-3": {"secret": "new"}}) is True
    assert reopen(store, store_backend).placements() == {"r-3": {"secret": "new"}}


def test_a_store_is_at_the_latest_schema_and_names_its_backend(store_backend: StoreUnderTest) -> None:
    from llmgw.server.store import schema
    from llmgw.server.store.backend import current_version

    store = store_backend.open()
    store.check()
    assert store.backend == store_backend.kind and str(store.path) == store_backend.where
    assert current_version(store._db) == schema.LATEST
    columns = {table: store._db.rows(f"SELECT * FROM {table} WHERE 1 = 0") for table in schema.TABLES}
    assert set(columns) == {
        "nodes",
        "certificates",
        "placements",
        "api_keys",
        "catalog_models",
        "hub_models",
        "model_versions",
        "audit_log",
        "teams",
        "budgets",
        "usage_hours",
        "usage_reports",
    }


def test_a_store_of_a_newer_llmgw_is_refused_unchanged(store_backend: StoreUnderTest) -> None:
    from llmgw.server.errors import StoreSchemaNewer
    from llmgw.server.store import schema

    store = store_backend.open()
    store.saw_node("a", "x", now=1)
    with store._db.write() as tx:
        tx.execute(schema.RECORD_VERSION, (schema.LATEST + 1, 0.0))
    store.close()
    with pytest.raises(StoreSchemaNewer) as info:
        store_backend.open()
    assert f"schema version {schema.LATEST + 1}, made by a newer llmgw" in str(info.value)
    assert store_backend.where in str(info.value)


# -- SQLite's own: its file, its errors, its backups ------------------------------------------


def test_a_store_that_cannot_be_opened_says_where(tmp_path: Path) -> None:
    (tmp_path / "llmgw.db").mkdir()
    with pytest.raises(MachineError) as info:
        Store.open(tmp_path)
    assert "llmgw.db" in str(info.value)


def test_sqlite_errors_are_translated_by_blame_with_or_without_a_code(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.db"
    for exc, kind in (
        (sqlite3.OperationalError("database is locked"), StoreBusy),  # Python 3.10: no code, SQLite's text
        (sqlite3.DatabaseError("database disk image is malformed"), StoreCorrupt),
        (sqlite3.DatabaseError("file is not a database"), StoreCorrupt),
        (sqlite3.OperationalError("database or disk is full"), StoreFailed),
    ):
        translated = store_error(path, exc, 1.0)
        assert type(translated) is kind and str(path) in str(translated), (exc, translated)
    coded = sqlite3.OperationalError("whatever the text")
    coded.sqlite_errorcode = 5 | (3 << 8)  # SQLITE_BUSY_TIMEOUT: an extended code of SQLITE_BUSY
    assert isinstance(store_error(path, coded, 1.0), StoreBusy)
    assert isinstance(store_error(path, coded, 1.0), MachineError)  # the CLI says it and exits 1


def test_a_backup_is_whole_private_checked_and_never_overwrites_unasked(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store.open(state)
    store.saw_node("a", "10.0.0.2")
    store.set_cordoned("a", True)
    store.revoke_serial(7, "gone")
    dest = tmp_path / "out" / "b.db"
    dest.parent.mkdir()
    info = backup(state, dest)  # the store is open meanwhile, as a running server's is
    assert (info.nodes, info.api_keys, info.placements, info.revoked_certificates) == (1, 0, 0, 1)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600 and info.size_bytes == dest.stat().st_size
    assert sorted(p.name for p in dest.parent.iterdir()) == ["b.db"]  # one file: no -wal, no temporary
    copy = Store(dest)
    assert [(n.node_id, n.cordoned) for n in copy.nodes()] == [("a", True)] and copy.is_revoked(7)
    copy.close()
    with pytest.raises(UsageError, match="exists; choose another name, or pass --force"):
        backup(state, dest)
    store.saw_node("b", "10.0.0.3")
    assert backup(state, dest, force=True).nodes == 2
    with pytest.raises(MachineError, match="no control-plane database at"):
        backup(tmp_path / "elsewhere", tmp_path / "x.db")
    assert not (tmp_path / "elsewhere" / "llmgw.db").exists()  # not created empty by looking


def test_a_backup_of_a_damaged_database_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store.open(state)
    for i in range(300):
        store.saw_node(f"node-{i:03d}", "10.0.0.1")
    store.close()
    path = store_path(state)
    with open(path, "r+b") as f:
        f.seek(4096 * 3)
        f.write(b"\x5a" * 4096 * 2)
    with pytest.raises(StoreCorrupt, match="is damaged"):
        backup(state, tmp_path / "b.db")
    assert list(tmp_path.iterdir()) == [state]


def test_a_database_from_before_schema_versions_is_taken_at_version_1_with_its_rows(tmp_path: Path) -> None:
    """A state directory of an earlier llmgw: its tables made by the schema of the time (as it
    was, without schema_version), with rows. Migration 1 finds them made and records version 1;
    the later ones are applied after it."""
    from llmgw.server.store import schema
    from llmgw.server.store.backend import current_version

    with sqlite3.connect(str(store_path(tmp_path))) as old:
        old.executescript(OLD_SCHEMA)
        old.execute("INSERT INTO nodes (node_id, first_seen, last_seen, address, cordoned) VALUES ('a', 1, 2, 'x', 1)")
        old.execute(
            "INSERT INTO certificates (serial, node_id, not_after, issued_at, revoked_at) VALUES ('7', 'a', 0, 1, 3)"
        )
    store_path(tmp_path).chmod(0o600)
    store = Store.open(tmp_path)
    assert current_version(store._db) == schema.LATEST == 6
    assert [(n.node_id, n.cordoned) for n in store.nodes()] == [("a", True)] and store.is_revoked(7)
    store.check()


# The schema of llmgw.db before versions were recorded, as store.py had it.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    address TEXT NOT NULL DEFAULT '', cordoned INTEGER NOT NULL DEFAULT 0, draining INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS certificates (serial TEXT PRIMARY KEY, node_id TEXT NOT NULL, not_after REAL NOT NULL,
    issued_at REAL NOT NULL, revoked_at REAL);
CREATE INDEX IF NOT EXISTS certificates_node ON certificates (node_id);
CREATE TABLE IF NOT EXISTS placements (replica_id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (name TEXT PRIMARY KEY, token_sha256 TEXT NOT NULL UNIQUE, models TEXT NOT NULL,
    rate_per_minute INTEGER NOT NULL, max_concurrency INTEGER NOT NULL, created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS catalog_models (name TEXT PRIMARY KEY, created REAL NOT NULL);
"""


def test_a_sqlite_store_never_imports_psycopg(tmp_path: Path) -> None:
    """SQLite users pay nothing for PostgreSQL: the control plane's start opens its store without
    loading the driver (a fresh interpreter: this one may have loaded it for other tests)."""
    import subprocess
    import sys

    from testlib.proc import llmgw_env

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from llmgw.server.store.asyncstore import AsyncStore\n"
        f"AsyncStore.open(Path({str(tmp_path)!r})).close()\n"
        "assert 'psycopg' not in sys.modules, sorted(m for m in sys.modules if m.startswith('psycopg'))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=llmgw_env(), timeout=60)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    assert store_path(tmp_path).exists()  # it did open the store
