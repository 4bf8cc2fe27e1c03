"""Errors of the control plane's domain, by blame. Domain code raises them; the admin API alone
turns each into an HTTP status (`llmgw.server.admin.api.ANSWERS`), and the SIGHUP reload logs them.

The store's errors (`StoreBusy`, `StoreUnavailable`, `StoreFailed`, `StoreCorrupt`,
`StoreSchemaNewer`, `StoreSchemaBehind`: the database, the disk or the network refused) are the machine's;
`llmgw.server.store` alone makes them, from sqlite3's and psycopg's exceptions. Each names where
the store is: its file, or a PostgreSQL database by its redacted url (hosts, ports, name).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llmgw.errors import MachineError, UsageError


class UnknownNode(UsageError):
    """The operator named a node this control plane does not know."""

    def __init__(self, node_id: str, known: Iterable[str]) -> None:
        self.node_id = node_id
        listing = ", ".join(known) or "none"
        super().__init__(
            f"no node {node_id!r} is known to this control plane (known nodes: {listing}); see `llmgw ctl nodes`"
        )


class UnknownReplica(UsageError):
    """The operator named a replica that is not placed."""

    def __init__(self, replica_id: str, known: Iterable[str]) -> None:
        self.replica_id = replica_id
        listing = ", ".join(known) or "none"
        super().__init__(f"no replica {replica_id!r} (replicas: {listing}); see `llmgw ctl replicas`")


class NoConfigFile(UsageError):
    """A reload was asked of a control plane started without a configuration file."""

    def __init__(self) -> None:
        super().__init__(
            "this control plane was started without --config; there is no file to reload. Start it with "
            "`llmgw server --config FILE` to change its catalog while it runs"
        )


class DiagnosticOff(UsageError):
    """A diagnostic that disturbs the control plane was asked for, and server.toml does not allow it."""

    def __init__(self, what: str, key: str) -> None:
        super().__init__(
            f"{what} is a diagnostic that is off on this control plane; set `{key} = true` under [debug] in "
            "server.toml and restart `llmgw server` to allow it (never on a cluster that serves users)"
        )


# -- the store's: the database or the disk under it refused --------------------------------

# Who may hold a store's write lock, by backend, for `StoreBusy`'s message.
SQLITE_HOLDERS = "a sqlite3 shell in a transaction, a backup, another llmgw command"
POSTGRES_HOLDERS = "a psql session in a transaction, `llmgw server migrate-store`, another llmgw command"
SQLITE_FIX = "Check the disk under it (free space, permissions, I/O errors in the kernel log)"
POSTGRES_FIX = "PostgreSQL's log on its server says more"


class StoreError(MachineError):
    """The database could not do what was asked; nothing changed. `retry_after_s`: when trying
    again may work. `path`: the store's file, or a PostgreSQL database's redacted url."""

    retry_after_s = 5.0

    def __init__(self, path: Path | str, message: str) -> None:
        self.path = path
        super().__init__(message)


class StoreBusy(StoreError):
    """Another process held the database's write lock for longer than the busy timeout."""

    retry_after_s = 2.0

    def __init__(self, path: Path | str, waited_s: float, *, holders: str = SQLITE_HOLDERS) -> None:
        super().__init__(
            path,
            f"{path} is locked by another process ({holders}) and stayed locked for {waited_s:g} s; nothing "
            "changed; try again",
        )


class StoreUnavailable(StoreError):
    """A PostgreSQL store cannot be reached: refused, lost (a restart, a failover), or the login
    failed. The next call connects again. `outcome_unknown`: the connection broke while a
    change was being committed, so whether it was made cannot be known from here."""

    retry_after_s = 5.0

    def __init__(self, path: Path | str, detail: str, *, outcome_unknown: bool = False) -> None:
        self.outcome_unknown = outcome_unknown
        changed = (
            "the connection broke while the change was being committed: whether it was made is unknown, look "
            "before trying again"
            if outcome_unknown
            else "nothing changed"
        )
        super().__init__(
            path,
            f"the control plane's database {path} cannot be reached: {detail.strip()}; {changed}. The next call "
            "connects again; check that PostgreSQL runs, that this machine reaches it, and the login ([store] url's "
            "user, and password_file or ~/.pgpass)",
        )


class NotLeader(StoreError):
    """A write of a control plane that no longer leads: the lease of its term (`epoch`) has
    passed to another (`found`), or this is a standby's store. Refused before anything changed;
    the leader (`leader_admin_url`, "" when none is known) takes the request."""

    retry_after_s = 1.0

    def __init__(self, path: Path | str, *, epoch: int, found: int | None, leader_admin_url: str = "") -> None:
        self.epoch = epoch
        self.found = found
        self.leader_admin_url = leader_admin_url
        if epoch < 0:
            why = "this control plane is a standby, and only the leader writes"
        else:
            why = f"this control plane's lease (epoch {epoch}) has passed to epoch {found}, so it leads no more"
        where = f"; the leader's admin API is at {leader_admin_url}" if leader_admin_url else ""
        super().__init__(path, f"{why}: the write to {path} was refused and nothing changed{where}; send it there")


