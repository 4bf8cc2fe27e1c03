"""The weights cache's size policy: what a node holds, and which files go when it is over its limit.

What is held is read from the weights directory itself, so it survives an agent restart: each
WEIGHTS/<sha256>/ directory is one held file (its `.part` while downloading), its size the sum of
its files' sizes and its last use the directory's mtime. The store touches that mtime when it
prepares a source and, at each collect, for every file a replica here uses (`touch`); writing a
file into the directory moves it too, which also means "used now".

`plan` is pure: given what is held, the limit, the digests that must stay (in use, being
prepared, being downloaded) and the bytes a download is about to add, it picks whole directories
least recently used first until the cache fits, and says when what must stay alone does not.
The store performs the plan (`retire`, then `remove_retired`): a directory is first renamed out
of its digest's name on the event loop, in the same step as the plan, so no prepare can find it
between the decision and the deletion; the slow part (unlinking GiBs) runs in a thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import attrs

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
RETIRED = ".evicting-"  # prefix of a directory being deleted; never a digest, so never read as held


class Held(NamedTuple):
    """One downloaded file on this node, as the control plane will be told of it."""

    sha256: str
    bytes: int  # on disk now: the file, or what has arrived of it
    complete: bool  # verified and at its final name; False: only a `.part` (a download resumed next time)
    last_used: float  # seconds since the epoch: the digest directory's mtime


def scan(root: Path) -> list[Held]:
    """Every digest directory under `root`, oldest use first. Cheap: a listing and a stat per file,
    no hashing. Blocking, but fast enough to call on the event loop for a few hundred files."""
    held = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return held
    for entry in entries:
        if not _SHA256.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue  # a symlinked digest directory is the operator's arrangement, as in collect
        size, complete = 0, False
        try:
            with os.scandir(entry.path) as files:
                for f in files:
                    if f.is_file(follow_symlinks=False) and not f.name.startswith("."):  # dot files: bookkeeping
                        size += f.stat(follow_symlinks=False).st_size
                        complete = complete or not f.name.endswith(".part")
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:  # removed meanwhile (a collect in a thread)
            continue
        held.append(Held(sha256=entry.name, bytes=size, complete=complete, last_used=mtime))
    held.sort(key=lambda h: (h.last_used, h.sha256))
    return held


@attrs.frozen(kw_only=True)
class Plan:
    evict: tuple[Held, ...]  # least recently used first
    total: int  # bytes held before the plan
    kept_in_use: tuple[Held, ...] = ()  # what must stay, when it alone (with the download) passes the limit

    @property
    def short(self) -> bool:
        """The cache stays over its limit after the plan: what is in use alone does not fit."""
        return bool(self.kept_in_use)


def plan(held: Iterable[Held], *, limit: int, protected: set[str], incoming: int = 0) -> Plan:
    """Which directories to delete so that `held` plus `incoming` bytes fits `limit` (0: no limit).

    Never one in `protected`. Least recently used first; ties by digest, so the choice is stable."""
    ordered = sorted(held, key=lambda h: (h.last_used, h.sha256))
    total = sum(h.bytes for h in ordered)
    if not limit or total + incoming <= limit:
        return Plan(evict=(), total=total)
    evict, left = [], total
    for h in ordered:
        if left + incoming <= limit:
            break
        if h.sha256 not in protected:
            evict.append(h)
            left -= h.bytes
    if left + incoming > limit:
        return Plan(evict=tuple(evict), total=total, kept_in_use=tuple(h for h in ordered if h.sha256 in protected))
    return Plan(evict=tuple(evict), total=total)


def touch(root: Path, digests: Iterable[str]) -> None:
    """Mark the digests' directories used now (their mtime), those that exist."""
    for digest in digests:
        with contextlib.suppress(FileNotFoundError):
            os.utime(root / digest)


def retire(root: Path, digest: str) -> bool:
    """Rename a digest's directory out of its name; False if it is gone already. A rename, so
    quick enough for the event loop, which keeps the plan and this step one (see the docstring)."""
    try:
        os.rename(root / digest, root / f"{RETIRED}{digest}")
    except FileNotFoundError:
        return False
    return True


def remove_retired(root: Path) -> None:
    """Blocking: delete every retired directory, also those an agent stopped mid-way left."""
    for path in root.glob(f"{RETIRED}*"):
        shutil.rmtree(path, ignore_errors=True)
