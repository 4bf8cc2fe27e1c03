"""The HTTP/1.1 codec's errors, both roles, by blame:

- `ProtocolError`: what the peer sent is not HTTP/1.1 the codec takes (a client's request, an
  engine's or the control plane's response). The message says what, showing the peer's bytes
  as text (`fields.as_text`); `status` is the answer a server gives it (400; 431 for a head too
  large, 501 for a coding it does not know, 505 for another version). Whether the peer closed in
  the middle of a message, rather than sent something wrong, is the parser's `eof`.
- `ClosedBeforeResponse`: the client role's peer closed before a byte of a response (on a
  connection reused after idling, it may have closed it while idle: RFC 9112 §9.3.1).
- `LocalProtocolError`: what this side was asked to write is not HTTP (a field that would split
  the message, a body other than its declared length): a bug of the caller, refused before a
  byte is written.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """The peer's bytes are not HTTP/1.1 this codec takes; `status` is a server's answer to it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ClosedBeforeResponse(ProtocolError):
    """The peer closed the connection before a byte of a response."""


class LocalProtocolError(ValueError):
    """This side was asked to write something that is not HTTP: a bug of the caller."""
