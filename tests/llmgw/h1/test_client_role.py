"""The HTTP/1.1 codec's client role (`llmgw.h1.client_role`), as the gateway speaks it to
engines, without I/O: requests written, and responses parsed the same whichever way their bytes
are split, with everything an engine might send wrong refused by name, in time linear in what
was fed."""

from __future__ import annotations

import gc
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.h1 import (
    END,
    MAX_HEAD_BYTES,
    NEED_DATA,
    ClosedBeforeResponse,
    Head,
    ProtocolError,
    ResponseParser,
    request_bytes,
)
from testlib.pieces import cut


def events(data: bytes, pieces: list[int] | None = None, *, eof: bool = False, method: str = "POST") -> list:
    """Everything the parser makes of `data` fed in pieces of the given sizes (default: whole),
    body pieces joined into one bytes; then the end of the connection if `eof`."""
    parser = ResponseParser(request_method=method)
    out: list = []
    body = bytearray()
    for chunk in [*cut(data, pieces), *([b""] if eof else [])]:
        parser.receive_data(chunk)
        while True:
            event = parser.next_event()
            if event is NEED_DATA:
                break
            if isinstance(event, bytes):
                assert event, "an empty body piece"
                body += event
                continue
            out.append(event)
            if event is END:
                break
        if out and out[-1] is END:
            break
    return [*out[:1], bytes(body), *out[1:]] if out else out


def test_a_request_is_its_head_with_host_and_length_first_then_the_body() -> None:
    head = request_bytes("POST", "/v1/chat/completions", "10.0.0.2:8000", [(b"x-a", b"1"), (b"x-a", b"2")], b"{}")
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.2:8000\r\ncontent-length: 2\r\n"
        b"x-a: 1\r\nx-a: 2\r\n\r\n"
    )


