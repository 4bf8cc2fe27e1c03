"""`llmgw server check-store`: whether this machine reaches the store server.toml names, and
which store it is, without changing it.

What `llmgw server add` runs on a new control plane's machine before it starts the service
there: a PostgreSQL store it cannot reach is said then, with libpq's reason, and nothing is
started. It never migrates (a database at an older schema is left for the leader's start to
migrate) and never writes.

A store's `identity` tells two urls apart that name different databases, where the url alone
cannot (`127.0.0.1` here is another machine's `10.0.0.5`): the sha256 of its `schema_version`
rows, each migration's version and the time it was applied, which every llmgw store holds from
its first open and which no copy carries (`schema_version` is the database's own,
`llmgw.server.store.schema`). An empty database has none: "".
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from llmgw.config import StoreSection, storeurl
from llmgw.server.store import schema
from llmgw.server.store.backend import Backend, current_version
from llmgw.server.store.sqlite import CLI_BUSY_TIMEOUT_S, SqliteBackend, store_path


@attrs.frozen(kw_only=True)
class Seen:
    store: str  # the state directory's llmgw.db, or the PostgreSQL database's redacted url
    backend: str  # "sqlite" or "postgresql"
    version: int  # its schema version; 0: an empty database
    latest: int  # this llmgw's
    identity: str  # sha256 of its schema_version rows, hex; "" for an empty database

    def as_json(self) -> dict:
        return attrs.asdict(self)

    def text(self) -> str:
        if self.version == 0:
            return f"{self.store} answers; it holds no llmgw store yet"
        behind = ""
        if self.version < self.latest and self.backend == "postgresql" and self.version >= schema.LEASED:
            behind = (
                f" (this llmgw's is {self.latest}: a control plane of this llmgw migrates it when it takes the lease)"
            )
        elif self.version < self.latest:
            behind = f" (this llmgw's is {self.latest}: the next `llmgw server` start migrates it)"
        return f"{self.store} answers; schema version {self.version}{behind}; identity {self.identity[:16]}"


def look(state_dir: Path, settings: StoreSection) -> Seen:
    """Open the store `settings` names, read what it is, close it. Raises the store's errors
    (`StoreUnavailable` with libpq's reason for a database this machine cannot reach)."""
    if not storeurl.is_postgresql(settings.url) and not store_path(state_dir).exists():
        # Opening would make the file: a check makes nothing.
        return Seen(store=str(store_path(state_dir)), backend="sqlite", version=0, latest=schema.LATEST, identity="")
    db = _open(state_dir, settings)
    try:
        db.check()
        version = current_version(db)  # StoreSchemaNewer for a newer llmgw's database
        rows = db.rows("SELECT version, applied_at FROM schema_version ORDER BY version") if version else []
        return Seen(
            store=str(db.path),
            backend=db.dialect.name,
            version=version,
            latest=schema.LATEST,
            identity=identity(rows),
        )
    finally:
        db.close()


def identity(rows: list[tuple]) -> str:
    if not rows:
        return ""
    text = "\n".join(f"{int(version)} {float(applied_at)!r}" for version, applied_at in rows)
    return hashlib.sha256(text.encode()).hexdigest()


def _open(state_dir: Path, settings: StoreSection) -> Backend:
    # The backend alone, not `open_backend`: that one migrates, and a check changes nothing.
    if storeurl.is_postgresql(settings.url):
        from llmgw.server.store.postgres import PostgresBackend, read_password

        password = read_password(settings.password_file) if settings.password_file else None
        return PostgresBackend(settings.url, password=password, busy_timeout_s=CLI_BUSY_TIMEOUT_S)
    return SqliteBackend(store_path(state_dir), busy_timeout_s=CLI_BUSY_TIMEOUT_S)
