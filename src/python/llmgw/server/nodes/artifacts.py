"""The control plane as a mirror: engine archives served to agents over the agent port.

An archive is available when a file in `STATE_DIR/artifacts/` has its sha256 — whatever the
file is called, so an operator can drop in a download by hand. Agents ask for
`GET /v1/artifacts/SHA256` on the agent port (the same TLS port and client certificate as the
link; `llmgw.server.links.agentport` routes the request here, `handle` answers it) and may resume with
`Range: bytes=N-`; anything else of HTTP is not offered here.

The index (which file holds which sha256) is disk work: a directory listing, a stat of each
file, and the sha256 of a whole archive for any file not named by its hash. It is never built
on the trio loop: `refresh` builds it in a thread, reusing the hash of every file whose size,
mtime and inode are unchanged (and the listing while the directory's mtime is), and
`serve_index` refreshes it every INDEX_INTERVAL_S and tells the agent port when the set changed.
`available` and `path_for` read only the index as last built; a request for a hash it does not
hold refreshes it once first, so a file dropped in is served at once. Partial downloads
(`*.part`) and dot files are not archives.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import attrs
import trio

from llmgw.download import sha256_of
from llmgw.http.errors import HTTPError
from llmgw.http.files import FileBody, open_file
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.log import get_logger
from llmgw.wire.agent_link import ARTIFACTS_PREFIX

log = get_logger("llmgw.artifacts")

INDEX_INTERVAL_S = 10.0  # how soon an archive dropped in by hand is offered to nodes that did not ask
# A listing is reused only if it was taken this long after the directory's last change: a file
# added within the same mtime tick as the listing would otherwise go unseen.
_MTIME_SLACK_NS = 2_000_000_000
_SHA = re.compile(r"^[0-9a-f]{64}$")


def artifacts_dir(state_dir: Path) -> Path:
    return state_dir / "artifacts"


@attrs.frozen(kw_only=True)
class _File:
    key: tuple[int, int, int]  # size, mtime_ns, inode: a file whose key is unchanged keeps its hash
    sha256: str


@attrs.frozen(kw_only=True)
class Index:
    """One build of the index; never changed after (a new build replaces it)."""

    directory_mtime_ns: int = -1
    listed_at_ns: int = 0
    names: tuple[str, ...] = ()
    files: Mapping[str, _File] = attrs.field(factory=dict)  # name -> its key and hash
    paths: Mapping[str, Path] = attrs.field(factory=dict)  # sha256 -> file


def build_index(directory: Path, previous: Index) -> Index:
    """The index of `directory`, from `previous` where nothing changed. Blocking: off the loop."""
    try:
        directory_mtime = directory.stat().st_mtime_ns
    except FileNotFoundError:
        return Index()
    except OSError as exc:
        log.warning("artifacts_unreadable", directory=str(directory), reason=str(exc))
        return previous
    if directory_mtime == previous.directory_mtime_ns and previous.listed_at_ns - directory_mtime > _MTIME_SLACK_NS:
        names, listed_at = previous.names, previous.listed_at_ns
    else:
        listed_at = time.time_ns()
        try:
            names = tuple(sorted(n for n in os.listdir(directory) if not n.startswith(".") and not n.endswith(".part")))
        except OSError as exc:
            log.warning("artifacts_unreadable", directory=str(directory), reason=str(exc))
            return previous
    files: dict[str, _File] = {}
    paths: dict[str, Path] = {}
    for name in names:
        path = directory / name
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                continue
            key = (st.st_size, st.st_mtime_ns, st.st_ino)
            known = previous.files.get(name)
            if known is not None and known.key == key:
                digest = known.sha256
            else:
                digest = name if _SHA.match(name) else sha256_of(path)
        except OSError:
            continue  # gone or unreadable since the listing: not offered
        files[name] = _File(key=key, sha256=digest)
        paths[digest] = path
    return Index(directory_mtime_ns=directory_mtime, listed_at_ns=listed_at, names=names, files=files, paths=paths)


class Artifacts:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._index = Index()  # empty until the first `refresh`
        self._refreshing = trio.Lock()

    def available(self) -> set[str]:
        """The sha256 of every archive in the index as last built (no disk access)."""
        return set(self._index.paths)

    def path_for(self, sha256: str) -> Path | None:
        return self._index.paths.get(sha256)

    async def refresh(self) -> None:
        """Rebuild the index off the loop (one build at a time)."""
        async with self._refreshing:
            self._index = await trio.to_thread.run_sync(
                build_index, self.directory, self._index, abandon_on_cancel=True
            )

    async def find(self, sha256: str) -> Path | None:
        """The file holding `sha256`; refreshes the index once if it holds none."""
        path = self.path_for(sha256)
        if path is None:
            await self.refresh()
            path = self.path_for(sha256)
        return path

    async def serve_index(
        self,
        *,
        interval_s: float = INDEX_INTERVAL_S,
        on_change: Callable[[], Awaitable[None]] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Build the index, then keep it fresh; `on_change` runs whenever the set of available
        archives differs from the one it last ran for (or from the first build)."""
        await self.refresh()
        task_status.started()
        announced = self.available()
        while True:
            await trio.sleep(interval_s)
            await self.refresh()
            now = self.available()
            if now != announced:
                announced = now
                if on_change is not None:
                    await on_change()


