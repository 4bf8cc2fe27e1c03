"""`[store] url` read without a driver (llmgw.config.storeurl), checked at config load, and
printed redacted; and the one place the store's SQL differs between its dialects."""

from __future__ import annotations

import pytest

from llmgw import config
from llmgw.config import storeurl
from llmgw.errors import ConfigError
from llmgw.server.store import schema


@pytest.mark.parametrize(
    ("url", "params"),
    [
        (
            "postgresql://llmgw@db1:5432,db2:5433/state?target_session_attrs=read-write&sslmode=verify-full",
            {
                "user": "llmgw",
                "host": "db1,db2",
                "port": "5432,5433",
                "dbname": "state",
                "target_session_attrs": "read-write",
                "sslmode": "verify-full",
            },
        ),
        ("postgres://[::1]:6543/x", {"host": "::1", "port": "6543", "dbname": "x"}),
        ("postgresql://%2Fvar%2Frun%2Fpostgresql/llmgw", {"host": "/var/run/postgresql", "dbname": "llmgw"}),
        ("postgresql://", {}),
        (
            "host=db1,db2 port=5432 dbname='my db' user=llmgw target_session_attrs=read-write",
            {
                "host": "db1,db2",
                "port": "5432",
                "dbname": "my db",
                "user": "llmgw",
                "target_session_attrs": "read-write",
            },
        ),
        ("host = a  dbname=it\\'s", {"host": "a", "dbname": "it's"}),
        ("dbname='a \\' b'", {"dbname": "a ' b"}),
    ],
)
def test_connection_strings_are_read_by_libpqs_rules(url: str, params: dict[str, str]) -> None:
    assert storeurl.parse(url).params == params


@pytest.mark.parametrize(
    ("url", "printed"),
    [
        ("sqlite", "sqlite"),
        (
            "postgresql://u:secret@db1:5432,db2:5433/state?target_session_attrs=read-write",
            "postgresql://db1:5432,db2:5433/state",
        ),
        ("host=db1,db2 port=5432 dbname=x user=u password=secret", "postgresql://db1:5432,db2:5432/x"),
        ("postgresql://[::1]:5/d", "postgresql://[::1]:5/d"),
        ("host=/run/pg dbname=d", "postgresql://%2Frun%2Fpg/d"),
        ("postgresql://u:secret@h:1/d?password=other", "postgresql://h:1/d"),
        ("not a url", "postgresql://(unreadable)"),
    ],
)
def test_a_url_is_printed_with_its_hosts_ports_and_database_only(url: str, printed: str) -> None:
    assert storeurl.redact(url) == printed


def load(store: dict) -> config.ServerConfig:
    return config.server_config_from_dict({"store": store})


def test_the_default_store_is_the_state_directorys_sqlite_file() -> None:
    assert load({}).store == config.StoreSection(url="sqlite", password_file="")
    assert load({"url": "postgresql://llmgw@db/llmgw", "password_file": "/etc/llmgw/store.password"}).store.url


@pytest.mark.parametrize(
    ("store", "problem"),
    [
        (
            {"url": "postgresql://llmgw:hunter2@db:5432/llmgw"},
            "the url holds a password (postgresql://db:5432/llmgw, shown without it)",
        ),
        (
            {"url": "host=db dbname=llmgw password=hunter2"},
            "password_file (mode 0600), or in ~/.pgpass or the file PGPASSFILE",
        ),
        ({"url": "postgresql://db/llmgw?sslpassword=hunter2"}, "the url holds a sslpassword"),
        ({"url": "mysql://db/llmgw"}, 'expected "sqlite" (the state directory\'s llmgw.db) or a PostgreSQL connection'),
        ({"url": "host=db dbname"}, "missing \"=\" after 'dbname'"),
        ({"url": "host='db"}, "the quoted value of 'host' is not closed"),
        ({"password_file": "/etc/llmgw/store.password"}, "a password file is for a PostgreSQL url"),
        (
            {"url": "postgresql://db/x", "password_file": "store.password"},
            "expected an absolute path, got 'store.password'",
        ),
    ],
)
def test_a_bad_store_is_refused_at_load_naming_the_key_and_the_fix_and_never_the_password(
    store: dict, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(store)
    message = str(info.value)
    assert problem in message and "@ $.store." in message
    assert "hunter2" not in message


def test_the_url_is_printed_redacted_where_the_config_is_printed() -> None:
    cfg = load({"url": "postgresql://llmgw@db1:5432/llmgw?application_name=x", "password_file": "/p"})
    assert config.to_dict(cfg)["store"] == {
        "url": "postgresql://db1:5432/llmgw",
        "password_file": "/p",
        "lease_ttl_s": 5.0,
        "lease_renew_s": 1.0,
    }


def test_the_dialects_differ_in_placeholders_and_numeric_types_only() -> None:
    sql = "UPDATE nodes SET cordoned = ? WHERE node_id = ?"
    assert schema.SQLITE.sql(sql) == sql
    assert schema.POSTGRESQL.sql(sql) == "UPDATE nodes SET cordoned = %s WHERE node_id = %s"
    sqlite_ddl = "\n".join(schema.MIGRATIONS[0][1](schema.SQLITE))
    pg_ddl = "\n".join(schema.MIGRATIONS[0][1](schema.POSTGRESQL))
    assert "DOUBLE PRECISION" not in sqlite_ddl and " REAL " not in pg_ddl and "BIGINT" in pg_ddl
    assert pg_ddl.replace("DOUBLE PRECISION", "REAL").replace("BIGINT", "INTEGER") == sqlite_ddl
    assert [v for v, _ in schema.MIGRATIONS] == list(range(1, schema.LATEST + 1))  # in order, none skipped
