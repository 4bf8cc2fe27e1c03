"""Header field lines as both roles of the codec read and write them (`llmgw.h1.fields`): a
block checked in one pass, and the line to blame named when it fails."""

from __future__ import annotations

import pytest

from llmgw.h1 import fields
from llmgw.h1.fields import FieldError, as_text, parse_fields, whole_lines, writable


def test_fields_are_lower_case_names_and_trimmed_values_in_order_repeats_kept() -> None:
    block = b"Host: a\r\nX-A:  1 \r\nx-a:\t2\t\r\nEmpty:\r\nTab: a\tb\r\n"
    assert parse_fields(block) == [
        (b"host", b"a"),
        (b"x-a", b"1"),
        (b"x-a", b"2"),
        (b"empty", b""),
        (b"tab", b"a\tb"),  # a TAB inside a value is allowed
    ]
    assert parse_fields(b"") == []


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (b"x-a: 1\r\nno colon\r\n", "not a header field line: 'no colon'"),
        (b"x-a: 1\r\n folded\r\n", "not a header field line: ' folded'"),  # obs-fold
        (b"x a: 1\r\n", "not a header field line: 'x a: 1'"),
        (b"x\xe9: 1\r\n", "not a header field line: 'x\xe9: 1'"),  # as text: latin-1
        (b"x-a: 1\r\nx-b: 2\x00\r\n", "a control character in the value of the header field 'x-b'"),
        (b"x-a: 1\rx-b: 2\r\n", "a control character in the value of the header field 'x-a'"),
        (b"x-a: 1\nx-b: 2\r\n", "a control character in the value of the header field 'x-a'"),
        (b"x-a: 1\x7f\r\n", "a control character in the value of the header field 'x-a'"),
        (b"x-a: 1\r\nx-b: 2", "the header field lines do not end with CRLF"),
    ],
)
def test_a_bad_line_is_named_wherever_it_is_in_the_block(block: bytes, message: str) -> None:
    with pytest.raises(FieldError) as raised:
        parse_fields(block)
    assert str(raised.value) == message


def test_a_peers_bytes_are_shown_as_text_escaped_and_cut() -> None:
    assert as_text(b"gzip") == "gzip"
    assert as_text(b"caf\xe9") == "caf\xe9"  # each byte a character, as HTTP reads it
    # A CR or LF must not break a message (or its log line) in two; no control character shows raw.
    assert as_text(b"a\r\nb\x00\tc\x7f\x9b") == "a\\x0d\\x0ab\\x00\\x09c\\x7f\\x9b"
    assert as_text(b"v" * 100, 10) == "vvvvvvvvvv... (100 characters)"


def test_a_head_written_is_whole_lines_only_when_no_field_splits_it() -> None:
    head = b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\r\n"
    assert whole_lines(head, 3)
    assert not whole_lines(head, 2)
    assert not whole_lines(b"HTTP/1.1 200 OK\r\nx-a: 1\r\nx-b: 2\r\n\r\n", 3)  # a CRLF inside a value
    assert not whole_lines(b"HTTP/1.1 200 OK\r\nx-a: 1\r\r\n\r\n", 3)
    assert not whole_lines(b"HTTP/1.1 200 OK\r\nx-a: 1\n\r\n\r\n", 3)
    assert not whole_lines(b"HTTP/1.1 200 OK\r\nx-a: 1\x00\r\n\r\n", 3)
    assert writable(b"x-a", b"1") and not writable(b"x-a", b"1\r") and not writable(b"x a", b"1")


def test_the_names_remembered_as_tokens_are_bounded() -> None:
    for i in range(2 * fields._KNOWN_NAMES_MAX):
        assert parse_fields(b"x-%d: 1\r\n" % i) == [(b"x-%d" % i, b"1")]
    assert len(fields._good_names) <= fields._KNOWN_NAMES_MAX
    with pytest.raises(FieldError):
        parse_fields(b"x(: 1\r\n")  # never remembered
