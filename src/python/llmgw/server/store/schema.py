"""The store's tables, their versioned migrations, and what differs between SQLite and PostgreSQL.

One SQL text serves both backends wherever they agree, which is nearly everywhere: the store's
statements are written with `?` placeholders and `ON CONFLICT` upserts (SQLite 3.24 and later
reads them as PostgreSQL does). What must differ is said once, in a `Dialect`: the placeholder
(`?` or psycopg's `%s`) and the numeric types (SQLite's REAL and INTEGER are 8 bytes,
PostgreSQL's are 4: a unix time needs `double precision` there, and a copy from SQLite `bigint`).

`MIGRATIONS` is the schema's history, in order, never edited once released: a change of schema
is a new entry at the end. The database records each one applied in `schema_version`; the
missing ones are applied in one transaction under the store's write lock, so two processes
migrating at once take turns (the second finds them applied). Who applies them: whoever opens a
SQLite file (its one control plane, or a command while none runs); a PostgreSQL store from
`LEASED` on, its leader only (`backend.migrate`), since control planes of two llmgw versions may
share it during an upgrade. A migration must therefore leave the schema readable by the llmgw
before it (add tables and columns, never rename or drop), and finish within a lease's TTL. Migration 1 is the schema as it was
before versions were recorded, all `IF NOT EXISTS`, so a database of that time takes it as a
no-op and is recorded at version 1.

`TABLES` lists every table of the state with its columns, in the order a copy fills them
(`llmgw server migrate-store`); `schema_version` is the database's own and never copied, and so
is `leader_lease` (who leads a store now is no state to carry into another).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs


@attrs.frozen(kw_only=True)
class Dialect:
    name: str  # "sqlite" or "postgresql"
    real: str  # an 8-byte float column
    integer: str  # an 8-byte integer column (SQLite's INTEGER is; PostgreSQL's is 4 bytes)
    placeholder: str  # what a `?` of the store's SQL becomes

    def sql(self, text: str) -> str:
        return _translate(text, self.placeholder)


@functools.lru_cache(maxsize=256)
def _translate(text: str, placeholder: str) -> str:
    if placeholder == "?":
        return text
    # The store's SQL has no string literal holding a `?` or a `%`: placeholders are the only ones.
    assert "%" not in text and "'?" not in text, text
    return text.replace("?", placeholder)


SQLITE = Dialect(name="sqlite", real="REAL", integer="INTEGER", placeholder="?")
POSTGRESQL = Dialect(name="postgresql", real="DOUBLE PRECISION", integer="BIGINT", placeholder="%s")


# The state's tables and their columns, in the order a copy fills them.
TABLES: dict[str, tuple[str, ...]] = {
    "nodes": ("node_id", "first_seen", "last_seen", "address", "cordoned", "draining"),
    "certificates": ("serial", "node_id", "not_after", "issued_at", "revoked_at"),
    "placements": ("replica_id", "body"),
    "api_keys": (
        "name",
        "token_sha256",
        "models",
        "rate_per_minute",
        "max_concurrency",
        "created_at",
        "revoked_at",
        "team",
    ),
    "catalog_models": ("name", "created"),
    "hub_models": ("name", "body", "sealed_token", "added_at"),
    "model_versions": ("id", "body"),
    "audit_log": ("id", "at", "actor", "source", "action", "target", "detail"),
    "teams": ("name", "created_at"),
    "budgets": ("id", "scope_kind", "scope", "model", "period", "tokens", "created_at"),
    "usage_hours": (
        "hour",
        "key_name",
        "team",
        "model",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ),
    "usage_reports": ("instance", "seq", "at"),
}
# What the copy's summary calls each table's rows.
TABLE_ROWS = {
    "nodes": "nodes",
    "certificates": "certificates (issued and revoked)",
    "placements": "replica placements",
    "api_keys": "API keys",
    "catalog_models": "catalog models",
    "hub_models": "models added from the Hub",
    "model_versions": "model definitions replicas run",
    "audit_log": "audit log entries",
    "teams": "teams",
    "budgets": "token budgets",
    "usage_hours": "usage ledger rows (key, model and hour)",
    "usage_reports": "gateways' acknowledged usage reports",
}


def _v1(d: Dialect) -> tuple[str, ...]:
    return (
        f"""CREATE TABLE IF NOT EXISTS nodes (
            node_id     TEXT PRIMARY KEY,
            first_seen  {d.real} NOT NULL,
            last_seen   {d.real} NOT NULL,
            address     TEXT NOT NULL DEFAULT '',
            cordoned    {d.integer} NOT NULL DEFAULT 0,
            draining    {d.integer} NOT NULL DEFAULT 0
        )""",
        f"""CREATE TABLE IF NOT EXISTS certificates (
            serial      TEXT PRIMARY KEY,          -- decimal, as x509 serials exceed 64 bits
            node_id     TEXT NOT NULL,
            not_after   {d.real} NOT NULL,
            issued_at   {d.real} NOT NULL,
            revoked_at  {d.real}                   -- NULL while valid
        )""",
        "CREATE INDEX IF NOT EXISTS certificates_node ON certificates (node_id)",
        """CREATE TABLE IF NOT EXISTS placements (
            replica_id  TEXT PRIMARY KEY,
            body        TEXT NOT NULL              -- JSON of the placement, its sealed secret and rendezvous port
        )""",
        f"""CREATE TABLE IF NOT EXISTS api_keys (
            name            TEXT PRIMARY KEY,
            token_sha256    TEXT NOT NULL UNIQUE,  -- hex; the token itself is shown once and never stored
            models          TEXT NOT NULL,         -- JSON array; empty = every model
            rate_per_minute {d.integer} NOT NULL,  -- 0 = no limit
            max_concurrency {d.integer} NOT NULL,  -- 0 = no limit
            created_at      {d.real} NOT NULL,
            revoked_at      {d.real}               -- NULL while valid
        )""",
        f"""CREATE TABLE IF NOT EXISTS catalog_models (
            name        TEXT PRIMARY KEY,
            created     {d.real} NOT NULL          -- when the catalog first named it (`created` in GET /v1/models)
        )""",
    )


def _v2(d: Dialect) -> tuple[str, ...]:
    # The leader's lease (`llmgw.server.store.lease`): one row, made here, so that taking the
    # lease is always an UPDATE of it. Used only where several control planes share PostgreSQL;
    # a SQLite store has the row and never reads it.
    return (
        f"""CREATE TABLE IF NOT EXISTS leader_lease (
            id          {d.integer} PRIMARY KEY CHECK (id = 1),
            holder      TEXT NOT NULL DEFAULT '',      -- the holding process's token; '' before the first
            agent_url   TEXT NOT NULL DEFAULT '',      -- where agents and gateways reach the holder (wss://)
            admin_url   TEXT NOT NULL DEFAULT '',      -- where `llmgw ctl` reaches its admin API (http://)
            epoch       {d.integer} NOT NULL DEFAULT 0,  -- one more at every taking: every leader write checks it
            expires_at  {d.real} NOT NULL DEFAULT 0    -- unix seconds, in the database's own clock
        )""",
        "INSERT INTO leader_lease (id) VALUES (1) ON CONFLICT DO NOTHING",
    )


def _v3(d: Dialect) -> tuple[str, ...]:
    # The models added while the cluster runs (`llmgw ctl models add NAME --hf ORG/REPO`): each as
    # its catalog entry (llmgw.config.Model as JSON: the commit and files it is pinned to, the
    # memory it was sized at), and the token of a gated repository sealed like the engine keys
    # (llmgw.server.store.keyseal, the model's name as associated data), '' for none.
    return (
        f"""CREATE TABLE IF NOT EXISTS hub_models (
            name          TEXT PRIMARY KEY,
            body          TEXT NOT NULL,               -- JSON: the model and its estimate
            sealed_token  TEXT NOT NULL DEFAULT '',
            added_at      {d.real} NOT NULL
        )""",
    )


def _v4(d: Dialect) -> tuple[str, ...]:
    # What each version of a model runs (llmgw.server.state.versions): the definition its
    # replicas were started with, by model and version, written with the placements (each
    # placement's row names its version), so that a restarted control plane or a new leader goes
    # on replacing the replicas of a changed model one at a time with the old ones serving
    # meanwhile, rather than restarting them all with the new definition. No token is kept.
    return (
        """CREATE TABLE IF NOT EXISTS model_versions (
            id    TEXT PRIMARY KEY,                -- MODEL@VERSION
            body  TEXT NOT NULL                    -- JSON: {"model", "version", "definition"}
        )""",
    )


def _v5(d: Dialect) -> tuple[str, ...]:
    # The audit log (issue 48): every admin action, who did it (the admin credential's name or the
    # page session's), when, from where and what changed. Nothing secret goes in `detail` (a key's
    # token never, its name and limits only). `id` is sortable: the time, then a random suffix.
    return (
        f"""CREATE TABLE IF NOT EXISTS audit_log (
            id      TEXT PRIMARY KEY,              -- `at` zero-padded to 17 characters, "-", a random hex: sorts as the log does
            at      {d.real} NOT NULL,             -- unix seconds
            actor   TEXT NOT NULL,                 -- the admin credential's name, or "page:<session name>"
            source  TEXT NOT NULL DEFAULT '',      -- the peer's address, or "local"
            action  TEXT NOT NULL,                 -- "key.create", "node.drain", "page.login", ...
            target  TEXT NOT NULL DEFAULT '',      -- what it acted on: a key's, node's or model's name
            detail  TEXT NOT NULL DEFAULT '{{}}'     -- JSON: what changed
        )""",
        "CREATE INDEX IF NOT EXISTS audit_log_at ON audit_log (at)",
    )


def _v6(d: Dialect) -> tuple[str, ...]:
    # Who used what (issue 48). A key belongs to a team ('' for none). The ledger counts every
    # answer's tokens per hour, key, team and model, from the engines' own `usage`; gateways report
    # their counts over the link, each report with a sequence per gateway instance, and a report
    # is added in the same transaction that records its sequence in `usage_reports`, so a report
    # sent again (after a reconnect or a leader change) is acknowledged and not counted twice.
    # Budgets: token budgets of a key or a team, for one model or all ('' = all), per period
    # ("minute", "day", "month").
    return (
        "ALTER TABLE api_keys ADD COLUMN team TEXT NOT NULL DEFAULT ''",
        f"""CREATE TABLE IF NOT EXISTS teams (
            name        TEXT PRIMARY KEY,
            created_at  {d.real} NOT NULL
        )""",
        f"""CREATE TABLE IF NOT EXISTS budgets (
            id          TEXT PRIMARY KEY,          -- SCOPE_KIND:SCOPE:MODEL:PERIOD
            scope_kind  TEXT NOT NULL,             -- "key" or "team"
            scope       TEXT NOT NULL,             -- the key's or team's name
            model       TEXT NOT NULL DEFAULT '',  -- '' = every model
            period      TEXT NOT NULL,             -- "minute", "day" or "month"
            tokens      {d.integer} NOT NULL,      -- the budget: prompt plus completion tokens
            created_at  {d.real} NOT NULL
        )""",
        f"""CREATE TABLE IF NOT EXISTS usage_hours (
            hour               {d.integer} NOT NULL,  -- unix seconds of the hour's start (UTC)
            key_name           TEXT NOT NULL,
            team               TEXT NOT NULL DEFAULT '',
            model              TEXT NOT NULL,
            requests           {d.integer} NOT NULL DEFAULT 0,
            prompt_tokens      {d.integer} NOT NULL DEFAULT 0,
            cached_tokens      {d.integer} NOT NULL DEFAULT 0,  -- of prompt_tokens, where the engine says
            completion_tokens  {d.integer} NOT NULL DEFAULT 0,
            PRIMARY KEY (hour, key_name, team, model)
        )""",
        f"""CREATE TABLE IF NOT EXISTS usage_reports (
            instance  TEXT PRIMARY KEY,            -- the gateway process (GatewayHello.instance)
            seq       {d.integer} NOT NULL,        -- the last report of it added to usage_hours
            at        {d.real} NOT NULL
        )""",
    )


# The schema's history: (version, its statements in a dialect). Append; never edit a released one.
MIGRATIONS: tuple[tuple[int, Callable[[Dialect], tuple[str, ...]]], ...] = (
    (1, _v1),
    (2, _v2),
    (3, _v3),
    (4, _v4),
    (5, _v5),
    (6, _v6),
)
LATEST = MIGRATIONS[-1][0]
# From this version on a database has the lease (`_v2`): a shared PostgreSQL store there is
# migrated by its leader only (`llmgw.server.store.backend.migrate`).
LEASED = 2


def version_table(d: Dialect) -> str:
    return f"CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at {d.real} NOT NULL)"


CURRENT_VERSION = "SELECT COALESCE(MAX(version), 0) FROM schema_version"
RECORD_VERSION = "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)"


def pending(found: int) -> list[tuple[int, Callable[[Dialect], tuple[str, ...]]]]:
    """The migrations a database at version `found` lacks, in order."""
    return [(v, statements) for v, statements in MIGRATIONS if v > found]
