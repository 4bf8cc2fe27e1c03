"""Errors of the control plane's domain, by blame. Domain code raises them; the admin API alone
turns each into an HTTP status (`llmgw.server.admin.ANSWERS`), and the SIGHUP reload logs them.

The store's own errors (`StoreBusy`, `StoreFailed`, `StoreCorrupt`: the database or the disk
refused) stay in `llmgw.server.store`, which translates sqlite3's exceptions into them.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.errors import UsageError


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
