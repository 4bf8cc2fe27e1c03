"""The control plane's SQLite store: what survives a restart (a new Store on the same file)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from llmgw.errors import MachineError, UsageError
from llmgw.server.backup import backup
from llmgw.server.store import (
    Store,
    StoreBusy,
    StoreCorrupt,
    StoreFailed,
    UnknownNode,
    store_error,
    store_path,
)


def reopen(store: Store) -> Store:
    store.close()
    return Store(store.path)


def test_nodes_and_their_cordons_survive_a_restart(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("b", "127.0.0.3", now=10)
    store.saw_node("a", "127.0.0.2", now=11)
    store.saw_node("a", "127.0.0.9", now=12)
    store.set_cordoned("a", True)
    store.set_draining("b", True)
    store = reopen(store)
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


def test_cordoning_an_unknown_node_names_the_known_ones(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("a", "x")
    with pytest.raises(UnknownNode) as info:
        store.set_cordoned("zz", True)
    assert "no node 'zz'" in str(info.value) and "known nodes: a" in str(info.value)


def test_removal_revokes_every_certificate_of_the_node_and_persists(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("a", "x")
    store.record_issued(111, "a", not_after=2e9)
    store.record_issued(222, "a", not_after=2e9)
    store.record_issued(333, "b", not_after=2e9)
    assert sorted(store.remove_node("a")) == ["111", "222"]
    store = reopen(store)
    assert store.nodes() == []
    assert store.is_revoked(111) and store.is_revoked(222)
    assert not store.is_revoked(333) and not store.is_revoked(444)
    assert sorted(store.revoked_serials()) == ["111", "222"]


def test_a_node_only_issued_a_certificate_can_be_removed(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.record_issued(5, "never-connected", not_after=2e9)
    assert store.remove_node("never-connected") == ["5"]
    with pytest.raises(UnknownNode):
        store.remove_node("never-connected")


def test_a_certificate_issued_revokes_the_node_ids_others_and_what_the_machine_held(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    assert store.record_issued(111, "a", not_after=2e9) == []
    assert store.record_issued(333, "b", not_after=2e9) == []
    assert store.record_issued(222, "a", not_after=2e9, revoke_others=True, also_revoke=[2**150 + 7]) == [
        "111",
        str(2**150 + 7),  # never recorded here (another run of the CA's records, say): revoked all the same
    ]
    assert store.record_issued(222, "a", not_after=2e9, revoke_others=True, also_revoke=[222]) == []  # again: no-op
    store = reopen(store)
    assert store.is_revoked(111) and store.is_revoked(2**150 + 7)
    assert not store.is_revoked(222) and not store.is_revoked(333)  # the new one, and another node id's
    row = store.certificate(222)
    assert row is not None and (row.node_id, row.not_after, row.revoked_at) == ("a", 2e9, None)
    assert store.certificate(111).revoked_at is not None and store.certificate(444) is None


def test_recording_a_certificate_is_one_transaction(tmp_path: Path) -> None:
    store = Store(store_path(tmp_path), busy_timeout_s=0.05)
    store.record_issued(111, "a", not_after=2e9)
    other = sqlite3.connect(str(store_path(tmp_path)), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreBusy, match="nothing changed; try again"):
            store.record_issued(222, "a", not_after=2e9, revoke_others=True)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.certificate(222) is None and not store.is_revoked(111)


def test_revoking_a_serial_never_recorded(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.revoke_serial(2**150 + 7, "a")  # x509 serials exceed SQLite's integers: stored as text
    assert reopen(store).is_revoked(2**150 + 7)


def test_a_store_that_cannot_be_opened_says_where(tmp_path: Path) -> None:
    (tmp_path / "llmgw.db").mkdir()
    with pytest.raises(MachineError) as info:
        Store.open(tmp_path)
    assert "llmgw.db" in str(info.value)


def test_removal_also_revokes_the_certificate_the_node_connected_with(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.record_issued(111, "a", not_after=2e9)
    # Known to the registry only, connected with a certificate another CA run issued: still removable.
    assert sorted(store.remove_node("a", also_revoke=999)) == ["111", "999"]
    assert store.is_revoked(999) and store.is_revoked(111)
    assert store.remove_node("never-seen", also_revoke=5) == ["5"]


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


def test_a_cli_call_under_the_lock_says_so_instead_of_a_traceback(tmp_path: Path) -> None:
    store = Store(store_path(tmp_path), busy_timeout_s=0.05)
    other = sqlite3.connect(str(store_path(tmp_path)), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreBusy, match="is locked by another process"):
            store.record_issued(1, "a", not_after=2e9)
    finally:
        other.execute("ROLLBACK")
    store.record_issued(1, "a", not_after=2e9)
    assert not store.is_revoked(1)


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

