"""Files as streamed response bodies: `FileBody` sends an open file's bytes in chunks read off the
loop, for a `StreamingResponse` with the length announced (the mirror's archives and the release
files on the agent port).

The file is opened by the handler (off the loop: `open_file`) and closed by the body however the
response ends — sent whole, cut by a client gone or too slow, or never started (a HEAD): the
server calls `aclose` in every case, and `on_close` runs then (a download slot given back). A
file that shrinks while it is sent ends the response short on purpose (`BodyAborted`: the client
sees a truncated body), since what was announced can no longer be kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import trio

from llmgw.http.errors import BodyAborted
from llmgw.log import get_logger

log = get_logger("llmgw.http")

CHUNK = 1 << 20


def _open(path: Path) -> tuple[BinaryIO, int] | None:
    try:
        f = path.open("rb")
    except OSError:
        return None
    try:
        return f, os.fstat(f.fileno()).st_size
    except OSError:
        f.close()
        return None


async def open_file(path: Path) -> tuple[BinaryIO, int] | None:
    """`path` opened for reading (off the loop) and its size; None if it cannot be opened (gone
    since it was listed)."""
    return await trio.to_thread.run_sync(_open, path)


class FileBody:
    """`length` bytes of `f` from offset `start`, read `chunk` at a time in a thread; `f` is
    closed and `on_close` called once, at `aclose`."""

    def __init__(
        self,
        f: BinaryIO,
        length: int,
        *,
        start: int = 0,
        chunk: int = CHUNK,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.f = f
        self.left = length
        self.start: int | None = start  # None once sought
        self.chunk = chunk
        self.on_close = on_close
        self.closed = False

    def __aiter__(self) -> FileBody:
        return self

    async def __anext__(self) -> bytes:
        if self.left <= 0:
            raise StopAsyncIteration
        block = await trio.to_thread.run_sync(self._read, min(self.chunk, self.left))
        if not block:
            name = getattr(self.f, "name", "?")
            log.warning("http_file_shrank", file=str(name), missing_bytes=self.left)
            raise BodyAborted(f"{name} ended {self.left} bytes early: it changed while it was sent")
        self.left -= len(block)
        return block

    def _read(self, n: int) -> bytes:
        if self.start is not None:
            self.f.seek(self.start)
            self.start = None
        return self.f.read(n)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.f.close()
        if self.on_close is not None:
            self.on_close()
        await trio.lowlevel.checkpoint()
