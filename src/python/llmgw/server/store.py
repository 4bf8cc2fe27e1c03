"""The control plane's durable state: operator intent and identity, in SQLite.

What lives here survives a control-plane restart: the nodes it knows (and when it last saw
each), cordon and drain marks, the certificates it issued and the serials it revoked, the
replica placements, the gateway's API keys, and when each model entered the catalog. What does not: anything an agent reports
(inventory, engines, replicas), which is rebuilt when the agents reconnect.

`Store` is synchronous: one small transaction per call, on one connection. While the control
plane runs, it alone opens the database, through `llmgw.server.asyncstore` (which owns a `Store`
and runs its calls in a worker thread, never on the event loop); `llmgw node add` and
`llmgw ca issue` record a serial and read revocations through its admin API. Only while no
control plane runs does `llmgw ca issue` open the database itself, and records with the same
method the admin API calls (`record_issued`). The database is in WAL mode, so readers never
wait for a writer: a backup (`llmgw server backup`, `copy_database` here) reads while the
server runs. No other module imports sqlite3.

sqlite3's exceptions never leave this module: each public method translates them once
(`store_error`), into `StoreBusy` (another process holds the lock past the busy timeout),
`StoreCorrupt` (the file is damaged) or `StoreFailed` (anything else the database or the disk
refused), which `llmgw.server.errors` holds with the package's other errors. A failed call
changed nothing: each is one transaction.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import attrs

from llmgw import private
from llmgw.errors import MachineError
from llmgw.server.errors import StoreBusy, StoreCorrupt, StoreError, StoreFailed, UnknownNode

P = ParamSpec("P")
R = TypeVar("R")

# How long a call of the CLI waits for another process's write lock: a command can afford to
# wait out the server's transactions (milliseconds each). The server uses a much shorter one
# (asyncstore.BUSY_TIMEOUT_S), since each of its waits holds its only connection.
CLI_BUSY_TIMEOUT_S = 10.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id     TEXT PRIMARY KEY,
    first_seen  REAL NOT NULL,
    last_seen   REAL NOT NULL,
    address     TEXT NOT NULL DEFAULT '',
    cordoned    INTEGER NOT NULL DEFAULT 0,
    draining    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS certificates (
    serial      TEXT PRIMARY KEY,          -- decimal, as x509 serials exceed 64 bits
    node_id     TEXT NOT NULL,
    not_after   REAL NOT NULL,
    issued_at   REAL NOT NULL,
    revoked_at  REAL                       -- NULL while valid
);
CREATE INDEX IF NOT EXISTS certificates_node ON certificates (node_id);
CREATE TABLE IF NOT EXISTS placements (
    replica_id  TEXT PRIMARY KEY,
    body        TEXT NOT NULL              -- JSON of the placement, its secret and rendezvous port
);
CREATE TABLE IF NOT EXISTS api_keys (
    name            TEXT PRIMARY KEY,
    token_sha256    TEXT NOT NULL UNIQUE,  -- hex; the token itself is shown once and never stored
    models          TEXT NOT NULL,         -- JSON array; empty = every model
    rate_per_minute INTEGER NOT NULL,      -- 0 = no limit
    max_concurrency INTEGER NOT NULL,      -- 0 = no limit
    created_at      REAL NOT NULL,
    revoked_at      REAL                   -- NULL while valid
);
CREATE TABLE IF NOT EXISTS catalog_models (
    name        TEXT PRIMARY KEY,
    created     REAL NOT NULL              -- when the catalog first named it (`created` in GET /v1/models)
);
"""


@attrs.frozen(kw_only=True)
class KeyRow:
    name: str
    token_sha256: str = attrs.field(repr=False)
    models: tuple[str, ...]
    rate_per_minute: int
    max_concurrency: int
    created_at: float
    revoked_at: float | None


@attrs.frozen(kw_only=True)
class NodeRow:
    node_id: str
    first_seen: float
    last_seen: float
    address: str
    cordoned: bool
    draining: bool


