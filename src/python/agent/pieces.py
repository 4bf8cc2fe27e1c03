"""A weights file fetched in pieces: the download's state, which survives any cut.

Every node cuts a file the same way (`llmgw.weightpieces`). Nodes exchange pieces (`agent.peers`), each one checked on arrival against its SHA-256
as the authority for that file says (a node holding the whole file verified, or the node
fetching it from its source), and the whole file against its own SHA-256 before anything uses it.

A download in pieces lives beside the file's final name, in its digest directory:

    WEIGHTS/<sha256>/<name>.part            the file's size, from the start (space reserved:
                                            `posix_fallocate`, so a disk too small says so before
                                            a byte moves); pieces land at their offsets
    WEIGHTS/<sha256>/.<name>.part.json      which pieces are in it and their SHA-256, written
                                            (atomically) after the pieces it lists are synced
    WEIGHTS/<sha256>/.pieces.json           once the file is whole and verified: every piece's
                                            SHA-256, for the nodes that fetch from this one

A piece listed in the state file is on disk: the part is synced before the state that lists it
is renamed into place. A piece written and not yet listed is fetched again after a restart. Dot
files are not weights (`agent.weights_cache.scan` ignores them).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import attrs

from llmgw.download import DiskFull
from llmgw.weightpieces import piece_count, read_range, span, write_hashes, write_json_atomic


def part_of(blob: Path) -> Path:
    return blob.with_name(blob.name + ".part")


def state_of(blob: Path) -> Path:
    return blob.with_name(f".{blob.name}.part.json")


@attrs.define
class Part:
    """A download in pieces: the `.part` file and which of its pieces are in (`hashes`, by index).
    Blocking methods: call them in a thread."""

    blob: Path  # the final name
    size: int
    hashes: dict[int, str] = attrs.field(factory=dict)  # pieces in the part, synced, and their SHA-256
    _fd: int = -1
    _unsynced: dict[int, str] = attrs.field(factory=dict)  # written, not yet synced nor listed
    _lock: threading.Lock = attrs.field(factory=threading.Lock)  # pieces are written from several threads
    # The whole file's SHA-256 so far, over pieces 0 .. _next - 1: advanced as pieces arrive in
    # order (those before come back from the page cache), so the file is not read again at the end.
    _whole: Any = attrs.field(factory=hashlib.sha256)
    _next: int = 0

    @property
    def count(self) -> int:
        return piece_count(self.size)

    @property
    def done_bytes(self) -> int:
        return sum(span(i, self.size)[1] for i in (*self.hashes, *self._unsynced))

    def has(self, index: int) -> bool:
        return index in self.hashes or index in self._unsynced

    def missing(self) -> list[int]:
        return [i for i in range(self.count) if not self.has(i)]

    def held(self) -> dict[int, str]:
        """Every piece in the part (synced or not) and its SHA-256."""
        with self._lock:
            return {**self.hashes, **self._unsynced}

    @classmethod
    def open(cls, blob: Path, size: int) -> Part:
        """The download of `blob` as a previous run left it, or a new one: the part made at its
        full size (the disk's space reserved). `DiskFull` if the disk cannot hold it."""
        part, state = part_of(blob), state_of(blob)
        hashes: dict[int, str] = {}
        try:
            saved = json.loads(state.read_text())
            if saved.get("size") == size and part.stat().st_size == size:
                hashes = {int(i): str(h) for i, h in saved.get("pieces", {}).items() if 0 <= int(i) < piece_count(size)}
        except (OSError, ValueError, TypeError, AttributeError):
            hashes = {}
        blob.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not hashes:
                os.ftruncate(fd, 0)
                _reserve(fd, size, blob)
                state.unlink(missing_ok=True)
        except BaseException:
            os.close(fd)
            if not hashes:
                part.unlink(missing_ok=True)
            raise
        return cls(blob=blob, size=size, hashes=hashes, fd=fd)

    def write(self, index: int, data: bytes | memoryview, digest: str) -> None:
        start, length = span(index, self.size)
        if len(data) != length:
            raise ValueError(f"piece {index} is {length} bytes, not {len(data)}")
        view = memoryview(data)
        done = 0
        with self._lock:  # held while writing: a part closed meanwhile is not written to
            if self._fd < 0:
                raise OSError(errno.EBADF, f"the download of {self.blob.name} has ended")
            while done < length:
                try:
                    done += os.pwrite(self._fd, view[done:], start + done)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise _disk_full(self.blob, self.size) from None
                    raise
            self._unsynced[index] = digest
            if index == self._next:
                self._whole.update(view)
                self._next += 1
            self._catch_up()  # those after it, or from the start after a resume

    def _catch_up(self) -> None:
        """Hash the pieces in after `_next`, in order, from the part (the lock held)."""
        while self._next < self.count and (self._next in self.hashes or self._next in self._unsynced):
            start, length = span(self._next, self.size)
            self._whole.update(os.pread(self._fd, length, start))
            self._next += 1

    def read(self, index: int) -> bytes:
        start, length = span(index, self.size)
        return os.pread(self._fd, length, start)

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes of the part for a peer (from the whole file once it is finished); b"" once gone."""
        fd = self._fd
        if fd < 0:  # finished meanwhile: the same bytes are at the file's final name
            return read_range(self.blob, offset, n)
        try:
            return os.pread(fd, n, offset)
        except OSError:
            return b""

    def sync(self) -> None:
        """Make every written piece durable, then list it in the state file."""
        with self._lock:
            fresh = dict(self._unsynced)
        if not fresh:
            return
        os.fdatasync(self._fd)
        with self._lock:
            self.hashes.update(fresh)
            for i in fresh:
                self._unsynced.pop(i, None)
            listed = {str(i): h for i, h in self.hashes.items()}
        write_json_atomic(state_of(self.blob), {"size": self.size, "pieces": listed})

    def sha256(self) -> str:
        """The whole part's SHA-256 (all pieces in: see `missing`), mostly hashed already as they came."""
        with self._lock:
            self._catch_up()
            if self._next < self.count:
                raise ValueError(f"piece {self._next} of {self.blob.name} is not in")
            return self._whole.copy().hexdigest()

    def finish(self) -> None:
        """The part, verified whole, becomes the file; the piece hashes stay for the peers."""
        self.sync()
        os.fsync(self._fd)
        self.close()
        write_hashes(self.blob, self.size, [self.hashes[i] for i in range(self.count)])
        os.replace(part_of(self.blob), self.blob)
        state_of(self.blob).unlink(missing_ok=True)

    def discard(self) -> None:
        """Nothing kept: the part and its state removed (a whole that did not verify)."""
        self.close()
        part_of(self.blob).unlink(missing_ok=True)
        state_of(self.blob).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1


def _reserve(fd: int, size: int, blob: Path) -> None:
    if not size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise _disk_full(blob, size) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system that cannot reserve: a full disk shows at a write


def _disk_full(blob: Path, size: int) -> DiskFull:
    try:
        free = os.statvfs(blob.parent).f_bavail * os.statvfs(blob.parent).f_frsize
    except OSError:
        free = 0
    return DiskFull(
        f"{blob.name} needs {_amount(size)} in {blob.parent.parent} and the disk has {_amount(free)} free; nothing "
        "partial is used. Free space there, lower weights_cache_gib so older files are evicted first, or point "
        "agent.toml's weights_dir at a larger disk"
    )


def _amount(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
