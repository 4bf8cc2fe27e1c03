"""Errors of installing engines, by blame."""

from __future__ import annotations

from llmgw.errors import MachineError, PeerError, UsageError


class DownloadError(PeerError):
    """The source failed or sent something else than promised (status, size, checksum)."""


class UnsafeArchive(PeerError):
    """An archive tried to write outside its directory (path traversal, links, devices)."""


class DiskFull(MachineError):
    """Not enough free space where the file must go."""


class EngineCheckFailed(MachineError):
    """An installed engine does not run; `output` holds what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        self.output = output
        super().__init__(message + (f"; it printed: {output.strip()[-800:]}" if output.strip() else ""))


class BadSource(UsageError):
    """The configured source cannot be used as it is (no source for this architecture, bad URL)."""
