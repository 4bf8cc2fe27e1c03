"""HTTP/1.1 as the gateway speaks it to engines, without I/O: a request written as bytes in one
piece, a response parsed into its head and its body's pieces (RFC 9112).

Why not h11, which the listeners keep: on this side the gateway talks only to engines it
started, always sends whole requests with a Content-Length, and never pipelines, so a client
needs a small part of HTTP/1.1; h11's general state machine, its validation of every header
the gateway itself wrote and its event objects cost about as much CPU as the rest of a relayed
request's handling (issue 30's profile; docs/performance.md). What an engine sends is still
checked as strictly: the status line (a status of 100 to 999, and no 101: the gateway asks for
no upgrade), every header line (a token for a name; no control characters, CR or LF in a value;
no obs-fold), one Content-Length (repeats the same digits) or one `chunked` framing, checked on
informational heads too, chunk sizes and their CRLFs, a head at most `MAX_HEAD_BYTES` and a
chunk-size line at most `MAX_LINE_BYTES`. Anything else is `ProtocolError`, which the pool makes
the engine's failure; its message shows what the engine sent as text (`fields.as_text`). Where
this differs from h11 on purpose, and why, is the table of
tests/llmgw/gateway/test_wire_oracle.py, which checks the two against each other.

`ResponseParser`: `feed` bytes (b"" at the peer's end), then `next_event` until `NEED_DATA`:
a `Head` (1xx heads are skipped), then `bytes` — every body byte decodable from what was fed, in
one piece (a chunked body's chunks are joined: several SSE events the engine wrote at once go
out to the client in one write; at most `MAX_STEPS` framing steps a piece) — then `END`.
`reusable` says whether the connection may carry another exchange once the response ended:
HTTP/1.1 without `Connection: close` (HTTP/1.0 with `keep-alive` and no Transfer-Encoding),
framed by length or by chunks but not both, nothing sent after it. Time is linear in the bytes
fed: the buffer is consumed from an offset and compacted, never re-scanned from its start.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from llmgw.http.fields import (
    BAD_VALUE,
    CHUNK_SIZE,
    TOKEN,
    FieldError,
    ReadBuffer,
    as_text,
    good_name,
    parse_fields,
    whole_lines,
    writable,
)

MAX_HEAD_BYTES = 64 << 10
MAX_LINE_BYTES = 4096  # a chunk-size line with its extensions, or one trailer line
# Framing steps (about a microsecond each) at most per `next_event`: 64 KiB of one-byte chunks
# come out in several pieces, the caller yielding between them, not in one long step.
MAX_STEPS = 1024
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")


class ProtocolError(Exception):
    """What an engine sent is not HTTP/1.1 this client accepts (the message says what)."""


class ClosedBeforeResponse(ProtocolError):
    """The engine closed the connection before a byte of a response (after a request on an
    idle connection: it may have closed it while idle, RFC 9112 §9.3.1)."""


class _Need:
    def __repr__(self) -> str:
        return "NEED_DATA"


class _End:
    def __repr__(self) -> str:
        return "END"


NEED_DATA = _Need()
END = _End()


@attrs.frozen
class Head:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # names lower-case, in the order sent, repeats kept


def request_bytes(method: str, target: str, host: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The request's head as bytes, with Host and Content-Length first. `headers` are the
    gateway's own or a client's as its listener parsed them (h11 refuses CR, LF and NUL in
    them); a field holding one anyway would split the request, so it is refused here too."""
    parts = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(body)}\r\n".encode("latin-1")]
    for name, value in headers:
        if not good_name(name):
            raise ValueError(f"the header field name '{as_text(name)}' is no token: not sent")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    # Three lines before the fields, one per field, the empty line: nothing else may end one.
    if not whole_lines(head, 4 + len(headers)):
        bad = next((name for name, value in headers if not writable(name, value)), None)
        what = f"the header field '{as_text(bad)}'" if bad is not None else "the request line or host"
        raise ValueError(f"{what} holds CR, LF or NUL: not sent")
    return head


_HEAD, _LENGTH, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


