"""What a store's backend is, and a backend opened: `Backend` and its transactions (`Tx`), which
`sqlite.SqliteBackend` and `postgres.PostgresBackend` are; `open_backend`, the one server.toml's
`[store]` names, open and migrated; and the migration of its schema (`migrate`), which a leader
alone applies to a PostgreSQL store shared by several control planes.

The calls on a backend's tables are `core.Store`'s; the migrations themselves are `schema`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from llmgw import private
from llmgw.config import StoreSection, storeurl
from llmgw.errors import MachineError
from llmgw.log import get_logger
from llmgw.server.errors import StoreSchemaBehind, StoreSchemaNewer
from llmgw.server.store import schema
from llmgw.server.store.lease import Fence
from llmgw.server.store.schema import Dialect
from llmgw.server.store.sqlite import CLI_BUSY_TIMEOUT_S, SqliteBackend, store_path

log = get_logger("llmgw.store")


class Tx(Protocol):
    """One transaction of a backend; SQL with `?` placeholders."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run one statement; the rows it changed."""

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]: ...


class Backend(Protocol):
    path: Path | str  # the file, or a PostgreSQL database's redacted url: what errors name
    busy_timeout_s: float
    dialect: Dialect

    def write(self, *, wait_s: float | None = None) -> contextlib.AbstractContextManager[Tx]:
        """One transaction holding the store's write lock (waited for `wait_s`, by default the
        busy timeout); committed when the block ends, rolled back if it raises."""

    def snapshot(self) -> contextlib.AbstractContextManager[Tx]:
        """One read-only transaction: every read in it sees the store as of one moment."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        """One read, its own transaction."""

    def has_table(self, name: str) -> bool: ...

    def check(self) -> None:
        """The backend's own health check (beyond the schema version, which `Store.check` reads)."""

    def scrub(self, replace: Callable[[], None]) -> bool:
        """Run `replace()` (a write replacing rows that held a secret) and leave no trace of
        the rows it replaced, as far as the backend can; False if it could not finish."""

    def claim(self) -> bool:
        """Hold, until closed, what tells running control planes' starts that this session copies
        the store; False if a running control plane holds it (`migrate-store`)."""

    def close(self) -> None: ...


# How long an open waits for another process's write lock while it migrates: a second control
# plane starting at once waits for the first one's migration, which may take longer than a call.
MIGRATION_WAIT_S = 30.0


def migrate(db: Backend, *, fence: Fence | None = None, alone: bool = False) -> int:
    """Apply the migrations the database lacks, in one transaction under the write lock; the
    version it is at. A database of a newer llmgw is refused (`StoreSchemaNewer`), unchanged.

    A PostgreSQL store that has the lease (`schema.LEASED` on) is migrated by its leader only:
    `fence` is the leader's term, checked in the migration's transaction first (`NotLeader` once
    the lease has passed on, and nothing applied), or `alone`: no control plane can run on it
    (`migrate-store`, holding the serving lock exclusively). Anyone else is refused
    (`StoreSchemaBehind`, unchanged): a control plane of the older llmgw may be leading it. A
    store without the lease (new, or older than the lease) has no leader to defer to, and is
    migrated by whoever opens it first. Logged when a leader applies any (`store_migrated`)."""
    found = current_version(db)
    if found == schema.LATEST:
        return found  # the usual case: no lock taken
    with db.write(wait_s=max(db.busy_timeout_s, MIGRATION_WAIT_S)) as tx:
        tx.execute(schema.version_table(db.dialect))
        found = tx.rows(schema.CURRENT_VERSION)[0][0]  # again, under the lock: another may have migrated
        if found > schema.LATEST:
            raise StoreSchemaNewer(db.path, found, schema.LATEST)
        if found < schema.LATEST and led(db, found) and not alone:
            if fence is None:
                raise StoreSchemaBehind(db.path, found, schema.LATEST)
            fence.check(tx, db.path)
        for version, statements in schema.pending(found):
            for statement in statements(db.dialect):
                tx.execute(statement)
            tx.execute(schema.RECORD_VERSION, (version, time.time()))
    if fence is not None and found < schema.LATEST:
        log.info("store_migrated", store=str(db.path), from_version=found, to_version=schema.LATEST, epoch=fence.epoch)
    return schema.LATEST


def led(db: Backend, version: int) -> bool:
    """Whether a database at `version` is one that only a leader migrates: a PostgreSQL store
    (control planes share it) that has the lease."""
    return db.dialect.name == schema.POSTGRESQL.name and version >= schema.LEASED


def current_version(db: Backend) -> int:
    if not db.has_table("schema_version"):
        return 0
    found = int(db.rows(schema.CURRENT_VERSION)[0][0])
    if found > schema.LATEST:
        raise StoreSchemaNewer(db.path, found, schema.LATEST)
    return found


def open_backend(
    state_dir: Path,
    settings: StoreSection | None = None,
    *,
    busy_timeout_s: float | None = None,
    check_same_thread: bool = True,
    server: bool = False,
    migrations: bool = True,
    fence: Fence | None = None,
) -> Backend:
    """The backend `settings` (`[store]`; None: the default) names, open and migrated: the
    state directory's SQLite file, or a PostgreSQL database. `busy_timeout_s`: how long a call
    waits for another's write lock (None: the CLI's, `CLI_BUSY_TIMEOUT_S`). `server`: a running
    control plane's, which `migrate-store` can tell is in use (PostgreSQL: `SERVING_LOCK`).
    `migrations` False: opened as it is, its schema unchecked (the caller looks); `fence`: the
    leader's term, which alone migrates a shared PostgreSQL store (`migrate`)."""
    settings = StoreSection() if settings is None else settings
    timeout = CLI_BUSY_TIMEOUT_S if busy_timeout_s is None else busy_timeout_s
    db: Backend
    if storeurl.is_postgresql(settings.url):
        from llmgw.server.store.postgres import PostgresBackend, read_password

        password = read_password(settings.password_file) if settings.password_file else None
        db = PostgresBackend(
            settings.url,
            password=password,
            busy_timeout_s=timeout,
            application_name="llmgw-server" if server else "llmgw",
            serving=server,
            idle_timeout_s=settings.lease_ttl_s / 2 if server else 0.0,
        )
    else:
        try:
            private.make_dir(state_dir, "the control plane's state directory")
        except OSError as exc:
            raise MachineError(f"cannot open the state directory {state_dir}: {exc.strerror or exc}") from None
        db = SqliteBackend(store_path(state_dir), busy_timeout_s=timeout, check_same_thread=check_same_thread)
    if migrations:
        try:
            migrate(db, fence=fence)
        except BaseException:
            db.close()
            raise
    return db