@pytest.mark.parametrize("field", [(b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\n"), (b"x-a", b"\x00"), (b"x a", b"1")])
def test_a_field_that_would_split_the_request_is_refused(field: tuple[bytes, bytes]) -> None:
    with pytest.raises(ValueError, match="not sent"):
        request_bytes("POST", "/", "h:1", [field], b"")
    with pytest.raises(ValueError, match=f"'{field[0].decode()}'.* not sent"):  # found among others, in one pass
        request_bytes("POST", "/", "h:1", [(b"x-0", b"0"), field, (b"x-9", b"9")], b"")


def test_a_target_that_would_split_the_request_is_refused() -> None:
    with pytest.raises(ValueError, match="the request line or host holds CR, LF or NUL: not sent"):
        request_bytes("POST", "/a\r\nx-b: 1", "h:1", [(b"x-a", b"1")], b"")


LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\n5;ext=1\r\nhello\r\n2\r\n\n\n\r\n0\r\nx-trailer: t\r\n\r\n"
)


def test_a_response_with_a_length_is_its_head_then_its_body_and_the_connection_is_reusable() -> None:
    parser = ResponseParser()
    parser.receive_data(LENGTH)
    head = parser.next_event()
    assert head == Head(status=200, headers=((b"content-type", b"application/json"), (b"content-length", b"5")))
    assert parser.next_event() == b"hello" and parser.next_event() is END and parser.reusable


def test_a_chunked_body_is_de_chunked_and_what_has_arrived_goes_out_in_one_piece() -> None:
    parser = ResponseParser()
    parser.receive_data(CHUNKED)
    assert isinstance(parser.next_event(), Head)
    assert parser.next_event() == b"data: hello\n\n"  # three chunks, one piece
    assert parser.next_event() is END and parser.reusable


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([LENGTH, CHUNKED]), st.lists(st.integers(min_value=1, max_value=9), max_size=60))
def test_any_split_of_the_bytes_gives_the_same_response(data: bytes, pieces: list[int]) -> None:
    assert events(data, pieces) == events(data)


def test_informational_heads_are_skipped_and_heads_without_a_body_end_at_once() -> None:
    assert events(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n" + LENGTH)[1] == b"hello"
    for status in (204, 304):
        assert events(b"HTTP/1.1 %d X\r\n\r\n" % status)[1:] == [b"", END]
    assert events(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", method="HEAD")[1:] == [b"", END]


def test_a_body_until_close_ends_with_the_connection_and_is_not_reused() -> None:
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.1 200 OK\r\n\r\nsome")
    assert isinstance(parser.next_event(), Head) and parser.next_event() == b"some"
    assert parser.next_event() is NEED_DATA
    parser.receive_data(b"")
    assert parser.next_event() is END and not parser.reusable


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK\r\n",  # bytes after the response
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nconnection: close\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",  # close wins
        # RFC 9112 §6.1: an HTTP/1.0 message with a Transfer-Encoding is closed after.
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    ],
)
def test_a_connection_the_engine_closes_or_that_carried_more_is_not_reused(data: bytes) -> None:
    parser = ResponseParser()
    parser.receive_data(data)
    while parser.next_event() is not END:
        pass
    assert not parser.reusable


def test_an_http_1_0_engine_that_asks_for_keep_alive_is_reused() -> None:
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n")
    assert isinstance(parser.next_event(), Head) and parser.next_event() is END and parser.reusable


@pytest.mark.parametrize(
    "data, says",
    [
        (b"HTTP/2 200 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 O\x01K\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 099 OK\r\ncontent-length: 0\r\n\r\n", "not an HTTP/1.1 status line"),  # no class 0
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n" + LENGTH, "101 Switching Protocols to a request that asked"),
        (b"HTTP/1.1 100 Continue\r\ncontent-length: x\r\n\r\n" + LENGTH, "not a length"),  # checked on a 1xx too
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5, 05\r\n\r\nhello", "given differently"),  # the same digits only
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n", "given twice"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "not a header field line"),
        (b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n", "not a header field line"),
        (b"HTTP/1.1 200 OK\r\nx: 1\r\n folded\r\n\r\n", "not a header field line"),
        (b"HTTP/1.1 200 OK\r\nx: a\x00b\r\n\r\n", "control character"),
        (b"HTTP/1.1 200 OK\r\nx: a\nb: c\r\n\r\n", "control character"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n", "given differently"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n", "not a length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0x5\r\n\r\n", "not a length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n", "other than chunked"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "not a chunk-size line"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n", "not a trailer"),
    ],
)
def test_what_is_not_http_is_refused_by_name(data: bytes, says: str) -> None:
    parser = ResponseParser()
    parser.receive_data(data)
    with pytest.raises(ProtocolError, match=says):
        while parser.next_event() not in (END, NEED_DATA):
            pass


@pytest.mark.parametrize(
    "data, says",
    [
        (b"", "closed before a response"),
        (b"HTTP/1.1 200 OK\r\n", "in the middle of a response head"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc", "6 bytes before the end"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", "in the middle of a chunked body"),
    ],
)
def test_an_end_of_connection_before_the_end_of_the_response_is_refused(data: bytes, says: str) -> None:
    parser = ResponseParser()
    parser.receive_data(data)
    parser.receive_data(b"")
    with pytest.raises(ProtocolError, match=says) as info:
        while parser.next_event() is not END:
            pass
    assert isinstance(info.value, ClosedBeforeResponse) == (data == b"")
    assert parser.started == (data != b"")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\xe9\r\n\r\n", "a Transfer-Encoding other than chunked: 'gzip\xe9'"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\x85\r\n\r\n", "a Content-Length that is not a length: '5\\x85'"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n", "Content-Length given differently: '5' and '6'"),
        (b"HTTP/1.1 200 O\rK\r\n\r\n", "not an HTTP/1.1 status line: 'HTTP/1.1 200 O\\x0dK'"),
        (b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n", "not a header field line: 'bad name: 1'"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "not a chunk-size line: 'zz'"),
    ],
)  # fmt: skip
def test_a_refusal_shows_what_the_engine_sent_as_text(data: bytes, message: str) -> None:
    """Not as Python's b'...': latin-1 text, control characters escaped."""
    parser = ResponseParser()
    parser.receive_data(data)
    with pytest.raises(ProtocolError) as info:
        while parser.next_event() not in (END, NEED_DATA):
            pass
    assert str(info.value) == message


def test_a_head_is_bounded_with_its_empty_line_whole_as_in_pieces() -> None:
    fields = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx: "
    at_bound = fields + b"a" * (MAX_HEAD_BYTES - len(fields) - 4) + b"\r\n\r\n"
    assert len(at_bound) == MAX_HEAD_BYTES and events(at_bound)[1:] == [b"", END]
    with pytest.raises(ProtocolError, match="response head larger than"):
        events(at_bound[:-4] + b"a\r\n\r\n")


def test_a_head_or_a_line_past_its_bound_is_refused_even_before_its_end() -> None:
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.1 200 OK\r\nx: " + b"a" * MAX_HEAD_BYTES)
    with pytest.raises(ProtocolError, match="response head larger than"):
        parser.next_event()
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"1" * 5000)
    assert isinstance(parser.next_event(), Head)
    with pytest.raises(ProtocolError, match="chunk-size or trailer line longer"):
        parser.next_event()


def fed_a_byte_at_a_time(size: int) -> float:
    """CPU seconds to parse a head of about `size` bytes of short fields fed one byte at a time
    (the least of three tries, the garbage collector off: a pause is no part of it)."""
    fields = b"x: a\r\n" * ((size - 40) // 6)
    data = b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 0\r\n\r\n"
    tries = []
    gc.disable()
    try:
        for _ in range(3):
            parser = ResponseParser()
            started = time.process_time()
            for i in range(len(data)):
                parser.receive_data(data[i : i + 1])
                event = parser.next_event()
            tries.append(time.process_time() - started)
            assert isinstance(event, Head) and event.headers[-1] == (b"content-length", b"0")
    finally:
        gc.enable()
    return min(tries)


def test_a_head_fed_a_byte_at_a_time_is_parsed_in_linear_time() -> None:
    """Each byte does not search the head again from its start: eight times the bytes take
    about eight times as long (a search from the start each time: about sixty times)."""
    small, large = fed_a_byte_at_a_time(MAX_HEAD_BYTES // 8), fed_a_byte_at_a_time(MAX_HEAD_BYTES - 100)
    assert large < 20 * small, f"{small:.3f} s, then {large:.3f} s for eight times the bytes"
