"""Errors of the wire layer, by blame: the peer's frames (`WireError`, `LinkProtocolError`,
`UpgradeRefused`) or our own code's use of a session (`LocalLinkError`, a bug). Named for the
link, so that none is mistaken for the HTTP codec's errors."""

from __future__ import annotations

from llmgw.errors import PeerError


class WireError(PeerError):
    """A frame the peer sent is refused. `code` is one of the LinkError codes; `code` and the
    message are the `LinkError` to send it before closing."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class LinkProtocolError(WireError):
    """A frame understood but out of order: a message before the hello, a second hello, a hello
    for another node or of another protocol version, a message of the other side's."""


class UpgradeRefused(PeerError):
    """The peer's WebSocket upgrade request is refused before any frame: `status` is the HTTP
    status to answer it with, the message its body."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class LocalLinkError(Exception):
    """Our own code asked a session to send what the protocol does not allow now: a bug."""
