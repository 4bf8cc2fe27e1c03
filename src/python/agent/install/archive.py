"""What an engine archive holds, judged whole before anything is written.

`read_members` turns a tar or zip into `Member`s, refusing as it reads: absolute names, any
`..` component, devices, FIFOs and other special files, setuid/setgid/sticky bits, and more
members or declared bytes than `Limits` allow (counted header by header, so a 100k-member or
10 GB archive is refused without reading the rest). `check_tree` then builds the tree the
members make and refuses what only the whole shows: a name given twice, a member under a link
or a file, a hard link to anything but a regular file earlier in the archive, and a symbolic
link that resolves outside the tree once every other link in the tree is followed (`a -> .`,
`l1 -> a/..` passes a textual check and leaves). `resolve` is that resolution, shared with the
check unpack.py makes on the real files afterwards. All of it is pure but the reading.
"""

from __future__ import annotations

import collections
import lzma
import re
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from agent.install.errors import ArchiveTooLarge, BadArchive, UnsafeArchive
from llmgw.config import DEFAULT_MAX_MEMBERS, DEFAULT_MAX_UNPACKED_BYTES

MAX_LINK_HOPS = 40  # as Linux's path resolution
MAX_LINK_TARGET = 4095  # PATH_MAX - 1: a zip stores a symlink's target as its contents
MAX_NAME = 4095  # likewise a member's name: deeper trees are no engine's, and each level costs a syscall

# What reading a damaged archive raises from tarfile, zipfile and their decompressors.
READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, RuntimeError, OSError)

DIR, FILE, SYMLINK, HARDLINK = "dir", "file", "symlink", "hardlink"


@attrs.frozen(kw_only=True)
class Limits:
    """An engine's caps (server.toml's [engines.NAME] max_unpacked_bytes, max_members)."""

    max_bytes: int = DEFAULT_MAX_UNPACKED_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS


@attrs.frozen(kw_only=True)
class Blame:
    """Names the archive and where server.toml configures it, for every refusal."""

    archive: str  # the archive's URL (or file name)
    engine: str = ""

    @property
    def section(self) -> str:
        return f"[engines.{self.engine or 'NAME'}]"

    def unsafe(self, member: str, problem: str) -> UnsafeArchive:
        return UnsafeArchive(
            f"archive {self.archive}: member {member!r} {problem}; refusing to unpack it. An engine archive llmgw "
            f"installs holds only files, directories and links inside itself: check the url and sha256 under "
            f"{self.section} in server.toml"
        )

    def too_large(self, member: str, what: str, cap: int, key: str) -> ArchiveTooLarge:
        return ArchiveTooLarge(
            f"archive {self.archive} has more than {cap} {what} (at member {member!r}); refusing to unpack it. If it "
            f"is the archive you meant, raise {key} under {self.section} in server.toml; else check its url and sha256"
        )

    def unreadable(self, problem: str) -> BadArchive:
        return BadArchive(
            f"archive {self.archive} cannot be read: {problem}; check the url and sha256 under {self.section} in "
            "server.toml (llmgw unpacks .tar.gz, .tgz, .tar.xz, .tar.bz2 and .zip)"
        )


@attrs.frozen(kw_only=True)
class Member:
    name: str  # as the archive spells it (for messages)
    parts: tuple[str, ...]  # the normalised path: no "", ".", ".." components
    kind: str  # DIR, FILE, SYMLINK, HARDLINK
    mode: int = 0o644  # permission bits only: special bits are refused
    size: int = 0  # what the header declares (FILE)
    link: str = ""  # SYMLINK: the target as written; HARDLINK: the source's normalised path
    source: Any = attrs.field(default=None, eq=False, repr=False)  # the TarInfo or ZipInfo

    @property
    def path(self) -> str:
        return "/".join(self.parts)


def split_name(name: str, blame: Blame) -> tuple[str, ...]:
    """A member's name as path components, refusing absolute names and any `..`."""
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise blame.unsafe(name, "has an absolute path")
    if "\0" in name:
        raise blame.unsafe(name, "has a NUL byte in its name")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise blame.unsafe(name[:80] + "...", f"has a name longer than {MAX_NAME} bytes")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise blame.unsafe(name, "leaves the directory ('..')")
    return parts


