"""Errors of `llmgw node add`, each under the llmgw class that says who has to act.

The subclasses exist so that a caller (the checklist screen) can tell them apart by class; the
message alone is what the operator reads, and it names the host, the value and the fix.
"""

from __future__ import annotations

from llmgw.errors import PeerError, UsageError


class UnknownHostKey(UsageError):
    """A host not in known_hosts whose key the operator did not accept; nothing was run there."""

    def __init__(self, message: str, *, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        super().__init__(message)


class ChangedHostKey(PeerError):
    """The host offers a key other than the one known_hosts holds for it: never accepted."""

    def __init__(self, message: str, *, offered: str, known: tuple[str, ...]) -> None:
        self.offered = offered
        self.known = known
        super().__init__(message)


class AuthFailed(PeerError):
    """The host refused every key offered for the login."""


class RemoteTimeout(PeerError):
    """A remote command did not finish within its deadline; it was cancelled."""
