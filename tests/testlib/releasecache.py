"""Release builds shared by the test files: one build for each content of what goes in.

A release build (`testlib.nodeadd.build_release`) costs about 8 CPU-s (four `pip download`
runs against the wheel cache, then the zipapp written), and about ten test files each built one,
most of them the same. `built` keeps each build in the user's cache (XDG_CACHE_HOME, as the wheel
cache and llama.cpp's are: outside the Pants sandbox, which goes with its test), under a key that
hashes everything the build reads: the version, the architectures, the commit and date it is told,
llmgw's and the agent's files as the build collects them, the requirements and the lockfile, the
release build's own code, and the llama.cpp archive it ships (its path, size and time). A change to
any of them is a new key, so a cached release is always the one the build would make now.

One process builds at a time (a lock on the cache), so two test files asking for the same release
at once build it once; a build is written beside its place and renamed into it, so a reader never
sees half of one. Each caller gets a copy of its own (a test may damage its release). The cache
keeps the last `KEPT` builds used.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

KEPT = 12


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw-release" / "test-builds"


def key(parts: Iterable[str | bytes], files: Iterable[Path]) -> str:
    """A hash of `parts` and of each file's name and bytes (not its directory: each Pants sandbox
    has its own; a missing file hashes as missing)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big") + data)
    for path in files:
        digest.update(path.name.encode() + b"\0")
        try:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        except FileNotFoundError:
            digest.update(b"missing")
    return digest.hexdigest()[:32]


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def built(name: str, build: Callable[[Path], object], out: Path, root: Path | None = None) -> Path:
    """`out` holding a copy of what `build(directory)` writes, built once for `name` (a key)."""
    root = root or cache_dir()
    with _locked(root):
        entry = root / name
        if not entry.is_dir():
            work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
            work.chmod(0o755)  # as a directory the build made (mkdtemp's is 0700), which out gets
            try:
                build(work)
                work.rename(entry)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        os.utime(entry)  # last used: what _prune keeps
        shutil.copytree(entry, out, dirs_exist_ok=True)
        _prune(root)
    return out


def _prune(root: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEPT:]:
        shutil.rmtree(old, ignore_errors=True)
