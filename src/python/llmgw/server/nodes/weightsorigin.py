"""The control plane as the origin of weights, for a cluster whose nodes cannot reach the internet
(server.toml `[downloads] weights_origin = "control_plane"`).

When a node asks the tracker (`llmgw.server.links.tracker`) for a file that no node it can reach
holds whole, and the catalog names that file (a URL source with its size, or a file of a model
from the Hub), the control plane downloads it from its source into `STATE_DIR/weights/<sha256>/`
— once, resumed after a cut, verified against its SHA-256 — and is named to every node as the
file's seed and authority: no node is its origin. The nodes take its pieces from the control
plane's agent port (`GET /v1/weights/SHA256[/pieces]`, node certificates only, as the tracker)
while it downloads, and from each other.

Pieces are served as soon as they are in: the download is sequential (`llmgw.download.fetch`),
and each piece wholly in its `.part` is hashed (`HASH_EVERY_S`) and offered with its hash. The
whole file is verified before it takes its name; one that does not verify is discarded by
`fetch` and the nodes, whose own whole-file check fails too, fetch it again.

A file is fetched while a node asked for it within `WANTED_S`; a failed download is tried again
every `RETRY_S` meanwhile. Files the catalog no longer names are no longer served or fetched
(`forget`; a download under way ends first) and are deleted (`collect`), at each pass of `serve`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw.download import DiskFull, DownloadError, fetch, weights_cap
from llmgw.errors import LlmgwError
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.weightpieces import (
    Offer,
    PieceSender,
    hash_piece,
    kept_or_hashed,
    piece_count,
    read_range,
    span,
)
from llmgw.wire.agent_link import CONTROL_PLANE_PEER

log = get_logger("llmgw.server.weights")

CONTROL_PLANE = CONTROL_PLANE_PEER
WANTED_S = 60.0
RETRY_S = 5.0
HASH_EVERY_S = 0.5
PASS_S = 1.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@attrs.frozen(kw_only=True)
class FileSource:
    """Where the catalog says one weights file comes from."""

    url: str
    size: int
    name: str  # the file's base name, as nodes keep it
    token: str = ""  # a secret: never logged
    max_bytes: int = 0


@attrs.define
class _Fetch:
    source: FileSource
    wanted_at: float
    arrived: int = 0  # bytes of the .part, as the download's progress says (set from its thread)
    hashes: dict[int, str] = attrs.field(factory=dict)
    complete: bool = False
    running: bool = False
    failed_at: float = -float("inf")
    error: str = ""


class WeightsOrigin:
    def __init__(self, directory: Path, catalog: Callable[[], dict[str, FileSource]]) -> None:
        """`catalog()`: every weights file the catalog names, by SHA-256 (read at each use: a
        reload or a model added changes it)."""
        self.directory = directory
        self.catalog = catalog
        self.sender = PieceSender()
        self.files: dict[str, _Fetch] = {}
        self.wake = Wakeup()  # a node wants a file, a download ended: the serve loop looks again
        self.downloads = 0

    def _blob(self, digest: str, source: FileSource) -> Path:
        return self.directory / digest / source.name

    def want(self, digest: str, now: float) -> bool:
        """A node needs `digest`: True if the control plane serves it (it holds it or fetches it
        now), False if the catalog does not name it with a size (the node then fetches it itself)."""
        entry = self.files.get(digest)
        if entry is None:
            source = self.catalog().get(digest)
            if source is None or not source.size or not _NAME.match(source.name):
                return False
            entry = self.files[digest] = _Fetch(source=source, wanted_at=now)
            self.wake.fire()
        entry.wanted_at = now
        if not entry.complete and not entry.running:
            self.wake.fire()
        return True

    def complete(self, digest: str) -> bool:
        entry = self.files.get(digest)
        return entry is not None and entry.complete

    def offer(self, digest: str) -> Offer | None:
        """What the control plane can serve of `digest` now: the whole file, or the pieces of its
        download hashed so far."""
        entry = self.files.get(digest)
        if entry is None or not (entry.complete or entry.hashes):
            return None
        blob = self._blob(digest, entry.source)
        path = blob if entry.complete else blob.with_name(blob.name + ".part")
        hashes = dict(entry.hashes)

        def read(offset: int, n: int) -> bytes:  # a download that finished meanwhile: its final name
            return read_range(path, offset, n) or read_range(blob, offset, n)

        return Offer(
            size=entry.source.size,
            complete=entry.complete,
            have=None if entry.complete else frozenset(hashes),
            hashes=lambda: hashes,
            read=read,
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fetch what nodes want, one download per file at a time; collect what the catalog dropped."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                woken = self.wake.next()  # before looking: a want meanwhile is not lost
                named = set(self.catalog())
                self.forget(named)
                now = trio.current_time()
                for digest, entry in list(self.files.items()):
                    idle = now - entry.wanted_at > WANTED_S
                    if entry.complete or entry.running or idle or now - entry.failed_at < RETRY_S:
                        if idle and not entry.running and not entry.complete:
                            del self.files[digest]  # nobody wants it: what arrived stays for a resume
                        continue
                    entry.running = True
                    nursery.start_soon(self._fetch, digest, entry)
                await trio.to_thread.run_sync(self.collect, named)
                with trio.move_on_after(PASS_S):
                    await woken.wait()

    def forget(self, named: set[str]) -> None:
        """Serve and fetch no more the files the catalog no longer names (`named`: those it does),
        held whole or in part; a download under way ends first. `collect` then deletes them: kept
        here, a file the catalog dropped would be served, named to nodes and kept on disk until a
        restart."""
        for digest, entry in list(self.files.items()):
            if digest not in named and not entry.running:
                del self.files[digest]

    async def _fetch(self, digest: str, entry: _Fetch) -> None:
        source = entry.source
        blob = self._blob(digest, source)
        headers = {"Authorization": f"Bearer {source.token}"} if source.token else {}

        def progress(p) -> None:  # the download's thread: a plain assignment only
            entry.arrived = p.done_bytes

        log.info("weights_origin_download", sha256=digest, url=source.url, bytes=source.size)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._hash_as_it_comes, blob, entry)
                try:
                    await fetch(
                        source.url,
                        blob,
                        sha256=digest,
                        cap=weights_cap(source.size, source.max_bytes),
                        headers=headers,
                        on_progress=progress,
                        sha256_from="the catalog",
                    )
                finally:
                    nursery.cancel_scope.cancel()
            hashes = await trio.to_thread.run_sync(_whole_hashes, blob, source.size, digest)
            entry.hashes = dict(enumerate(hashes))
            entry.complete = True
            self.downloads += 1
            log.info("weights_origin_ready", sha256=digest, path=str(blob), bytes=source.size)
        except (DownloadError, DiskFull, LlmgwError, OSError) as exc:
            entry.hashes = {}  # what was offered may have been wrong (a file that did not verify)
            entry.failed_at = trio.current_time()
            if str(exc) != entry.error:
                log.warning("weights_origin_failed", sha256=digest, url=source.url, reason=str(exc), retry_s=RETRY_S)
            entry.error = str(exc)
        finally:
            entry.running = False
            self.wake.fire()

    async def _hash_as_it_comes(self, blob: Path, entry: _Fetch) -> None:
        """Hash each piece wholly in the .part, in order, as the download passes its end."""
        part = blob.with_name(blob.name + ".part")
        size = entry.source.size
        while True:
            index = len(entry.hashes)
            if index < piece_count(size):
                start, length = span(index, size)
                if entry.arrived >= start + length:
                    data = await trio.to_thread.run_sync(read_range, part, start, length)
                    if len(data) == length:
                        entry.hashes[index] = hash_piece(data)
                        continue
            await trio.sleep(HASH_EVERY_S)

    def collect(self, keep: set[str]) -> None:
        """Blocking: delete the digest directories the catalog no longer names."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for e in entries:
            if re.fullmatch(r"[0-9a-f]{64}", e.name) and e.name not in keep and e.name not in self.files:
                shutil.rmtree(e.path, ignore_errors=True)
                log.info("weights_origin_removed", sha256=e.name)


def _whole_hashes(blob: Path, size: int, digest: str) -> list[str]:
    """The piece hashes of the verified file: kept beside it, or computed (and checked) once."""
    hashes, whole = kept_or_hashed(blob, size, digest)
    if whole != digest:
        blob.unlink(missing_ok=True)
        raise DownloadError(f"{blob} changed on disk (sha256 {whole}, not {digest}); it is fetched again")
    return hashes
