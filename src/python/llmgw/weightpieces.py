"""Weights files in pieces, as every holder of one serves them: how a file is cut (the same on
every node), the piece hashes kept beside a whole file, and the answer to a request for a file's
piece list or for one piece — given by a node's weights port (`agent.peers`) and, where the
control plane is the origin of weights, by its agent port (`llmgw.server.nodes.weightsorigin`).

Cutting: pieces of 1 MiB for a small file, doubling up to 16 MiB so that a file has at most about
128 of them (a 2 GiB file: 128 pieces of 16 MiB).

The two requests (GET, under WEIGHTS_PREFIX):

    SHA256/pieces   {"size", "piece_size", "complete", "have": "<hex bitmap>", "hashes": [...]}
                    (hashes with `?hashes=1`: each piece's SHA-256, "" for one not here)
    SHA256          with `Range: bytes=A-B` covering exactly one piece here: 206, the piece

At most `uploads` pieces are sent at once by one `PieceSender`; past that a request is answered
503 and the asker goes to another holder. A piece is sent a block at a time, read off the loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw.http.errors import BodyAborted, HTTPError
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.wire import agent_link as w

PIECE_MIN = 1 << 20
PIECE_MAX = 16 << 20
PIECES_TARGET = 128
HASHES_FILE = ".pieces.json"


def piece_size(size: int) -> int:
    """The piece size of a file of `size` bytes, the same on every node."""
    piece = PIECE_MIN
    while piece < PIECE_MAX and size > piece * PIECES_TARGET:
        piece *= 2
    return piece


def piece_count(size: int) -> int:
    piece = piece_size(size)
    return max(1, -(-size // piece))


def span(index: int, size: int) -> tuple[int, int]:
    """(offset, length) of piece `index` of a file of `size` bytes."""
    piece = piece_size(size)
    start = index * piece
    return start, max(0, min(piece, size - start))


def piece_of(start: int, length: int, size: int) -> int | None:
    """The piece exactly covered by bytes [start, start + length), or None."""
    piece = piece_size(size)
    if start % piece or (start, length) != span(start // piece, size) or not length:
        return None
    return start // piece


def hash_piece(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


HASHES_FILE = ".pieces.json"
UPLOADS = 8  # pieces a sender sends at once
BLOCK = 1 << 20  # read and sent at a time
_SHA = re.compile(r"^[0-9a-f]{64}$")
_RANGE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{1,19})")


def read_range(path: Path, start: int, n: int) -> bytes:
    """`n` bytes of `path` from `start` (blocking); b"" when it cannot be read (gone meanwhile)."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            return f.read(n)
    except OSError:
        return b""


def write_json_atomic(path: Path, obj: object) -> None:
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(json.dumps(obj, separators=(",", ":")))
    os.replace(fresh, path)


def write_hashes(blob: Path, size: int, hashes: list[str]) -> None:
    write_json_atomic(blob.parent / HASHES_FILE, {"name": blob.name, "size": size, "pieces": hashes})


