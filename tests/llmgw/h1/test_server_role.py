"""The HTTP/1.1 codec's server role (`llmgw.h1.server_role`), as the listeners speak it, without
I/O: requests parsed the same however their bytes are split, everything a client may send wrong
refused by name with the status it deserves, in time linear in what was fed; answers framed by
what the client can read; and the connection carried to the next request only when both sides
are done and neither closes. The server around it is tests/llmgw/http/test_server.py's; hostile
peers on real sockets, tests/integration/test_hostile_peers.py's."""

from __future__ import annotations

import gc
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.h1 import (
    CLOSED,
    END,
    NEED_DATA,
    PAUSED,
    Data,
    LocalProtocolError,
    ProtocolError,
    RequestHead,
    ServerConnection,
)
from testlib.pieces import cut

MAX_HEAD = 16384


def parsed(data: bytes, pieces: list[int] | None = None, *, eof: bool = False) -> list:
    """What a connection makes of `data` fed in pieces of the given sizes (default: whole): the
    head as (method, target, headers, version), the body joined, then END (or CLOSED)."""
    conn = ServerConnection(max_head_bytes=MAX_HEAD)
    out: list = []
    body = bytearray()
    for chunk in [*cut(data, pieces), *([b""] if eof else [])]:
        conn.receive_data(chunk)
        while (event := conn.next_event()) not in (NEED_DATA, PAUSED):
            if isinstance(event, RequestHead):
                out.append((event.method, event.target, event.headers, event.http_version))
            elif isinstance(event, Data):
                body += event.data
            else:
                out.append(bytes(body))
                out.append(event)
                if event in (END, CLOSED):
                    return out
    return out


POST = b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
CHUNKED = (
    b"POST /up HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
    b"3\r\nabc\r\n4;name=value\r\ndefg\r\n0\r\nx-checksum: 1\r\n\r\n"
)


def test_a_request_is_its_head_with_names_lower_case_and_repeats_kept_then_its_body() -> None:
    head, body, end = parsed(POST)
    assert head == (
        b"POST",
        b"/v1/chat/completions?x=1",
        [(b"host", b"gw"), (b"content-length", b"5"), (b"x-a", b"1"), (b"x-a", b"2")],
        b"1.1",
    )
    assert (body, end) == (b"hello", END)


def test_a_chunked_body_is_de_chunked_and_its_chunks_counted() -> None:
    conn = ServerConnection(max_head_bytes=MAX_HEAD)
    conn.receive_data(CHUNKED)
    assert isinstance(conn.next_event(), RequestHead)
    data = conn.next_event()
    assert isinstance(data, Data) and (data.data, data.chunks) == (b"abcdefg", 2)
    assert conn.next_event() is END and conn.next_event() is PAUSED


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([POST, CHUNKED]), st.lists(st.integers(min_value=1, max_value=9), max_size=60))
def test_any_split_of_the_bytes_gives_the_same_request(data: bytes, pieces: list[int]) -> None:
    assert parsed(data, pieces) == parsed(data)


def test_empty_lines_before_a_request_are_skipped_and_a_quiet_end_between_requests_is_closed() -> None:
    assert parsed(b"\r\n\r\nGET / HTTP/1.1\r\nhost: a\r\n\r\n")[0][:2] == (b"GET", b"/")
    assert parsed(b"", eof=True) == [b"", CLOSED]


