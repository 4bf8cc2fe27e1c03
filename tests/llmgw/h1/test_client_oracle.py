"""The gateway's HTTP/1.1 client codec (`llmgw.h1`'s client role, reading engines' responses) checked
against h11 as an oracle: generated responses to a POST or a HEAD, with informational heads
before some, mutated where parsers disagree (framing fields repeated, listed, padded, oversized
and in odd case; obs-fold; bare CR and LF; NUL and other odd bytes; status lines; chunk sizes and
extensions; trailers), fed whole, a byte at a time or in random pieces, must get the same verdict
from `ResponseParser` and from an `h11.Connection(h11.CLIENT)` that sent the same request: the
same response (status, fields, body, whether it ended with the connection, whether the connection
is kept, what follows it) or a refusal from both. Where ours differs on purpose, `TABLE` names the
difference, its reason and the rule that says when it applies (testlib/h1oracle.py's `judge`);
each row is also shown by its own example. What the oracle found wrong is tested by example in
test_client_role.py."""

from __future__ import annotations

import dataclasses

import h11
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmgw.h1 import END, MAX_HEAD_BYTES, MAX_LINE_BYTES, NEED_DATA, Head, ProtocolError, ResponseParser
from testlib import h1gen as g
from testlib import h1oracle as o
from testlib.pieces import cut


def ours(data: bytes, sizes: list[int] | None = None, method: str = "POST") -> o.Verdict:
    parser = ResponseParser(request_method=method)
    head, body, at_eof = None, bytearray(), None
    try:
        for piece in [*cut(data, sizes), b""]:
            parser.receive_data(piece)
            while at_eof is None:
                got = parser.next_event()
                if got is NEED_DATA:
                    break
                if isinstance(got, Head):
                    head = got
                elif isinstance(got, bytes):
                    body += got
                else:
                    assert got is END, got
                    at_eof = not piece
    except ProtocolError as exc:
        return o.Refused(str(exc))
    assert at_eof is not None and head is not None  # at the connection's end a response is whole, or refused
    return o.Message(
        start=(method.encode(), head.status),
        headers=o.compared(list(head.headers)),
        body=bytes(body),
        keep_alive=parser.keep_alive,
        left=parser.trailing(),
        at_eof=at_eof,
        fields=head.headers,
    )


