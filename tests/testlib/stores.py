"""The control plane's store under test, in either backend: the state directory's SQLite file
or a fresh database of the test session's PostgreSQL (testlib.postgres). The same store tests
run against both (tests/llmgw/server/conftest.py's `store_backend`); a test of one backend's own
behaviour (SQLite's file modes, WAL, a damaged file) asks for that one alone.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import attrs

from llmgw.config import StoreSection
from llmgw.server.store import Store, store_path
from llmgw.server.store.asyncstore import BUSY_TIMEOUT_S, AsyncStore
from testlib.postgres import Database, PostgresServer


@attrs.frozen(kw_only=True)
class StoreUnderTest:
    kind: str  # "sqlite" or "postgresql"
    state: Path  # the state directory (the SQLite file's, and the CA's in either case)
    pg: PostgresServer | None = None
    db: Database | None = None

    @property
    def settings(self) -> StoreSection:
        return StoreSection() if self.db is None else self.db.settings

    @property
    def where(self) -> str:
        """How errors name the store: its file, or the database's redacted url."""
        return (
            str(store_path(self.state)) if self.db is None else f"postgresql://127.0.0.1:{self.pg.port}/{self.db.name}"
        )

    @property
    def holders(self) -> str:
        """What a busy store's message says may hold its lock."""
        return "a sqlite3 shell" if self.db is None else "a psql session"

    def open(self, *, busy_timeout_s: float | None = None) -> Store:
        return Store.open(self.state, self.settings, busy_timeout_s=busy_timeout_s)

    def open_async(self, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> AsyncStore:
        return AsyncStore.open(self.state, self.settings, busy_timeout_s=busy_timeout_s)

    @contextlib.contextmanager
    def write_lock(self) -> Iterator[None]:
        """Another session holding the store's write lock until the block ends: a `sqlite3`
        shell in a transaction (BEGIN IMMEDIATE), or a `psql` one holding the advisory lock
        every write of the store takes."""
        if self.db is None:
            other = sqlite3.connect(str(store_path(self.state)), isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                other.execute("ROLLBACK")
                other.close()
            return
        from llmgw.server.store.postgres import WRITE_LOCK

        with self.pg.connect(self.db) as conn:
            conn.execute("BEGIN")
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WRITE_LOCK)
            try:
                yield
            finally:
                conn.execute("ROLLBACK")
