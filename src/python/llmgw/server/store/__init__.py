"""The control plane's durable state (`Store`), in SQLite by default or in PostgreSQL.

    core      `Store`: every call's SQL, written once for both backends
    backend   what a backend is; `open_backend`, the one `[store]` names; `migrate`, its schema
    schema    the tables, their versioned migrations, and the two dialects
    sqlite    the state directory's llmgw.db; `copy_database` for `llmgw server backup`
    postgres  a PostgreSQL database (`[store] url`), through psycopg, imported only then
    copy      `llmgw server migrate-store`: every table from one store into an empty other
    asyncstore  the running control plane's store: a `Store` whose calls run off the event loop
    backup, migratestore, check  `llmgw server backup`, `migrate-store` and `check-store`
    keyseal   engine keys sealed for the database, and the secret that seals them

While the control plane runs, it alone opens its store, through `llmgw.server.store.asyncstore`
(which owns a `Store` and runs its calls in a worker thread, never on the event loop); `llmgw
node add` and `llmgw ca issue` record a serial and read revocations through its admin API. Only
while no control plane runs does `llmgw ca issue` open the store itself, and records with the
same method the admin API calls (`record_issued`). No module outside this package imports
sqlite3 or psycopg: the drivers' exceptions are translated here, once, into the store's errors
(`llmgw.server.errors`).
"""

from llmgw.server.errors import StoreBusy, StoreCorrupt, StoreError, StoreFailed, StoreUnavailable, UnknownNode
from llmgw.server.store.backend import migrate, open_backend
from llmgw.server.store.core import AuditRow, CertRow, HubModelRow, KeyRow, NodeRow, Store
from llmgw.server.store.sqlite import CLI_BUSY_TIMEOUT_S, copy_database, store_error, store_path

__all__ = [
    "CLI_BUSY_TIMEOUT_S",
    "AuditRow",
    "CertRow",
    "HubModelRow",
    "KeyRow",
    "NodeRow",
    "Store",
    "StoreBusy",
    "StoreCorrupt",
    "StoreError",
    "StoreFailed",
    "StoreUnavailable",
    "UnknownNode",
    "copy_database",
    "migrate",
    "open_backend",
    "store_error",
    "store_path",
]
