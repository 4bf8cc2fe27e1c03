"""The codec's server role, as llmgw's listeners speak HTTP/1.1, without I/O (RFC 9112): requests
parsed from what a client sends, answers written as bytes, and the connection's state between
them. The head is found, framed and the body read by `readers` (which the client role shares);
the request line, Host, Expect, the answer and the connection's reuse are this module's.

It took h11's place on the listeners for a measured reason (issue 30, docs/performance.md): on
the gateway's request path h11's general state machine, event objects and its validation of
every header the server itself writes cost about a fifth of the gateway's CPU per request; this
does what the listeners need in a few byte operations per message. The rules a client is held
to are h11's, and RFC 9112's:

- A request head is at most `max_head_bytes`, measured whole however it arrives (431 past it,
  before its end has come); a request line `METHOD SP TARGET SP HTTP/1.x` (a method is a token,
  a target visible ASCII; another HTTP version is 505); header lines `name: value` (a name a
  token, a value without control characters, CR, LF or NUL; obs-fold refused); an HTTP/1.1
  request has one Host, and no request two (RFC 9112 §3.2). Empty lines before a request line
  are skipped (RFC 9112 §2.2).
- A body framed by one Content-Length or one `Transfer-Encoding: chunked` (`readers`' rules: a
  repeated length the same digits, another coding 501, chunk-size and trailer lines bounded);
  both framings in one request are refused (RFC 9112 §6.1: a smuggling attempt, perhaps).
- Keep-alive: HTTP/1.1 unless `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`
  and no `close`, and never after a Transfer-Encoding (RFC 9112 §9.3, §6.1).
  `Expect: 100-continue` is noted (`expecting_continue`) until the body is read or answered.
- Answers: a status line and the handler's fields, then the framing this writes itself (a
  Content-Length, or `chunked` to an HTTP/1.1 client, or the end of the connection to an
  HTTP/1.0 one) and `Connection: close` when either side closes after it; a HEAD, 204 or 304
  answer has no body. A field with CR, LF or NUL, or a name that is no token, is refused
  (`LocalProtocolError`, before anything is written): it would split the answer. Writing more
  or fewer bytes than a Content-Length declared is refused too.

Where this differs from h11 on purpose (stricter, mostly), and why, is the table of
tests/llmgw/h1/test_server_oracle.py, which checks the two against each other. Its messages show
what the client sent as text (`fields.as_text`). Parsing is linear in the bytes fed and bounded
per call (`readers`).

`ServerConnection`: `receive_data` (b"" at the peer's end), `next_event` until `NEED_DATA` —
a `RequestHead`, then `Data` pieces, then `END` — then `send_head`, `send_data`, `send_end`;
`start_next_cycle` for the next request when `reusable`. Errors are `llmgw.h1.errors`': a
client's `ProtocolError` (with the status it deserves; `eof` says whether it closed midway),
this side's `LocalProtocolError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus

from llmgw.h1.errors import LocalProtocolError, ProtocolError
from llmgw.h1.fields import FieldError, as_text, good_name, parse_fields, whole_lines, writable
from llmgw.h1.readers import (
    CHUNK_SIZE_LINE,
    DONE,
    END,
    ENDING,
    HEAD,
    LENGTH,
    NEED_DATA,
    Reader,
    Sentinel,
)

_REQUEST_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_NOT_IN_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # all but TAB, CR and LF
# The fields an answer's framing writes itself (what a handler gives is dropped).
_FRAMING_OUT = frozenset((b"content-length", b"transfer-encoding", b"connection"))
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}

CLOSED = Sentinel("CLOSED")  # the client closed the connection between requests
PAUSED = Sentinel("PAUSED")  # the request is whole: nothing more until `start_next_cycle`


class RequestHead:
    __slots__ = ("method", "target", "headers", "http_version", "size", "length")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: bytes,
        size: int,
        length: int | None = 0,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # names lower-case, in the order sent, repeats kept
        self.http_version = http_version  # b"1.1" or b"1.0"
        self.size = size  # the head's bytes, CRLFs included
        # The body's framing as parsed: its Content-Length (a list of equal values taken as one,
        # RFC 9112 §6.3), 0 for none, None for a chunked body.
        self.length = length


class Data:
    __slots__ = ("data", "chunks")

    def __init__(self, data: bytes, chunks: int = 0) -> None:
        self.data = data
        self.chunks = chunks  # of a chunked body: how many chunks began in this piece


# ours: the answer's state
_ANSWER_IDLE, _ANSWER_LENGTH, _ANSWER_CHUNKED, _ANSWER_UNTIL_CLOSE, _ANSWER_NONE, _ANSWER_DONE = range(6)


class ServerConnection(Reader):
    body_name = "request body"
    body_ends_in = ENDING  # END, then PAUSED until the next cycle
    _say = (
        "Content-Length '{}' is not a length; send the body's size in bytes",
        "Content-Length given twice, differently ('{}' and '{}'); send it once",
        # Chunked twice, or a coding after it: either way not a framing to guess at.
        "Transfer-Encoding given twice; send it once: Transfer-Encoding: chunked",
        "Transfer-Encoding '{}' is not supported; send the body with Content-Length or Transfer-Encoding: chunked",
    )

    def __init__(self, *, max_head_bytes: int) -> None:
        super().__init__()
        self.max_head_bytes = max_head_bytes
        self._answer = _ANSWER_IDLE
        self._answer_left = 0
        self.keep_alive = True  # the client's wish for this request
        self.closing = False  # this side closes after the answer
        self.http_version = b"1.1"
        self.expecting_continue = False

    # -- reading --------------------------------------------------------------------------

    @property
    def request_whole(self) -> bool:
        return self._state == DONE

    def next_event(self) -> RequestHead | Data | Sentinel:
        state = self._state
        if state == HEAD:
            return self._head()
        if state == DONE:
            return PAUSED
        if state == ENDING:
            return self._ended()
        if state == LENGTH:
            data = self._read_length()
            if data is NEED_DATA:
                return data
            self.expecting_continue = False
            return Data(data)  # type: ignore[arg-type]
        got = self._read_chunked()
        if got is END:
            return self._ended()
        begun, self._begun = self._begun, 0
        if got is NEED_DATA:
            if not begun:
                return got
            got = b""  # a chunk begun, its data not yet here: counted now
        self.expecting_continue = False
        return Data(got, begun)  # type: ignore[arg-type]

    def _ended(self) -> Sentinel:
        self._state = DONE
        self.expecting_continue = False
        return END

    def _unfinished_head(self, since: int) -> None:
        # A byte no head may hold is refused at once, not once the head is whole (nothing that
        # is HTTP at all, say), searched for in what came since the last search.
        if _NOT_IN_HEAD.search(self._buf, since) is not None:
            raise ProtocolError("a control character in the request head: this is not HTTP/1.1")

    def _too_large(self, size: int | None) -> ProtocolError:
        if size is None:
            return ProtocolError(f"request head larger than the limit of {self.max_head_bytes} bytes", 431)
        return ProtocolError(f"request head of {size} bytes is larger than the limit of {self.max_head_bytes}", 431)

    def _head(self) -> RequestHead | Sentinel:
        buf = self._buf
        while buf.startswith(b"\r\n", self._pos):  # empty lines before a request line (RFC 9112 §2.2)
            self._pos += 2
        head = self._head_block(self.max_head_bytes)
        if head is None:
            if self.eof:
                if self._pos == len(buf):
                    return CLOSED
                raise ProtocolError("the connection closed in the middle of a request head")
            return NEED_DATA
        first = head.find(b"\r\n")
        line = _REQUEST_LINE.fullmatch(head, 0, first)
        if line is None:
            raise ProtocolError(f"not a request line: '{as_text(head[:first], 80)}'")
        method, target, major, minor = line.groups()
        if major != b"1" or minor not in (b"0", b"1"):
            raise ProtocolError(f"HTTP/{major.decode()}.{minor.decode()} is not supported; send HTTP/1.1", 505)
        try:
            headers = parse_fields(head[first + 2 :])
        except FieldError as exc:
            raise ProtocolError(str(exc)) from None
        version = b"1." + minor
        length, chunked, close, hosts, expect = self._framing(headers, version == b"1.0")
        if chunked and length is not None:
            # RFC 9112 §6.1: a message with both may be an attempt at request smuggling; answer
            # and close rather than guess which framing the sender meant.
            raise ProtocolError("request has both Content-Length and Transfer-Encoding; send one of them")
        if hosts > 1 or (version == b"1.1" and not hosts):
            raise ProtocolError("a request has no Host header field" if not hosts else "Host given more than once")
        self.http_version = version
        self.keep_alive = not close
        if chunked:
            self._state = CHUNK_SIZE_LINE
            self._begun = 0
        elif length:
            self._state, self._left = LENGTH, length
        else:
            self._state = ENDING
        self.expecting_continue = expect and version == b"1.1" and self._state != ENDING
        return RequestHead(method, target, headers, version, len(head) + 2, None if chunked else length or 0)

    # -- writing --------------------------------------------------------------------------

    @property
    def answer_begun(self) -> bool:
        return self._answer != _ANSWER_IDLE

    def send_continue(self) -> bytes:
        self.expecting_continue = False
        return b"HTTP/1.1 100 Continue\r\n\r\n"

    def send_head(
        self,
        status: int,
        headers: Iterable[tuple[bytes | str, bytes | str]],
        *,
        length: int | None,
        close: bool = False,
        head_only: bool = False,
    ) -> bytes:
        """The answer's head: `headers` (a Content-Length, Transfer-Encoding or Connection
        among them is replaced by this one's framing), `length` the body's (None: not known,
        streamed), `close` to end the connection after it; `head_only` for a HEAD request."""
        if self._answer != _ANSWER_IDLE:
            raise LocalProtocolError("an answer has begun already")
        line = _STATUS_LINES.get(status)
        if line is None:
            if not 200 <= status <= 999:
                raise LocalProtocolError(f"status {status} is not a final answer's")
            line = b"HTTP/1.1 %d \r\n" % status
        parts = [line]
        for name, value in headers:
            name = name if name.__class__ is bytes else name.encode("latin-1")
            value = value if value.__class__ is bytes else value.encode("latin-1")
            if not good_name(name):
                raise LocalProtocolError(f"the header field name '{as_text(name)}' cannot be written: it is no token")
            low = name.lower()
            if low in _FRAMING_OUT:
                if low == b"connection":
                    close = close or b"close" in value.lower()
                continue  # this writes its own framing
            parts += (name, b": ", value, b"\r\n")
        fields_end = len(parts)
        close = close or not self.keep_alive
        answer_left = 0
        if head_only or status in (204, 304):
            if head_only and length is not None:
                parts.append(b"content-length: %d\r\n" % length)
            answer = _ANSWER_NONE
        elif length is not None:
            parts.append(b"content-length: %d\r\n" % length)
            answer, answer_left = _ANSWER_LENGTH, length
        elif self.http_version == b"1.1":
            parts.append(b"transfer-encoding: chunked\r\n")
            answer = _ANSWER_CHUNKED
        else:  # an HTTP/1.0 client: the body ends with the connection
            close = True
            answer = _ANSWER_UNTIL_CLOSE
        if close:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        # Each field is 4 parts and one line; the status line and what follows the fields, a line each.
        if not whole_lines(head, 1 + (fields_end - 1) // 4 + len(parts) - fields_end):
            name = next((parts[i] for i in range(1, fields_end, 4) if not writable(parts[i], parts[i + 2])), b"")
            raise LocalProtocolError(f"the header field '{as_text(name)}' cannot be written: CR, LF or NUL in it")
        self._answer, self._answer_left, self.closing = answer, answer_left, close
        return head

    def send_data(self, data: bytes) -> bytes:
        answer = self._answer
        if answer == _ANSWER_CHUNKED:
            return b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        if answer == _ANSWER_LENGTH:
            if len(data) > self._answer_left:
                raise LocalProtocolError(f"{len(data)} bytes where {self._answer_left} were left of the Content-Length")
            self._answer_left -= len(data)
            return data
        if answer == _ANSWER_UNTIL_CLOSE:
            return data
        if answer == _ANSWER_NONE:
            return b""
        raise LocalProtocolError("no answer head was written before its body")

    def send_end(self) -> bytes:
        answer = self._answer
        if answer == _ANSWER_LENGTH and self._answer_left:
            raise LocalProtocolError(f"the body ended {self._answer_left} bytes short of its Content-Length")
        if answer == _ANSWER_IDLE or answer == _ANSWER_DONE:
            raise LocalProtocolError("no answer to end")
        self._answer = _ANSWER_DONE
        return b"0\r\n\r\n" if answer == _ANSWER_CHUNKED else b""

    # -- between requests -----------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection: the request read whole, its
        answer written whole, and neither side closing."""
        return self._state == DONE and self._answer == _ANSWER_DONE and not self.closing and not self.eof

    def start_next_cycle(self) -> None:
        if not self.reusable:
            raise LocalProtocolError("the connection cannot carry another request")
        self._state = HEAD
        self._answer = _ANSWER_IDLE
        self.keep_alive = True
        self.expecting_continue = False
