"""The store in SQLite: the state directory's `llmgw.db`, the embedded default.

One connection, in WAL mode, so readers never wait for a writer: a backup (`llmgw server
backup`, `copy_database` here) reads while the server runs. A write is `BEGIN IMMEDIATE`:
SQLite's one write lock is taken first, so no read inside a write can be outdated by another
writer; a lock held by another process longer than the busy timeout fails the call with
`StoreBusy`. The file is made 0600 before SQLite opens it (SQLite creates its -wal and -shm
files with the database's mode), and refused if it or they are open to others.

sqlite3's exceptions never leave this module: each entry point translates them once
(`store_error`) into `StoreBusy` (another process holds the lock past the busy timeout),
`StoreCorrupt` (the file is damaged) or `StoreFailed` (anything else the database or the disk
refused). Misuse of the connection (sqlite3's ProgrammingError, InterfaceError) is a bug of
ours and passes as it is.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmgw import private
from llmgw.errors import MachineError
from llmgw.server.errors import StoreBusy, StoreCorrupt, StoreError, StoreFailed
from llmgw.server.store.schema import SQLITE, TABLES

# How long a call of the CLI waits for another process's write lock: a command can afford to
# wait out the server's transactions (milliseconds each). The server uses a much shorter one
# (asyncstore.BUSY_TIMEOUT_S), since each of its waits holds its only connection.
CLI_BUSY_TIMEOUT_S = 10.0


def store_path(state_dir: Path) -> Path:
    return state_dir / "llmgw.db"


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.execute(sql, args).rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        return self._db.execute(sql, args).fetchall()


class SqliteBackend:
    dialect = SQLITE

    def __init__(self, path: Path, *, busy_timeout_s: float, check_same_thread: bool = True) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        try:
            private.make_dir(path.parent, check_existing=False)  # a new one is 0700; see `Store.open`
            # Made 0600 before SQLite opens it: SQLite creates its -wal and -shm files with the
            # database's mode, and would create the database itself 0644 less the umask.
            private.create_empty(path)
        except OSError as exc:
            raise MachineError(f"cannot open the control plane's store {path}: {exc}; check its permissions") from None
        private.require(
            [
                (path, "the control plane's database", False),
                (path.with_name(path.name + "-wal"), "the database's write-ahead log", False),
                (path.with_name(path.name + "-shm"), "the database's shared-memory index", False),
            ]
        )
        with self._translated():
            self._db = sqlite3.connect(
                str(path), isolation_level=None, timeout=busy_timeout_s, check_same_thread=check_same_thread
            )
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
            except BaseException:
                self._db.close()
                raise

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except (sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # misuse of the connection: a bug of ours, not the database's state
        except sqlite3.Error as exc:
            raise store_error(self.path, exc, self.busy_timeout_s) from exc

    @contextlib.contextmanager
    def write(self, *, wait_s: float | None = None) -> Iterator[_Tx]:
        # `wait_s` is the connection's busy timeout, fixed when it opened: the CLI's 10 s, the
        # server's 1 s; an open's migration waits as long (no two servers share one file).
        with self._translated(), self._db:
            self._db.execute("BEGIN IMMEDIATE")  # the lock first: no read that a writer could outdate
            yield _Tx(self._db)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[_Tx]:
        with self._translated(), self._db:
            self._db.execute("BEGIN")  # deferred: the first read takes a read snapshot of the WAL
            yield _Tx(self._db)

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._translated():
            return self._db.execute(sql, args).fetchall()

    def has_table(self, name: str) -> bool:
        return bool(self.rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)))

    def check(self) -> None:
        """SQLite's `PRAGMA quick_check` (every page and b-tree, in a few ms for a store this
        size); raises `StoreCorrupt` with what it found."""
        found = [r[0] for r in self.rows("PRAGMA quick_check")]
        if found != ["ok"]:
            raise StoreCorrupt(
                self.path, "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
            )

    def scrub(self, replace: Callable[[], None]) -> bool:
        """`replace()` with deleted content overwritten with zeros (secure_delete), then the file
        rebuilt from what is live (VACUUM: earlier writes left old rows in free space) and the
        write-ahead log emptied. False if a reader of another process kept the log from being
        emptied within the busy timeout."""
        with self._translated():
            self._db.execute("PRAGMA secure_delete = ON")
            try:
                replace()
                self._db.execute("VACUUM")
                busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                self._db.execute("PRAGMA secure_delete = OFF")
        return not busy

    def claim(self) -> bool:
        """Whether no control plane uses the file, as far as SQLite can tell: it cannot (a running
        control plane holds no lock between its calls); `migrate-store` asks its admin.url."""
        return True

    def close(self) -> None:
        self._db.close()


# -- backups -------------------------------------------------------------------------------


def copy_database(source: Path, tmp: Path) -> dict[str, int]:
    """An online backup (`llmgw server backup`): SQLite's backup API copies the database at
    `source` into the empty file `tmp` page by page inside one read transaction, so the copy is
    the database as of one moment even while the server writes. The copy is switched to a
    rollback journal (one self-contained file) and checked (`PRAGMA quick_check`: `StoreCorrupt`
    otherwise); the row counts of the copy. `source` is opened read-write but never created: a
    missing database is an error, not an empty backup. sqlite3's errors are translated here, as
    everywhere in this module."""
    uri = f"{source.resolve().as_uri()}?mode=rw"  # rw, not create: a missing database is not made empty
    at = source
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=CLI_BUSY_TIMEOUT_S)) as src:
            with contextlib.closing(sqlite3.connect(str(tmp), isolation_level=None)) as dst:
                src.backup(dst)
                at = tmp
                dst.execute("PRAGMA journal_mode=DELETE")  # one file, no -wal beside it
                found = [r[0] for r in dst.execute("PRAGMA quick_check").fetchall()]
                if found != ["ok"]:
                    raise StoreCorrupt(source, "; ".join(found[:3]))
                assert {"nodes", "api_keys", "placements", "certificates"} <= set(TABLES)
                return {
                    "nodes": _count(dst, "SELECT COUNT(*) FROM nodes"),
                    "api_keys": _count(dst, "SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL"),
                    "placements": _count(dst, "SELECT COUNT(*) FROM placements"),
                    "revoked_certificates": _count(
                        dst, "SELECT COUNT(*) FROM certificates WHERE revoked_at IS NOT NULL"
                    ),
                }
    except StoreError:
        raise
    except sqlite3.Error as exc:
        raise store_error(at, exc, CLI_BUSY_TIMEOUT_S) from exc


def _count(db: sqlite3.Connection, sql: str) -> int:
    return int(db.execute(sql).fetchone()[0])


# -- sqlite3's exceptions, translated once --------------------------------------------------


# SQLite's primary result codes (https://www.sqlite.org/rescode.html).
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_CORRUPT, SQLITE_NOTADB = 5, 6, 11, 26
# Python before 3.11 gives no code, only SQLite's own message for it (sqlite3_errstr), which is
# stable across SQLite versions: the one place this module reads an error's text.
_CODE_OF_MESSAGE = {
    "database is locked": SQLITE_BUSY,
    "database table is locked": SQLITE_LOCKED,
    "database schema is locked": SQLITE_LOCKED,
    "database disk image is malformed": SQLITE_CORRUPT,
    "file is not a database": SQLITE_NOTADB,
    "file is encrypted or is not a database": SQLITE_NOTADB,
}


def store_error(path: Path, exc: sqlite3.Error, busy_timeout_s: float) -> StoreError:
    code = getattr(exc, "sqlite_errorcode", None)
    code = _CODE_OF_MESSAGE.get(str(exc).split(":")[0].strip(), -1) if code is None else code & 0xFF
    if code in (SQLITE_BUSY, SQLITE_LOCKED):
        return StoreBusy(path, busy_timeout_s)
    if code in (SQLITE_CORRUPT, SQLITE_NOTADB):
        return StoreCorrupt(path, str(exc))
    return StoreFailed(path, str(exc))
