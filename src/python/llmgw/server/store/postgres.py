"""The store in PostgreSQL (`[store] url = "postgresql://..."`), through psycopg 3.

psycopg is imported here only, and only when a PostgreSQL store is opened: a SQLite user never
loads it. The connection is one, synchronous, in autocommit mode; `AsyncStore` runs its calls
in a worker thread as it does SQLite's.

Writes: each is one transaction that first takes a transaction-level advisory lock
(`pg_advisory_xact_lock(WRITE_LOCK)`), released by its COMMIT or ROLLBACK. Writers take turns
as they do on SQLite's file lock (`BEGIN IMMEDIATE`), so a transaction that reads and then
writes (`remove_node`, `record_issued`) cannot be outdated by another writer, with no
serialization failures to retry. The wait is bounded by `lock_timeout` (the busy timeout), past
which the call fails with `StoreBusy`. Migrations at open take the same lock, so two control
planes starting at once take turns: the second finds them applied.

A running control plane's session is ended by PostgreSQL if it stays inside a transaction for
half a lease (`idle_in_transaction_session_timeout`): a control plane paused in the middle of a
write cannot hold the write lock, or the lease row, while another takes over
(`llmgw.server.store.lease`).

A running control plane also holds a session-level shared advisory lock (`SERVING_LOCK`) for
as long as it is connected: `llmgw server migrate-store` takes it exclusively, so it refuses to
copy from or into a database a control plane is using, wherever that control plane runs.

Connection loss (a PostgreSQL restart, a failover, a network cut) fails the call in progress
with `StoreUnavailable`; the next call connects again (libpq follows `target_session_attrs` to
the new primary of a cluster). A connection that died while idle is found dead by the first
statement of the next call, which has changed nothing yet: that call connects again once and
goes on, so the first call after PostgreSQL is back succeeds. A COMMIT whose answer was lost is
the one case where the outcome is unknown (`StoreUnavailable.outcome_unknown`).

psycopg's exceptions never leave this module: they are translated once, by SQLSTATE (never by
text), in `_translated`. The url is never printed whole: errors and logs name the database by
`storeurl.redact` (hosts, ports, database name). The password comes from `[store]
password_file` (passed to libpq as a connection parameter, never on a command line, never in
the environment) or from libpq's own ~/.pgpass / PGPASSFILE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from llmgw.config import storeurl
from llmgw.log import get_logger
from llmgw.server.errors import (
    POSTGRES_FIX,
    POSTGRES_HOLDERS,
    StoreBusy,
    StoreError,
    StoreFailed,
    StoreUnavailable,
)
from llmgw.server.store.schema import POSTGRESQL

if TYPE_CHECKING:
    import psycopg

log = get_logger("llmgw.store")

# Advisory lock keys (two int4s: llmgw's class, then which lock). Per database: two llmgw
# stores in one PostgreSQL server do not share them.
LOCK_CLASS = 0x6C6C6D67  # "llmg"
WRITE_LOCK = (LOCK_CLASS, 1)  # transaction-level, exclusive: one writer at a time
SERVING_LOCK = (LOCK_CLASS, 2)  # session-level: shared by running control planes, exclusive for migrate-store

# libpq parameters added unless the url gives them: without a connect_timeout libpq waits for
# the kernel's TCP timeout (minutes) on a host that does not answer; without keepalives and a
# user timeout a connection to a host that vanished is found dead only after the kernel's
# retransmissions (15 minutes). With these, a control plane learns within seconds that its
# database is gone, and says so (503 with Retry-After) instead of hanging.
DEFAULT_PARAMS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "20000",  # ms
}

# SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html) by blame.
_BUSY = {"55P03", "40001", "40P01", "57014"}  # lock_not_available, serialization, deadlock, timeout
# admin_shutdown, crash_shutdown, cannot_connect_now, and a standby's read_only_sql_transaction
# (a failover under way, or a url without target_session_attrs=read-write).
_GONE = {"57P01", "57P02", "57P03", "25006"}


def _ms(seconds: float) -> int:
    # PostgreSQL reads a lock_timeout of 0 as "wait forever": never round a short wait down to it.
    return max(1, round(seconds * 1000))


def _psycopg() -> Any:
    import psycopg  # here, not at the top: only a PostgreSQL store pays for the import

    return psycopg


class _Tx:
    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._conn.execute(POSTGRESQL.sql(sql), args or None).rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if rows:
            with self._conn.cursor() as cur:
                cur.executemany(POSTGRESQL.sql(sql), rows)

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        return self._conn.execute(POSTGRESQL.sql(sql), args or None).fetchall()


class _Call:
    """One call's translation of psycopg's exceptions, and what it needs to know to do it:
    whether the COMMIT was in flight."""

    def __init__(self, backend: PostgresBackend) -> None:
        self.backend = backend
        self.committing = False

    def __enter__(self) -> _Call:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        psycopg = _psycopg()
        if exc is None or not isinstance(exc, psycopg.Error) or isinstance(exc, psycopg.InterfaceError):
            return False  # no error, not psycopg's, or misuse of the connection: a bug of ours
        raise self.backend.error(exc, committing=self.committing) from exc


class PostgresBackend:
    dialect = POSTGRESQL

    def __init__(
        self,
        url: str,
        *,
        password: str | None,
        busy_timeout_s: float,
        application_name: str = "llmgw",
        serving: bool = False,
        idle_timeout_s: float = 0.0,
    ) -> None:
        """Connect to the database `url` names (a libpq connection string, with no password:
        `password` comes from password_file, or None for libpq's own files). `serving`: this
        is a running control plane's store, which holds `SERVING_LOCK` shared. `idle_timeout_s`:
        PostgreSQL ends this session if it sits that long inside a transaction (0: never), so a
        paused process frees the locks its write held (`llmgw.server.store.lease`)."""
        self.path = storeurl.redact(url)
        self.busy_timeout_s = busy_timeout_s
        self.serving = serving
        self.idle_timeout_s = idle_timeout_s
        self._conn: psycopg.Connection | None = None
        psycopg = _psycopg()
        with _Call(self):
            params = psycopg.conninfo.conninfo_to_dict(url)
        for key, value in DEFAULT_PARAMS.items():
            params.setdefault(key, value)
        params.setdefault("fallback_application_name", application_name)
        if password is not None:
            params["password"] = password
        self._params = params
        with _Call(self):
            self._connection()

    # -- the connection -------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        """The open connection, or a new one if there is none or it was lost."""
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        self._conn = None
        psycopg = _psycopg()
        conn = psycopg.Connection.connect(autocommit=True, **self._params)
        try:
            # A wait for a lock (the write lock, a table another session locked) is bounded:
            # past it the call fails with StoreBusy instead of holding the worker thread.
            conn.execute(f"SET lock_timeout = {_ms(self.busy_timeout_s)}")
            if self.idle_timeout_s:
                conn.execute(f"SET idle_in_transaction_session_timeout = {_ms(self.idle_timeout_s)}")
            if self.serving:
                conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", SERVING_LOCK)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _first(self, statement: Callable[[psycopg.Connection], Any]) -> tuple[psycopg.Connection, Any]:
        """Run a call's first statement, which changes nothing by itself (BEGIN, or a read). On
        a connection that died while idle (a restart, a failover since the last call) it fails
        having done nothing: connect again, once, and run it there."""
        psycopg = _psycopg()
        conn = self._connection()
        try:
            return conn, statement(conn)
        except psycopg.OperationalError:
            if not conn.broken:
                raise
        log.info("store_reconnecting", store=self.path, reason="the connection was lost while idle")
        conn = self._connection()
        return conn, statement(conn)

    def error(self, exc: psycopg.Error, *, committing: bool = False) -> StoreError:
        """psycopg's exception as the store's, by blame."""
        state = exc.sqlstate or ""
        conn = self._conn
        lost = conn is None or conn.closed
        detail = " ".join(str(exc).split())  # libpq's messages span lines; a log line does not
        if isinstance(exc, _psycopg().ProgrammingError) and not state:
            # libpq refused the connection string itself (an unknown parameter, a bad value)
            return StoreFailed(self.path, detail, fix="Fix [store] url in server.toml (docs/configuration.md)")
        if state == "25006" and conn is not None:
            conn.close()  # a standby: the next call connects again, to the primary if there is one
            lost = True
        if lost or state in _GONE or state.startswith("08"):
            return StoreUnavailable(self.path, detail, outcome_unknown=committing and lost)
        if state in _BUSY:
            return StoreBusy(self.path, self.busy_timeout_s, holders=POSTGRES_HOLDERS)
        return StoreFailed(self.path, f"{detail} (SQLSTATE {state})" if state else detail, fix=POSTGRES_FIX)

    # -- the backend's calls --------------------------------------------------------------

    @contextlib.contextmanager
    def write(self, *, wait_s: float | None = None) -> Iterator[_Tx]:
        with _Call(self) as call:
            conn, _ = self._first(lambda c: c.execute("BEGIN"))
            try:
                if wait_s is not None:
                    conn.execute(f"SET LOCAL lock_timeout = {_ms(wait_s)}")
                conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WRITE_LOCK)
                yield _Tx(conn)
            except BaseException:
                self._rollback(conn)
                raise
            call.committing = True
            conn.execute("COMMIT")

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[_Tx]:
        with _Call(self):
            conn, _ = self._first(lambda c: c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"))
            try:
                yield _Tx(conn)
            except BaseException:
                self._rollback(conn)
                raise
            conn.execute("COMMIT")

    def _rollback(self, conn: psycopg.Connection) -> None:
        if conn.closed:
            return  # the server rolled it back when the connection went
        try:
            conn.execute("ROLLBACK")
        except _psycopg().Error:
            conn.close()  # a connection in an unknown state: the next call makes a new one

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with _Call(self):
            _, found = self._first(lambda c: c.execute(POSTGRESQL.sql(sql), args or None).fetchall())
            return found

    def has_table(self, name: str) -> bool:
        return self.rows("SELECT to_regclass(?) IS NOT NULL", (name,))[0][0]

    def check(self) -> None:
        """That the database answers (the schema version is `Store.check`'s)."""
        self.rows("SELECT 1")

    def scrub(self, replace: Callable[[], None]) -> bool:
        """`replace()`, then the table rewritten (VACUUM FULL: a few ms at this size, under an
        exclusive lock on the table) so that its files hold no dead row version. What
        PostgreSQL keeps elsewhere (its write-ahead log and archive, replicas, base backups)
        holds the old rows until recycled; no client can reach those."""
        replace()
        with _Call(self):
            self._first(lambda c: c.execute("VACUUM FULL placements"))
        return True

    def claim(self) -> bool:
        """Take `SERVING_LOCK` exclusively for this session (`migrate-store`): False if a running
        control plane holds it."""
        return bool(self.rows("SELECT pg_try_advisory_lock(?, ?)", SERVING_LOCK)[0][0])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def read_password(path: str) -> str:
    """The password in `[store] password_file`: a private file (`llmgw.private.read` refuses one
    open to others), its first line."""
    from pathlib import Path

    from llmgw import private
    from llmgw.errors import MachineError

    try:
        data = private.read(Path(path), "the PostgreSQL password ([store] password_file)")
    except FileNotFoundError:
        raise MachineError(
            f"[store] password_file {path} does not exist; write the store's PostgreSQL password into it "
            f"(install -m 600 /dev/null {path}, then edit it), or remove password_file to use ~/.pgpass"
        ) from None
    except PermissionError:
        raise MachineError(f"cannot read [store] password_file {path}; run as the user that owns it") from None
    try:
        password = data.decode().splitlines()[0] if data.strip() else ""
    except UnicodeDecodeError:
        raise MachineError(f"[store] password_file {path} is not UTF-8 text; write the password as text") from None
    if not password:
        raise MachineError(f"[store] password_file {path} is empty; write the store's PostgreSQL password into it")
    return password
