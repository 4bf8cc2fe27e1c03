"""Every download is capped: at the size server.toml gives the file, else at the Content-Length
the server announces, else at [downloads]'s maximum. Real HTTP servers on loopback: llmgw's own
(chunked bodies, no Content-Length) and a raw one that lies, or never says how long its body is."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import trio

from llmgw.download import Cap, DownloadError, Progress, fetch
from testlib.fileserver import Files, serve_files, serve_raw

pytestmark = pytest.mark.trio

MIB = 1 << 20
SETTING = "[downloads].max_weights_gib"


@pytest.fixture
async def files(nursery: trio.Nursery) -> tuple[Files, str]:
    return await serve_files(nursery)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Seen:
    """The most bytes a download had written, by its progress reports."""

    def __init__(self) -> None:
        self.most = 0

    def __call__(self, p: Progress) -> None:
        self.most = max(self.most, p.done_bytes)


def nothing_left(directory: Path) -> bool:
    return list(directory.iterdir()) == []


async def test_a_body_without_content_length_stops_at_the_maximum(files, tmp_path: Path) -> None:
    server, base = files
    server.streamed["/w.bin"] = (b"x" * 65536, 64)  # 4 MiB, chunked: no Content-Length
    seen = Seen()
    with pytest.raises(DownloadError) as err:
        await fetch(
            f"{base}/w.bin",
            tmp_path / "w.bin",
            sha256="0" * 64,
            cap=Cap(max_bytes=MIB, setting=SETTING),
            on_progress=seen,
        )
    text = str(err.value)
    assert text.startswith(f"{base}/w.bin sent more than 1048576 bytes (1 MiB) without announcing its size")
    assert f"more than {SETTING} allows; the download was stopped and its partial file removed" in text
    assert f"give its source `size = BYTES` in server.toml (`stat -c %s FILE`), or raise {SETTING}" in text
    assert seen.most == MIB  # not one byte past the cap reached the disk
    assert nothing_left(tmp_path)


async def test_a_body_that_ends_only_with_the_connection_is_cut_off_at_the_cap(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # HTTP/1.1 with neither Content-Length nor chunking: the body is whatever comes until close.
    endless = 256 * MIB
    raw, base = await serve_raw(nursery, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", endless)
    seen = Seen()
    with pytest.raises(DownloadError, match="sent more than 2097152 bytes"):
        await fetch(
            f"{base}/w.bin",
            tmp_path / "w.bin",
            sha256="0" * 64,
            cap=Cap(max_bytes=2 * MIB, setting=SETTING),
            on_progress=seen,
        )
    assert seen.most == 2 * MIB and nothing_left(tmp_path)
    with trio.fail_after(30):
        await raw.closed.wait()
    assert raw.sent < endless // 4, raw.sent  # the client hung up: the server did not get to send it all


async def test_a_content_length_that_lies_small_brings_no_more_than_it_said(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    raw, base = await serve_raw(nursery, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", 64 * MIB)
    seen = Seen()
    with pytest.raises(DownloadError, match="has sha256 .* but server.toml says"):
        await fetch(
            f"{base}/w.bin",
            tmp_path / "w.bin",
            sha256="0" * 64,
            cap=Cap(max_bytes=4 * MIB, setting=SETTING),
            on_progress=seen,
        )
    assert seen.most == 1000 and nothing_left(tmp_path)
    with trio.fail_after(30):
        await raw.closed.wait()
    assert raw.sent < 32 * MIB, raw.sent


async def test_a_content_length_other_than_the_configured_size_is_refused_before_a_byte(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    raw, base = await serve_raw(nursery, b"HTTP/1.1 200 OK\r\nContent-Length: 10485760\r\n\r\n", 10 * MIB)
    seen = Seen()
    with pytest.raises(DownloadError) as err:
        await fetch(
            f"{base}/w.bin",
            tmp_path / "w.bin",
            sha256="0" * 64,
            cap=Cap(size=MIB, max_bytes=64 * MIB, setting=SETTING),
            on_progress=seen,
        )
    assert str(err.value).startswith(
        f"{base}/w.bin announces 10485760 bytes, but server.toml gives its size as 1048576; nothing was kept"
    )
    assert "set it to the file's size in bytes (`stat -c %s FILE`)" in str(err.value)
    assert seen.most == 0 and nothing_left(tmp_path)


async def test_the_configured_size_caps_a_body_without_content_length(files, tmp_path: Path) -> None:
    server, base = files
    data = os.urandom(MIB)
    server.streamed["/exact.bin"] = (data, 1)
    server.streamed["/more.bin"] = (data, 3)
    # Exactly the size: fine (the cap is not off by one).
    got = await fetch(
        f"{base}/exact.bin", tmp_path / "exact.bin", sha256=sha(data), cap=Cap(size=MIB, max_bytes=1, setting=SETTING)
    )
    assert got.read_bytes() == data
    # More: stopped at the size, whatever the maximum.
    with pytest.raises(DownloadError) as err:
        await fetch(
            f"{base}/more.bin",
            tmp_path / "more.bin",
            sha256=sha(data * 3),
            cap=Cap(size=MIB, max_bytes=64 * MIB, setting=SETTING),
        )
    assert str(err.value).startswith(f"{base}/more.bin sent more than 1048576 bytes, the size server.toml gives it")
    assert not (tmp_path / "more.bin.part").exists() and not (tmp_path / "more.bin").exists()


async def test_a_part_longer_than_the_configured_size_is_started_afresh(files, tmp_path: Path) -> None:
    server, base = files
    data = os.urandom(MIB)
    server.content["/w.bin"] = data
    (tmp_path / "w.bin.part").write_bytes(b"y" * (MIB + 10))
    await fetch(f"{base}/w.bin", tmp_path / "w.bin", sha256=sha(data), cap=Cap(size=MIB, max_bytes=1, setting=SETTING))
    assert (tmp_path / "w.bin").read_bytes() == data
    assert server.ranges_seen == []  # no resume from a part that cannot be the file's beginning
