"""The control plane's durable state: operator intent and identity, in SQLite.

What lives here survives a control-plane restart: the nodes it knows (and when it last saw
each), cordon and drain marks, the certificates it issued and the serials it revoked. What
does not: anything an agent reports (inventory, engines, replicas), which is rebuilt when the
agents reconnect.

Calls are synchronous and short (one small transaction each); callers on the trio loop call
them directly. The database is opened in WAL mode so `llmgw ca issue` can record a
certificate while the server runs.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import attrs

from llmgw.errors import MachineError, UsageError

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


def store_path(state_dir: Path) -> Path:
    return state_dir / "llmgw.db"


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise MachineError(f"cannot open the control plane's store {path}: {exc}; check its permissions") from None

    @classmethod
    def open(cls, state_dir: Path) -> Store:
        return cls(store_path(state_dir))

    def close(self) -> None:
        self._db.close()

    # -- nodes ----------------------------------------------------------------------------

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

    def node(self, node_id: str) -> NodeRow | None:
        return next((n for n in self.nodes() if n.node_id == node_id), None)

    def saw_node(self, node_id: str, address: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._db.execute(
            "INSERT INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (node_id) DO UPDATE SET last_seen = excluded.last_seen, address = excluded.address",
            (node_id, now, now, address),
        )

    def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET cordoned = ? WHERE node_id = ?", (int(cordoned), node_id))

    def set_draining(self, node_id: str, draining: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET draining = ? WHERE node_id = ?", (int(draining), node_id))

    def _update_known(self, node_id: str, sql: str, args: tuple) -> None:
        if self._db.execute(sql, args).rowcount == 0:
            raise UnknownNode(node_id, [n.node_id for n in self.nodes()])

    def remove_node(self, node_id: str, now: float | None = None) -> list[str]:
        """Forget a node and revoke every certificate issued to it; returns the revoked serials."""
        now = time.time() if now is None else now
        known = self._db.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        issued = self._db.execute(
            "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL", (node_id,)
        ).fetchall()
        if not known and not issued:
            raise UnknownNode(node_id, [n.node_id for n in self.nodes()])
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
            self._db.execute(
                "UPDATE certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL", (now, node_id)
            )
        return [r[0] for r in issued]

    # -- placements -----------------------------------------------------------------------

    def placements(self) -> dict[str, dict]:
        rows = self._db.execute("SELECT replica_id, body FROM placements ORDER BY replica_id").fetchall()
        return {r[0]: json.loads(r[1]) for r in rows}

    def set_placements(self, placements: dict[str, dict]) -> None:
        """Replace the stored placements with these (one transaction)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM placements")
            self._db.executemany(
                "INSERT INTO placements (replica_id, body) VALUES (?, ?)",
                [(k, json.dumps(v, sort_keys=True)) for k, v in sorted(placements.items())],
            )

    # -- gateway API keys -----------------------------------------------------------------

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

    def revoke_api_key(self, name: str, now: float | None = None) -> bool:
        """Mark a key revoked; False if no key has that name."""
        now = time.time() if now is None else now
        cur = self._db.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE name = ?", (now, name))
        return cur.rowcount > 0

    # -- certificates ---------------------------------------------------------------------

    def record_certificate(self, serial: int, node_id: str, not_after: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._db.execute(
            "INSERT OR IGNORE INTO certificates (serial, node_id, not_after, issued_at) VALUES (?, ?, ?, ?)",
            (str(serial), node_id, not_after, now),
        )

    def revoke_serial(self, serial: int, node_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._db.execute(
            "INSERT INTO certificates (serial, node_id, not_after, issued_at, revoked_at) VALUES (?, ?, 0, ?, ?) "
            "ON CONFLICT (serial) DO UPDATE SET revoked_at = COALESCE(revoked_at, excluded.revoked_at)",
            (str(serial), node_id, now, now),
        )

    def is_revoked(self, serial: int) -> bool:
        row = self._db.execute("SELECT revoked_at FROM certificates WHERE serial = ?", (str(serial),)).fetchone()
        return row is not None and row[0] is not None

    def revoked_serials(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT serial FROM certificates WHERE revoked_at IS NOT NULL")]


class UnknownNode(UsageError):
    def __init__(self, node_id: str, known: list[str]) -> None:
        self.node_id = node_id
        listing = ", ".join(known) if known else "none"
        super().__init__(
            f"no node {node_id!r} is known to this control plane (known nodes: {listing}); see `llmgw ctl nodes`"
        )
