"""Downloading a file once, verified: resume with HTTP Range, sha256 before use, atomic rename.

Shared by the agent (engines, weights) and the control plane (filling its mirror).

`fetch` leaves either nothing, a `.part` file a later call resumes, or the complete verified
file at its final name; never an unverified file at the final name. The transfer runs in a
worker thread (stdlib urllib: https, redirects, proxies from the environment) and stops at the
next chunk when the caller is cancelled.
"""

from __future__ import annotations

import hashlib
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
class Progress:
    url: str
    done_bytes: int
    total_bytes: int | None


def sha256_of(path: Path) -> str:
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
    ssl_context: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> Path:
    """Make `dest` the verified content of `url`; reuses a complete `dest`, resumes a `.part`."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(
            _fetch_blocking,
            url,
            dest,
            sha256,
            ssl_context,
            dict(headers or {}),
            on_progress,
            stop,
            abandon_on_cancel=True,
        )
    finally:
        stop.set()


def _fetch_blocking(url, dest: Path, sha256: str, ctx, headers: dict, on_progress, stop: threading.Event) -> Path:
    if dest.exists() and sha256_of(dest) == sha256:  # hashing a large file: here, off the event loop
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.exists() else 0
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
            return _finish(part, dest, sha256, url)
        raise DownloadError(f"{url} answered HTTP {exc.code} {exc.reason}; check the URL in server.toml") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DownloadError(
            f"cannot download {url}: {reason}; check the node's network or use the control plane as mirror"
        ) from None
    with response:
        if response.status == 200 and offset:
            log.info("download_restart", url=url, reason="the server does not resume (no Range support)")
            offset = 0
        length = response.headers.get("content-length")
        total = offset + int(length) if length and length.isdigit() else None
        if total is not None:
            check_free_space(dest.parent, total - offset, f"downloading {url}")
        with part.open("ab" if offset else "wb") as out:
            done = offset
            while not stop.is_set():
                block = response.read(CHUNK)
                if not block:
                    break
                out.write(block)
                done += len(block)
                if on_progress is not None:
                    on_progress(Progress(url=url, done_bytes=done, total_bytes=total))
            if stop.is_set():
                raise DownloadError(f"download of {url} was cancelled at {done} bytes; it resumes next time")
        if total is not None and done != total:
            raise DownloadError(f"{url} ended after {done} of {total} bytes; it resumes next time")
    return _finish(part, dest, sha256, url)


def _finish(part: Path, dest: Path, sha256: str, url: str) -> Path:
    got = sha256_of(part)
    if got != sha256:
        part.unlink(missing_ok=True)  # a corrupt part would poison every resume
        raise DownloadError(
            f"{url} has sha256 {got}, but server.toml says {sha256}; the file changed or the checksum is wrong "
            "(nothing was installed)"
        )
    os.replace(part, dest)
    return dest
