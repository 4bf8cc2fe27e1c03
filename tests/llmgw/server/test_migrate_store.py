"""`llmgw server migrate-store`: a SQLite state copied into a real PostgreSQL and back, through the
real command, and what it refuses (a target that is not empty, a store a control plane uses, a
password in a url). `llmgw server backup` on a PostgreSQL store says how to back it up instead."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from llmgw import paths
from llmgw.config import StoreSection
from llmgw.errors import MachineError, UsageError
from llmgw.server.errors import StoreInUse, StoreNotEmpty
from llmgw.server.store import HubModelRow, KeyRow, Store, open_backend, schema, store_path
from llmgw.server.store.backup import backup
from llmgw.server.store.migratestore import migrate_store
from testlib.postgres import Database, PostgresServer
from testlib.proc import run_llmgw

BIG = 2**150 + 7  # a serial beyond any integer column: kept as its decimal text


def fill(store: Store) -> None:
    """A little of everything the store holds."""
    store.saw_node("node-a", "10.0.0.2", now=100.25)
    store.saw_node("node-b", "10.0.0.3", now=101)
    store.set_cordoned("node-a", True)
    store.set_draining("node-b", True)
    store.record_issued(111, "node-a", not_after=2e9, now=90.5)
    store.record_issued(BIG, "node-a", not_after=2.5e9, revoke_others=True, now=95)
    store.revoke_serial(222, "gone", now=99)
    store.add_api_key(
        KeyRow(
            name="k1",
            token_sha256="ab" * 32,
            models=("chat",),
            rate_per_minute=60,
            max_concurrency=4,
            created_at=5.5,
            revoked_at=None,
        )
    )
    store.add_api_key(
        KeyRow(
            name="k2",
            token_sha256="cd" * 32,
            models=(),
            rate_per_minute=0,
            max_concurrency=0,
            created_at=6.0,
            revoked_at=None,
        )
    )
    store.revoke_api_key("k2", now=7.0)
    store.record_catalog({"chat": 1.5, "gone-model": 2.0})
    store.add_hub_model(
        HubModelRow(name="from-hub", body={"model": {"name": "from-hub"}}, sealed_token="sealed:abc", added_at=8.5)
    )
    store.set_placements(
        {"chat-0": {"node": "node-a", "key": "sealed:xyz", "port": 41000}, "chat-1": {"node": "node-b"}},
        {"chat@abc": {"model": "chat", "version": "abc", "definition": {"name": "chat", "engine": "sim"}}},
    )


def contents(store: Store) -> dict[str, list[tuple]]:
    """Every table's rows, sorted, as plain values (SQLite's 10 and PostgreSQL's 10.0 alike)."""
    out = {}
    for table, cols in schema.TABLES.items():
        rows = store._db.rows(f"SELECT {', '.join(cols)} FROM {table}")
        out[table] = sorted(
            (tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in r) for r in rows),
            key=lambda r: str(r[0]),
        )
    return out


