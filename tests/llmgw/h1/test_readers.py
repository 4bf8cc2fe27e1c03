"""What both roles read a body with (`llmgw.h1.readers`): the work of one call bounded the same
on both sides, and the bytes decoded whatever the bound cut."""

from __future__ import annotations

import pytest

from llmgw.h1 import END, MAX_STEPS, NEED_DATA, Data, RequestHead, ResponseParser, ServerConnection

TINY_CHUNKS = b"1\r\nx\r\n" * 5000 + b"0\r\nx-t: 1\r\n\r\n"  # three framing steps a byte


def pieces(role: str) -> tuple[list[bytes], int]:
    """The body pieces `role` makes of a body of 5000 one-byte chunks that came in one read, and
    the chunks it counted (the server role's count; the client's is not told)."""
    if role == "server":
        conn = ServerConnection(max_head_bytes=16384)
        conn.receive_data(b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n" + TINY_CHUNKS)
        assert isinstance(conn.next_event(), RequestHead)
        out, chunks = [], 0
        while (event := conn.next_event()) is not END:
            assert isinstance(event, Data), event
            out.append(event.data)
            chunks += event.chunks
        return out, chunks
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + TINY_CHUNKS)
    parser.next_event()
    out = []
    while (event := parser.next_event()) is not END:
        assert event is not NEED_DATA
        out.append(event)
    return out, 5000


@pytest.mark.parametrize("role", ["server", "client"])
def test_a_read_of_many_tiny_chunks_comes_out_in_pieces_of_bounded_work_on_both_sides(role: str) -> None:
    out, chunks = pieces(role)
    assert b"".join(out) == b"x" * 5000 and chunks == 5000
    assert len(out) > 1 and all(len(piece) <= MAX_STEPS // 3 + 1 for piece in out), [len(p) for p in out]