async def handle(request: Request, artifacts: Artifacts, node: str) -> Response | StreamingResponse:
    """Answer one artifact request (`node`'s, its certificate checked): the archive whole, or
    from the offset `Range: bytes=N-` asks (206), or 416; 404 for a hash not held. Sent by the
    shared server: each write within the send deadline, so an agent that stops reading does not
    hold the connection and the file open."""
    allow(request, "GET")
    sha256 = request.target.decode("latin-1").removeprefix(ARTIFACTS_PREFIX)
    path = await artifacts.find(sha256) if _SHA.match(sha256) else None
    opened = await open_file(path) if path is not None else None
    if opened is None:
        raise HTTPError(404, "no such artifact on this control plane")
    f, size = opened
    start = range_start(request.headers.get("range", ""), size)
    if start is None:
        f.close()
        return Response(status=416, headers=(("content-range", f"bytes */{size}"),))
    log.info("artifact_served", node=node, sha256=sha256, offset=start, size=size)
    return StreamingResponse(
        status=206 if start else 200,
        body=FileBody(f, size - start, start=start),
        headers=(("content-range", f"bytes {start}-{size - 1}/{size}"),) if start else (),
        length=size - start,
    )


# The one range form agents send (`llmgw.download` resuming a partial file): "bytes=N-".
# ASCII digits only: `\d` would also match other scripts' digits. The unit is case-insensitive
# (RFC 9110 §14.1).
_FROM = re.compile(r"bytes=([0-9]+)-", re.IGNORECASE)


def range_start(header: str, size: int) -> int | None:
    """Where to start sending a file of `size` bytes for a request's `Range` header ("" if none):
    0 for the whole file, None when the range cannot be satisfied (416).

    RFC 9110 §14.2 lets a server ignore Range, and this one ignores every form but "bytes=N-"
    (other ranges, several ranges, other units, malformed ones): the whole file is sent with 200,
    which a client that asked to resume takes as "start again". "bytes=N-" with N at or past the
    end is unsatisfiable (§14.1.1: first-pos not below the length) and answered 416 with
    `Content-Range: bytes */SIZE` (§15.5.17) — however many digits N has: it is compared by its
    length before `int` would run on it (CPython refuses more than 4300 digits)."""
    m = _FROM.fullmatch(header.strip())
    if m is None:
        return 0
    digits = m.group(1).lstrip("0") or "0"
    if len(digits) > len(str(size)):
        return None  # more digits than the size has: past the end
    start = int(digits)
    return start if start < size else None
