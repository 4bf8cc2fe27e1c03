"""The mirror's route on memory streams: an archive sent whole or from an offset, and whatever a
peer puts in `Range` answered per RFC 9110 — never a dropped connection or a traceback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from llmgw.server import agentport, artifacts
from llmgw.server.artifacts import Artifacts, range_start

DATA = bytes(range(256)) * 40  # 10240 bytes
SIZE = len(DATA)


@pytest.mark.parametrize(
    ("header", "start"),
    [
        ("", 0),
        ("bytes=0-", 0),
        ("bytes=100-", 100),
        ("Bytes=100-", 100),  # the unit is case-insensitive (RFC 9110 §14.1)
        (" bytes=100- ", 100),
        ("bytes=" + "0" * 5000 + "7-", 7),  # leading zeros do not make a number large
        (f"bytes={SIZE - 1}-", SIZE - 1),
        (f"bytes={SIZE}-", None),  # the first byte past the end: unsatisfiable (§14.1.1)
        ("bytes=" + "9" * 5000 + "-", None),  # past CPython's 4300 digits for int(): still only past the end
        ("bytes=" + "9" * 20 + "-", None),
        ("bytes=100-200", 0),  # other forms: ignored, the whole file (§14.2)
        ("bytes=-100", 0),
        ("bytes=1-,5-", 0),
        ("items=5-", 0),
        ("bytes=²-", 0),  # str.isdigit says yes; not a digit of HTTP's
        ("bytes=٣-", 0),
        ("bytes=-", 0),
        ("garbage" * 1000, 0),
    ],
)
def test_the_range_start_of_each_range_header(header: str, start: int | None) -> None:
    assert range_start(header, SIZE) == start


def test_an_empty_file_satisfies_no_range() -> None:
    assert range_start("", 0) == 0 and range_start("bytes=0-", 0) is None


async def _get(mirror: Artifacts, target: bytes, range_header: bytes | None) -> tuple[int, dict[bytes, bytes], bytes]:
    client, server = trio.testing.memory_stream_pair()
    headers = [(b"host", b"cp")] + ([(b"range", range_header)] if range_header is not None else [])
    request = h11.Request(method=b"GET", target=target, headers=headers)
    conn = h11.Connection(h11.CLIENT)
    await client.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
    head = await agentport.read_head(server)
    assert agentport.route(head.request) is agentport.Route.MIRROR
    await artifacts.serve(server, head.conn, head.request, mirror, "node-a", send_timeout_s=5)
    await server.aclose()
    status, got, body = 0, {}, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await client.receive_some())
        elif isinstance(event, h11.Response):
            status, got = event.status_code, dict(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, got, body


@pytest.mark.trio
async def test_the_route_answers_every_range_with_the_file_its_end_or_416(tmp_path: Path) -> None:
    (tmp_path / "archive.tar.gz").write_bytes(DATA)
    mirror = Artifacts(tmp_path)
    target = b"/v1/artifacts/" + hashlib.sha256(DATA).hexdigest().encode()
    status, headers, body = await _get(mirror, target, None)
    assert status == 200 and body == DATA
    status, headers, body = await _get(mirror, target, b"bytes=10000-")
    assert (
        status == 206
        and body == DATA[10000:]
        and headers[b"content-range"] == f"bytes 10000-{SIZE - 1}/{SIZE}".encode()
    )
    for absurd in (b"bytes=" + b"9" * 5000 + b"-", f"bytes={SIZE}-".encode()):
        status, headers, body = await _get(mirror, target, absurd)
        assert status == 416 and body == b"" and headers[b"content-range"] == f"bytes */{SIZE}".encode()
    for ignored in (b"bytes=5-9", b"bytes=\xb2-", b"bytes=1-,5-"):
        status, headers, body = await _get(mirror, target, ignored)
        assert status == 200 and body == DATA and b"content-range" not in headers
