"""Model weights on this node: where a replica's weights live, and getting them there verified.

    WEIGHTS/<sha256>/<file name from the URL>     a URL source, shared by every replica of it
    WEIGHTS/<sha256>/<file name>.part             a download in progress (resumed next time)
    WEIGHTS/hub/<org>--<name>/<commit>/<path>     a Hub model's files as in its repository: links
                                                  to WEIGHTS/<sha256>/<name>, one download per file

A Hub source's files are each downloaded like a URL source (a file two revisions share, or two
models, once); the model's directory holds a symbolic link per file, made once every file is
there and verified, so the engine finds the layout it expects (split GGUF parts side by side,
config.json beside the shards) and a half-fetched model is never a directory an engine opens.

A URL source is downloaded once per node, whatever the number of replicas using it: one
download per sha256 at a time (a `trio.Lock` per digest), resumed with HTTP Range, verified by
sha256 before anything uses it and renamed into place atomically (`llmgw.download.fetch`).
A file already verified by this process is not hashed again unless its size or mtime changed.
A path source is the operator's arrangement and is only checked to exist.

Nothing the control plane sends can name a file outside the weights directory: the digest
must be 64 hex digits, the file name (the URL's last path segment, percent-decoded) must be a
plain name, a Hub file's path a few plain names joined by '/', and a relative path source must
stay inside once resolved.

What the catalog no longer names is deleted (`collect`): the control plane sends with each
desired state the digests of every weights file its catalog names (`DesiredState.keep_files`),
and the node removes the downloaded files outside them that no replica it runs uses, the links
to them, and the Hub directories left linking to nothing. Two models of one commit (two
quantisations of a GGUF repository) share its directory, each adding its links. A path source,
the operator's, is never touched.

The cache may have a size limit (agent.toml's `weights_cache_gib`): before a download would pass
it, and at each collect, whole digest directories are evicted least recently used first until
it fits, never one in use (by a replica here, a prepare under way or a download); the policy and
how "last used" is kept across restarts are in `agent.weights_cache`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import ssl
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urlsplit

import trio

from agent import pieces
from agent import weights_cache as cache
from agent.swarm import Peering, Swarm
from llmgw import weightpieces
from llmgw.download import DownloadError, Progress, check_free_space, fetch, sha256_of, weights_cap
from llmgw.errors import MachineError, PeerError
from llmgw.log import get_logger
from llmgw.weightpieces import Offer, read_range
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


HUB_DIR = "hub"
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def check_repo_path(path: str) -> tuple[str, ...]:
    """A Hub file's path as its parts, each a plain name; `BadWeightsSource` otherwise."""
    parts = tuple(path.split("/"))
    if not 1 <= len(parts) <= 5:
        raise BadWeightsSource(f"file path {path!r} has {len(parts)} parts; a Hub file's path has 1 to 5")
    for part in parts:
        check_name(part, "a part of file path")
    return parts


def hub_dir_of(weights_dir: Path, source: w.WeightsSource) -> Path:
    """Where a Hub source's files are laid out on this node (pure: checks names, touches nothing)."""
    if not _REPO.match(source.repo) or ".." in source.repo:
        raise BadWeightsSource(f"repository {source.repo!r} is not ORG/NAME; this node refuses it")
    if not _COMMIT.match(source.commit):
        raise BadWeightsSource(f"commit {source.commit!r} of {source.repo} is not 40 hex digits; this node refuses it")
    if not source.files:
        raise BadWeightsSource(f"the model from {source.repo} lists no files; this node has nothing to fetch")
    return weights_dir.resolve() / HUB_DIR / source.repo.replace("/", "--") / source.commit


def blob_of(weights_dir: Path, f: w.WeightsFile) -> Path:
    """Where one Hub file's content is kept: by its digest, under its own base name."""
    digest = f.sha256.lower()
    if not _SHA256.match(digest):
        raise BadWeightsSource(f"file {f.path!r} comes with sha256 {f.sha256!r}, which is not 64 hex digits")
    return weights_dir.resolve() / digest / check_repo_path(f.path)[-1]


