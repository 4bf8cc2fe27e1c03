"""The control plane's release files, served on the agent port so a node fetches its own release.

`llmgw node add` has a node download `llmgw-VERSION-linux-ARCH.pyz` for its architecture from
`GET RELEASE_PREFIX + NAME` on the agent port, and reads `GET RELEASE_PREFIX + SHA256SUMS` itself
to know the digest the node must find. Which files (docs/install.md, "The release the control
plane serves"):

1. `[release] dir` in server.toml: the files its SHA256SUMS lists, with the digests it lists (so a
   file damaged on disk is served as it is and refused by the node's sha256 check): the zipapps
   and the llama.cpp archives, which are also its nodes' default llama.cpp (`llama_archives`).
2. Else the release this control plane runs from: when its file's directory (symlinks resolved)
   holds a SHA256SUMS listing it, every release file that list names (both architectures, as
   downloaded); else that one file, under its release name, its sha256 computed here.
3. A development build serves none (404, saying what to set).

The request names a file; it is looked up in that catalog by exact name and never joined to a
path, so nothing outside the catalog can be named (no traversal). These are public files, served
without a client certificate (a node has none yet when it fetches its release): the agent port
admits a peer without one to this route alone (`handle` answers it). At most MAX_DOWNLOADS are
sent at once, each write within the send deadline; the catalog (a directory read, perhaps a whole-file hash) is
built off the loop at each request, reusing the hash of a file whose size, mtime and inode are
unchanged. The last catalog built is kept (`latest`): what the nodes are told to install is read
from it synchronously, and it is built at start, at each request and at each reload.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from pathlib import Path

import attrs
import trio

from llmgw.download import sha256_of
from llmgw.engines.wants import ReleaseArchive
from llmgw.errors import UsageError, cut
from llmgw.http.errors import HTTPError
from llmgw.http.files import FileBody, open_file
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.log import get_logger
from llmgw.releasefiles import (
    LLAMA_NAME,
    SUMS,
    UNAME,
    Running,
    is_release_name,
    llama_binary,
    parse_sums,
    release_files,
)
from llmgw.wire.agent_link import RELEASE_PREFIX

log = get_logger("llmgw.releases")

MAX_DOWNLOADS = 8  # release files sent at once; a ninth peer is told 503 and retries
MAX_SUMS_BYTES = 1 << 20

_Key = tuple[str, int, int, int]  # path, size, mtime_ns, inode


@attrs.frozen(kw_only=True)
class Entry:
    name: str
    path: Path
    sha256: str
    size: int = 0  # as the directory was read; 0: not known


@attrs.frozen(kw_only=True)
class Catalog:
    """What is served, built once per request; never changed after."""

    source: str  # where the files come from, for the log and the 404
    files: Mapping[str, Entry] = attrs.field(factory=dict)
    missing: str = ""  # when `files` is empty: why, and what to set

    def sums(self) -> bytes:
        return "".join(f"{e.sha256}  {e.name}\n" for e in sorted(self.files.values(), key=lambda e: e.name)).encode()

    def llama_archives(self) -> tuple[ReleaseArchive, ...]:
        """The llama.cpp archives held, as the nodes' engine wants name them."""
        found = []
        for e in sorted(self.files.values(), key=lambda e: e.name):
            m = LLAMA_NAME.match(e.name)
            if m:
                found.append(
                    ReleaseArchive(
                        name=e.name,
                        version=m["version"],
                        arch=UNAME[m["arch"]],
                        sha256=e.sha256,
                        binary=llama_binary(e.name),
                        size=e.size,
                        backend=m["backend"] or "cpu",
                    )
                )
        return tuple(found)


def build_catalog(
    directory: Path | None, running: Running | None, hashes: dict[_Key, str]
) -> tuple[Catalog, dict[_Key, str]]:
    """The catalog, and the hash cache to pass next time. Blocking: off the loop."""
    if directory is not None:
        return _from_dir(directory, f"[release] dir {directory}"), hashes
    if running is None:
        return Catalog(
            source="none",
            missing="this control plane is not a release build, so it has no release of its own to serve; set "
            "[release] dir in server.toml to a directory holding the release files and SHA256SUMS",
        ), hashes
    beside = running.path.parent / SUMS
    try:
        listed = running.name in parse_sums(_read_sums(beside), str(beside))
    except (OSError, UsageError):
        listed = False
    if listed:
        return _from_dir(running.path.parent, f"the release directory it runs from, {running.path.parent}"), hashes
    try:
        st = running.path.stat()
        key = (str(running.path), st.st_size, st.st_mtime_ns, st.st_ino)
        digest = hashes.get(key) or sha256_of(running.path)
    except OSError as exc:
        return Catalog(source=str(running.path), missing=f"cannot read {running.path}: {exc}"), hashes
    entry = Entry(name=running.name, path=running.path, sha256=digest)
    return Catalog(source=f"the file it runs from, {running.path}", files={entry.name: entry}), {key: digest}


