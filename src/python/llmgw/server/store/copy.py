"""`llmgw server migrate-store`: every table of one store copied into another, empty, store.

Either way round: SQLite to PostgreSQL (a control plane becoming one of several) and
PostgreSQL to SQLite (back to one). The copy is one transaction on the target, holding its
write lock from the first count to the COMMIT: the target is found empty, filled, counted and
read back inside it, so a target that is not empty is refused as it is, and a copy that does
not read back as its source (`CopyMismatch`) leaves it as empty as it was. The source is read
in one read-only transaction, so the copy is the source as of one moment.

Both stores are opened by this llmgw, so both are at its schema version before anything is
copied; `schema_version` is each database's own and is not copied. The state is the store's
tables alone (`schema.TABLES`: nodes, certificates issued and revoked, API keys, the catalog's
models, replica placements); there is no audit table (the audit trail is the control plane's
log). Placements hold engine keys sealed with the state directory's engine-keys.secret, which
the copy leaves where it is.
"""

from __future__ import annotations

import math

import attrs

from llmgw.errors import UsageError
from llmgw.server.errors import CopyMismatch, StoreNotEmpty
from llmgw.server.store.core import Store
from llmgw.server.store.schema import TABLE_ROWS, TABLES


@attrs.frozen(kw_only=True)
class Copied:
    source: str
    target: str
    rows: dict[str, int]  # by table, in TABLES' order: what was read, written and read back


def copy_store(source: Store, target: Store, *, target_fix: str) -> Copied:
    """Copy every table of `source` into the empty `target`; `target_fix`: how an operator empties
    the target (said when it is not empty)."""
    if str(source.path) == str(target.path):
        raise UsageError(f"the source and the target are the same store ({source.path}); name another with --to")
    with target._db.write() as tx:
        held = {table: int(tx.rows(f"SELECT COUNT(*) FROM {table}")[0][0]) for table in TABLES}
        if any(held.values()):
            raise StoreNotEmpty(target.path, {TABLE_ROWS[t]: n for t, n in held.items()}, target_fix)
        with source._db.snapshot() as snap:
            read = {
                table: _sorted(snap.rows(f"SELECT {', '.join(cols)} FROM {table}")) for table, cols in TABLES.items()
            }
        for table, cols in TABLES.items():
            marks = ", ".join("?" for _ in cols)
            tx.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", read[table])
        for table, cols in TABLES.items():
            counted = int(tx.rows(f"SELECT COUNT(*) FROM {table}")[0][0])
            if counted != len(read[table]):
                raise CopyMismatch(target.path, table, f"{len(read[table])} rows read, {counted} counted after writing")
            back = _sorted(tx.rows(f"SELECT {', '.join(cols)} FROM {table}"))
            for before, after in zip(read[table], back, strict=True):
                if not _same(before, after):
                    raise CopyMismatch(target.path, table, f"the row whose {cols[0]} is {before[0]!r} differs")
    return Copied(source=str(source.path), target=str(target.path), rows={t: len(read[t]) for t in TABLES})


def _sorted(rows: list[tuple]) -> list[tuple]:
    # By primary key (each table's first column), in Python: the two databases' collations differ.
    return sorted((tuple(r) for r in rows), key=lambda r: str(r[0]))


def _same(a: tuple, b: tuple) -> bool:
    # SQLite may hand back 10 where PostgreSQL hands back 10.0: equal as numbers, and so the same.
    return len(a) == len(b) and all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(a, b, strict=True)
    )