@pytest.mark.parametrize(
    "data, status, says",
    [
        (b"\x00" * 100, 400, "control character in the request head"),  # at once, before a head's end
        (b"GET /\x01 HTTP/1.1\r\n", 400, "control character in the request head"),
        (b"GET  / HTTP/1.1\r\nhost: a\r\n\r\n", 400, "not a request line"),
        (b"G(T / HTTP/1.1\r\nhost: a\r\n\r\n", 400, "not a request line"),
        (b"GET / HTTP/2.0\r\nhost: a\r\n\r\n", 505, "HTTP/2.0 is not supported"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "no Host header field"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", 400, "Host given more than once"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nbad name: 1\r\n\r\n", 400, "not a header field line"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nx: 1\r\n folded\r\n\r\n", 400, "not a header field line"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nx: 1\rsplit\r\n\r\n", 400, "control character"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5, 6\r\n\r\n", 400, "given twice, differently"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: +5\r\n\r\n", 400, "not a length"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5, 05\r\n\r\n", 400, "given twice, differently"),
        (b"GET / HTTP/1.0\r\nhost: a\r\nhost: a\r\n\r\n", 400, "Host given more than once"),  # any version
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\n\r\n", 501, "is not supported"),
        (
            b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
            400,
            "twice",
        ),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\nxyz\r\n", 400, "not a chunk-size line"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc", 400, "not followed by CRLF"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"a" * MAX_HEAD, 431, "larger than the limit"),  # unfinished
        (b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"a" * MAX_HEAD + b"\r\n\r\n", 431, "larger than the limit"),
    ],
)
def test_what_is_not_http_is_refused_by_name_with_its_status(data: bytes, status: int, says: str) -> None:
    with pytest.raises(ProtocolError, match=says) as info:
        parsed(data)
    assert info.value.status == status


TE = b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n"


@pytest.mark.parametrize(
    "data, message",
    [
        (TE + b"transfer-encoding: chunked\r\n\r\n", "Transfer-Encoding given twice; send it once: Transfer-Encoding: chunked"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\xe9\r\n\r\n",
         "Transfer-Encoding 'gzip\xe9' is not supported; send the body with Content-Length or Transfer-Encoding: chunked"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5\x85\r\n\r\n",
         "Content-Length '5\\x85' is not a length; send the body's size in bytes"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
         "Content-Length given twice, differently ('5' and '6'); send it once"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: " + b"1" * 60 + b"\r\n\r\n",
         "Content-Length '" + "1" * 40 + "... (60 characters)' is not a length; send the body's size in bytes"),
        (b"GET /a\rb HTTP/1.1\r\nhost: a\r\n\r\n", "not a request line: 'GET /a\\x0db HTTP/1.1'"),
        (TE + b"\r\nxyz\r\n", "not a chunk-size line: 'xyz'"),
        (TE + b"\r\n0\r\nbad line\r\n\r\n", "not a trailer field line: 'bad line'"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nbad name: 1\r\n\r\n", "not a header field line: 'bad name: 1'"),
    ],
)  # fmt: skip
def test_a_refusal_shows_what_the_client_sent_as_text(data: bytes, message: str) -> None:
    """Not as Python's b'...': latin-1 text, control characters escaped, cut when long."""
    with pytest.raises(ProtocolError) as info:
        parsed(data)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.0\r\nconnection: keep-alive, close\r\n\r\n",
        b"GET / HTTP/1.0\r\nconnection: close\r\nconnection: keep-alive\r\n\r\n",
        # RFC 9112 §6.1: an HTTP/1.0 message with a Transfer-Encoding is closed after.
        b"POST / HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    ],
)
def test_an_http_1_0_connection_asked_to_close_or_chunked_is_not_kept(data: bytes) -> None:
    assert not request(data).keep_alive


@pytest.mark.parametrize(
    "data, says",
    [
        (b"GET / HT", "in the middle of a request head"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 9\r\n\r\nabc", "6 bytes before the end"),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", "chunked request body"),
    ],
)
def test_an_end_in_the_middle_of_a_request_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        parsed(data, eof=True)