Opened = zipfile.ZipFile | tarfile.TarFile


def open_archive(archive: Path, blame: Blame) -> Opened:
    try:
        return zipfile.ZipFile(archive) if zipfile.is_zipfile(archive) else tarfile.open(archive)
    except tarfile.ReadError:  # tarfile's message lists every decompressor it tried
        raise blame.unreadable("it is neither a zip nor a tar archive llmgw can read") from None
    except READ_ERRORS as exc:
        raise blame.unreadable(f"it is neither a zip nor a tar archive llmgw can read ({exc})") from None


def read_members(opened: Opened, limits: Limits, blame: Blame) -> Iterator[Member]:
    """The archive's members, each checked alone, within the limits; BadArchive otherwise."""
    try:
        if isinstance(opened, zipfile.ZipFile):
            yield from _counted(_zip_members(opened, blame), limits, blame)
        else:
            yield from _counted((_tar_member(m, blame) for m in opened), limits, blame)
    except READ_ERRORS as exc:
        raise blame.unreadable(str(exc) or type(exc).__name__) from None


def open_member(opened: Opened, member: Member) -> IO[bytes]:
    """A FILE member's contents (as many bytes as its header declares, holes of a sparse
    member as zeros)."""
    if isinstance(opened, zipfile.ZipFile):
        return opened.open(member.source)
    stream = opened.extractfile(member.source)
    assert stream is not None  # a regular file's
    return stream


def _counted(members: Iterator[Member], limits: Limits, blame: Blame) -> Iterator[Member]:
    count = total = 0
    for member in members:
        count += 1
        if count > limits.max_members:
            raise blame.too_large(member.name, "members", limits.max_members, "max_members")
        total += member.size
        if total > limits.max_bytes:
            raise blame.too_large(member.name, "bytes unpacked", limits.max_bytes, "max_unpacked_bytes")
        yield member


def _special_bits(name: str, mode: int, blame: Blame) -> int:
    if mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        raise blame.unsafe(name, f"has the setuid, setgid or sticky bit (mode {mode & 0o7777:04o})")
    return mode & 0o777


def _tar_member(m: tarfile.TarInfo, blame: Blame) -> Member:
    parts = split_name(m.name, blame)
    if m.isdir():
        return Member(name=m.name, parts=parts, kind=DIR, mode=_special_bits(m.name, m.mode, blame), source=m)
    if m.isreg():
        mode = _special_bits(m.name, m.mode, blame)
        return Member(name=m.name, parts=parts, kind=FILE, mode=mode, size=m.size, source=m)
    if m.issym():
        return Member(name=m.name, parts=parts, kind=SYMLINK, link=_link_target(m.name, m.linkname, blame), source=m)
    if m.islnk():
        if m.linkname.startswith("/"):
            raise blame.unsafe(m.name, f"is a hard link to the absolute path {m.linkname!r}")
        source = tuple(p for p in m.linkname.split("/") if p not in ("", "."))
        if ".." in source or "\0" in m.linkname:
            raise blame.unsafe(m.name, f"is a hard link to {m.linkname!r}, which leaves the directory ('..')")
        return Member(name=m.name, parts=parts, kind=HARDLINK, link="/".join(source), source=m)
    what = "a device file" if m.ischr() or m.isblk() else "a FIFO" if m.isfifo() else "a special file"
    raise blame.unsafe(m.name, f"is {what}")


def _link_target(name: str, target: str, blame: Blame) -> str:
    if target.startswith("/"):
        raise blame.unsafe(name, f"is a link to the absolute path {target!r}")
    if not target or "\0" in target or len(target) > MAX_LINK_TARGET:
        raise blame.unsafe(name, "is a link with an empty, overlong or NUL-bearing target")
    return target