def read_hashes(blob: Path, size: int) -> list[str] | None:
    """The piece hashes kept beside a whole file of `size` bytes, or None (not kept, or not this file's)."""
    try:
        saved = json.loads((blob.parent / HASHES_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("name") != blob.name or saved.get("size") != size:
        return None
    pieces = saved.get("pieces")
    if not isinstance(pieces, list) or len(pieces) != piece_count(size) or not all(isinstance(h, str) for h in pieces):
        return None
    return pieces


def kept_or_hashed(blob: Path, size: int, digest: str) -> tuple[list[str], str]:
    """A whole file's piece hashes and its SHA-256 as far as known: those kept beside it (with
    `digest`, which it was verified against), or computed in one read and kept if it is `digest`'s
    (blocking). A second value other than `digest` says the file is not what it should be."""
    hashes = read_hashes(blob, size)
    if hashes is not None:
        return hashes, digest
    hashes, whole = hash_whole(blob)
    if whole == digest:
        with contextlib.suppress(OSError):
            write_hashes(blob, size, hashes)
    return hashes, whole


def hash_whole(blob: Path) -> tuple[list[str], str]:
    """Every piece's SHA-256 of a whole file, and the file's own (blocking: one read of it)."""
    size = blob.stat().st_size
    hashes = []
    whole = hashlib.sha256()
    with blob.open("rb") as f:
        for i in range(piece_count(size)):
            start, length = span(i, size)
            f.seek(start)
            data = f.read(length)
            whole.update(data)
            hashes.append(hash_piece(data))
    return hashes, whole.hexdigest()


@attrs.frozen(kw_only=True)
class Offer:
    """What this node can serve of one file now: `read(offset, n)` gives bytes of it (blocking)."""

    size: int
    complete: bool
    have: frozenset[int] | None  # None: every piece (complete)
    hashes: Callable[[], dict[int, str]]  # the pieces' SHA-256 as known here (blocking for a whole file the first time)
    read: Callable[[int, int], bytes]


def bitmap(have: frozenset[int] | None, count: int) -> str:
    """Pieces as hex, piece 0 the highest bit of the first byte."""
    bits = bytearray((count + 7) // 8)
    for i in range(count) if have is None else have:
        if 0 <= i < count:
            bits[i // 8] |= 0x80 >> (i % 8)
    return bits.hex()


def from_bitmap(text: str, count: int) -> frozenset[int]:
    bits = bytes.fromhex(text)
    return frozenset(i for i in range(min(count, len(bits) * 8)) if bits[i // 8] & (0x80 >> (i % 8)))


class PieceSender:
    """Answers the two requests from `offers` (a file's Offer by its SHA-256, None if not held),
    sending at most `uploads` pieces at once."""

    def __init__(self, uploads: int = UPLOADS) -> None:
        self.limit = uploads
        self.uploads = trio.Semaphore(uploads)
        self.sent_bytes = 0

    async def answer(
        self, request: Request, offers: Callable[[str], Offer | None], *, place: str
    ) -> Response | StreamingResponse:
        """`place`: what the server is, for the 404's words ("node", "control plane")."""
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        rest = path.removeprefix(w.WEIGHTS_PREFIX)
        if rest == path:
            raise HTTPError(404, f"no such path on a {place}'s weights port")
        want_pieces = rest.endswith(w.PIECES_SUFFIX)
        digest = rest.removesuffix(w.PIECES_SUFFIX)
        offer = offers(digest) if _SHA.match(digest) else None
        if offer is None:
            raise HTTPError(404, f"this {place} holds no such file")
        count = piece_count(offer.size)
        if want_pieces:
            body = {
                "size": offer.size,
                "piece_size": piece_size(offer.size),
                "complete": offer.complete,
                "have": bitmap(offer.have, count),
            }
            if "hashes=1" in query.split("&"):
                known = await trio.to_thread.run_sync(offer.hashes)
                body["hashes"] = [known.get(i, "") for i in range(count)]
            return Response.json(200, body)
        m = _RANGE.fullmatch(request.headers.get("range", "").strip())
        index = piece_of(int(m[1]), int(m[2]) - int(m[1]) + 1, offer.size) if m else None
        if index is None or index >= count:
            raise HTTPError(416, "ask for one piece: Range: bytes=A-B on piece boundaries")
        if offer.have is not None and index not in offer.have:
            raise HTTPError(404, f"piece {index} is not here yet")
        try:
            self.uploads.acquire_nowait()
        except trio.WouldBlock:
            raise HTTPError(
                503, f"this {place} is sending as many pieces as it may; ask another", headers=(("retry-after", "1"),)
            ) from None
        start, length = span(index, offer.size)
        return StreamingResponse(
            status=206,
            body=_PieceBody(self, offer, start, length),
            headers=(("content-range", f"bytes {start}-{start + length - 1}/{offer.size}"),),
            length=length,
        )


class _PieceBody:
    """One piece as a response body, a block at a time read off the loop; its upload place is
    given back at `aclose`, which the server calls however the response ends (unstarted too)."""

    def __init__(self, server: PieceSender, offer: Offer, start: int, length: int) -> None:
        self.server, self.offer, self.at, self.left = server, offer, start, length
        self.closed = False

    def __aiter__(self) -> _PieceBody:
        return self

    async def __anext__(self) -> bytes:
        if self.left <= 0:
            raise StopAsyncIteration
        block = await trio.to_thread.run_sync(self.offer.read, self.at, min(BLOCK, self.left))
        if not block:
            raise BodyAborted(f"the file ended {self.left} bytes early: it went while it was sent")
        self.at += len(block)
        self.left -= len(block)
        self.server.sent_bytes += len(block)
        return block

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.uploads.release()
        await trio.lowlevel.checkpoint()
