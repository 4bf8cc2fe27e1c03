"""What both roles read a message with (as h11's `_readers.py` serves its client and server):
the bytes received and not yet parsed, a head found in them and bounded, what its framing fields
say, and a body by its framing — a Content-Length, chunks with their trailers, or the end of the
connection. `server_role.ServerConnection` (requests) and `client_role.ResponseParser`
(responses) are `Reader`s; they parse the start line and decide what a head means.

The rules (RFC 9112):
- A head ends at its empty line and is at most the role's limit, measured whole however it
  arrives: an unfinished head past the limit is refused before its end has come.
- Framing fields: Content-Length is digits (at most 18), and its repeats, listed or on several
  lines, are one length only as the same digits (§6.3: identical values; "5" and "05" may be
  read otherwise by a parser in front); Transfer-Encoding is `chunked` once and nothing else
  (§6.1: chunked once, and last; another coding is 501). `close` in Connection wins wherever it
  is; an HTTP/1.0 message keeps its connection only with `keep-alive`, and never after a
  Transfer-Encoding (§9.3; §6.1: its framing may be faulty).
- A chunk-size line is hex (at most 16 digits) with optional extensions and no CR or LF in
  them, at most `MAX_LINE_BYTES` with them, as is each trailer line (a token, `:`, a value
  without control characters); a chunk is followed by CRLF. Trailer fields are checked and
  dropped.

Work is linear in the bytes fed and bounded per call: the buffer is read from an offset and
compacted once half of it is consumed; a head's or a line's end is searched for from where the
last search stopped; a chunked body's decoder takes at most `MAX_STEPS` steps a call (about a
microsecond each), so 64 KiB of one-byte chunks come out in several pieces, the caller free to
yield between them.

A body read returns every byte decodable from what has come, in one piece (several chunks
joined), `NEED_DATA` when nothing more can be read yet, and `END` when the body has ended (after
its last data, at the next call). Bytes after the message stay in the buffer (`trailing`).
"""

from __future__ import annotations

from llmgw.h1.errors import ProtocolError
from llmgw.h1.fields import BAD_VALUE, CHUNK_SIZE, TOKEN, as_text

MAX_LINE_BYTES = 4096  # a chunk-size line with its extensions, or one trailer line
MAX_STEPS = 1024  # framing steps of a chunked body per call


class Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = Sentinel("NEED_DATA")  # nothing more until more bytes come (or the end of the connection)
END = Sentinel("END")  # the message's body has ended

# The fields `_framing` reads (a request's Host and Expect among them).
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection", b"host", b"expect"))

# Where the reading of a message is: its head; its body by the framing (a chunked body in one
# of four places); ENDING: the body has ended and END is due at the next call; DONE.
HEAD, LENGTH, CHUNK_SIZE_LINE, CHUNK_DATA, CHUNK_CRLF, TRAILERS, UNTIL_CLOSE, ENDING, DONE = range(9)