def test_a_head_fed_a_byte_at_a_time_is_parsed_in_linear_time() -> None:
    def took(size: int) -> float:
        data = b"GET / HTTP/1.1\r\nhost: a\r\n" + b"x: a\r\n" * ((size - 40) // 6) + b"\r\n"
        tries = []
        gc.disable()
        try:
            for _ in range(3):
                conn = ServerConnection(max_head_bytes=MAX_HEAD * 4)
                started = time.process_time()
                for i in range(len(data)):
                    conn.receive_data(data[i : i + 1])
                    event = conn.next_event()
                tries.append(time.process_time() - started)
                assert isinstance(event, RequestHead)
        finally:
            gc.enable()
        return min(tries)

    small, large = took(MAX_HEAD // 2), took(MAX_HEAD * 4 - 100)
    assert large < 20 * small, f"{small:.3f} s, then {large:.3f} s for eight times the bytes"


def answer(
    conn: ServerConnection, status: int, body: bytes | None, *, close: bool = False, head: bool = False
) -> bytes:
    out = conn.send_head(status, [("content-type", "text/plain")], length=None if body is None else len(body),
                         close=close, head_only=head)  # fmt: skip
    for piece in (body or b"", b"more") if body is None else (body,):
        out += conn.send_data(piece)
    return out + conn.send_end()


def request(data: bytes) -> ServerConnection:
    conn = ServerConnection(max_head_bytes=MAX_HEAD)
    conn.receive_data(data)
    while conn.next_event() is not END:
        pass
    return conn


def test_an_answer_with_a_length_keeps_the_connection_for_the_next_request() -> None:
    conn = request(b"GET /a HTTP/1.1\r\nhost: a\r\n\r\nGET /b HTTP/1.1\r\nhost: a\r\n\r\n")
    assert answer(conn, 200, b"hi") == (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nhi")
    assert conn.reusable and conn.buffered == len(b"GET /b HTTP/1.1\r\nhost: a\r\n\r\n")
    conn.start_next_cycle()
    head = conn.next_event()
    assert isinstance(head, RequestHead) and head.target == b"/b"


def test_a_streamed_answer_is_chunked_to_http_1_1_and_ends_the_connection_to_http_1_0() -> None:
    assert answer(request(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n"), 200, None).endswith(
        b"transfer-encoding: chunked\r\n\r\n4\r\nmore\r\n0\r\n\r\n"
    )
    old = request(b"GET / HTTP/1.0\r\n\r\n")
    assert answer(old, 200, None).endswith(b"connection: close\r\n\r\nmore") and not old.reusable


def test_heads_without_a_body_and_who_closes() -> None:
    conn = request(b"HEAD / HTTP/1.1\r\nhost: a\r\n\r\n")
    assert answer(conn, 200, b"12345", head=True).endswith(b"content-length: 5\r\n\r\n") and conn.reusable
    assert answer(request(b"DELETE /k HTTP/1.1\r\nhost: a\r\n\r\n"), 204, b"").endswith(b"text/plain\r\n\r\n")
    for data in (b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"):
        conn = request(data)
        assert b"connection: close\r\n" in answer(conn, 200, b"x") and not conn.reusable
    kept = request(b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
    assert b"connection" not in answer(kept, 200, b"x") and kept.reusable
    closing = request(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    assert b"connection: close\r\n" in answer(closing, 503, b"x", close=True) and not closing.reusable


def test_a_client_that_expects_100_continue_is_told_once_until_its_body_comes() -> None:
    conn = ServerConnection(max_head_bytes=MAX_HEAD)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: a\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
    assert isinstance(conn.next_event(), RequestHead) and conn.expecting_continue
    assert conn.next_event() is NEED_DATA and conn.send_continue() == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert not conn.expecting_continue


@pytest.mark.parametrize(
    "fields",
    [
        [("x-a", "1\r\nx-b: 2")],
        [("x-a", "\n")],
        [("x-a", "\r")],
        [("x-a", "\x00")],
        [("x a", "1")],
        [("x-a", "1"), ("x-b", b"2\r\n"), ("x-c", "3")],  # checked in one pass: found wherever it is
    ],
)
def test_a_field_that_would_split_the_answer_is_refused_before_anything_is_written(fields: list) -> None:
    conn = request(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    with pytest.raises(LocalProtocolError, match="cannot be written"):
        conn.send_head(200, fields, length=0)
    assert not conn.answer_begun  # an error answer may still be written


def test_a_body_other_than_its_content_length_is_refused() -> None:
    conn = request(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    conn.send_head(200, [], length=3)
    with pytest.raises(LocalProtocolError, match="4 bytes where 3 were left"):
        conn.send_data(b"abcd")
    conn.send_data(b"ab")
    with pytest.raises(LocalProtocolError, match="1 bytes short"):
        conn.send_end()
