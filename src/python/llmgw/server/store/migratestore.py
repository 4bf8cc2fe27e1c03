"""`llmgw server migrate-store --to URL`: which two stores, whether they may be copied, the copy.

The source is the store server.toml's `[store]` names (or `--from URL`), the target `--to URL`:
"sqlite" is the state directory's llmgw.db, anything else a PostgreSQL connection string, whose
password comes from `--to-password-file` / `--from-password-file` (or the configured
`password_file` for the configured store), else from libpq's ~/.pgpass or PGPASSFILE. A url
with a password in it is refused, as in server.toml: a command line is seen by every user of the
machine.

Refused while a control plane uses either store, as far as that can be seen: a SQLite store's
state directory whose admin.url answers (a running `llmgw server` writes it and removes it when
it stops), or a PostgreSQL database where a control plane holds llmgw's serving lock (wherever
that control plane runs; `llmgw.server.store.postgres`). The copy takes that lock itself, so no
control plane starts on either database until it is done. The copy itself is
`llmgw.server.store.copy`'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from llmgw import paths
from llmgw.config import StoreSection, storeurl
from llmgw.errors import MachineError, UsageError
from llmgw.server.errors import StoreInUse
from llmgw.server.store import Store, migrate, open_backend, store_path
from llmgw.server.store.copy import Copied, copy_store

PROBE_TIMEOUT_S = 2.0


def migrate_store(
    state_dir: Path,
    configured: StoreSection,
    *,
    to: str,
    to_password_file: str = "",
    source: str | None = None,
    from_password_file: str = "",
) -> Copied:
    if source is None:
        src = configured
    else:
        src = StoreSection(url=source, password_file=_absolute(from_password_file))
        _check(src, "--from", "--from-password-file")
    dst = StoreSection(url=to, password_file=_absolute(to_password_file))
    _check(dst, "--to", "--to-password-file")
    if not storeurl.is_postgresql(src.url) and not storeurl.is_postgresql(dst.url):
        raise UsageError(
            f"the source and the target are both the state directory's {store_path(state_dir)}; give --to a "
            "PostgreSQL url (or --from one, to go back to SQLite)"
        )
    if not storeurl.is_postgresql(src.url) and not store_path(state_dir).is_file():
        raise MachineError(
            f"no control-plane database at {store_path(state_dir)}, so nothing to copy; is the state directory "
            "right (--state-dir, or [server].state_dir of --config)?"
        )
    _refuse_if_serving_here(state_dir)
    with _opened(state_dir, src) as source_store, _opened(state_dir, dst) as target_store:
        return copy_store(source_store, target_store, target_fix=_how_to_empty(state_dir, dst))


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path else ""


def _check(settings: StoreSection, url_flag: str, password_flag: str) -> None:
    found = storeurl.problems(settings.url, settings.password_file, url_key=url_flag, password_key=password_flag)
    if found:
        raise UsageError("; ".join(found))


def _refuse_if_serving_here(state_dir: Path) -> None:
    """Refused while a control plane answers at the state directory's admin.url: it uses this
    directory, and its SQLite store if that is one of the two."""
    url_file = paths.admin_url_path(state_dir)
    try:
        url = url_file.read_text().strip()
    except FileNotFoundError:
        return
    except PermissionError:
        raise MachineError(f"cannot read {url_file}; run the command with sudo") from None
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError:
        return  # a file left by a control plane that did not stop cleanly: nothing answers there
    raise StoreInUse(
        store_path(state_dir),
        f"the control plane of {state_dir} answers at {url}; if none should, remove the stale {url_file}",
    )


@contextlib.contextmanager
def _opened(state_dir: Path, settings: StoreSection) -> Iterator[Store]:
    db = open_backend(state_dir, settings, migrations=False)
    try:
        if not db.claim():
            raise StoreInUse(db.path, "a running `llmgw server` is connected to it and holds llmgw's serving lock")
        migrate(db, alone=True)  # claimed: no control plane runs on it, so none leads it
        yield Store(db)
    finally:
        db.close()


def _how_to_empty(state_dir: Path, target: StoreSection) -> str:
    if storeurl.is_postgresql(target.url):
        return (
            "drop and create the database (dropdb NAME; createdb -O ROLE NAME) if what it holds may go, or "
            "give --to another database"
        )
    db = store_path(state_dir)
    return (
        f"move {db} and its -wal and -shm files aside (mv {db} {db}.old) if what it holds may go (an earlier "
        "state, from before the move to PostgreSQL?), or give --state-dir another directory"
    )
