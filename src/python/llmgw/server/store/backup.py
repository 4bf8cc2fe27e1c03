"""An online backup of the control plane's database (`llmgw server backup FILE`).

SQLite's backup API copies the database page by page inside one read transaction, so the copy
is the database as of one moment, even while the server writes (in WAL mode a reader neither
waits for the writer nor holds it up). The copy is made in a temporary file next to FILE
(mode 0600 from its creation: it holds the gateway keys' hashes and the placements' engine
keys, sealed: they open only with the state directory's engine-keys.secret, which is not in it), switched to a rollback journal so it is one self-contained file, checked with
`PRAGMA quick_check`, synced, and only then renamed to FILE: a FILE that exists is a whole,
checked backup. An existing FILE is kept unless `force`.

A PostgreSQL store (`[store] url`) is backed up with PostgreSQL's own tools (pg_dump, base
backups); `backup` says so instead of copying an unused SQLite file.

SQLite itself is the store's (`llmgw.server.store.copy_database` makes the copy and checks it):
this module owns the files around it — the private temporary file, the sync, the rename.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from llmgw.config import StoreSection, storeurl
from llmgw.errors import MachineError, UsageError
from llmgw.server.store import copy_database, store_path


@attrs.frozen(kw_only=True)
class BackupInfo:
    source: Path
    path: Path
    size_bytes: int
    nodes: int
    api_keys: int
    placements: int
    revoked_certificates: int


def backup(state_dir: Path, dest: Path, *, force: bool = False, settings: StoreSection | None = None) -> BackupInfo:
    """Back up the state directory's SQLite store to `dest`. `settings`: server.toml's `[store]`;
    a PostgreSQL store is refused, saying how it is backed up instead (pg_dump)."""
    if settings is not None and storeurl.is_postgresql(settings.url):
        raise UsageError(
            f"this control plane's store is PostgreSQL ({storeurl.redact(settings.url)}), which `llmgw server backup` "
            "does not copy: back it up the PostgreSQL way, e.g. `pg_dump --format=custom --file=llmgw.dump "
            'postgresql://USER@HOST:PORT/DBNAME` (docs/operations.md, "The PostgreSQL store"), or turn it into a '
            "SQLite file with `llmgw server migrate-store --to sqlite --state-dir EMPTY_DIR`"
        )
    source = store_path(state_dir)
    try:
        found = source.is_file()
    except PermissionError:
        raise MachineError(
            f"cannot read {source}: the state directory is readable only by its owner (root on a control "
            "plane); run the command with sudo"
        ) from None
    if not found:
        raise MachineError(
            f"no control-plane database at {source}, so nothing to back up; is the state directory right "
            "(--state-dir, or [server].state_dir of --config)?"
        )
    if dest.is_dir():
        raise UsageError(f"{dest} is a directory; give the backup's file name, e.g. {dest / 'llmgw-backup.db'}")
    if dest.exists() and not force:
        raise UsageError(f"{dest} exists; choose another name, or pass --force to replace it")
    if not dest.parent.is_dir():
        raise UsageError(f"the directory {dest.parent} does not exist; create it first")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise MachineError(f"cannot write the backup next to {dest}: {exc}") from None
    try:
        os.fchmod(fd, 0o600)  # exactly: a umask such as 0277 would leave it 0400, which SQLite cannot write
    finally:
        os.close(fd)
    try:
        counts = copy_database(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _publish(tmp, dest, force=force)
    finally:
        tmp.unlink(missing_ok=True)
    return BackupInfo(source=source, path=dest, size_bytes=dest.stat().st_size, **counts)


def _publish(tmp: Path, dest: Path, *, force: bool) -> None:
    """Rename the finished copy to `dest` atomically; without `force`, never over an existing file."""
    try:
        if force:
            os.replace(tmp, dest)
        else:
            os.link(tmp, dest)  # fails if dest appeared meanwhile, where a rename would replace it
    except FileExistsError:
        raise UsageError(f"{dest} exists; choose another name, or pass --force to replace it") from None
    except OSError as exc:
        raise MachineError(f"cannot write the backup {dest}: {exc}") from None
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