class Reader:
    """The bytes a role has received (`receive_data`; b"" for the peer's end, `eof`), and the
    readers over them. A role sets what its messages call a body (`body_name`), the state a
    body's end leaves (`body_ends_in`: ENDING where END is an event of its own before the role's
    DONE means something else) and its wording of the framing refusals (`_say`)."""

    body_name = "body"
    body_ends_in = ENDING
    # The refusals of framing fields, in the role's words: not a length (the value), two
    # lengths (the first, the second), Transfer-Encoding twice, another coding (the value).
    _say = (
        "Content-Length '{}' is not a length",
        "Content-Length given differently: '{}' and '{}'",
        "Transfer-Encoding given twice",
        "a Transfer-Encoding other than chunked: '{}'",
    )

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # where what is not yet parsed begins
        self._scanned = 0  # where the search for a head's or a line's end goes on from
        self._state = HEAD
        self._left = 0  # of a Content-Length body, or of the current chunk
        self._begun = 0  # chunks begun since the role last took the count
        self.eof = False

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer; b"" when it has closed its side."""
        if not data:
            self.eof = True
            return
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._scanned = max(0, self._scanned - self._pos)
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        return len(self._buf) - self._pos

    # -- a head ---------------------------------------------------------------------------

    def _head_block(self, limit: int) -> bytes | None:
        """The head that begins at the read offset, once whole, with its empty line consumed:
        its start line and field lines, the last one's CRLF with it. None while it has not all
        come (the role decides what the end of the connection then means)."""
        buf, start = self._buf, self._pos
        end = buf.find(b"\r\n\r\n", max(start, self._scanned))
        if end < 0:
            self._unfinished_head(max(start, self._scanned))
            self._scanned = max(start, len(buf) - 3)  # what is searched is not searched again
            if len(buf) - start > limit:
                raise self._too_large(None)
            return None
        if end + 4 - start > limit:  # the head with its empty line, as in pieces
            raise self._too_large(end + 4 - start)
        self._pos = end + 4
        return bytes(buf[start : end + 2])

    def _unfinished_head(self, since: int) -> None:
        """A role's look at what came of a head since the last search, before its end."""

    def _too_large(self, size: int | None) -> ProtocolError:
        """The refusal of a head past the limit: `size` its bytes, None for one unfinished."""
        raise NotImplementedError

    def _framing(self, fields: list[tuple[bytes, bytes]], http10: bool) -> tuple[int | None, bool, bool, int, bool]:
        """What a head's fields say of its body and its connection, in one pass: its
        Content-Length (None: none given), whether it is chunked, whether the connection closes
        after it; and, of a request, how many Hosts it names and whether it expects
        100-continue. Refused: a length that is none or is given differently, a coding other
        than chunked, chunked twice."""
        digits: bytes | None = None
        chunked = expect = False
        hosts = 0
        connection: list[bytes] = []
        for name, value in fields:
            if name not in _FRAMING:
                continue
            if name == b"content-length":
                if digits is None and value.isdigit() and len(value) <= 18:
                    digits = value  # the usual one: a single length
                    continue
                for one in value.split(b","):
                    one = one.strip(b" \t")
                    if not one.isdigit() or len(one) > 18:
                        raise ProtocolError(self._say[0].format(as_text(value)))
                    if digits is not None and one != digits:
                        raise ProtocolError(self._say[1].format(as_text(digits), as_text(one)))
                    digits = one
            elif name == b"transfer-encoding":
                if chunked:
                    raise ProtocolError(self._say[2])
                if value.lower() != b"chunked":
                    raise ProtocolError(self._say[3].format(as_text(value)), 501)
                chunked = True
            elif name == b"connection":
                connection += [t.strip(b" \t").lower() for t in value.split(b",")]
            elif name == b"host":
                hosts += 1
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
        close = b"close" in connection or (http10 and (b"keep-alive" not in connection or chunked))
        return (None if digits is None else int(digits)), chunked, close, hosts, expect

    # -- a body ---------------------------------------------------------------------------

    def _read_length(self) -> bytes | Sentinel:
        """Of a body of `_left` bytes (more than none): what has come of it."""
        available = len(self._buf) - self._pos
        if not available:
            if self.eof:
                raise ProtocolError(f"the connection closed {self._left} bytes before the end of the {self.body_name}")
            return NEED_DATA
        take = min(available, self._left)
        data = bytes(self._buf[self._pos : self._pos + take])
        self._pos += take
        self._left -= take
        if not self._left:
            self._state = self.body_ends_in
        return data

    def _read_until_close(self) -> bytes | Sentinel:
        """Of a body that ends with the connection: what has come of it; END at the end."""
        available = len(self._buf) - self._pos
        if available:
            data = bytes(self._buf[self._pos :])
            self._pos += available
            return data
        if self.eof:
            self._state = DONE
            return END
        return NEED_DATA

    def _read_chunked(self) -> bytes | Sentinel:
        """Of a chunked body: every byte decodable from what has come, in one piece, after at
        most `MAX_STEPS` steps (b"" when they were all trailer lines); END when the body has
        ended with nothing before it; counts the chunks begun in `_begun`."""
        buf = self._buf
        out: list[bytes] = []
        for _ in range(MAX_STEPS):
            state = self._state
            if state == CHUNK_DATA:
                available = len(buf) - self._pos
                if not available:
                    break
                take = min(available, self._left)
                out.append(bytes(buf[self._pos : self._pos + take]))
                self._pos += take
                self._left -= take
                if not self._left:
                    self._state = CHUNK_CRLF
            elif state == CHUNK_SIZE_LINE or state == TRAILERS:
                end = buf.find(b"\r\n", max(self._pos, self._scanned))
                if end < 0:
                    self._scanned = max(self._pos, len(buf) - 1)
                    if len(buf) - self._pos > MAX_LINE_BYTES:
                        raise ProtocolError(f"a chunk-size or trailer line longer than {MAX_LINE_BYTES} bytes")
                    break
                line = bytes(buf[self._pos : end])
                if len(line) > MAX_LINE_BYTES:
                    raise ProtocolError(f"a chunk-size or trailer line longer than {MAX_LINE_BYTES} bytes")
                self._pos = end + 2
                if state == TRAILERS:
                    if not line:
                        self._state = self.body_ends_in
                        return b"".join(out) if out else END
                    name, colon, value = line.partition(b":")
                    if not colon or TOKEN.fullmatch(name) is None or BAD_VALUE.search(value.strip(b" \t")):
                        raise ProtocolError(f"not a trailer field line: '{as_text(line, 80)}'")
                    continue
                size = CHUNK_SIZE.fullmatch(line)
                if size is None:
                    raise ProtocolError(f"not a chunk-size line: '{as_text(line, 80)}'")
                self._left = int(size.group(1), 16)
                if self._left:
                    self._state = CHUNK_DATA
                    self._begun += 1
                else:
                    self._state = TRAILERS
            else:  # CHUNK_CRLF (the roles call this in the four states of a chunked body only)
                if len(buf) - self._pos < 2:
                    break
                if buf[self._pos : self._pos + 2] != b"\r\n":
                    raise ProtocolError("a chunk not followed by CRLF")
                self._pos += 2
                self._state = CHUNK_SIZE_LINE
        else:
            return b"".join(out)  # a piece of many tiny chunks; the rest at the next call
        if out:
            return b"".join(out)  # what came before the end of the connection goes first
        if self.eof:
            raise ProtocolError(f"the connection closed in the middle of a chunked {self.body_name}")
        return NEED_DATA

    def trailing(self) -> bytes:
        """The bytes received and not yet parsed (after a message: what followed it)."""
        return bytes(self._buf[self._pos :])