def _read_sums(path: Path) -> str:
    with path.open("rb") as f:
        return f.read(MAX_SUMS_BYTES).decode("utf-8", "replace")


def _from_dir(directory: Path, source: str) -> Catalog:
    sums_file = directory / SUMS
    try:
        sums = release_files(parse_sums(_read_sums(sums_file), str(sums_file)))
    except OSError as exc:
        return Catalog(
            source=source, missing=f"cannot read {sums_file} ({exc.strerror or exc}); download it with the release"
        )
    except UsageError as exc:
        return Catalog(source=source, missing=str(exc))
    files = {}
    for name, digest in sums.items():
        assert is_release_name(name)  # release_files: no '/', so the path stays in the directory
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            continue  # listed, not downloaded
        if stat.S_ISREG(st.st_mode):
            files[name] = Entry(name=name, path=path, sha256=digest, size=st.st_size)
    if not files:
        return Catalog(source=source, missing=f"{sums_file} lists no release file that is beside it; download them")
    return Catalog(source=source, files=files)


class Releases:
    """The release files of this control plane; `serve=False` serves none."""

    def __init__(self, *, directory: Path | None, running: Running | None, serve: bool = True) -> None:
        self.directory = directory
        self.running = running
        self.enabled = serve
        self.slots = trio.Semaphore(MAX_DOWNLOADS)
        self._hashes: dict[_Key, str] = {}
        self._lock = trio.Lock()
        self.latest: Catalog | None = None  # the last catalog built; None before the first

    async def catalog(self) -> Catalog:
        if not self.enabled:
            self.latest = Catalog(
                source="none", missing="this control plane serves no release ([release] serve = false)"
            )
            return self.latest
        async with self._lock:  # one build at a time: a second hash of the same file would be waste
            catalog, self._hashes = await trio.to_thread.run_sync(
                build_catalog, self.directory, self.running, self._hashes, abandon_on_cancel=True
            )
        self.latest = catalog
        return catalog

    def llama_archives(self) -> tuple[ReleaseArchive, ...]:
        """The llama.cpp archives of the last catalog built (none before the first)."""
        return self.latest.llama_archives() if self.latest is not None else ()

    async def announce(self) -> None:
        """Log what is served (at start: an operator sees which release nodes get)."""
        catalog = await self.catalog()
        if catalog.files:
            log.info("releases_served", source=catalog.source, files=sorted(catalog.files))
        else:
            log.info("releases_served", source=catalog.source, files=[], why=catalog.missing)


async def handle(request: Request, releases: Releases, peer: str) -> Response | StreamingResponse:
    """Answer one request for a release file, by exact name from the catalog (never a path).
    Sent by the shared server: each write within the send deadline; a download holds one of
    MAX_DOWNLOADS slots until its response ends, however it ends."""
    allow(request, "GET")
    name = request.target.decode("latin-1").removeprefix(RELEASE_PREFIX)
    if name != SUMS and not is_release_name(name):
        raise HTTPError(404, f"not a release file: {RELEASE_PREFIX}{SUMS} lists those served")
    catalog = await releases.catalog()
    if not catalog.files:
        raise HTTPError(404, catalog.missing)
    if name == SUMS:
        return Response(status=200, body=catalog.sums(), headers=(("content-type", "text/plain; charset=utf-8"),))
    entry = catalog.files.get(name)
    if entry is None:
        raise HTTPError(404, f"this control plane does not hold {cut(name)}; {SUMS} lists what it holds")
    try:
        releases.slots.acquire_nowait()
    except trio.WouldBlock:
        raise HTTPError(503, f"{MAX_DOWNLOADS} release downloads are in flight; try again shortly") from None
    try:
        opened = await open_file(entry.path)
    except BaseException:
        releases.slots.release()
        raise
    if opened is None:
        releases.slots.release()
        raise HTTPError(404, f"{name} is gone from {catalog.source}")
    f, size = opened
    log.info("release_served", peer=peer, name=name, size=size, sha256=entry.sha256)
    # A Range header is ignored, as RFC 9110 §14.2 allows: the whole file, 200. A node fetches
    # its release whole; there is nothing here to resume, nor to parse. What is announced is
    # what is sent, even if the file changes meanwhile (`FileBody` ends short rather than long).
    return StreamingResponse(
        status=200,
        body=FileBody(f, size, on_close=releases.slots.release),
        headers=(("content-type", "application/octet-stream"),),
        length=size,
    )
