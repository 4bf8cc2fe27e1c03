"""`Store`: the control plane's durable state, one small transaction per call, over a backend.

What lives here survives a control-plane restart: the nodes it knows (and when it last saw
each), cordon and drain marks, the certificates it issued and the serials it revoked, the
replica placements with the model versions they run, the gateway's API keys, and when each
model entered the catalog. What does not: anything an agent reports (inventory, engines,
replicas), which is rebuilt when the agents reconnect.

The SQL is written once, here, for both backends (`llmgw.server.store.schema` says where the
dialects differ); a backend (`backend.Backend`: `sqlite.SqliteBackend`, `postgres.PostgresBackend`,
opened and migrated by `backend.open_backend`) owns the connection, the write lock and the driver's exceptions. Every write of a call goes through
`_write`: one transaction holding the store's write lock, the one door where a check that
applies to every write belongs (the leader's fencing epoch, when several control planes share a
PostgreSQL store: `lease.Fence`). Two writers take the backend's write lock directly, on purpose, since they run
outside a control plane's calls: `backend.migrate` at open, and `migrate-store`'s copy (`copy.py`).
Reads run on their own (`_rows`).

A failed call raises a `StoreError` (the backend translated the driver's exception) and changed
nothing: each call is one transaction. The one exception is a PostgreSQL connection lost while
its COMMIT was in flight, which `StoreUnavailable.outcome_unknown` says.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from llmgw.config import StoreSection
from llmgw.server.errors import StoreFailed, UnknownNode
from llmgw.server.store import schema
from llmgw.server.store.backend import Backend, Tx, current_version, migrate, open_backend
from llmgw.server.store.budgetrows import BudgetCalls
from llmgw.server.store.lease import STANDBY, Fence
from llmgw.server.store.ledger import LedgerCalls
from llmgw.server.store.sqlite import CLI_BUSY_TIMEOUT_S, SqliteBackend


@attrs.frozen(kw_only=True)
class KeyRow:
    name: str
    token_sha256: str = attrs.field(repr=False)
    models: tuple[str, ...]
    rate_per_minute: int
    max_concurrency: int
    created_at: float
    revoked_at: float | None
    team: str = ""  # the team it belongs to, '' for none


@attrs.frozen(kw_only=True)
class HubModelRow:
    name: str
    body: dict  # the catalog entry and its estimate, as JSON
    sealed_token: str = attrs.field(default="", repr=False)  # keyseal's, '' for none
    added_at: float


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


@attrs.frozen(kw_only=True)
class AuditRow:
    """One admin action (`llmgw.server.admin.audit`): who, when, from where, what it changed."""

    id: str  # sorts as the log does: the time, then a random suffix
    at: float
    actor: str  # "admin" (the credential) or "page:<session id>"
    source: str  # the peer's address
    action: str  # "key.create", "node.drain", "page.login", ...
    target: str  # what it acted on: a key's, node's or model's name; "" for none
    detail: dict  # what changed, as JSON: never a secret


AUDIT_COLUMNS = "id, at, actor, source, action, target, detail"
MAX_AUDIT_ROWS = 10_000  # the most one read returns


def _audit_row(r: tuple) -> AuditRow:
    return AuditRow(id=r[0], at=r[1], actor=r[2], source=r[3], action=r[4], target=r[5], detail=json.loads(r[6]))


def audit_id(at: float) -> str:
    """An entry's key: `at` as 17 characters (seconds and microseconds, zero-padded), then a random
    suffix, so that the keys sort as the entries were made (to the microsecond) and never clash."""
    return f"{at:017.6f}-{secrets.token_hex(4)}"


NODE_COLUMNS = "node_id, first_seen, last_seen, address, cordoned, draining"


def _node_row(r: tuple) -> NodeRow:
    return NodeRow(
        node_id=r[0], first_seen=r[1], last_seen=r[2], address=r[3], cordoned=bool(r[4]), draining=bool(r[5])
    )


class Store(LedgerCalls, BudgetCalls):
    """The store's calls, the same over either backend. `Store(path)` opens a SQLite file (a
    state directory's, or a backup); `Store.open` opens what server.toml's `[store]` names."""

    def __init__(
        self,
        path: Path | Backend,
        *,
        busy_timeout_s: float | None = None,
        check_same_thread: bool = True,
        fence: Fence | None = None,
    ) -> None:
        """`path`: a SQLite file (opened, created if need be, migrated), or a backend already
        open and migrated (`open_backend`). `check_same_thread=False` is for an owner that
        hands the connection from thread to thread, one at a time (asyncstore). `fence`: the
        lease every write checks first (a PostgreSQL store shared by several control planes:
        the leader's term, or `lease.STANDBY`); None, none (SQLite, the commands)."""
        if isinstance(path, Path):
            timeout = CLI_BUSY_TIMEOUT_S if busy_timeout_s is None else busy_timeout_s
            db: Backend = SqliteBackend(path, busy_timeout_s=timeout, check_same_thread=check_same_thread)
            try:
                migrate(db)
            except BaseException:
                db.close()
                raise
        else:
            db = path
        self._db = db
        self.fence = fence
        self.path = db.path
        self.busy_timeout_s = db.busy_timeout_s
        self.backend = db.dialect.name  # "sqlite" or "postgresql"

    @classmethod
    def open(
        cls,
        state_dir: Path,
        settings: StoreSection | None = None,
        *,
        busy_timeout_s: float | None = None,
        check_same_thread: bool = True,
        server: bool = False,
        fence: Fence | None = None,
        migrations: bool = True,
    ) -> Store:
        """The store `settings` (server.toml's `[store]`, a `StoreSection`; None: the default)
        names: the state directory's SQLite file, which must be private too, or a PostgreSQL
        database (`server`: this is a running control plane's, which others can tell).
        `fence`: the lease its writes check (`Store`), and a leader's term migrates a shared
        store; `migrations` False: opened as it is (`open_backend`)."""
        return cls(
            open_backend(
                state_dir,
                settings,
                busy_timeout_s=busy_timeout_s,
                check_same_thread=check_same_thread,
                server=server,
                migrations=migrations,
                fence=None if fence == STANDBY else fence,  # a standby's refuses: StoreSchemaBehind
            ),
            fence=fence,
        )

    def close(self) -> None:
        self._db.close()

    def check(self) -> None:
        """The backend's check (SQLite: `PRAGMA quick_check`, `StoreCorrupt` with what it found;
        PostgreSQL: it answers), then the schema version: this llmgw's latest, or an error."""
        self._db.check()
        found = current_version(self._db)
        if found != schema.LATEST:
            raise StoreFailed(
                self.path,
                f"its schema is at version {found}, this llmgw needs {schema.LATEST}; open it once with "
                "migrations allowed (`llmgw server` does at start)",
            )

    @contextlib.contextmanager
    def _write(self) -> Iterator[Tx]:
        """The one door of every write: a transaction holding the write lock, in which the
        leader's fencing epoch is checked first when there is one (`lease.Fence`: `NotLeader`
        once the lease has passed to another, and nothing is written)."""
        with self._db.write() as tx:
            if self.fence is not None:
                self.fence.check(tx, self.path)
            yield tx

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        return self._db.rows(sql, args)

    # -- nodes ----------------------------------------------------------------------------

    def nodes(self) -> list[NodeRow]:
        return [_node_row(r) for r in self._rows(f"SELECT {NODE_COLUMNS} FROM nodes ORDER BY node_id")]

    def node(self, node_id: str) -> NodeRow | None:
        """One node's row, read by its key: a node's joining costs the same with 5,000 nodes as with 5."""
        found = self._rows(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,))
        return _node_row(found[0]) if found else None

    def saw_node(self, node_id: str, address: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._write() as tx:
            tx.execute(
                "INSERT INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (node_id) DO UPDATE SET last_seen = excluded.last_seen, address = excluded.address",
                (node_id, now, now, address),
            )

    def saw_nodes(self, seen: dict[str, str], now: float | None = None) -> dict[str, NodeRow]:
        """`saw_node` for each node id -> address, in one transaction; the rows as they are then
        (thousands of nodes joining at once: a transaction each kept their hellos waiting)."""
        now = time.time() if now is None else now
        ids = sorted(seen)
        with self._write() as tx:
            tx.executemany(
                "INSERT INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (node_id) DO UPDATE SET last_seen = excluded.last_seen, address = excluded.address",
                [(node_id, now, now, seen[node_id]) for node_id in ids],
            )
        rows: dict[str, NodeRow] = {}
        for at in range(0, len(ids), 500):  # within any backend's limit of parameters
            part = ids[at : at + 500]
            marks = ", ".join("?" * len(part))
            for r in self._rows(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id IN ({marks})", tuple(part)):
                row = _node_row(r)
                rows[row.node_id] = row
        return rows

    def know_node(self, node_id: str, address: str, now: float | None = None) -> None:
        """Make sure the node has a row (a new one says it was seen now); an existing one is kept."""
        now = time.time() if now is None else now
        with self._write() as tx:
            tx.execute(
                "INSERT INTO nodes (node_id, first_seen, last_seen, address) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (node_id, now, now, address),
            )

    def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET cordoned = ? WHERE node_id = ?", (int(cordoned), node_id))

    def set_draining(self, node_id: str, draining: bool) -> None:
        self._update_known(node_id, "UPDATE nodes SET draining = ? WHERE node_id = ?", (int(draining), node_id))

    def set_drained(self, node_id: str) -> None:
        """A drain's end: cordoned and no longer draining, in one statement."""
        self._update_known(node_id, "UPDATE nodes SET cordoned = 1, draining = 0 WHERE node_id = ?", (node_id,))

    def _update_known(self, node_id: str, sql: str, args: tuple) -> None:
        with self._write() as tx:
            if tx.execute(sql, args) == 0:
                raise UnknownNode(node_id, _node_ids(tx))

    def remove_node(self, node_id: str, now: float | None = None, *, also_revoke: int | None = None) -> list[str]:
        """Forget a node and revoke every certificate issued to it, and `also_revoke` (the one it
        is connected with, which this control plane may not have issued), in one transaction;
        returns the revoked serials. `UnknownNode` if there is nothing to forget or revoke."""
        now = time.time() if now is None else now
        with self._write() as tx:  # the lock first: no read that a writer could outdate
            known = tx.rows("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,))
            issued = [
                r[0]
                for r in tx.rows("SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL", (node_id,))
            ]
            if not known and not issued and also_revoke is None:
                raise UnknownNode(node_id, _node_ids(tx))
            tx.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
            tx.execute(
                "UPDATE certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL", (now, node_id)
            )
            if also_revoke is not None:
                _revoke(tx, also_revoke, node_id, now)
                issued.append(str(also_revoke))
        return issued

    # -- placements -----------------------------------------------------------------------

    def placements(self) -> dict[str, dict]:
        rows = self._rows("SELECT replica_id, body FROM placements ORDER BY replica_id")
        return {r[0]: json.loads(r[1]) for r in rows}

    def set_placements(self, placements: dict[str, dict], versions: dict[str, dict] | None = None) -> None:
        """Replace the stored placements with these, and the model versions they run with
        `versions` (None: those stay as they are); one transaction."""
        with self._write() as tx:
            tx.execute("DELETE FROM placements")
            tx.executemany(
                "INSERT INTO placements (replica_id, body) VALUES (?, ?)",
                [(k, json.dumps(v, sort_keys=True)) for k, v in sorted(placements.items())],
            )
            if versions is not None:
                tx.execute("DELETE FROM model_versions")
                tx.executemany(
                    "INSERT INTO model_versions (id, body) VALUES (?, ?)",
                    [(k, json.dumps(v, sort_keys=True)) for k, v in sorted(versions.items())],
                )

    def model_versions(self) -> dict[str, dict]:
        """The definitions the placements run, by MODEL@VERSION (`llmgw.server.state.versions`)."""
        return {r[0]: json.loads(r[1]) for r in self._rows("SELECT id, body FROM model_versions ORDER BY id")}

    def scrub_placements(self, placements: dict[str, dict]) -> bool:
        """Replace the placements (one transaction, as in `set_placements`), then leave as
        little trace of the rows they replace as the backend can, for rows that held a secret.
        SQLite: deleted content is overwritten with zeros (secure_delete), the file rebuilt
        from what is live (VACUUM) and the write-ahead log emptied; False if a reader of
        another process kept the log from being emptied within the busy timeout (its old
        frames are overwritten as the log is reused). PostgreSQL: the table is rewritten
        (VACUUM FULL, cheap at this size) so its files hold no dead row; PostgreSQL's
        write-ahead log, its archive, replicas and base backups keep the old rows until they
        are recycled, which no client can hasten."""
        return self._db.scrub(lambda: self.set_placements(placements))

    # -- gateway API keys -----------------------------------------------------------------

    def api_keys(self) -> list[KeyRow]:
        rows = self._rows(
            "SELECT name, token_sha256, models, rate_per_minute, max_concurrency, created_at, revoked_at, team "
            "FROM api_keys ORDER BY name"
        )
        return [
            KeyRow(
                name=r[0],
                token_sha256=r[1],
                models=tuple(json.loads(r[2])),
                rate_per_minute=r[3],
                max_concurrency=r[4],
                created_at=r[5],
                revoked_at=r[6],
                team=r[7],
            )
            for r in rows
        ]

    def add_api_key(self, row: KeyRow) -> bool:
        """Record a new key; False if the name is taken (a revoked key keeps its name)."""
        with self._write() as tx:
            added = tx.execute(
                "INSERT INTO api_keys (name, token_sha256, models, rate_per_minute, max_concurrency, created_at, team) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (
                    row.name,
                    row.token_sha256,
                    json.dumps(list(row.models)),
                    row.rate_per_minute,
                    row.max_concurrency,
                    row.created_at,
                    row.team,
                ),
            )
        return added > 0

    def revoke_api_key(self, name: str, now: float | None = None) -> bool:
        """Mark a key revoked; False if no key has that name."""
        now = time.time() if now is None else now
        with self._write() as tx:
            return (
                tx.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE name = ?", (now, name)) > 0
            )

    # -- the catalog ----------------------------------------------------------------------

    def catalog_models(self) -> dict[str, float]:
        """When each model the catalog ever named first entered it (unix time), by name."""
        return {r[0]: r[1] for r in self._rows("SELECT name, created FROM catalog_models")}

    def record_catalog(self, created: dict[str, float]) -> None:
        """Record the names of `created` not recorded yet, with their time; a name recorded keeps
        its first time (a model removed and added again)."""
        with self._write() as tx:
            tx.executemany(
                "INSERT INTO catalog_models (name, created) VALUES (?, ?) ON CONFLICT DO NOTHING",
                sorted(created.items()),
            )

    # -- models added from the Hub ---------------------------------------------------------

    def hub_models(self) -> list[HubModelRow]:
        rows = self._rows("SELECT name, body, sealed_token, added_at FROM hub_models ORDER BY name")
        return [HubModelRow(name=r[0], body=json.loads(r[1]), sealed_token=r[2], added_at=r[3]) for r in rows]

    def add_hub_model(self, row: HubModelRow) -> bool:
        """Record a model added to the catalog; False if one of that name is there already."""
        with self._write() as tx:
            added = tx.execute(
                "INSERT INTO hub_models (name, body, sealed_token, added_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (row.name, json.dumps(row.body, sort_keys=True), row.sealed_token, row.added_at),
            )
        return added > 0

    def update_hub_model(self, row: HubModelRow) -> bool:
        """Replace a model added to the catalog with `row` (`llmgw ctl models update`; its
        `added_at` stays); False if there is none of that name."""
        with self._write() as tx:
            return (
                tx.execute(
                    "UPDATE hub_models SET body = ?, sealed_token = ? WHERE name = ?",
                    (json.dumps(row.body, sort_keys=True), row.sealed_token, row.name),
                )
                > 0
            )

    def remove_hub_model(self, name: str) -> bool:
        """Forget a model added to the catalog; False if there was none of that name."""
        with self._write() as tx:
            return tx.execute("DELETE FROM hub_models WHERE name = ?", (name,)) > 0

    # -- the audit log --------------------------------------------------------------------

    def record_audit(
        self,
        *,
        actor: str,
        source: str,
        action: str,
        target: str = "",
        detail: dict | None = None,
        now: float | None = None,
    ) -> AuditRow:
        """Append one admin action to the audit log; the row written. `detail` must hold nothing
        secret (`llmgw.server.admin.audit` makes it so)."""
        at = time.time() if now is None else now
        row = AuditRow(
            id=audit_id(at), at=at, actor=actor, source=source, action=action, target=target, detail=detail or {}
        )
        with self._write() as tx:
            tx.execute(
                f"INSERT INTO audit_log ({AUDIT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (row.id, at, actor, source, action, target, json.dumps(row.detail, sort_keys=True)),
            )
        return row

    def audit(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        action: str = "",
        actor: str = "",
        target: str = "",
        limit: int = 100,
    ) -> list[AuditRow]:
        """The audit log's entries, newest first, at most `limit` (up to `MAX_AUDIT_ROWS`):
        from `since` (inclusive) to `until` (exclusive), unix seconds; `action` "key" matches
        "key" and every "key.*", "key.create" only itself; `actor` "page" matches "page" and every
        "page:*" (a page session's); `target` exactly."""
        where: list[str] = []
        args: list[Any] = []
        if since is not None:
            where.append("at >= ?")
            args.append(since)
        if until is not None:
            where.append("at < ?")
            args.append(until)
        for column, value, sep in (("action", action, "."), ("actor", actor, ":")):
            if value:
                # substr rather than LIKE: no wildcard in a name can widen the match.
                where.append(f"({column} = ? OR substr({column}, 1, ?) = ?)")
                args.extend((value, len(value) + 1, value + sep))
        if target:
            where.append("target = ?")
            args.append(target)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        args.append(max(1, min(limit, MAX_AUDIT_ROWS)))
        rows = self._rows(f"SELECT {AUDIT_COLUMNS} FROM audit_log{clause} ORDER BY at DESC, id DESC LIMIT ?", args)
        return [_audit_row(r) for r in rows]

    def prune_audit(self, before: float) -> int:
        """Forget the audit log's entries older than `before` (unix seconds); how many."""
        with self._write() as tx:
            return tx.execute("DELETE FROM audit_log WHERE at < ?", (before,))

    # -- certificates ---------------------------------------------------------------------

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
        with self._write() as tx:
            tx.execute(
                "INSERT INTO certificates (serial, node_id, not_after, issued_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (str(serial), node_id, not_after, now),
            )
            revoked: list[str] = []
            if revoke_others:
                revoked = [
                    r[0]
                    for r in tx.rows(
                        "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL AND serial != ?",
                        (node_id, str(serial)),
                    )
                ]
                tx.execute(
                    "UPDATE certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL AND serial != ?",
                    (now, node_id, str(serial)),
                )
            for other in also_revoke:
                if other != serial and str(other) not in revoked:
                    _revoke(tx, other, node_id, now)
                    revoked.append(str(other))
        return sorted(revoked, key=int)

    def revoke_serial(self, serial: int, node_id: str, now: float | None = None) -> None:
        with self._write() as tx:
            _revoke(tx, serial, node_id, time.time() if now is None else now)

    def is_revoked(self, serial: int) -> bool:
        rows = self._rows("SELECT revoked_at FROM certificates WHERE serial = ?", (str(serial),))
        return bool(rows) and rows[0][0] is not None

    def certificate(self, serial: int) -> CertRow | None:
        """What the store holds of one serial; None if it was never recorded or revoked."""
        rows = self._rows(
            "SELECT serial, node_id, not_after, issued_at, revoked_at FROM certificates WHERE serial = ?",
            (str(serial),),
        )
        if not rows:
            return None
        (row,) = rows
        return CertRow(serial=int(row[0]), node_id=row[1], not_after=row[2], issued_at=row[3], revoked_at=row[4])

    def revoked_serials(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT serial FROM certificates WHERE revoked_at IS NOT NULL")]


def _node_ids(tx: Tx) -> list[str]:
    return [r[0] for r in tx.rows("SELECT node_id FROM nodes ORDER BY node_id")]


def _revoke(tx: Tx, serial: int, node_id: str, now: float) -> None:
    tx.execute(
        "INSERT INTO certificates (serial, node_id, not_after, issued_at, revoked_at) VALUES (?, ?, 0, ?, ?) "
        "ON CONFLICT (serial) DO UPDATE SET revoked_at = COALESCE(certificates.revoked_at, excluded.revoked_at)",
        (str(serial), node_id, now, now),
    )
