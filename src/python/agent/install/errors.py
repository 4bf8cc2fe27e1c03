"""Errors of installing engines, by blame."""

from __future__ import annotations

from llmgw.download import DiskFull, DownloadError  # noqa: F401 - re-exported for the agent
from llmgw.errors import MachineError, PeerError, UsageError


class UnsafeArchive(PeerError):
    """An archive tried to write outside its directory (path traversal, links, devices)."""


class EngineCheckFailed(MachineError):
    """An installed engine does not run; `output` holds what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        self.output = output
        super().__init__(message + (f"; it printed: {output.strip()[-800:]}" if output.strip() else ""))


class BadSource(UsageError):
    """The configured source cannot be used as it is (no source for this architecture, bad URL)."""
