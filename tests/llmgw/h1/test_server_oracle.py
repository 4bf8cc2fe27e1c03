"""The listeners' HTTP/1.1 codec (`llmgw.h1`, the server role) checked against h11 as an
oracle: generated requests, mutated where parsers disagree (framing fields repeated, listed,
padded, oversized and in odd case; obs-fold; bare CR and LF; NUL and other odd bytes; chunk sizes
and extensions; trailers), fed whole, a byte at a time or in random pieces, must get the same
verdict from both: the same request (method, target, fields, body, whether the connection is
kept, what follows it) or a refusal from both. Where ours is stricter or otherwise differs on
purpose, `TABLE` names the difference, its reason and the rule that says when it applies
(testlib/h1oracle.py's `judge`); each row is also shown by its own example. What the oracle
found wrong is tested by example in test_server_role.py."""

from __future__ import annotations

import dataclasses

import h11
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmgw.h1 import CLOSED as OURS_CLOSED
from llmgw.h1 import END, MAX_LINE_BYTES, NEED_DATA, Data, ProtocolError, RequestHead, ServerConnection
from testlib import h1gen as g
from testlib import h1oracle as o
from testlib.pieces import cut

MAX_HEAD = 600  # small, so that generated heads pass it; h11 is held to the same for a head in pieces


def ours(data: bytes, sizes: list[int] | None = None) -> o.Verdict:
    conn = ServerConnection(max_head_bytes=MAX_HEAD)
    head, body, ended = None, bytearray(), False
    try:
        for piece in [*cut(data, sizes), b""]:
            conn.receive_data(piece)
            while not ended:
                got = conn.next_event()
                if got is NEED_DATA:
                    break
                if got is OURS_CLOSED:
                    return o.CLOSED
                if isinstance(got, RequestHead):
                    head = got
                elif isinstance(got, Data):
                    body += got.data
                else:
                    assert got is END, got
                    ended = True
    except ProtocolError as exc:
        assert 400 <= exc.status < 600, exc.status
        return o.Refused(str(exc))
    assert ended and head is not None  # at the connection's end a request is whole, or refused
    assert head.length is None or head.length == len(body)
    return o.Message(
        start=(head.method, head.target, head.http_version),
        headers=o.compared(head.headers),
        body=bytes(body),
        keep_alive=conn.keep_alive,
        left=conn.trailing(),
        fields=tuple(head.headers),
        version=head.http_version,
    )


def theirs(data: bytes, sizes: list[int] | None = None) -> o.Verdict:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    request, body, state = None, bytearray(), None
    try:
        for piece in [*cut(data, sizes), b""]:
            conn.receive_data(piece)
            while state is None:
                got = conn.next_event()
                if got is h11.NEED_DATA:
                    break
                if type(got) is h11.ConnectionClosed:
                    return o.CLOSED
                if type(got) is h11.Request:
                    request = got
                elif type(got) is h11.Data:
                    body += got.data
                else:
                    assert type(got) is h11.EndOfMessage, got
                    state = conn.their_state
    except h11.RemoteProtocolError as exc:
        return o.Refused(str(exc))
    assert state in (h11.DONE, h11.MUST_CLOSE), state  # no upgrade is generated
    return o.Message(
        start=(request.method, request.target, request.http_version),
        headers=o.compared(list(request.headers)),
        body=bytes(body),
        keep_alive=state is h11.DONE,
        left=conn.trailing_data[0],
        fields=tuple(request.headers),
        version=request.http_version,
    )


def _parts(data: bytes, message: o.Message, h11_lines: bool) -> o.Parts:
    return o.parts(data, message, h11_lines=h11_lines, response=False)


def _without_empty_lines(p: o.Parts) -> bytes:
    data = p.data
    while data.startswith(b"\r\n"):
        data = data[2:]
    return data


CHUNKED = b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n"