def _framing(headers: tuple[tuple[bytes, bytes], ...], minor: int) -> tuple[int | None, bool, bool]:
    """What a head's fields say of its body and its connection: the Content-Length (None: none
    given), whether the body is chunked, whether the connection closes after it. Refused: a
    Content-Length that is no number or is given differently, a coding other than chunked, a
    Transfer-Encoding given twice."""
    digits = None
    chunked = False
    connection: set[bytes] = set()
    for name, value in headers:
        if name == b"content-length":
            for one in value.split(b","):
                one = one.strip(b" \t")
                if not one.isdigit() or len(one) > 18:
                    raise ProtocolError(f"a Content-Length that is not a length: '{as_text(value)}'")
                # Repeats are one length only as the same digits (RFC 9112 §6.3: identical values).
                if digits is not None and one != digits:
                    raise ProtocolError(f"Content-Length given differently: '{as_text(digits)}' and '{as_text(one)}'")
                digits = one
        elif name == b"transfer-encoding":
            if chunked:
                raise ProtocolError("Transfer-Encoding given twice")
            if value.lower() != b"chunked":
                raise ProtocolError(f"a Transfer-Encoding other than chunked: '{as_text(value)}'")
            chunked = True
        elif name == b"connection":
            connection.update(t.strip(b" \t").lower() for t in value.split(b","))
    # `close` wins wherever it is; HTTP/1.0 keeps a connection only when asked to, and never
    # after a Transfer-Encoding (RFC 9112 §9.3; §6.1: its framing may be faulty).
    close = b"close" in connection or (minor == 0 and (b"keep-alive" not in connection or chunked))
    return (None if digits is None else int(digits)), chunked, close