_FREE = trio.Lock()  # never taken: the lock of a digest no download has asked for yet


class WeightsStore:
    """The weights directory of this node, shared by every replica the agent supervises."""

    def __init__(self, root: Path, *, ssl_context: ssl.SSLContext | None = None, limit_bytes: int = 0) -> None:
        self.root = root
        self.ssl_context = ssl_context
        self.limit_bytes = limit_bytes  # the cache's size limit; 0: none but the disk's
        self.downloads = 0  # completed transfers, for the log and for tests
        self.evictions = 0  # digest directories evicted for the size limit, for the log and for tests
        self._locks: dict[str, trio.Lock] = {}
        self._verified: dict[Path, tuple[int, int]] = {}  # path -> (size, mtime_ns) when its digest matched
        self._progress: dict[str, Progress] = {}  # digest -> latest, written by the download thread
        self._layouts: dict[Path, trio.Lock] = {}  # a commit's directory -> its layout's lock
        # Held while the Hub's directories change, by a layout (its staging `.new` directory made,
        # then renamed into place) or by a tidy-up (which deletes `.new` directories a crash left
        # and directories whose links all went): one never sees the other's work half done.
        self._hub_tidy = trio.Lock()
        self._done: set[str] = set()  # digests verified here since start (a Hub model's progress counts them)
        self._preparing: dict[str, int] = {}  # digest -> prepare calls under way that need it
        self._using: set[str] = set()  # digests of the replicas here, as the last collect was told
        self._prepared: set[str] = set()  # digests prepared since the last collect: about to be used
        self._fitting = trio.Lock()  # one eviction pass at a time, so each sees the last one's result
        self._warned: tuple[str, ...] = ()  # what was in use at the last over-limit warning
        # Fetching from the other nodes (agent.swarm); None: every file from its source, alone.
        self.peering: Peering | None = None
        self.serve_port = 0  # where agent.peers serves this store's files to the other nodes; 0: nowhere
        self._parts: dict[str, pieces.Part] = {}  # digest -> a download in pieces under way, served to peers
        self._piece_hashes: dict[str, tuple[tuple[int, int], list[str]]] = {}  # digest -> (size, mtime), hashes

    def held(self) -> list[cache.Held]:
        """Every downloaded file here (complete or partial): (sha256, bytes, complete, last_used),
        least recently used first. Cheap (a listing and a stat per file, no hashing): for the
        control plane, to know which nodes hold which weights."""
        return cache.scan(self.root.resolve())

    def cache_bytes(self) -> int:
        """The bytes the downloaded files here take, partial downloads included (what the limit counts)."""
        return sum(h.bytes for h in self.held())

    def progress(self, source: w.WeightsSource) -> Progress | None:
        """The latest progress of the download `source` needs, if one runs; for a Hub source, of
        all its files together (the done ones counted whole)."""
        if not source.files:
            return self._progress.get(source.sha256.lower())
        running = [self._progress.get(f.sha256.lower()) for f in source.files]
        # A file's download shows progress from its first chunk on; before that (or between two
        # files) its lock says that the source's download runs.
        if not any(running) and not any(self._locks.get(f.sha256.lower(), _FREE).locked() for f in source.files):
            return None
        done = sum(
            p.done_bytes if p is not None else (f.size if f.sha256.lower() in self._done else 0)
            for f, p in zip(source.files, running, strict=True)
        )
        return Progress(url=source.repo, done_bytes=done, total_bytes=sum(f.size for f in source.files))

    async def prepare(self, source: w.WeightsSource, *, on_wait: Callable[[str], None] | None = None) -> str:
        """The weights' path on this node, there and verified; raises `LlmgwError` saying why not.

        `on_wait` is told, in words, what the call waits for (another replica's download).
        """
        if source.files:
            digests = [f.sha256.lower() for f in source.files]
        else:
            target = target_of(self.root, source)
            if not source.url:
                if not target.exists():
                    raise WeightsMissing(
                        f"weights path {str(target)!r} does not exist on this node; copy the weights there "
                        "or fix the model's path in server.toml"
                    )
                return str(target)
            digests = [source.sha256.lower()]
        # Counted before the first await: an eviction planned from now on keeps these.
        for digest in digests:
            self._preparing[digest] = self._preparing.get(digest, 0) + 1
        try:
            path = await (self._prepare_hub(source, on_wait) if source.files else self._prepare_url(source, on_wait))
        finally:
            for digest in digests:
                self._preparing[digest] -= 1
                if not self._preparing[digest]:
                    del self._preparing[digest]
        cache.touch(self.root.resolve(), digests)
        self._prepared.update(digests)
        return path

    async def _prepare_url(self, source: w.WeightsSource, on_wait: Callable[[str], None] | None) -> str:
        target = target_of(self.root, source)
        digest = source.sha256.lower()
        lock = self._locks.setdefault(digest, trio.Lock())
        if lock.locked() and on_wait is not None:
            on_wait(f"waiting for the download of {target.name} started for another replica")
        async with lock:
            if await self._is_verified(target, digest):
                return str(target)
            await self._download(source, target, digest)
        return str(target)

    async def _prepare_hub(self, source: w.WeightsSource, on_wait: Callable[[str], None] | None) -> str:
        directory = hub_dir_of(self.root, source)
        blobs = [(f, blob_of(self.root, f)) for f in source.files]  # every name checked before a byte moves
        for f, blob in blobs:
            file_source = w.WeightsSource(
                url=f.url, sha256=f.sha256, token=source.token, size=f.size, max_bytes=source.max_bytes
            )
            digest = f.sha256.lower()
            lock = self._locks.setdefault(digest, trio.Lock())
            if lock.locked() and on_wait is not None:
                on_wait(f"waiting for the download of {f.path} started for another replica")
            async with lock:
                if not await self._is_verified(blob, digest):
                    await self._download(file_source, blob, digest)
            self._done.add(digest)
        async with self._layouts.setdefault(directory, trio.Lock()), self._hub_tidy:  # one layout of a commit at a time
            await trio.to_thread.run_sync(_lay_out, directory, [(check_repo_path(f.path), blob) for f, blob in blobs])
        first = directory.joinpath(*check_repo_path(source.files[0].path))
        return str(directory if source.directory else first)

    async def collect(self, keep: set[str], using: Sequence[w.WeightsSource]) -> list[str]:
        """Delete the downloaded files whose digest is neither in `keep` (what the catalog names)
        nor used by `using` (the sources of the replicas this node runs), and the Hub directories
        left linking to nothing; a digest being downloaded now is kept. Then, with a size limit,
        evict the least recently used files no replica uses until the cache fits. The files in use
        are marked used now. What was deleted, by digest."""
        self._using = {f.sha256.lower() for source in using for f in source.files}
        self._using.update(source.sha256.lower() for source in using if source.url)
        self._prepared = set()  # a replica prepared since the last collect is in `using` if it still runs
        cache.touch(self.root.resolve(), self._using)
        keep = {d.lower() for d in keep} | self._in_use()
        async with self._hub_tidy:
            removed = await trio.to_thread.run_sync(_collect, self.root, keep)
        self._forget(removed)
        if removed:
            log.info("weights_removed", digests=len(removed), kept=len(keep))
        return removed + await self._fit()

    def _in_use(self) -> set[str]:
        """The digests no deletion may touch: used by a replica here, being prepared or downloaded."""
        locked = {d for d, lock in self._locks.items() if lock.locked()}
        return self._using | self._prepared | set(self._preparing) | locked

    def _forget(self, digests: list[str]) -> None:
        for digest in digests:
            self._done.discard(digest)
            self._verified = {p: v for p, v in self._verified.items() if p.parent.name != digest}

    async def _fit(self, incoming: int = 0) -> list[str]:
        """Evict the least recently used files not in use until the cache and `incoming` more
        bytes fit the limit; warn when what is in use alone does not. What was evicted, by digest."""
        if not self.limit_bytes:
            return []
        root = self.root.resolve()
        async with self._fitting:
            held = await trio.to_thread.run_sync(cache.scan, root)
            in_use = self._in_use()
            plan = cache.plan(held, limit=self.limit_bytes, protected=in_use, incoming=incoming)
            # No await from the plan to the renames: a prepare that starts later finds the file gone.
            evicted = [h for h in plan.evict if cache.retire(root, h.sha256)]
            if evicted:
                async with self._hub_tidy:
                    await trio.to_thread.run_sync(_remove_evicted, root)
        for h in evicted:
            last_used = datetime.datetime.fromtimestamp(h.last_used, datetime.timezone.utc)
            log.info("weights_evicted", sha256=h.sha256, bytes=h.bytes, last_used=last_used.isoformat())
        self.evictions += len(evicted)
        self._forget([h.sha256 for h in evicted])
        kept = tuple(h.sha256 for h in plan.kept_in_use)
        if plan.short and kept != self._warned:
            log.warning(
                "weights_cache_over_limit",
                limit_gib=round(self.limit_bytes / 2**30, 3),
                in_use_gib=round(sum(h.bytes for h in plan.kept_in_use) / 2**30, 3),
                in_use=list(kept),
                incoming_bytes=incoming,
                detail="the files replicas here use, or that are being fetched, do not fit weights_cache_gib: "
                "they are kept and downloads need only the disk's free space; raise weights_cache_gib in "
                "agent.toml or place fewer models on this node",
            )
        self._warned = kept if plan.short else ()
        return [h.sha256 for h in evicted]

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
        part = target.with_name(target.name + ".part")
        arrived = part.stat().st_size if part.exists() else 0  # counted in the cache already
        await self._fit(max(0, source.size - arrived))  # a size not known: 0, and a pass after the download
        if self.peering is not None and source.size > 0:
            try:
                await self._swarm(source, target, digest, headers, progress)
            finally:
                self._progress.pop(digest, None)
            return await self._downloaded(source, target)
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
        await self._downloaded(source, target)

    async def _downloaded(self, source: w.WeightsSource, target: Path) -> None:
        self.downloads += 1
        st = target.stat()
        self._verified[target] = (st.st_size, st.st_mtime_ns)
        log.info("weights_ready", url=source.url, path=str(target), bytes=st.st_size)
        await self._fit()

    async def _swarm(
        self,
        source: w.WeightsSource,
        target: Path,
        digest: str,
        headers: dict[str, str],
        progress: Callable[[Progress], None],
    ) -> None:
        """`target` fetched in pieces from the other nodes, and from the source if the tracker
        says this node is its origin (`agent.swarm`); verified whole before it takes its name."""
        assert self.peering is not None
        old = target.with_name(target.name + ".part")
        if old.exists() and not pieces.state_of(target).exists():
            old.unlink()  # a download of the earlier kind (a prefix): started again in pieces
        await trio.to_thread.run_sync(check_free_space, target.parent, 0, f"downloading {source.url}")
        part = await trio.to_thread.run_sync(pieces.Part.open, target, source.size)
        self._parts[digest] = part
        try:
            swarm = Swarm(
                digest=digest,
                part=part,
                url=source.url,
                headers=headers,
                ssl_context=self.ssl_context,
                peering=self.peering,
                on_progress=progress,
            )
            await swarm.run()
            got = await trio.to_thread.run_sync(part.sha256)
            if got != digest:
                await trio.to_thread.run_sync(part.discard)
                log.warning("weights_corrupt", path=str(target), expected_sha256=digest, got_sha256=got)
                raise DownloadError(
                    f"the pieces of {source.url} make a file with sha256 {got}, not {digest}; nothing was kept and it "
                    "is fetched again. If this repeats, the file at the source changed: add the model again"
                )
            await trio.to_thread.run_sync(part.finish)
        finally:
            self._parts.pop(digest, None)
            part.close()

    def offer(self, digest: str) -> Offer | None:
        """What this node can serve of the file `digest` to another (agent.peers): a download
        in pieces under way, or the whole verified file."""
        part = self._parts.get(digest)
        if part is not None:
            return Offer(
                size=part.size,
                complete=False,
                have=frozenset(part.held()),
                hashes=part.held,
                read=part.read_at,
            )
        directory = self.root.resolve() / digest
        try:
            files = [p for p in directory.iterdir() if not p.name.startswith(".") and not p.name.endswith(".part")]
        except OSError:
            return None
        if len(files) != 1 or not files[0].is_file() or files[0].is_symlink():
            return None
        blob = files[0]
        size = blob.stat().st_size

        def hashes() -> dict[int, str]:
            return dict(enumerate(self._hashes_of(blob, digest)))

        return Offer(size=size, complete=True, have=None, hashes=hashes, read=partial(read_range, blob))

    def _hashes_of(self, blob: Path, digest: str) -> list[str]:
        """A whole file's piece hashes: kept beside it, or computed once (blocking)."""
        st = blob.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        known = self._piece_hashes.get(digest)
        if known is not None and known[0] == stamp:
            return known[1]
        # A file fetched whole, before pieces, is hashed now, and checked on the way.
        hashes, whole = weightpieces.kept_or_hashed(blob, st.st_size, digest)
        if whole != digest:
            log.warning("weights_corrupt", path=str(blob), expected_sha256=digest, got_sha256=whole)
            return []  # no hash from here: no node takes a piece on this one's word
        self._piece_hashes[digest] = (stamp, hashes)
        return hashes


