"""The codec's client role, without I/O (RFC 9112): a request written as bytes in one piece, a
response parsed into its head and its body's pieces. The gateway speaks it to engines
(`llmgw.gateway.upstream`), a gateway worker to the control plane's private socket
(`llmgw.http.relay`), the agent to its engines' /health (`agent.engine_proc`). The head is found,
framed and the body read by `readers`, which the server role shares; the status line, what 1xx
and 101 heads mean, and the connection's reuse are this module's.

What a peer sends is checked as strictly as a request is: the status line (a status of 100 to
999, and no 101: no request here asks for an upgrade), every header line (a token for a name;
no control characters, CR or LF in a value; no obs-fold), the framing fields (`readers`' rules,
checked on informational heads too), chunk sizes and their CRLFs, a head at most
`max_head_bytes` (`MAX_HEAD_BYTES` by default) and a chunk-size or trailer line at most
`MAX_LINE_BYTES`. Anything else is `ProtocolError`, which the caller makes the peer's failure;
its message shows what the peer sent as text (`fields.as_text`). Where this differs from h11 on
purpose, and why, is the table of tests/llmgw/h1/test_client_oracle.py, which checks the two
against each other.

`ResponseParser`: `receive_data` (b"" at the peer's end), then `next_event` until `NEED_DATA`:
a `Head` (1xx heads are skipped), then `bytes` — every body byte decodable from what came, in
one piece (a chunked body's chunks are joined: several SSE events an engine wrote at once go out
to the client in one write; at most `readers.MAX_STEPS` framing steps a piece) — then `END`.
`reusable` says whether the connection may carry another exchange once the response ended:
HTTP/1.1 without `Connection: close` (HTTP/1.0 with `keep-alive` and no Transfer-Encoding),
framed by length or by chunks but not both, nothing sent after it.

Why not h11 (issue 30's profile, docs/performance.md): these clients always send whole requests
with a Content-Length and never pipeline, so they need a small part of HTTP/1.1; h11's general
state machine, its validation of every header this side wrote and its event objects cost about
as much CPU as the rest of a relayed request's handling.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from llmgw.h1.errors import ClosedBeforeResponse, LocalProtocolError, ProtocolError
from llmgw.h1.fields import FieldError, as_text, good_name, parse_fields, whole_lines, writable
from llmgw.h1.readers import (
    CHUNK_SIZE_LINE,
    DONE,
    END,
    HEAD,
    LENGTH,
    NEED_DATA,
    UNTIL_CLOSE,
    Reader,
    Sentinel,
)

MAX_HEAD_BYTES = 64 << 10
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")


@attrs.frozen
class Head:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # names lower-case, in the order sent, repeats kept


def request_bytes(method: str, target: str, host: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The request's head as bytes, with Host and Content-Length first. `headers` are the
    caller's own or a client's as a listener parsed them (the server role refuses CR, LF and NUL
    in them); a field holding one anyway would split the request, so it is refused
    (`LocalProtocolError`), as is a name that is no token."""
    parts = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(body)}\r\n".encode("latin-1")]
    for name, value in headers:
        if not good_name(name):
            raise LocalProtocolError(f"the header field name '{as_text(name)}' is no token: not sent")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    # Three lines before the fields, one per field, the empty line: nothing else may end one.
    if not whole_lines(head, 4 + len(headers)):
        bad = next((name for name, value in headers if not writable(name, value)), None)
        what = f"the header field '{as_text(bad)}'" if bad is not None else "the request line or host"
        raise LocalProtocolError(f"{what} holds CR, LF or NUL: not sent")
    return head


class ResponseParser(Reader):
    body_ends_in = DONE  # END at every call after
    _say = (
        "a Content-Length that is not a length: '{}'",
        "Content-Length given differently: '{}' and '{}'",
        "Transfer-Encoding given twice",
        "a Transfer-Encoding other than chunked: '{}'",
    )

    def __init__(self, *, request_method: str = "POST", max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        super().__init__()
        self.max_head_bytes = max_head_bytes
        self._head_request = request_method == "HEAD"
        self.keep_alive = True
        # The final head's Content-Length where it is not chunked (to a HEAD, or of a 204 or 304
        # too: the length it announces); None without one.
        self.content_length: int | None = None

    @property
    def reusable(self) -> bool:
        return self._state == DONE and self.keep_alive and self._pos == len(self._buf) and not self.eof

    def trailing(self) -> bytes:
        """Bytes received after the response (none on a connection that may be reused)."""
        return super().trailing() if self._state == DONE else b""

    @property
    def started(self) -> bool:
        """Whether any byte of a response has come (a reused connection that fails before one
        may just have been closed by the peer while idle)."""
        return self._state != HEAD or self._pos < len(self._buf)

    def next_event(self) -> Head | bytes | Sentinel:
        state = self._state
        if state == HEAD:
            return self._head()
        if state == DONE:
            return END
        if state == LENGTH:
            return self._read_length()
        if state == UNTIL_CLOSE:
            return self._read_until_close()
        return self._read_chunked()

    # -- the head ---------------------------------------------------------------------------

    def _too_large(self, size: int | None) -> ProtocolError:
        return ProtocolError(f"a response head larger than {self.max_head_bytes} bytes")

    def _head(self) -> Head | Sentinel:
        while True:
            whole = self._head_block(self.max_head_bytes)
            if whole is None:
                if self.eof:
                    if self._pos == len(self._buf):
                        raise ClosedBeforeResponse("the connection closed before a response")
                    raise ProtocolError("the connection closed in the middle of a response head")
                return NEED_DATA
            head, http10 = self._parse_head(whole)
            length, chunked, close, _, _ = self._framing(head.headers, http10)  # of every head, as h11 does
            if head.status == 101:
                # No request here asks for an upgrade: what follows would be another protocol's bytes.
                raise ProtocolError("a 101 Switching Protocols to a request that asked for no upgrade")
            if head.status < 200:
                continue  # 100 Continue, 103 Early Hints: the final answer follows
            self._frame(head, length, chunked, close)
            return head

    def _parse_head(self, whole: bytes) -> tuple[Head, bool]:
        first = whole.find(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(whole, 0, first)
        if status_line is None:
            raise ProtocolError(f"not an HTTP/1.1 status line: '{as_text(whole[:first], 80)}'")
        try:
            headers = parse_fields(whole[first + 2 :])
        except FieldError as exc:
            raise ProtocolError(str(exc)) from None
        return Head(status=int(status_line.group(2)), headers=tuple(headers)), status_line.group(1) == b"0"

    def _frame(self, head: Head, length: int | None, chunked: bool, close: bool) -> None:
        self.keep_alive = not close
        self.content_length = None if chunked else length
        if self._head_request or head.status in (204, 304):
            self._state = DONE
        elif chunked:
            if length is not None:
                self.keep_alive = False  # both framings: chunked wins (RFC 9112 §6.3), and it is not reused
            self._state = CHUNK_SIZE_LINE
        elif length is not None:
            self._left = length
            self._state = LENGTH if length else DONE
        else:
            self.keep_alive = False
            self._state = UNTIL_CLOSE