class ResponseParser(ReadBuffer):
    def __init__(self, *, request_method: str = "POST") -> None:
        super().__init__()
        self._eof = False
        self._state = _HEAD
        self._left = 0  # of a Content-Length body, or of the current chunk
        self._head_request = request_method == "HEAD"
        self.keep_alive = True

    @property
    def reusable(self) -> bool:
        return self._state == _DONE and self.keep_alive and self._pos == len(self._buf) and not self._eof

    def trailing(self) -> bytes:
        """Bytes received after the response (none on a connection that may be reused)."""
        return bytes(self._buf[self._pos :]) if self._state == _DONE else b""

    @property
    def started(self) -> bool:
        """Whether any byte of a response has come (a reused connection that fails before one
        may just have been closed by the engine while idle)."""
        return self._state != _HEAD or self._pos < len(self._buf)

    def feed(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        self._append(data)

    def next_event(self) -> Head | bytes | _Need | _End:
        state = self._state
        if state == _HEAD:
            return self._head()
        if state == _DONE:
            return END
        if state == _LENGTH or state == _UNTIL_CLOSE:
            available = len(self._buf) - self._pos
            if state == _LENGTH:
                take = min(available, self._left)
            else:
                take = available
            if take:
                data = bytes(self._buf[self._pos : self._pos + take])
                self._pos += take
                if state == _LENGTH:
                    self._left -= take
                    if not self._left:
                        self._state = _DONE
                return data
            if state == _LENGTH and not self._left:
                self._state = _DONE
                return END
            if self._eof:
                if state == _UNTIL_CLOSE:
                    self._state = _DONE
                    return END
                raise ProtocolError(f"the connection closed {self._left} bytes before the end of the body")
            return NEED_DATA
        return self._chunked()

    # -- the head ---------------------------------------------------------------------------

    def _head(self) -> Head | _Need:
        while True:
            buf = self._buf
            end = buf.find(b"\r\n\r\n", max(self._pos, self._scanned))
            if end < 0:
                self._scanned = max(self._pos, len(buf) - 3)  # what is searched is not searched again
                if len(buf) - self._pos > MAX_HEAD_BYTES:
                    raise ProtocolError(f"a response head larger than {MAX_HEAD_BYTES} bytes")
                if self._eof:
                    if self._pos == len(buf):
                        raise ClosedBeforeResponse("the connection closed before a response")
                    raise ProtocolError("the connection closed in the middle of a response head")
                return NEED_DATA
            if end + 4 - self._pos > MAX_HEAD_BYTES:  # the head with its empty line, as in pieces
                raise ProtocolError(f"a response head larger than {MAX_HEAD_BYTES} bytes")
            whole = bytes(buf[self._pos : end + 2])  # the last field line's CRLF with it
            self._pos = end + 4
            head, version = self._parse_head(whole)
            length, chunked, close = _framing(head.headers, version)  # of every head, as h11 does
            if head.status == 101:
                # The gateway asks for no upgrade: what follows would be another protocol's bytes.
                raise ProtocolError("a 101 Switching Protocols to a request that asked for no upgrade")
            if head.status < 200:
                continue  # 100 Continue, 103 Early Hints: the final answer follows
            self._frame(head, length, chunked, close)
            return head

    def _parse_head(self, whole: bytes) -> tuple[Head, int]:
        first = whole.find(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(whole, 0, first)
        if status_line is None:
            raise ProtocolError(f"not an HTTP/1.1 status line: '{as_text(whole[:first], 80)}'")
        try:
            headers = parse_fields(whole[first + 2 :])
        except FieldError as exc:
            raise ProtocolError(str(exc)) from None
        return Head(status=int(status_line.group(2)), headers=tuple(headers)), int(status_line.group(1))

    def _frame(self, head: Head, length: int | None, chunked: bool, close: bool) -> None:
        self.keep_alive = not close
        if self._head_request or head.status in (204, 304):
            self._state = _DONE
        elif chunked:
            if length is not None:
                self.keep_alive = False  # both framings: chunked wins (RFC 9112 §6.3), and it is not reused
            self._state = _CHUNK_SIZE_LINE
        elif length is not None:
            self._left = length
            self._state = _LENGTH if length else _DONE
        else:
            self.keep_alive = False
            self._state = _UNTIL_CLOSE

    # -- a chunked body ---------------------------------------------------------------------

    def _chunked(self) -> bytes | _Need | _End:
        out: list[bytes] = []
        for _ in range(MAX_STEPS):
            got = self._chunk_step(out)
            if got is not None:
                return b"".join(out) if out else got  # the data first; the end, if it came, next
        return b"".join(out)  # a piece of many tiny chunks; the rest at the next call

    def _chunk_step(self, out: list[bytes]) -> _Need | _End | None:
        """One step of the chunked framing; None to go on, else what to return (after `out`)."""
        buf, state = self._buf, self._state
        if state == _CHUNK_SIZE_LINE or state == _TRAILERS:
            end = buf.find(b"\r\n", max(self._pos, self._scanned))
            if end < 0:
                self._scanned = max(self._pos, len(buf) - 1)
                if len(buf) - self._pos > MAX_LINE_BYTES:
                    raise ProtocolError(f"a chunk-size or trailer line longer than {MAX_LINE_BYTES} bytes")
                return self._more()
            line = bytes(buf[self._pos : end])
            if len(line) > MAX_LINE_BYTES:
                raise ProtocolError(f"a chunk-size or trailer line longer than {MAX_LINE_BYTES} bytes")
            self._pos = end + 2
            if state == _TRAILERS:
                if not line:
                    self._state = _DONE
                    return END
                name, colon, value = line.partition(b":")
                if not colon or TOKEN.fullmatch(name) is None or BAD_VALUE.search(value.strip(b" \t")):
                    raise ProtocolError(f"not a trailer field line: '{as_text(line, 80)}'")
                return None
            size = CHUNK_SIZE.fullmatch(line)
            if size is None:
                raise ProtocolError(f"not a chunk-size line: '{as_text(line, 80)}'")
            self._left = int(size.group(1), 16)
            self._state = _CHUNK_DATA if self._left else _TRAILERS
            return None
        if state == _CHUNK_DATA:
            available = len(buf) - self._pos
            if not available:
                return self._more()
            take = min(available, self._left)
            out.append(bytes(buf[self._pos : self._pos + take]))
            self._pos += take
            self._left -= take
            if not self._left:
                self._state = _CHUNK_CRLF
            return None
        if state == _CHUNK_CRLF:
            if len(buf) - self._pos < 2:
                return self._more()
            if buf[self._pos : self._pos + 2] != b"\r\n":
                raise ProtocolError("a chunk not followed by CRLF")
            self._pos += 2
            self._state = _CHUNK_SIZE_LINE
            return None
        return END  # _DONE

    def _more(self) -> _Need:
        if self._eof:
            raise ProtocolError("the connection closed in the middle of a chunked body")
        return NEED_DATA