@attrs.frozen(kw_only=True)
class CertRow:
    serial: int
    node_id: str
    not_after: float  # 0 for a serial revoked without having been recorded
    issued_at: float
    revoked_at: float | None


def store_path(state_dir: Path) -> Path:
    return state_dir / "llmgw.db"


def _at_the_edge(method: Callable[P, R]) -> Callable[P, R]:
    """sqlite3's exceptions, translated once into the store's own classes by blame."""

    @functools.wraps(method)
    def translated(self: Store, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except (sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # misuse of the connection: a bug of ours, not the database's state
        except sqlite3.Error as exc:
            raise store_error(self.path, exc, self.busy_timeout_s) from exc

    return translated  # type: ignore[return-value]


class Store:
    def __init__(
        self, path: Path, *, busy_timeout_s: float = CLI_BUSY_TIMEOUT_S, check_same_thread: bool = True
    ) -> None:
        """Open (creating if need be) the database at `path`. `check_same_thread=False` is for an
        owner that hands the connection from thread to thread, one at a time (asyncstore)."""
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        try:
            private.make_dir(path.parent, check_existing=False)  # a new one is 0700; see `open`
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
        self._db = self._connect(check_same_thread)

    @_at_the_edge
    def _connect(self, check_same_thread: bool) -> sqlite3.Connection:
        db = sqlite3.connect(
            str(self.path), isolation_level=None, timeout=self.busy_timeout_s, check_same_thread=check_same_thread
        )
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    @classmethod
    def open(cls, state_dir: Path) -> Store:
        """The control plane's database, in its state directory, which must be private too (a
        copy elsewhere, such as a backup, is opened with `Store(path)`)."""
        try:
            private.make_dir(state_dir, "the control plane's state directory")
        except OSError as exc:
            raise MachineError(f"cannot open the state directory {state_dir}: {exc.strerror or exc}") from None
        return cls(store_path(state_dir))

    def close(self) -> None:
        self._db.close()

    @_at_the_edge
    def check(self) -> None:
        """SQLite's `PRAGMA quick_check` (every page and b-tree, in a few ms for a store this
        size); raises `StoreCorrupt` with what it found."""
        found = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        if found != ["ok"]:
            raise StoreCorrupt(
                self.path, "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
            )

    # -- nodes ----------------------------------------------------------------------------

    @_at_the_edge
    def nodes(self) -> list[NodeRow]:
        rows = self._db.execute(
            "SELECT node_id, first_seen, last_seen, address, cordoned, draining FROM nodes ORDER BY node_id"
        ).fetchall()
        return [
            NodeRow(
                node_id=r[0], first_seen=r[1], last_seen=r[2], address=r[3], cordoned=bool(r[4]), draining=bool(r[5])
            )
            for r in rows
        ]

    @_at_the_edge
    def node(self, node_id: str) -> NodeRow | None:
        return next((n for n in self.nodes() if n.node_id == node_id), None)

    @_at_the_edge
    def saw_node(self, node_id: str, address: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._db.execute(
            "INSERT INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (node_id) DO UPDATE SET last_seen = excluded.last_seen, address = excluded.address",
            (node_id, now, now, address),
        )

    @_at_the_edge
    def know_node(self, node_id: str, address: str, now: float | None = None) -> None:
        """Make sure the node has a row (a new one says it was seen now); an existing one is kept."""
        now = time.time() if now is None else now
        self._db.execute(
            "INSERT OR IGNORE INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?)",
            (node_id, now, now, address),
        )

    @_at_the_edge
    def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET cordoned = ? WHERE node_id = ?", (int(cordoned), node_id))

    @_at_the_edge
    def set_draining(self, node_id: str, draining: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET draining = ? WHERE node_id = ?", (int(draining), node_id))

    @_at_the_edge
    def set_drained(self, node_id: str) -> None:
        """A drain's end: cordoned and no longer draining, in one statement."""
        self._update_known(node_id, "UPDATE nodes SET cordoned = 1, draining = 0 WHERE node_id = ?", (node_id,))

    def _update_known(self, node_id: str, sql: str, args: tuple) -> None:
        if self._db.execute(sql, args).rowcount == 0:
            raise UnknownNode(node_id, [n.node_id for n in self.nodes()])

    @_at_the_edge
    def remove_node(self, node_id: str, now: float | None = None, *, also_revoke: int | None = None) -> list[str]:
        """Forget a node and revoke every certificate issued to it, and `also_revoke` (the one it
        is connected with, which this control plane may not have issued), in one transaction;
        returns the revoked serials. `UnknownNode` if there is nothing to forget or revoke."""
        now = time.time() if now is None else now
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")  # the lock first: no read that a writer could outdate
            known = self._db.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            issued = [
                r[0]
                for r in self._db.execute(
                    "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL", (node_id,)
                ).fetchall()
            ]
            if not known and not issued and also_revoke is None:
                raise UnknownNode(node_id, [n.node_id for n in self.nodes()])
            self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
            self._db.execute(
                "UPDATE certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL", (now, node_id)
            )
            if also_revoke is not None:
                self._revoke(also_revoke, node_id, now)
                issued.append(str(also_revoke))
        return issued

    # -- placements -----------------------------------------------------------------------

    @_at_the_edge
    def placements(self) -> dict[str, dict]:
        rows = self._db.execute("SELECT replica_id, body FROM placements ORDER BY replica_id").fetchall()
        return {r[0]: json.loads(r[1]) for r in rows}

    @_at_the_edge
    def set_placements(self, placements: dict[str, dict]) -> None:
        """Replace the stored placements with these (one transaction)."""
        self._replace_placements(placements)

    @_at_the_edge
    def scrub_placements(self, placements: dict[str, dict]) -> bool:
        """Replace the placements and leave no trace of the rows they replace in the files, for
        rows that held a secret: deleted content is overwritten with zeros (secure_delete), the
        file is rebuilt from what is live (VACUUM: earlier writes left old rows in free space)
        and the write-ahead log is emptied. The replacement is one transaction, as in
        `set_placements`; the scrub follows it. False if a reader of another process kept the
        log from being emptied within the busy timeout: its old frames are overwritten as the
        log is reused."""
        self._db.execute("PRAGMA secure_delete = ON")
        try:
            self._replace_placements(placements)
            self._db.execute("VACUUM")
            busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            self._db.execute("PRAGMA secure_delete = OFF")
        return not busy

    def _replace_placements(self, placements: dict[str, dict]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM placements")
            self._db.executemany(
                "INSERT INTO placements (replica_id, body) VALUES (?, ?)",
                [(k, json.dumps(v, sort_keys=True)) for k, v in sorted(placements.items())],
            )

    # -- gateway API keys -----------------------------------------------------------------

    @_at_the_edge
    def api_keys(self) -> list[KeyRow]:
        rows = self._db.execute(
            "SELECT name, token_sha256, models, rate_per_minute, max_concurrency, created_at, revoked_at "
            "FROM api_keys ORDER BY name"
        ).fetchall()
        return [
            KeyRow(
                name=r[0],
                token_sha256=r[1],
                models=tuple(json.loads(r[2])),
                rate_per_minute=r[3],
                max_concurrency=r[4],
                created_at=r[5],
                revoked_at=r[6],
            )
            for r in rows
        ]

    @_at_the_edge
    def add_api_key(self, row: KeyRow) -> bool:
        """Record a new key; False if the name is taken (a revoked key keeps its name)."""
        try:
            self._db.execute(
                "INSERT INTO api_keys (name, token_sha256, models, rate_per_minute, max_concurrency, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    row.name,
                    row.token_sha256,
                    json.dumps(list(row.models)),
                    row.rate_per_minute,
                    row.max_concurrency,
                    row.created_at,
                ),
            )
        except sqlite3.IntegrityError:
            return False
        return True

    @_at_the_edge
    def revoke_api_key(self, name: str, now: float | None = None) -> bool:
        """Mark a key revoked; False if no key has that name."""
        now = time.time() if now is None else now
        cur = self._db.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE name = ?", (now, name))
        return cur.rowcount > 0

    # -- the catalog ----------------------------------------------------------------------

    @_at_the_edge
    def catalog_models(self) -> dict[str, float]:
        """When each model the catalog ever named first entered it (unix time), by name."""
        return dict(self._db.execute("SELECT name, created FROM catalog_models").fetchall())

    @_at_the_edge
    def record_catalog(self, created: dict[str, float]) -> None:
        """Record the names of `created` not recorded yet, with their time; a name recorded keeps
        its first time (a model removed and added again)."""
        with self._db:
            self._db.executemany(
                "INSERT OR IGNORE INTO catalog_models (name, created) VALUES (?, ?)", sorted(created.items())
            )

    # -- certificates ---------------------------------------------------------------------

    @_at_the_edge
    def record_issued(
        self,
        serial: int,
        node_id: str,
        not_after: float,
        *,
        revoke_others: bool = False,
        also_revoke: Sequence[int] = (),
        now: float | None = None,
    ) -> list[str]:
        """Record a certificate just issued to `node_id`, so that `llmgw node remove` revokes it
        even if it never connects. With `revoke_others`, revoke every other certificate issued to
        the node id (a node id has one live certificate: the machine it replaces loses its own);
        and revoke `also_revoke` (what the machine held before, which this CA issued but may not
        have recorded). One transaction, the one way a serial is recorded (`llmgw ca issue`,
        `llmgw node add` through the admin API); returns the serials it revoked, decimal, in
        numeric order. Recording a serial again changes nothing."""
        now = time.time() if now is None else now
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR IGNORE INTO certificates (serial, node_id, not_after, issued_at) VALUES (?, ?, ?, ?)",
                (str(serial), node_id, not_after, now),
            )
            revoked: list[str] = []
            if revoke_others:
                revoked = [
                    r[0]
                    for r in self._db.execute(
                        "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL AND serial != ?",
                        (node_id, str(serial)),
                    ).fetchall()
                ]
                self._db.execute(
                    "UPDATE certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL AND serial != ?",
                    (now, node_id, str(serial)),
                )
            for other in also_revoke:
                if other != serial and str(other) not in revoked:
                    self._revoke(other, node_id, now)
                    revoked.append(str(other))
        return sorted(revoked, key=int)

    @_at_the_edge
    def revoke_serial(self, serial: int, node_id: str, now: float | None = None) -> None:
        self._revoke(serial, node_id, time.time() if now is None else now)

    def _revoke(self, serial: int, node_id: str, now: float) -> None:
        self._db.execute(
            "INSERT INTO certificates (serial, node_id, not_after, issued_at, revoked_at) VALUES (?, ?, 0, ?, ?) "
            "ON CONFLICT (serial) DO UPDATE SET revoked_at = COALESCE(revoked_at, excluded.revoked_at)",
            (str(serial), node_id, now, now),
        )

    @_at_the_edge
    def is_revoked(self, serial: int) -> bool:
        row = self._db.execute("SELECT revoked_at FROM certificates WHERE serial = ?", (str(serial),)).fetchone()
        return row is not None and row[0] is not None

    @_at_the_edge
    def certificate(self, serial: int) -> CertRow | None:
        """What the store holds of one serial; None if it was never recorded or revoked."""
        row = self._db.execute(
            "SELECT serial, node_id, not_after, issued_at, revoked_at FROM certificates WHERE serial = ?",
            (str(serial),),
        ).fetchone()
        if row is None:
            return None
        return CertRow(serial=int(row[0]), node_id=row[1], not_after=row[2], issued_at=row[3], revoked_at=row[4])

    @_at_the_edge
    def revoked_serials(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT serial FROM certificates WHERE revoked_at IS NOT NULL")]


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
