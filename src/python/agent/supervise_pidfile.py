"""The agent supervisor's pid file (`agent.supervise`): held open and exclusively locked while a
supervisor runs, and who holds it, asked by `llmgw agent stop`.

Invariants:
- The exclusive flock is held exactly while a supervisor runs; the kernel drops it when the
  process dies, however it dies. So the lock, not the number written in the file, says whether
  a supervisor runs (`holder`), and `stop` signals a pid only while its lock is held: a stale
  file left by a killed supervisor never gets an unrelated process (which reused the pid) killed.
- flock locks belong to the open file description: a supervisor that detaches (`--daemon`)
  after taking the lock keeps it through fork, once the original process has exited.
- A supervisor that stops unlinks its file only while it is still the file it locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import attrs

from llmgw.errors import MachineError


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class PidFile:
    """The supervisor's pid file, held open and exclusively locked.

    Nothing here unlocks on garbage collection: after `--daemon` forks, the original process
    simply exits and the daemon keeps the lock.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, path: Path) -> PidFile:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MachineError(
                f"cannot create {path.parent} for the pid file: {exc.strerror}; "
                "run as a user who may, or pass --pid-file in a directory you can write"
            ) from None
        # A supervisor that is stopping unlinks its file: if that happens between our open and
        # our lock, we hold a lock on a file nobody else will see. Open again then.
        for _ in range(5):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise MachineError(
                    f"cannot open the pid file {path}: {exc.strerror}; pass --pid-file in a directory you can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                who = f"pid {pid}" if pid else "its pid not written yet"
                raise MachineError(
                    f"an agent supervisor already runs with the pid file {path} ({who}); "
                    f"stop it first with `llmgw agent stop --pid-file {path}`, or use another --pid-file"
                ) from None
            if _same_file(fd, path):
                os.ftruncate(fd, 0)
                try:
                    os.fchmod(fd, 0o644)  # whatever the umask said
                except PermissionError:
                    pass  # someone else's file that we may write: leave its mode alone
                return cls(path, fd)
            os.close(fd)
        raise MachineError(f"the pid file {path} keeps being replaced while it is locked; try again")

    def write_pid(self, pid: int) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{pid}\n".encode(), 0)

    def release(self) -> None:
        if _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # the last descriptor of the description: the lock goes with it


@attrs.frozen
class Holder:
    """Who holds a pid file: `locked` while a supervisor runs; `pid` what the file says."""

    exists: bool
    locked: bool
    pid: int | None


def holder(path: Path) -> Holder:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Holder(exists=False, locked=False, pid=None)
    except OSError as exc:
        raise MachineError(f"cannot read the pid file {path}: {exc.strerror}; run as its owner or root") from None
    try:
        pid = _read_pid(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return Holder(exists=True, locked=True, pid=pid)
        return Holder(exists=True, locked=False, pid=pid)
    finally:
        os.close(fd)