class StoreFailed(StoreError):
    """The database or the disk under it refused: full, read-only, an I/O error."""

    def __init__(self, path: Path | str, detail: str, *, fix: str = SQLITE_FIX) -> None:
        super().__init__(path, f"the control plane's database {path} failed: {detail}; nothing changed. {fix}")


class StoreSchemaNewer(StoreFailed):
    """The database was migrated by a newer llmgw than this one: its tables may mean what this
    version does not know."""

    retry_after_s = 60.0

    def __init__(self, path: Path | str, found: int, known: int) -> None:
        StoreError.__init__(
            self,
            path,
            f"the control plane's database {path} has schema version {found}, made by a newer llmgw; this one "
            f"knows versions up to {known} and leaves it alone. Run the newer llmgw, or restore a backup made by "
            "this version",
        )


class StoreSchemaBehind(StoreFailed):
    """A PostgreSQL store that control planes share, at an older schema than this llmgw's: only
    its leader migrates it (a standby of a newer llmgw waits for the lease), never a command or
    a standby, so that a control plane of the older llmgw still leading it is not migrated under."""

    retry_after_s = 60.0

    def __init__(self, path: Path | str, found: int, known: int) -> None:
        StoreError.__init__(
            self,
            path,
            f"the control plane's database {path} has schema version {found}, and this llmgw needs {known}; a "
            "PostgreSQL store that control planes share is migrated by its leader only, and nothing changed. Start "
            "`llmgw server` of this llmgw on it (it stands by while an older one leads, and migrates the store once "
            'it takes the lease: docs/high-availability.md, "Upgrading"), or run the llmgw the control planes run',
        )


class StoreCorrupt(StoreFailed):
    """The file is damaged: only a backup, or starting empty, brings it back."""

    retry_after_s = 60.0

    def __init__(self, path: Path | str, detail: str) -> None:
        name = path.name if isinstance(path, Path) else str(path)
        StoreError.__init__(
            self,
            path,
            f"the control plane's database {path} is damaged ({detail}). Stop the server and restore the latest "
            f'backup (made by `llmgw server backup`; docs/operations.md, "Backing up and restoring the control '
            f"plane's state\", has the commands), or move {name} and its -wal and -shm files aside to start "
            "with an empty one, which loses the cordon and drain marks, the replica placements (replicas are placed "
            "anew), the gateway's API keys (clients need new ones), the certificate revocations (run "
            "`llmgw node remove` again for nodes removed before) and the audit log of admin actions",
        )


class StoreNotEmpty(UsageError):
    """`migrate-store` copies into an empty store only, and the target holds rows."""

    def __init__(self, path: Path | str, holds: dict[str, int], fix: str) -> None:
        listing = ", ".join(f"{what}: {n}" for what, n in holds.items() if n)
        super().__init__(
            f"the target store {path} is not empty: it holds {listing}. migrate-store copies into an empty store "
            f"only, so that nothing is merged by accident; {fix}"
        )


class StoreInUse(UsageError):
    """A control plane is using a store that `migrate-store` was asked to copy from or into."""

    def __init__(self, path: Path | str, how: str) -> None:
        super().__init__(
            f"a control plane is using {path} ({how}): what it writes during the copy would be lost, or mixed "
            "into it. Stop every `llmgw server` using it (systemctl stop llmgw-server), then run migrate-store again"
        )


class CopyMismatch(MachineError):
    """The rows written by `migrate-store` do not read back as the rows read: the copy was rolled
    back, and the target is as empty as it was."""

    def __init__(self, path: Path | str, table: str, detail: str) -> None:
        super().__init__(
            f"the copy into {path} does not read back as its source in table {table} ({detail}); it was rolled "
            "back, and the target is still empty. Report this with both stores' versions"
        )


class ApiKeyError(UsageError):
    """An API key operation the operator asked for cannot be done (duplicate name, unknown key)."""


class ApiKeyExists(ApiKeyError):
    """The name is taken."""


class UnknownApiKey(ApiKeyError):
    """No key has that name."""


class TeamError(UsageError):
    """A team operation the operator asked for cannot be done (bad or duplicate name, unknown team)."""


class TeamExists(TeamError):
    """The name is taken."""


class UnknownTeam(TeamError):
    """No team has that name."""


class TeamInUse(TeamError):
    """Valid keys belong to the team."""


class BudgetError(UsageError):
    """A token budget the operator asked for cannot be set (an unknown key or team, a bad period or amount)."""


class UnknownBudget(BudgetError):
    """No budget has that id."""
