"""`llmgw server check-store` (llmgw.server.store.check) against a real PostgreSQL: which store a
url reaches, told apart from another database by its schema history, without migrating or
writing anything; a database it cannot reach is the store's error, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.config import StoreSection
from llmgw.server.errors import StoreUnavailable
from llmgw.server.store import Store, schema
from llmgw.server.store.check import look
from testlib.ports import free_port
from testlib.postgres import PostgresServer
from testlib.proc import run_llmgw


def test_an_empty_database_is_seen_empty_and_left_empty(tmp_path: Path, postgres_server: PostgresServer) -> None:
    db = postgres_server.create_database()
    seen = look(tmp_path, db.settings)
    assert (seen.backend, seen.version, seen.identity) == ("postgresql", 0, "")
    assert seen.latest == schema.LATEST
    assert "holds no llmgw store yet" in seen.text()
    with postgres_server.connect(db) as conn:  # nothing was made: no migration ran
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0] == 0


def test_a_store_is_known_by_its_schema_history_not_its_url(tmp_path: Path, postgres_server: PostgresServer) -> None:
    first, second = postgres_server.create_database(), postgres_server.create_database()
    for db in (first, second):
        Store.open(tmp_path, db.settings).close()
    seen = look(tmp_path, first.settings)
    assert seen.version == schema.LATEST and len(seen.identity) == 64
    assert seen.store == f"postgresql://127.0.0.1:{postgres_server.port}/{first.name}"
    assert look(tmp_path, first.settings).identity == seen.identity  # the same store, seen again
    assert look(tmp_path, second.settings).identity != seen.identity  # another database, the same schema


def test_a_store_out_of_reach_is_unavailable_naming_it(tmp_path: Path, postgres_server: PostgresServer) -> None:
    db = postgres_server.create_database()
    port = free_port()  # nothing listens there
    gone = StoreSection(url=f"postgresql://llmgw_test@127.0.0.1:{port}/{db.name}", password_file=str(db.password_file))
    with pytest.raises(StoreUnavailable) as info:
        look(tmp_path, gone)
    assert f"postgresql://127.0.0.1:{port}/{db.name} cannot be reached" in str(info.value)
    assert postgres_server.password not in str(info.value)


def test_the_command_prints_what_it_saw_and_fails_with_the_reason(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    db = postgres_server.create_database()
    Store.open(tmp_path, db.settings).close()
    config = tmp_path / "server.toml"
    config.write_text(
        f'[server]\nstate_dir = "{tmp_path / "state"}"\n[store]\nurl = "{db.url}"\npassword_file = "{db.password_file}"\n'
    )
    done = run_llmgw("server", "check-store", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["version"] == schema.LATEST and seen["identity"] == look(tmp_path, db.settings).identity
    config.write_text(config.read_text().replace(str(postgres_server.port), str(free_port())))
    done = run_llmgw("server", "check-store", "--config", str(config))
    assert done.returncode != 0 and "cannot be reached" in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()  # a check makes no state directory either