def theirs(data: bytes, sizes: list[int] | None = None, method: str = "POST") -> o.Verdict:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.send(h11.Request(method=method, target="/", headers=[("host", "engine"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    response, body, at_eof, state = None, bytearray(), None, None
    try:
        for piece in [*cut(data, sizes), b""]:
            conn.receive_data(piece)
            while at_eof is None:
                got = conn.next_event()
                if got is h11.NEED_DATA:
                    break
                if type(got) is h11.Response:
                    response = got
                elif type(got) is h11.Data:
                    body += got.data
                elif type(got) is h11.EndOfMessage:
                    at_eof, state = not piece, conn.their_state
                else:
                    assert type(got) is h11.InformationalResponse, got  # skipped, as ours skips it
    except h11.RemoteProtocolError as exc:
        return o.Refused(str(exc))
    assert state in (h11.DONE, h11.MUST_CLOSE), state
    return o.Message(
        start=(method.encode(), response.status_code),
        headers=o.compared(list(response.headers)),
        body=bytes(body),
        # A body that ended with the connection leaves nothing to reuse, though h11 says DONE.
        keep_alive=state is h11.DONE and not at_eof,
        left=conn.trailing_data[0],
        at_eof=at_eof,
        fields=tuple(response.headers),
        version=response.http_version,
    )


def _parts(data: bytes, message: o.Message, h11_lines: bool) -> o.Parts:
    return o.parts(data, message, h11_lines=h11_lines, response=True)


def _bodiless(m: o.Message) -> bool:
    return m.start[0] == b"HEAD" or m.start[1] in (204, 304)


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"

# Where ours differs from h11 on purpose. Each rule reads h11's parse (stricter, differs) or
# ours (lenient); testlib/h1oracle.py says what each kind requires of the two verdicts.
TABLE = o.Table(
    stricter=(
        o.Row(
            "bare LF line end",
            "RFC 9112 §2.2 lets a recipient take a bare LF for a line's end, and h11 does; ours takes "
            "CRLF only, as on the listeners: one rule for both codecs",
            lambda p, m: o.bare_lf(p),
            b"HTTP/1.1 200 OK\ncontent-length: 1\n\nx",
        ),
        o.Row(
            "obs-fold",
            "RFC 9112 §5.2: a user agent replaces obs-fold by SP, as h11 does; an engine has no reason "
            "to fold, and ours refuses it as the listeners do",
            lambda p, m: o.obs_fold(p),
            b"HTTP/1.1 200 OK\r\nx: 1\r\n 2\r\ncontent-length: 0\r\n\r\n",
        ),
        o.Row(
            "control character in a field value or the reason phrase",
            "RFC 9110 §5.5 allows no control character but HTAB in a value, nor RFC 9112 §4 in a "
            "reason phrase; h11 lets the others through, ours refuses them, in the trailers too",
            lambda p, m: o.control_in_value(p),
            b"HTTP/1.1 200 O\x01K\r\ncontent-length: 0\r\n\r\n",
        ),
        o.Row(
            "HTTP version other than 1.0 or 1.1",
            "h11 takes any HTTP/d.d status line; ours refuses what it cannot know the framing of",
            lambda p, m: m.version not in (b"1.0", b"1.1"),
            b"HTTP/2.0 200 OK\r\ncontent-length: 0\r\n\r\n",
        ),
        o.Row(
            "Content-Length of more than 18 digits",
            "h11 takes 20; ours keeps a length an integer of 63 bits",
            lambda p, m: o.length_digits(m, 18),
            b"HTTP/1.1 200 OK\r\ncontent-length: 0000000000000000001\r\n\r\nx",
        ),
        o.Row(
            "chunk size of more than 16 hex digits",
            "h11 takes 20; ours keeps a chunk's size to 64 bits (leading zeros count)",
            lambda p, m: o.chunk_size_digits(p, 16),
            CHUNKED + b"00000000000000001\r\nx\r\n0\r\n\r\n",
        ),
        o.Row(
            "CR in a chunk-size line",
            "h11's chunk extension is `;.*`, a bare CR in it taken; ours refuses CR and LF in a "
            "chunk-size line, as the listeners do",
            lambda p, m: o.cr_in_chunk_line(p),
            CHUNKED + b"1;a\rb\r\nx\r\n0\r\n\r\n",
        ),
        o.Row(
            "head larger than MAX_HEAD_BYTES",
            "h11 bounds only a head still incomplete (max_incomplete_event_size); ours a head past "
            "MAX_HEAD_BYTES however it arrives",
            lambda p, m: any(end - start > MAX_HEAD_BYTES for start, end in p.heads),
            b"HTTP/1.1 200 OK\r\nx: " + b"v" * (MAX_HEAD_BYTES - 40) + b"\r\ncontent-length: 0\r\n\r\n",
        ),
        o.Row(
            "chunk-size or trailer line longer than MAX_LINE_BYTES",
            "h11 bounds such a line only by its incomplete-event size; ours by MAX_LINE_BYTES",
            lambda p, m: o.long_line(p, MAX_LINE_BYTES),
            CHUNKED + b"1;" + b"e" * MAX_LINE_BYTES + b"\r\nx\r\n0\r\n\r\n",
        ),
    ),
    lenient=(
        o.Row(
            "whitespace before a chunk extension",
            "RFC 9112 §7.1.1's chunk-ext begins with BWS; h11 refuses it",
            lambda p, m: o.bws_before_extension(p),
            CHUNKED + b"1 ;a\r\nx\r\n0\r\n\r\n",
            normalize=o.without_bws_before_extension,
        ),
        o.Row(
            "framing fields in the trailers",
            "h11 checks a trailer Content-Length or Transfer-Encoding as if it framed the message; "
            "ours reads trailers and drops them, so they frame nothing (RFC 9110 §6.5.1)",
            lambda p, m: o.framing_in_trailers(p),
            CHUNKED + b"1\r\nx\r\n0\r\ntransfer-encoding: gzip\r\n\r\n",
            normalize=o.without_framing_trailers,
        ),
    ),
    differs=(
        o.Row(
            "HTTP/1.0 keep-alive",
            "RFC 9112 §9.3: an HTTP/1.0 response with `Connection: keep-alive` (and no close) may keep "
            "its connection, and ours does unless it carried Transfer-Encoding (§6.1) or its body "
            "ended with the connection; h11 closes every HTTP/1.0 connection",
            lambda p, m: m.version == b"1.0",
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
            expect=lambda m: dataclasses.replace(m, keep_alive=o.http10_keep_alive(m)),
        ),
        o.Row(
            "Content-Length with Transfer-Encoding: not reused",
            "both let chunked win (RFC 9112 §6.3), which also says such a message ought to be "
            "handled as an error; h11 reuses the connection, ours does not",
            lambda p, m: o.has(m, b"content-length") and o.has(m, b"transfer-encoding") and not _bodiless(m),
            CHUNKED.replace(b"\r\n\r\n", b"\r\ncontent-length: 5\r\n\r\n") + b"1\r\nx\r\n0\r\n\r\n",
            expect=lambda m: dataclasses.replace(m, keep_alive=False),
        ),
    ),
    parts=_parts,
    oracle=theirs,  # to a POST: the lenient rows' examples and the generated ones alike (see `judged`)
)


def judged(method: str) -> o.Table:
    """`TABLE` with h11 answering a request of `method`."""
    return dataclasses.replace(TABLE, oracle=lambda data: theirs(data, method=method))


VERSIONS = (b"1.1", b"1.1", b"1.0")
ODD_VERSIONS = (b"1.2", b"2.0", b"0.9")
STATUSES = (b"200", b"200", b"201", b"204", b"304", b"404", b"500", b"999")
ODD_STATUSES = (b"099", b"000", b"1000", b"20", b"2x0")
REASONS = (b" OK", b" OK", b"", b" ", b" Not Found", b" caf\xe9", b" a\tb")
ODD_REASONS = (b" \x01", b" a\x00", b"\tOK", b" a\x7f")
INFORMATIONAL = (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
ODD_INFORMATIONAL = (
    b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\ncontent-length: x\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\ntransfer-encoding: gzip\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
)


@st.composite
def responses(draw: st.DrawFn) -> tuple[str, bytes]:
    """The method of the request (POST or HEAD) and a response: informational heads before it
    now and then, a status line and fields, a body framed every way testlib/h1gen.py frames
    one (or by the connection's end), then mutated as it mutates heads."""
    method = draw(g.one(("POST", "POST", "POST", "HEAD")))
    status = b"HTTP/" + g.pick(draw, VERSIONS, ODD_VERSIONS) + b" " + g.pick(draw, STATUSES, ODD_STATUSES)
    status += g.pick(draw, REASONS, ODD_REASONS)
    before = b"".join(g.pick(draw, ((),) * 4 + ((INFORMATIONAL[0],), INFORMATIONAL), (ODD_INFORMATIONAL,)))
    lines, body = g.framed(draw, g.common_fields(draw))
    return method, before + g.mutated(draw, [status, *lines], body + draw(g.one(g.AFTER)))


@settings(
    max_examples=1000,
    derandomize=True,  # the same examples every run: a failure here is a change, not luck
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_ours_and_h11_give_the_same_verdict_on_generated_responses_but_for_the_table(data: st.DataObject) -> None:
    method, raw = data.draw(responses(), label="response")
    sizes = g.pieces(data.draw, raw)
    verdict = ours(raw, sizes, method)
    assert verdict == ours(raw, method=method), "ours parses the pieces otherwise than the whole"
    event(o.judge(judged(method), raw, verdict, theirs(raw, sizes, method)))


ROWS = [(kind, row) for kind in ("stricter", "lenient", "differs") for row in getattr(TABLE, kind)]


@pytest.mark.parametrize("kind, row", ROWS, ids=[row.name for _, row in ROWS])
def test_each_difference_in_the_table_is_real_and_its_rule_sees_it(kind: str, row: o.Row) -> None:
    mine, h11s = ours(row.example), theirs(row.example)
    if kind == "stricter":
        assert isinstance(h11s, o.Message) and isinstance(mine, o.Refused), (h11s, mine)
        assert row.applies(_parts(row.example, h11s, True), h11s)
    elif kind == "lenient":
        assert isinstance(h11s, o.Refused) and isinstance(mine, o.Message), (h11s, mine)
        p = _parts(row.example, mine, False)
        assert row.applies(p, mine) and theirs(row.normalize(p)) == mine
    else:
        assert isinstance(h11s, o.Message) and row.applies(_parts(row.example, h11s, True), h11s)
        assert mine == row.expect(h11s) != h11s
    o.judge(TABLE, row.example, mine, h11s)
