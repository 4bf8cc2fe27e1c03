"""Model weights on this node: where a replica's weights live, and getting them there verified.

    WEIGHTS/<sha256>/<file name from the URL>     a URL source, shared by every replica of it
    WEIGHTS/<sha256>/<file name>.part             a download in progress (resumed next time)

A URL source is downloaded once per node, whatever the number of replicas using it: one
download per sha256 at a time (a `trio.Lock` per digest), resumed with HTTP Range, verified by
sha256 before anything uses it and renamed into place atomically (`llmgw.download.fetch`).
A file already verified by this process is not hashed again unless its size or mtime changed.
A path source is the operator's arrangement and is only checked to exist.

Nothing the control plane sends can name a file outside the weights directory: the digest
must be 64 hex digits, the file name (the URL's last path segment, percent-decoded) must be a
plain name, and a relative path source must stay inside once resolved.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import trio

from llmgw.download import Progress, fetch, sha256_of, weights_cap
from llmgw.errors import MachineError, PeerError
from llmgw.log import get_logger
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.weights")

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class BadWeightsSource(PeerError):
    """The control plane sent a weights source this node refuses (bad digest, unsafe name)."""


class WeightsMissing(MachineError):
    """A path source names nothing on this node."""


def check_name(value: str, what: str) -> str:
    """`value` if it is a plain name (letters, digits, '.', '_', '-'; no separators, no '..')."""
    if not SAFE_NAME.match(value) or value in (".", ".."):
        raise BadWeightsSource(
            f"{what} {value!r} is not a plain name (letters, digits, '.', '_' and '-', starting with a "
            "letter or digit); this node refuses it so that no file lands outside its directories"
        )
    return value


def file_name_of(url: str) -> str:
    """The file name a URL's weights are stored under: its last path segment, decoded and checked."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadWeightsSource(f"weights url {url!r} must be http(s)://HOST/PATH/FILE; fix the model's url")
    raw = parts.path.rsplit("/", 1)[-1]
    name = unquote(raw)
    if not name:
        raise BadWeightsSource(f"weights url {url!r} ends in '/'; it must name a file (…/model.gguf)")
    return check_name(name, "the file name of weights url")


def target_of(weights_dir: Path, source: w.WeightsSource) -> Path:
    """Where `source` is on this node (pure: checks names, touches nothing)."""
    root = weights_dir.resolve()
    if source.url:
        digest = source.sha256.lower()
        if not _SHA256.match(digest):
            raise BadWeightsSource(
                f"weights {source.url} come with sha256 {source.sha256!r}, which is not 64 hex digits; "
                "set the model's sha256 in server.toml (`sha256sum FILE`)"
            )
        target = root / digest / file_name_of(source.url)
    elif source.path:
        given = Path(source.path)
        if given.is_absolute():
            return given  # the operator's own arrangement, anywhere on the node
        target = (root / given).resolve()
        if not target.is_relative_to(root):
            raise BadWeightsSource(
                f"weights path {source.path!r} leads outside the weights directory {root}; "
                "give an absolute path or one inside it"
            )
        return target
    else:
        raise BadWeightsSource("the weights source names neither a url nor a path; set one for the model")
    if not target.resolve().is_relative_to(root):  # belt and braces: a symlinked digest directory
        raise BadWeightsSource(f"weights for {source.url} would land outside {root}; refusing")
    return target


class WeightsStore:
    """The weights directory of this node, shared by every replica the agent supervises."""

    def __init__(self, root: Path, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.root = root
        self.ssl_context = ssl_context
        self.downloads = 0  # completed transfers, for the log and for tests
        self._locks: dict[str, trio.Lock] = {}
        self._verified: dict[Path, tuple[int, int]] = {}  # path -> (size, mtime_ns) when its digest matched
        self._progress: dict[str, Progress] = {}  # digest -> latest, written by the download thread

    def progress(self, source: w.WeightsSource) -> Progress | None:
        """The latest progress of the download `source` needs, if one runs."""
        return self._progress.get(source.sha256.lower())

    async def prepare(self, source: w.WeightsSource, *, on_wait: Callable[[str], None] | None = None) -> str:
        """The weights' path on this node, there and verified; raises `LlmgwError` saying why not.

        `on_wait` is told, in words, what the call waits for (another replica's download).
        """
        target = target_of(self.root, source)
        if not source.url:
            if not target.exists():
                raise WeightsMissing(
                    f"weights path {str(target)!r} does not exist on this node; copy the weights there "
                    "or fix the model's path in server.toml"
                )
            return str(target)
        digest = source.sha256.lower()
        lock = self._locks.setdefault(digest, trio.Lock())
        if lock.locked() and on_wait is not None:
            on_wait(f"waiting for the download of {target.name} started for another replica")
        async with lock:
            if await self._is_verified(target, digest):
                return str(target)
            await self._download(source, target, digest)
        return str(target)

    async def _is_verified(self, target: Path, digest: str) -> bool:
        try:
            st = target.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_size, st.st_mtime_ns)
        if self._verified.get(target) == stamp:
            return True
        # Hashing many GiB takes minutes: off the event loop.
        if await trio.to_thread.run_sync(sha256_of, target) == digest:
            self._verified[target] = stamp
            return True
        # Never left by `fetch`, so something changed it since: it must not be used, or resumed.
        log.warning("weights_corrupt", path=str(target), expected_sha256=digest)
        target.unlink()
        return False

    async def _download(self, source: w.WeightsSource, target: Path, digest: str) -> None:
        headers = {"Authorization": f"Bearer {source.token}"} if source.token else {}

        def progress(p: Progress) -> None:  # runs in the download thread: a plain assignment only
            self._progress[digest] = p

        log.info("weights_download", url=source.url, path=str(target))
        try:
            await fetch(
                source.url,
                target,
                sha256=digest,
                cap=weights_cap(source.size, source.max_bytes),
                ssl_context=self.ssl_context,
                headers=headers,
                on_progress=progress,
            )
        finally:
            self._progress.pop(digest, None)
        self.downloads += 1
        st = target.stat()
        self._verified[target] = (st.st_size, st.st_mtime_ns)
        log.info("weights_ready", url=source.url, path=str(target), bytes=st.st_size)


def describe(p: Progress) -> str:
    """A download's progress in words, for a replica's status."""
    done = p.done_bytes / 2**20
    if p.total_bytes:
        return f"downloading weights: {done:.0f} of {p.total_bytes / 2**20:.0f} MiB ({100 * p.done_bytes // p.total_bytes}%)"
    return f"downloading weights: {done:.0f} MiB"
