"""Unpacking an engine archive so that nothing it holds reaches outside its directory.

The agent runs as root, so this does not trust any one check. In layers:

1. archive.py reads every header and judges the whole archive before the first byte is
   written (names, kinds, modes, links resolved through the tree, member count, declared size).
2. Writing never follows a link: `dest` is a fresh directory; each member's directories are
   opened component by component from `dest`'s descriptor with O_DIRECTORY|O_NOFOLLOW, and
   every file, directory and link is created with *at() calls relative to its parent's
   descriptor, files with O_CREAT|O_EXCL|O_NOFOLLOW (so a name planted earlier is never written
   through). A hard link may only name a file this run wrote.
3. Bytes are counted as they are written, against the member's declared size and the total
   cap: a header that lies, or a sparse member, cannot fill the disk.
4. tarfile's `data` filter (where this Python has it) judges each tar member again against the
   real directory as it stands, and every symbolic link is resolved again on the real files
   at the end.

Files keep their execute bits and lose group/other write; ownership is the agent's. On any
failure `dest` is removed, so a refused archive leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from agent.install import archive as a
from agent.install.archive import Blame, Limits, Member
from agent.install.errors import BadArchive, CannotWrite, DiskFull

CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_data_filter = getattr(tarfile, "data_filter", None)  # 3.10.12+/3.11.4+; the other layers stand without it


def unpack(
    archive: Path, dest: Path, *, limits: Limits | None = None, label: str = "", engine: str = ""
) -> list[Member]:
    """Unpack `archive` into `dest` (created here; must not exist), or raise BadArchive (the
    archive's fault), DiskFull or CannotWrite (this node's) and leave no `dest`. `label` names
    the archive in messages (its URL), `engine` the server.toml section that configures it."""
    blame = Blame(archive=label or archive.name, engine=engine)
    limits = limits or Limits()
    with a.open_archive(archive, blame) as opened:
        members = list(a.read_members(opened, limits, blame))
        a.check_tree(members, blame)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(dest, 0o700)
        try:
            root = os.open(dest, _DIR_FLAGS)
            try:
                _Writer(root, dest, opened, limits, blame).write(members)
            finally:
                os.close(root)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)  # rmtree does not follow links
            raise
    return members


class HeaderLied(Exception):
    """A member holds more bytes than its header declared."""


class OverCap(Exception):
    """Writing a member would pass the total cap."""


class Unreadable(Exception):
    """A member's bytes cannot be read (a damaged stream, a bad CRC, an encrypted zip member)."""


def copy_capped(src: IO[bytes], out: IO[bytes], *, declared: int, budget: int) -> int:
    """Copy `src` to `out`, refusing before writing past `declared` bytes (HeaderLied) or `budget`
    (OverCap), or Unreadable if `src` cannot be read; returns the bytes written."""
    done = 0
    while True:
        try:
            chunk = src.read(CHUNK)
        except a.READ_ERRORS as exc:
            raise Unreadable(str(exc) or type(exc).__name__) from None
        if not chunk:
            return done
        done += len(chunk)
        if done > declared:
            raise HeaderLied()
        if done > budget:
            raise OverCap()
        out.write(chunk)