def test_sqlite_to_postgresql_and_back_through_the_command(
    postgres_server: PostgresServer, postgres_db: Database, tmp_path: Path
) -> None:
    first, back = tmp_path / "first", tmp_path / "back"
    store = Store.open(first)
    fill(store)
    before = contents(store)
    store.close()

    done = run_llmgw(
        "server",
        "migrate-store",
        "--state-dir",
        str(first),
        "--to",
        postgres_db.url,
        "--to-password-file",
        str(postgres_db.password_file),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == {
        "source": str(store_path(first)),
        "target": f"postgresql://127.0.0.1:{postgres_server.port}/{postgres_db.name}",
        "rows": {
            "nodes": 2,
            "certificates": 3,
            "placements": 2,
            "api_keys": 2,
            "catalog_models": 2,
            "hub_models": 1,
            "model_versions": 1,
            "audit_log": 0,
            "teams": 0,
            "budgets": 0,
            "usage_hours": 0,
            "usage_reports": 0,
        },
        "verified": True,
    }
    pg = Store.open(tmp_path, postgres_db.settings)
    assert contents(pg) == before
    assert pg.is_revoked(111) and not pg.is_revoked(BIG) and pg.is_revoked(222)
    assert [(n.node_id, n.cordoned, n.draining) for n in pg.nodes()] == [
        ("node-a", True, False),
        ("node-b", False, True),
    ]
    pg.close()

    # And back, to one control plane on SQLite: from PostgreSQL into a state directory's new llmgw.db.
    done = run_llmgw(
        "server",
        "migrate-store",
        "--state-dir",
        str(back),
        "--from",
        postgres_db.url,
        "--from-password-file",
        str(postgres_db.password_file),
        "--to",
        "sqlite",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"copied postgresql://127.0.0.1:{postgres_server.port}/{postgres_db.name} to {store_path(back)} in one "
        "transaction; every table read back as its source:"
    )
    assert any(re.fullmatch(r"  certificates \(issued and revoked\) +3", line) for line in lines) and lines[
        -1
    ].startswith("next: remove [store] url")
    again = Store.open(back)
    assert contents(again) == before
    assert again.api_keys()[0].models == ("chat",) and again.placements()["chat-0"]["port"] == 41000
    assert postgres_server.password not in done.stdout + done.stderr


def test_a_target_that_is_not_empty_is_refused_naming_what_it_holds(postgres_db: Database, tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill(Store.open(state))
    target = Store.open(tmp_path, postgres_db.settings)
    target.saw_node("someone", "10.9.9.9", now=1)
    target.record_catalog({"m": 1.0})
    target.close()
    with pytest.raises(StoreNotEmpty) as info:
        migrate_store(state, StoreSection(), to=postgres_db.url, to_password_file=str(postgres_db.password_file))
    message = str(info.value)
    assert "is not empty: it holds nodes: 1, catalog models: 1." in message and "dropdb" in message
    target = Store.open(tmp_path, postgres_db.settings)
    assert [n.node_id for n in target.nodes()] == ["someone"] and target.api_keys() == []  # nothing merged

    # Back into a state directory that still holds its llmgw.db from before: refused too.
    with pytest.raises(StoreNotEmpty, match=r"nodes: 2, certificates \(issued and revoked\): 3.*mv .*llmgw.db"):
        migrate_store(
            state,
            postgres_db.settings,
            to="sqlite",
        )


def test_a_store_a_control_plane_uses_is_refused(postgres_db: Database, tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill(Store.open(state))
    running = open_backend(tmp_path / "elsewhere", postgres_db.settings, server=True)  # another machine's, say
    try:
        with pytest.raises(StoreInUse, match="holds llmgw's serving lock"):
            migrate_store(state, StoreSection(), to=postgres_db.url, to_password_file=str(postgres_db.password_file))
    finally:
        running.close()

    # A control plane answering at the state directory's admin.url uses its llmgw.db.
    listener = socket.create_server(("127.0.0.1", 0))
    paths.admin_url_path(state).write_text(f"http://127.0.0.1:{listener.getsockname()[1]}\n")
    with listener, pytest.raises(StoreInUse, match="answers at http://127.0.0.1"):
        migrate_store(state, StoreSection(), to=postgres_db.url, to_password_file=str(postgres_db.password_file))
    # Left behind by one that did not stop cleanly: nothing answers, the copy goes on.
    copied = migrate_store(state, StoreSection(), to=postgres_db.url, to_password_file=str(postgres_db.password_file))
    assert copied.rows["nodes"] == 2


def test_what_is_refused_before_anything_is_opened(postgres_db: Database, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(MachineError, match="no control-plane database at .*nothing to copy"):
        migrate_store(state, StoreSection(), to=postgres_db.url)
    assert not store_path(state).exists()  # not created empty by looking
    secret_url = postgres_db.url.replace("llmgw_test@", "llmgw_test:hunter2@")
    with pytest.raises(UsageError) as info:
        migrate_store(state, StoreSection(), to=secret_url)
    assert "the url holds a password" in str(info.value) and "@ --to" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(UsageError, match="both the state directory's"):
        migrate_store(state, StoreSection(), to="sqlite")


def test_backup_of_a_postgresql_store_says_how_to_back_it_up(postgres_db: Database, tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        backup(tmp_path, tmp_path / "b.db", settings=postgres_db.settings)
    message = str(info.value)
    assert "store is PostgreSQL (postgresql://127.0.0.1:" in message and "pg_dump" in message
    assert "llmgw_test" not in message  # the url is printed with its hosts, ports and name only
    assert not (tmp_path / "b.db").exists()
