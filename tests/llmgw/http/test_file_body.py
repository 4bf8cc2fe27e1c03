"""Files as streamed bodies (`llmgw.http.files`): the announced bytes from the offset, in chunks;
a file that shrank ends the body on purpose; the file closed and `on_close` called once, also
for a body never started (a HEAD), and through the server, whatever the client does."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.http.errors import BodyAborted
from llmgw.http.files import FileBody, open_file
from llmgw.http.messages import Request, StreamingResponse
from testlib.httpexchange import exchange

pytestmark = pytest.mark.trio

DATA = bytes(range(256)) * 100


async def test_the_bytes_from_the_offset_in_chunks_then_closed_once(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    opened = await open_file(tmp_path / "f")
    assert opened is not None and opened[1] == len(DATA)
    closed: list[bool] = []
    body = FileBody(opened[0], len(DATA) - 1000, start=1000, chunk=4096, on_close=lambda: closed.append(True))
    chunks = [chunk async for chunk in body]
    assert b"".join(chunks) == DATA[1000:] and max(map(len, chunks)) == 4096
    await body.aclose()
    await body.aclose()
    assert closed == [True] and opened[0].closed
    assert await open_file(tmp_path / "gone") is None


async def test_a_file_that_shrank_ends_the_body_short_on_purpose(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    opened = await open_file(tmp_path / "f")
    assert opened is not None
    (tmp_path / "f").write_bytes(DATA[:100])  # truncated in place while it is sent
    body = FileBody(opened[0], len(DATA))
    with pytest.raises(BodyAborted, match="bytes early"):
        async for _ in body:
            pass
    await body.aclose()


async def test_through_the_server_a_head_or_a_get_each_closes_the_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    closed: list[str] = []

    async def handler(request: Request) -> StreamingResponse:
        opened = await open_file(tmp_path / "f")
        assert opened is not None
        body = FileBody(opened[0], opened[1], on_close=lambda: closed.append(request.method))
        return StreamingResponse(status=200, body=body, length=opened[1])

    got = await exchange(handler, b"GET /f HTTP/1.1\r\nhost: t\r\n\r\n")
    assert got.status == 200 and got.body == DATA and got.headers[b"content-length"] == str(len(DATA)).encode()
    assert b"transfer-encoding" not in got.headers
    got = await exchange(handler, b"HEAD /f HTTP/1.1\r\nhost: t\r\n\r\n")
    assert got.status == 200 and got.body == b"" and got.headers[b"content-length"] == str(len(DATA)).encode()
    assert closed == ["GET", "HEAD"]