class _Writer:
    def __init__(self, root: int, dest: Path, opened: a.Opened, limits: Limits, blame: Blame) -> None:
        self.root, self.dest, self.opened, self.limits, self.blame = root, dest, opened, limits, blame
        self.written = 0
        self.files: set[tuple[str, ...]] = set()  # regular files this run wrote: the only hard-link sources
        self.dir_modes: dict[tuple[str, ...], int] = {}

    def write(self, members: list[Member]) -> None:
        for member in members:
            self._layer_data_filter(member)
            try:
                self._write(member)
            except BadArchive:
                raise
            except OSError as exc:
                raise self._os_error(member, exc) from None
            except ValueError as exc:  # a NUL or a bad component: archive.py refuses both first
                raise self.blame.unsafe(member.name, f"has a name that cannot be written ({exc})") from None
        self._check_links_on_disk(members)
        self._apply_dir_modes()

    def _write(self, member: Member) -> None:
        if not member.parts:  # the archive's own root ("./"): that is dest
            return
        *above, name = member.parts
        with self._dir(tuple(above), create=True) as parent:
            if member.kind == a.DIR:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                        raise
                self.dir_modes[member.parts] = member.mode
            elif member.kind == a.SYMLINK:
                os.symlink(member.link, name, dir_fd=parent)
            elif member.kind == a.HARDLINK:
                self._hard_link(member, name, parent)
            else:
                self._write_file(member, name, parent)

    def _write_file(self, member: Member, name: str, parent: int) -> None:
        with a.open_member(self.opened, member) as src:
            fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=parent)
            with open(fd, "wb") as out:
                try:
                    self.written += copy_capped(
                        src, out, declared=member.size, budget=self.limits.max_bytes - self.written
                    )
                except HeaderLied:
                    raise self.blame.unsafe(
                        member.name, f"holds more bytes than its header declares ({member.size})"
                    ) from None
                except OverCap:
                    raise self.blame.too_large(
                        member.name, "bytes unpacked", self.limits.max_bytes, "max_unpacked_bytes"
                    ) from None
                except Unreadable as exc:
                    raise self.blame.unreadable(f"member {member.name!r}: {exc}") from None
                # Execute bits as the archive has them, never group/other write; readable by the owner.
                os.fchmod(fd, (member.mode & 0o755) | 0o600)
        self.files.add(member.parts)

    def _hard_link(self, member: Member, name: str, parent: int) -> None:
        source = tuple(member.link.split("/"))
        if source not in self.files:
            raise self.blame.unsafe(
                member.name, f"is a hard link to {member.link!r}, which this archive did not unpack"
            )
        *above, source_name = source
        with self._dir(tuple(above), create=False) as source_parent:
            os.link(source_name, name, src_dir_fd=source_parent, dst_dir_fd=parent, follow_symlinks=False)

    @contextmanager
    def _dir(self, parts: tuple[str, ...], *, create: bool) -> Iterator[int]:
        """A descriptor of dest/parts, each component a real directory (never a link)."""
        fd = os.dup(self.root)
        try:
            for i, part in enumerate(parts):
                if part in ("", ".", "..") or "/" in part:
                    raise ValueError(f"bad path component {part!r}")
                if create:
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                        self.dir_modes.setdefault(parts[: i + 1], 0o755)
                    except FileExistsError:
                        pass
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)

    def _layer_data_filter(self, member: Member) -> None:
        if _data_filter is None or not isinstance(member.source, tarfile.TarInfo) or not member.parts:
            return
        try:
            _data_filter(member.source, str(self.dest))
        except tarfile.FilterError as exc:
            raise self.blame.unsafe(member.name, f"is refused by tarfile's data filter ({exc})") from None

    def _check_links_on_disk(self, members: list[Member]) -> None:
        def lookup(path: tuple[str, ...]) -> tuple[str, str]:
            where = "/".join(path)
            try:
                mode = os.stat(where, dir_fd=self.root, follow_symlinks=False).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return "missing", ""
            if stat.S_ISLNK(mode):
                return a.SYMLINK, os.readlink(where, dir_fd=self.root)
            return (a.DIR if stat.S_ISDIR(mode) else a.FILE), ""

        for member in members:
            if member.kind == a.SYMLINK:
                try:
                    a.resolve(member.parts[:-1], member.link, lookup)
                except a.Escapes as exc:
                    raise self.blame.unsafe(member.name, f"is a link to {member.link!r}, which {exc}") from None

    def _apply_dir_modes(self) -> None:
        # Deepest first, after every file is in: a directory the archive makes read-only is
        # still filled. Owner rwx always (the agent removes old versions), never group/other write.
        for parts in sorted(self.dir_modes, key=len, reverse=True):
            with self._dir(parts, create=False) as fd:
                os.fchmod(fd, (self.dir_modes[parts] & 0o755) | 0o700)
        os.fchmod(self.root, 0o755)

    def _os_error(self, member: Member, exc: OSError) -> Exception:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull(
                f"no space left in {self.dest.parent} while unpacking member {member.name!r} of {self.blame.archive}: "
                "free some space on this node (or raise the agent's state directory's quota) and the agent retries"
            )
        if exc.errno == errno.EEXIST:
            return self.blame.unsafe(member.name, "is given twice (a name already unpacked would be overwritten)")
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return self.blame.unsafe(member.name, "would be written through a link or under a file")
        return CannotWrite(
            f"cannot write member {member.name!r} of {self.blame.archive} into {self.dest}: {exc.strerror or exc}; "
            "check that the agent's state directory is writable by the agent (permissions, a read-only or failing disk)"
        )
