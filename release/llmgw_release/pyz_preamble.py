"""Run by shiv's bootstrap in the release zipapp after unpacking, before llmgw starts (shiv's
`preamble`): marks the unpacked copy as in use, and removes the other llmgw versions unpacked
next to it that no process uses.

In use means held: every llmgw process takes a shared flock on its unpacked directory and keeps
it until it exits. A directory is removed only by whoever gets an exclusive flock on it, and on
shiv's extraction lock (`.NAME_lock`), without waiting: so an agent still running the previous
version keeps its files after the operator upgrades the file and runs the new one, and a copy
being unpacked is left alone. Removal renames the directory out of the way first, so no one ever
sees half of one. A process that finds its own directory gone between unpacking and holding it
(another version removed it in that instant) stops with a message rather than fail later at an
import.

Only directories whose shiv build id starts with `llmgw-` are considered, so a SHIV_ROOT shared
with other shiv applications is safe. Cleaning is best effort: an error skips that directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

EX_TEMPFAIL = 75
REMOVING = ".removing"


def is_llmgw(name: str) -> bool:
    """shiv names an unpacked copy `<file name>_<build id>`; llmgw's build ids start with `llmgw-`."""
    return name.rpartition("_")[2].startswith("llmgw-")


def hold(unpacked: Path) -> int:
    """A shared lock on this process's unpacked directory, kept until the process exits."""
    try:
        fd = os.open(unpacked, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.path.samestat(os.fstat(fd), os.stat(unpacked)):
            return fd
    except FileNotFoundError:
        pass
    sys.stderr.write(
        f"llmgw: {unpacked} was removed by another llmgw version while this one started; run the command again\n"
    )
    sys.exit(EX_TEMPFAIL)


def _try_lock(path: Path, flags: int) -> int | None:
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove(root: Path, name: str) -> bool:
    base = name[: -len(".tmp")] if name.endswith(".tmp") else name
    extract_lock = _try_lock(root / f".{base}_lock", os.O_RDWR | os.O_CREAT)
    if extract_lock is None:
        return False
    try:
        in_use = _try_lock(root / name, os.O_RDONLY | os.O_DIRECTORY)
        if in_use is None:
            return False
        try:
            trash = root / f".{name}{REMOVING}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(root / name, trash)
        finally:
            os.close(in_use)
        shutil.rmtree(trash, ignore_errors=True)
        if not (root / base).exists() and not (root / f"{base}.tmp").exists():
            os.unlink(root / f".{base}_lock")
        return True
    except OSError:
        return False
    finally:
        os.close(extract_lock)


def clean(root: Path, keep: str) -> list[str]:
    """Remove the unused llmgw copies in `root` other than `keep`; the names removed."""
    removed = []
    for name in sorted(os.listdir(root)):
        if name.startswith(".") and name.endswith(REMOVING) and is_llmgw(name[1 : -len(REMOVING)]):
            shutil.rmtree(root / name, ignore_errors=True)  # left by a cleaner that was killed
            continue
        base = name[: -len(".tmp")] if name.endswith(".tmp") else name
        if name.startswith(".") or base == keep or not is_llmgw(base):
            continue
        if (root / name).is_dir() and not (root / name).is_symlink() and _remove(root, name):
            removed.append(name)
    return removed


def main(site_packages: Path) -> None:
    unpacked = site_packages.parent
    hold(unpacked)
    try:
        clean(unpacked.parent, unpacked.name)
    except OSError:
        pass  # someone else's directory we may not read: not a reason to stop llmgw


if __name__ == "__main__":
    main(site_packages)  # noqa: F821 - shiv's bootstrap runs this file with `site_packages` defined
