"""The mirror's route on the shared HTTP server over memory streams: an archive sent whole or
from an offset, and whatever a peer puts in `Range` answered per RFC 9110 — never a dropped
connection or a traceback; HEAD answered as GET without the body."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import pytest

from llmgw.server.nodes import artifacts
from llmgw.server.nodes.artifacts import Artifacts, range_start
from testlib.httpexchange import exchange

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
    """GET `target` of the mirror's handler on the shared HTTP server, over memory streams."""
    request = b"GET " + target + b" HTTP/1.1\r\nhost: cp\r\n"
    request += (b"range: " + range_header + b"\r\n" if range_header is not None else b"") + b"\r\n"
    answered = await exchange(partial(artifacts.handle, artifacts=mirror, node="node-a"), request)
    return answered.status, answered.headers, answered.body


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


@pytest.mark.trio
async def test_head_and_a_hash_not_held_and_other_methods(tmp_path: Path) -> None:
    (tmp_path / "archive.tar.gz").write_bytes(DATA)
    mirror = Artifacts(tmp_path)
    target = b"/v1/artifacts/" + hashlib.sha256(DATA).hexdigest().encode()
    handler = partial(artifacts.handle, artifacts=mirror, node="node-a")
    head = await exchange(handler, b"HEAD " + target + b" HTTP/1.1\r\nhost: cp\r\n\r\n")
    assert head.status == 200 and head.headers[b"content-length"] == str(SIZE).encode()
    assert head.raw.endswith(b"\r\n\r\n")  # the head alone
    status, _, body = await _get(mirror, b"/v1/artifacts/" + b"0" * 64, None)
    assert status == 404 and body == b"no such artifact on this control plane\n"
    post = await exchange(handler, b"POST " + target + b" HTTP/1.1\r\nhost: cp\r\ncontent-length: 0\r\n\r\n")
    assert post.status == 405 and post.headers[b"allow"] == b"GET, HEAD"