def _zip_members(z: zipfile.ZipFile, blame: Blame) -> Iterator[Member]:
    for info in z.infolist():
        parts = split_name(info.filename, blame)
        unix = info.external_attr >> 16  # st_mode, when the archiver was a Unix one
        kind = stat.S_IFMT(unix)
        if info.is_dir() or kind == stat.S_IFDIR:
            yield Member(
                name=info.filename, parts=parts, kind=DIR, mode=_special_bits(info.filename, unix, blame) or 0o755
            )
        elif kind == stat.S_IFLNK:
            if info.file_size > MAX_LINK_TARGET:
                raise blame.unsafe(info.filename, "is a link with an overlong target")
            target = z.read(info).decode("utf-8", "surrogateescape")
            link = _link_target(info.filename, target, blame)
            yield Member(name=info.filename, parts=parts, kind=SYMLINK, link=link, source=info)
        elif kind in (0, stat.S_IFREG):
            mode = _special_bits(info.filename, unix, blame) or 0o644
            yield Member(name=info.filename, parts=parts, kind=FILE, mode=mode, size=info.file_size, source=info)
        else:
            what = (
                "a device file"
                if kind in (stat.S_IFCHR, stat.S_IFBLK)
                else "a FIFO"
                if kind == stat.S_IFIFO
                else "a special file"
            )
            raise blame.unsafe(info.filename, f"is {what}")


# -- the tree the members make -------------------------------------------------------------

Lookup = Callable[[tuple[str, ...]], tuple[str, str]]  # path -> (DIR | FILE | SYMLINK | "missing", link target)


class Escapes(Exception):
    """A link resolves outside the tree (`str` says how)."""


def resolve(start: tuple[str, ...], target: str, lookup: Lookup) -> tuple[str, ...]:
    """Where the link target `target`, read in directory `start`, leads: each component in
    turn, links followed as the kernel would (a link spliced in before a following `..`).
    Escapes if any step goes above the tree's root or a link is absolute or loops. A missing
    component is taken literally: the kernel would fail there, so that errs on the safe side."""
    if target.startswith("/"):
        raise Escapes(f"is absolute ({target!r})")
    parts = list(start)
    todo = collections.deque(target.split("/"))
    hops = 0
    while todo:
        part = todo.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise Escapes("goes above the archive's root")
            parts.pop()
            continue
        parts.append(part)
        kind, link = lookup(tuple(parts))
        if kind == SYMLINK:
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise Escapes(f"passes more than {MAX_LINK_HOPS} links (a loop)")
            if link.startswith("/"):
                raise Escapes(f"passes {'/'.join(parts)!r}, a link to the absolute path {link!r}")
            parts.pop()
            todo.extendleft(reversed(link.split("/")))
    return tuple(parts)


def check_tree(members: list[Member], blame: Blame) -> None:
    """Refuse what only the whole archive shows (see the module's docstring)."""
    tree: dict[tuple[str, ...], Member | None] = {(): None}  # None: a directory no member names
    for member in members:
        for i in range(1, len(member.parts)):
            above = member.parts[:i]
            node = tree.setdefault(above, None)
            if node is not None and node.kind != DIR:
                what = "a link" if node.kind == SYMLINK else "a file"
                raise blame.unsafe(member.name, f"would be written under {node.name!r}, which is {what}")
        if member.kind == HARDLINK:
            source = tree.get(tuple(member.link.split("/")))
            if source is None or source.kind != FILE:
                raise blame.unsafe(
                    member.name,
                    f"is a hard link to {member.link!r}, which is not a regular file earlier in the archive",
                )
        if member.parts in tree:
            before = tree[member.parts]
            if member.kind == DIR and (before is None or before.kind == DIR):
                tree[member.parts] = member
                continue
            if member.parts == ():
                raise blame.unsafe(member.name, "names the archive's root as something else than a directory")
            raise blame.unsafe(member.name, f"is given twice (also as {before.name if before else 'a directory'!r})")
        tree[member.parts] = member

    def lookup(path: tuple[str, ...]) -> tuple[str, str]:
        if path not in tree:
            return "missing", ""
        node = tree[path]
        if node is None or node.kind == DIR:
            return DIR, ""
        return (SYMLINK, node.link) if node.kind == SYMLINK else (FILE, "")

    for member in members:
        if member.kind == SYMLINK:
            try:
                resolve(member.parts[:-1], member.link, lookup)
            except Escapes as exc:
                raise blame.unsafe(member.name, f"is a link to {member.link!r}, which {exc}") from None