# Where ours differs from h11 on purpose. Each rule reads h11's parse (stricter, differs) or
# ours (lenient); testlib/h1oracle.py says what each kind requires of the two verdicts.
TABLE = o.Table(
    stricter=(
        o.Row(
            "bare LF line end",
            "RFC 9112 §2.2 lets a recipient take a bare LF for a line's end, and h11 does; ours takes "
            "CRLF only: a proxy in front that splits lines otherwise would see other fields (smuggling)",
            lambda p, m: o.bare_lf(p),
            b"POST / HTTP/1.1\nhost: a\ncontent-length: 1\n\nx",
        ),
        o.Row(
            "obs-fold",
            "RFC 9112 §5.2: a server refuses obs-fold with 400 or replaces it by SP; h11 replaces, ours "
            "refuses (it is how a field is hidden from a parser that does neither)",
            lambda p, m: o.obs_fold(p),
            b"GET / HTTP/1.1\r\nhost: a\r\nx: 1\r\n 2\r\n\r\n",
        ),
        o.Row(
            "control character in a field value",
            "RFC 9110 §5.5 allows no control character but HTAB in a value; h11 lets the others "
            "through (its issue 57, for cookies), ours refuses them, in the trailers too",
            lambda p, m: o.control_in_value(p),
            b"GET / HTTP/1.1\r\nhost: a\r\nx: 1\x01\r\n\r\n",
        ),
        o.Row(
            "HTTP version other than 1.0 or 1.1",
            "h11 takes any HTTP/d.d request line and frames it as HTTP/1.1; ours answers 505 "
            "(RFC 9110 §15.6.6) rather than guess what another version means",
            lambda p, m: m.version not in (b"1.0", b"1.1"),
            b"GET / HTTP/1.2\r\nhost: a\r\n\r\n",
        ),
        o.Row(
            "Content-Length with Transfer-Encoding",
            "RFC 9112 §6.1: a server may refuse a request with both, and must close after it either "
            "way; h11 lets chunked win, ours refuses (400) rather than guess which framing the "
            "sender meant (the classic smuggling request)",
            lambda p, m: o.has(m, b"content-length") and o.has(m, b"transfer-encoding"),
            CHUNKED.replace(b"\r\n\r\n", b"\r\ncontent-length: 1\r\n\r\n") + b"1\r\nx\r\n0\r\n\r\n",
        ),
        o.Row(
            "Content-Length of more than 18 digits",
            "h11 takes 20; ours keeps a length an integer of 63 bits, past any body a listener takes",
            lambda p, m: o.length_digits(m, 18),
            b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 0000000000000000001\r\n\r\nx",
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
            "chunk-size line: to another parser a bare CR may end the line",
            lambda p, m: o.cr_in_chunk_line(p),
            CHUNKED + b"1;a\rb\r\nx\r\n0\r\n\r\n",
        ),
        o.Row(
            "head larger than the limit",
            "h11 bounds only a head still incomplete (max_incomplete_event_size); ours refuses a head "
            "past max_head_bytes however it arrives, whole in one read too (431)",
            lambda p, m: p.heads[0][1] - p.heads[0][0] > MAX_HEAD,
            b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"v" * MAX_HEAD + b"\r\n\r\n",
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
            "empty lines before the request line",
            "RFC 9112 §2.2: a server should ignore at least one empty line before a request line "
            "(some clients send one after a POST's body); h11 refuses",
            lambda p, m: p.data.startswith(b"\r\n"),
            b"\r\nGET / HTTP/1.1\r\nhost: a\r\n\r\n",
            normalize=_without_empty_lines,
        ),
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
            "ours reads trailers and drops them (never merged into the head: RFC 9110 §6.5.1), so "
            "they frame nothing",
            lambda p, m: o.framing_in_trailers(p),
            CHUNKED + b"1\r\nx\r\n0\r\ncontent-length: x\r\n\r\n",
            normalize=o.without_framing_trailers,
        ),
    ),
    differs=(
        o.Row(
            "HTTP/1.0 keep-alive",
            "RFC 9112 §9.3: an HTTP/1.0 request with `Connection: keep-alive` (and no close) may keep "
            "its connection, and ours does unless it carried Transfer-Encoding (§6.1); h11 closes "
            "every HTTP/1.0 connection",
            lambda p, m: m.version == b"1.0",
            b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
            expect=lambda m: dataclasses.replace(m, keep_alive=o.http10_keep_alive(m)),
        ),
    ),
    parts=_parts,
    oracle=theirs,
)


VERSIONS = (b"1.1", b"1.1", b"1.0")
ODD_VERSIONS = (b"1.2", b"2.0", b"0.9")
METHODS = (b"GET", b"POST", b"POST", b"PUT", b"HEAD", b"DELETE", b"get", b"M-SEARCH")
TARGETS = (b"/", b"/v1/chat/completions?x=1", b"*", b"http://gw/v1/models", b"/caf%C3%A9")
ODD_HOSTS = ((), (b"gw", b"gw"), (b"gw", b"other"))


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request line and fields (Host none, one or two; Connection; Expect) and a body framed
    every way testlib/h1gen.py frames one, then mutated as it mutates heads."""
    start = draw(g.one(METHODS)) + b" " + draw(g.one(TARGETS)) + b" HTTP/" + g.pick(draw, VERSIONS, ODD_VERSIONS)
    fields = [g.field_line(draw, b"host", host) for host in g.pick(draw, ((b"gw",), (b"",)), ODD_HOSTS)]
    fields += g.common_fields(draw)
    if draw(g.ints(0, 5)) == 0:
        fields.append(g.field_line(draw, b"expect", b"100-continue"))
    lines, body = g.framed(draw, fields)
    return g.mutated(draw, [start, *lines], body + draw(g.one(g.AFTER)))


@settings(
    max_examples=1000,
    derandomize=True,  # the same examples every run: a failure here is a change, not luck
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_ours_and_h11_give_the_same_verdict_on_generated_requests_but_for_the_table(data: st.DataObject) -> None:
    raw = data.draw(requests(), label="request")
    sizes = g.pieces(data.draw, raw)
    verdict = ours(raw, sizes)
    assert verdict == ours(raw), "ours parses the pieces otherwise than the whole"
    event(o.judge(TABLE, raw, verdict, theirs(raw, sizes)))


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
