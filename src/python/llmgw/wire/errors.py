"""Errors of the wire layer."""

from __future__ import annotations

from llmgw.errors import PeerError


class WireError(PeerError):
    """A frame the peer sent cannot be understood. `code` is one of the LinkError codes."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)