def _lay_out(directory: Path, files: list[tuple[tuple[str, ...], Path]]) -> None:
    """The model's directory: a link per file to its verified content. A new directory is made
    beside and renamed into place, so it is whole or absent. One that exists (another model of
    the same commit: another quantisation of a GGUF repository) gets the links it lacks, each
    renamed into place, and keeps the others': a replica of that model may be using them.
    Blocking; the caller holds the directory's lock."""
    if not directory.is_dir():
        staging = directory.with_name(directory.name + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        for parts, blob in files:
            link = staging.joinpath(*parts)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
        os.replace(staging, directory)
        return
    for parts, blob in files:
        link = directory.joinpath(*parts)
        if link.is_symlink() and Path(os.readlink(link)) == blob:
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        fresh = link.with_name(f".{link.name}.new")  # no file of a repository is named so (check_name)
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(blob)
        os.replace(fresh, link)


def _collect(root: Path, keep: set[str]) -> list[str]:
    """Blocking: the digest directories outside `keep` removed, then the links to removed files,
    and the Hub directories left with no link."""
    removed = []
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if _SHA256.match(entry.name) and entry.is_dir() and not entry.is_symlink() and entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    _clean_hub(root)
    return removed


def _remove_evicted(root: Path) -> None:
    """Blocking: the retired digest directories deleted, then the Hub links left pointing at nothing."""
    cache.remove_retired(root)
    _clean_hub(root)


def _clean_hub(root: Path) -> None:
    """Blocking: the links to files no longer here removed, and the Hub directories left with no link."""
    hub = root / HUB_DIR
    for snapshot in sorted(hub.glob("*/*")) if hub.is_dir() else ():
        links = [p for p in snapshot.rglob("*") if p.is_symlink()]
        if not snapshot.name.endswith(".new"):
            for link in [p for p in links if not p.exists()]:  # another model's, of the same commit
                link.unlink(missing_ok=True)
                links.remove(link)
        if snapshot.name.endswith(".new") or not links:
            shutil.rmtree(snapshot, ignore_errors=True)
            with contextlib.suppress(OSError):
                snapshot.parent.rmdir()  # the repository's directory, once its last revision goes


def describe(p: Progress, rate: float | None = None) -> str:
    """A download's progress in words, for a replica's status; `rate` in bytes a second."""
    done = p.done_bytes / 2**20
    speed = f", {rate / 2**20:.1f} MiB/s" if rate is not None and rate >= 0 else ""
    if p.total_bytes:
        return (
            f"downloading weights: {done:.0f} of {p.total_bytes / 2**20:.0f} MiB "
            f"({100 * p.done_bytes // p.total_bytes}%{speed})"
        )
    return f"downloading weights: {done:.0f} MiB{speed.replace(', ', ' (', 1) + ')' if speed else ''}"
