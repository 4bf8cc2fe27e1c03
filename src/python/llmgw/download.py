"""Downloading a file once, verified: resume with HTTP Range, sha256 before use, atomic rename.

Shared by the agent (engines, weights) and the control plane (filling its mirror).

`fetch` leaves either nothing, a `.part` file a later call resumes, or the complete verified
file at its final name; never an unverified file at the final name. The transfer runs in a
worker thread (stdlib urllib: https, redirects, proxies from the environment) and stops at the
next chunk when the caller is cancelled.

Every download is capped (`Cap`): at the file's size when server.toml gives it (a server that
announces another size is refused before a byte is written), else at the Content-Length the
server announces, else at a configured maximum. A size known either way is checked against the
free space first. A body that goes past its cap stops the download at that byte and removes the
partial file.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw.config import DownloadsSection
from llmgw.errors import MachineError, PeerError
from llmgw.log import get_logger

log = get_logger("llmgw.download")


class DownloadError(PeerError):
    """The source failed or sent something else than promised (status, size, checksum)."""


class DiskFull(MachineError):
    """Not enough free space where the file must go."""


CHUNK = 1 << 20
TIMEOUT_S = 60.0


@attrs.frozen(kw_only=True)
class Cap:
    """How many bytes a download may bring, and what an error about it names as the fix."""

    size: int = 0  # the file's exact size, from server.toml's `size`; 0: not given
    max_bytes: int  # the cap when neither `size` nor a Content-Length is known
    setting: str  # the server.toml key that sets max_bytes, e.g. "[downloads].max_weights_gib"

    def wrong_size(self, url: str, announced: int) -> str:
        return (
            f"{url} announces {announced} bytes, but server.toml gives its size as {self.size}; nothing was kept. "
            f"The file at the URL changed, or `size` is wrong: set it to the file's size in bytes (`stat -c %s FILE`)"
        )

    def exceeded(self, url: str, limit: int, announced: int | None) -> str:
        head = f"{url} sent more than {limit} bytes"
        tail = "; the download was stopped and its partial file removed"
        if self.size:
            return (
                f"{head}, the size server.toml gives it{tail}. The file at the URL changed, or `size` is wrong: set "
                "it to the file's size in bytes (`stat -c %s FILE`)"
            )
        if announced is not None:
            return f"{head}, the Content-Length it announced{tail}; the server is broken, or not the one meant"
        return (
            f"{head} ({_gib(limit)}) without announcing its size, more than {self.setting} allows{tail}. If the file "
            f"really is larger, give its source `size = BYTES` in server.toml (`stat -c %s FILE`), or raise "
            f"{self.setting}"
        )


def archive_cap(size: int, max_bytes: int) -> Cap:
    """An engine archive's cap; `max_bytes` 0 (a control plane from before caps): the default."""
    return Cap(
        size=size,
        max_bytes=max_bytes or DownloadsSection().max_archive_bytes,
        setting="[downloads].max_archive_gib",
    )


def weights_cap(size: int, max_bytes: int) -> Cap:
    """A weights file's cap; `max_bytes` 0 (a control plane from before caps): the default."""
    return Cap(
        size=size,
        max_bytes=max_bytes or DownloadsSection().max_weights_bytes,
        setting="[downloads].max_weights_gib",
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


@attrs.frozen(kw_only=True)
class Progress:
    url: str
    done_bytes: int
    total_bytes: int | None


def sha256_of(path: Path) -> str:
    """The file's SHA-256, hex: the one helper for it (blocking: call it off the event loop)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def check_free_space(directory: Path, needed: int, what: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise DiskFull(
            f"{what} needs {needed / 2**30:.2f} GiB in {directory} and only {free / 2**30:.2f} GiB is free; "
            "free some space or point the agent's state_dir / weights_dir at a larger disk"
        )


async def fetch(
    url: str,
    dest: Path,
    *,
    sha256: str,
    cap: Cap,
    ssl_context: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    sha256_from: str = "server.toml",
) -> Path:
    """Make `dest` the verified content of `url`; reuses a complete `dest`, resumes a `.part`.
    `sha256_from`: where the expected digest was read, for the message when it does not match."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(
            _fetch_blocking,
            url,
            dest,
            sha256,
            cap,
            ssl_context,
            dict(headers or {}),
            on_progress,
            stop,
            sha256_from,
            abandon_on_cancel=True,
        )
    finally:
        stop.set()


def _fetch_blocking(
    url, dest: Path, sha256: str, cap: Cap, ctx, headers: dict, on_progress, stop: threading.Event, sha256_from: str
) -> Path:
    if dest.exists() and sha256_of(dest) == sha256:  # hashing a large file: here, off the event loop
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.exists() else 0
    if cap.size and offset > cap.size:  # not a prefix of the file: start afresh
        part.unlink()
        offset = 0
    request = urllib.request.Request(url)
    for name, value in headers.items():
        if name.lower() == "authorization":
            request.add_unredirected_header(name, value)  # a redirect to another host must not get the token
        else:
            request.add_header(name, value)
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S, context=ctx)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # nothing after what we have: the part may be complete
            return _finish(part, dest, sha256, url, sha256_from)
        raise DownloadError(f"{url} answered HTTP {exc.code} {exc.reason}; check the URL in server.toml") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise DownloadError(
            f"cannot download {url}: {reason!r}; check the node's network or use the control plane as mirror"
        ) from None
    with response:
        if response.status == 200 and offset:
            log.info("download_restart", url=url, reason="the server does not resume (no Range support)")
            offset = 0
        length = response.headers.get("content-length")
        total = offset + int(length) if length and length.isdigit() else None
        if cap.size and total is not None and total != cap.size:
            part.unlink(missing_ok=True)
            raise DownloadError(cap.wrong_size(url, total))
        limit = cap.size or total or cap.max_bytes
        expected = total if total is not None else cap.size  # 0: not known
        if expected:
            check_free_space(dest.parent, expected - offset, f"downloading {url}")
        over = False
        with part.open("ab" if offset else "wb") as out:
            done = offset
            while not stop.is_set():
                if done > limit:  # a part kept from before is past the cap already
                    over = True
                    break
                try:
                    block = response.read(min(CHUNK, limit - done + 1))  # one byte past the cap says it is passed
                except (OSError, http.client.HTTPException) as exc:  # cut, reset, or no longer HTTP mid-body
                    raise DownloadError(
                        f"the download of {url} broke off at {done} bytes ({exc!r}); what arrived is kept and "
                        "resumed next time"
                    ) from None
                if not block:
                    break
                if done + len(block) > limit:
                    over = True
                    break
                out.write(block)
                done += len(block)
                if on_progress is not None:
                    on_progress(Progress(url=url, done_bytes=done, total_bytes=total or cap.size or None))
            if stop.is_set():
                raise DownloadError(f"download of {url} was cancelled at {done} bytes; it resumes next time")
        if over:
            part.unlink(missing_ok=True)
            raise DownloadError(cap.exceeded(url, limit, total))
        if total is not None and done != total:
            raise DownloadError(f"{url} ended after {done} of {total} bytes; it resumes next time")
    return _finish(part, dest, sha256, url, sha256_from)


def _finish(part: Path, dest: Path, sha256: str, url: str, sha256_from: str) -> Path:
    got = sha256_of(part)
    if got != sha256:
        part.unlink(missing_ok=True)  # a corrupt part would poison every resume
        raise DownloadError(
            f"{url} has sha256 {got}, but {sha256_from} says {sha256}; the file changed or the checksum is wrong "
            "(nothing was installed)"
        )
    os.replace(part, dest)
    return dest
