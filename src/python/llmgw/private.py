"""Files and directories only their owner may use: making them, writing them, refusing them.

Private means a key, a token, a secret, a database holding any of them, and every directory
llmgw makes to keep them in. The rules, on both the control plane and a node:

- Private from the start, whatever the umask: a directory is made 0700 (and so is each missing
  parent made on the way), a file 0600, each then set to exactly that. A umask only ever takes
  bits away, so there is no moment at which either is open to anyone else.
- Written whole or not at all, and durably: a temporary file next to the target, fsynced,
  renamed over the target, then the directory fsynced so that the rename survives a crash too.
  A reader sees the old file or the whole new one.
- Found open to others (any group or other bit) or belonging to another user, it is refused,
  never silently fixed: whether the secret leaked meanwhile is for the operator to judge. The
  error (`NotPrivate`, a `MachineError`) names each path, the mode or owner found and the
  command that fixes it.

Checks follow symbolic links (an operator may keep a state directory elsewhere and link it)
and read a file through the descriptor they checked, so the check and the read see one file.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import attrs

from llmgw.errors import MachineError

DIR_MODE = 0o700
FILE_MODE = 0o600
_OPEN = 0o077  # any permission for group or others


@attrs.frozen(kw_only=True)
class Problem:
    """One private path that is not private: what is wrong and the command that fixes it."""

    path: Path
    what: str  # what it holds, for the operator: "the CA key"
    found: str  # "mode 0644", "owner uid 65534 (nobody)"
    fix: str  # a shell command

    def __str__(self) -> str:
        return f"{self.path} has {self.found} ({self.what}); fix it with `{self.fix}`"


class NotPrivate(MachineError):
    """Private files or directories were found open to other users or owned by another: the
    operator fixes the machine (each problem names the command) and starts again."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        lines = [str(p) for p in self.problems]
        if len(lines) == 1:
            text = lines[0]
        else:
            text = "\n".join(["private files and directories are open to other users:", *(f"  {s}" for s in lines)])
            text += f"\nfix them all with `{' && '.join(p.fix for p in self.problems)}`"
        super().__init__(
            text + "\nllmgw refuses to use them until then; consider what they hold exposed if others could read it"
        )


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def problems_of(
    path: Path, st: os.stat_result, what: str, *, is_dir: bool, owner: bool = True, writable_only: bool = False
) -> list[Problem]:
    """What is wrong with a private path whose `stat` is `st` (empty: nothing). `owner=False`
    leaves out the owner (a copy of a credential that root reads for another user's server).
    `writable_only`: a directory others may read but not change (it holds a private one, and
    whoever may write in it may replace what it holds)."""
    quoted = shlex.quote(str(path))
    found: list[Problem] = []
    if is_dir != stat.S_ISDIR(st.st_mode):
        kind = "a directory" if is_dir else "a file"
        return [
            Problem(
                path=path, what=what, found=f"the wrong type: it should be {kind}", fix=f"mv {quoted} {quoted}.aside"
            )
        ]
    me = os.geteuid()
    if owner and st.st_uid != me:
        found.append(
            Problem(
                path=path,
                what=what,
                found=f"owner uid {st.st_uid} ({user_name(st.st_uid)}), not {user_name(me)} who runs llmgw",
                fix=f"chown {shlex.quote(user_name(me))} {quoted}",
            )
        )
    mode = stat.S_IMODE(st.st_mode)
    if writable_only and mode & 0o022:
        found.append(
            Problem(path=path, what=what, found=f"mode {mode:04o}, writable by others", fix=f"chmod go-w {quoted}")
        )
    elif not writable_only and mode & _OPEN:
        want = DIR_MODE if is_dir else FILE_MODE
        found.append(Problem(path=path, what=what, found=f"mode {mode:04o}", fix=f"chmod {want:o} {quoted}"))
    return found


def check(path: Path, what: str, *, is_dir: bool, writable_only: bool = False) -> list[Problem]:
    """The problems of `path` if it exists (a missing path is not this check's business)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise MachineError(
            f"cannot look at {path} ({what}): {exc.strerror or exc}; run as the user that owns it"
        ) from None
    return problems_of(path, st, what, is_dir=is_dir, writable_only=writable_only)


def require(paths: Iterable[tuple[Path, str, bool]]) -> None:
    """Refuse (`NotPrivate`, listing every problem at once) unless each existing (path, what,
    is_dir) is private."""
    found = [p for path, what, is_dir in paths for p in check(path, what, is_dir=is_dir)]
    if found:
        raise NotPrivate(found)


def read(path: Path, what: str, *, owner: bool = True) -> bytes:
    """The contents of a private file, refused (`NotPrivate`) if others may read it or (unless
    `owner` is false) it is not ours. `FileNotFoundError` and `PermissionError` are the
    caller's to explain."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        found = problems_of(path, os.fstat(fd), what, is_dir=False, owner=owner)
        if found:
            raise NotPrivate(found)
        return f.read()


def make_dir(d: Path, what: str = "a private directory", *, check_existing: bool = True) -> None:
    """Make `d` 0700, and each missing parent on the way, whatever the umask. An existing `d` is
    checked (`NotPrivate` if it is open to others), unless `check_existing` is false (a
    directory the operator chose, e.g. `ca issue --out DIR`); existing parents are left alone."""
    d = Path(d)
    missing: list[Path] = []
    p = d
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    made: set[Path] = set()
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: checked below if it is `d`
        os.chmod(p, DIR_MODE)  # the umask took bits away, never added any
        made.add(p)
    if check_existing and d not in made:
        require([(d, what, True)])


def create_empty(path: Path) -> bool:
    """Create `path` empty and 0600 if it does not exist (True if this call made it). For a file
    another program fills in place, such as SQLite's database, whose -wal and -shm files SQLite
    creates with the database's own mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, FILE_MODE)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return True


def write(path: Path, data: bytes, *, mode: int = FILE_MODE, exclusive: bool = False) -> None:
    """Write `path` whole or not at all, durably. The temporary file is created 0600 (mkstemp's
    O_EXCL, 0600) and only then given `mode`, so a secret is never readable by others, not even
    while it is written. `exclusive` refuses to replace an existing file (FileExistsError):
    link() fails where rename() would overwrite, so two racing writers cannot both win."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    """Make the directory's entries (a rename, a new file) survive a crash."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
