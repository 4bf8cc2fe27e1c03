"""Unpacking an archive without letting it write outside its directory.

Every member is checked before anything is written: no absolute names, no `..`, no devices
or FIFOs, and a link (symbolic or hard) may point only inside the destination. Files are
written by this module (not by tarfile/zipfile's extract), so their semantics cannot widen
what is allowed; modes keep the execute bits and drop setuid/setgid/sticky.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

import attrs

from agent.install.errors import UnsafeArchive


@attrs.frozen(kw_only=True)
class Member:
    name: str  # normalised, relative, "/"-separated
    kind: str  # "file", "dir", "symlink", "hardlink"
    mode: int = 0o644
    link: str = ""  # for links: the target as written in the archive


def _normalise(name: str, archive: Path) -> str:
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"{archive.name}: member {name!r} has an absolute path; refusing to unpack")
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{norm}/":
        raise UnsafeArchive(f"{archive.name}: member {name!r} leaves the directory ('..'); refusing to unpack")
    return norm


def _check_link(member: Member, archive: Path) -> None:
    if member.link.startswith("/"):
        raise UnsafeArchive(f"{archive.name}: link {member.name!r} points to the absolute path {member.link!r}")
    base = posixpath.dirname(member.name) if member.kind == "symlink" else ""
    target = posixpath.normpath(posixpath.join(base, member.link))
    if target == ".." or target.startswith("../"):
        raise UnsafeArchive(f"{archive.name}: link {member.name!r} -> {member.link!r} points outside the directory")


def list_members(archive: Path) -> list[Member]:
    if zipfile.is_zipfile(archive):
        return _zip_members(archive)
    try:
        with tarfile.open(archive) as tar:
            return [_tar_member(m, archive) for m in tar.getmembers()]
    except tarfile.TarError as exc:
        raise UnsafeArchive(f"{archive.name} is neither a zip nor a tar archive llmgw can read: {exc}") from None


def _tar_member(m: tarfile.TarInfo, archive: Path) -> Member:
    name = _normalise(m.name, archive)
    if m.isdir():
        member = Member(name=name, kind="dir", mode=m.mode)
    elif m.isreg():
        member = Member(name=name, kind="file", mode=m.mode)
    elif m.issym():
        member = Member(name=name, kind="symlink", link=m.linkname)
    elif m.islnk():
        member = Member(name=name, kind="hardlink", link=_normalise(m.linkname, archive))
    else:
        raise UnsafeArchive(
            f"{archive.name}: member {m.name!r} is a device, FIFO or other special file; refusing to unpack"
        )
    if member.kind in ("symlink", "hardlink"):
        _check_link(member, archive)
    return member


def _zip_members(archive: Path) -> list[Member]:
    out = []
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            name = _normalise(info.filename, archive)
            unix_mode = info.external_attr >> 16
            if info.is_dir():
                out.append(Member(name=name, kind="dir", mode=0o755))
            elif stat.S_ISLNK(unix_mode):
                member = Member(name=name, kind="symlink", link=z.read(info).decode("utf-8"))
                _check_link(member, archive)
                out.append(member)
            else:
                out.append(Member(name=name, kind="file", mode=stat.S_IMODE(unix_mode) or 0o644))
    return out


def unpack(archive: Path, dest: Path) -> list[Member]:
    """Unpack into `dest` (created, must not exist) after checking every member; returns them."""
    members = list_members(archive)  # everything is checked before the first byte is written
    dest.mkdir(parents=True)
    root = dest.resolve()
    is_zip = zipfile.is_zipfile(archive)
    opened = zipfile.ZipFile(archive) if is_zip else tarfile.open(archive)
    with opened as source:
        infos = source.infolist() if is_zip else source.getmembers()
        by_name = {posixpath.normpath(getattr(i, "filename", None) or i.name): i for i in infos}
        for member in members:
            if member.name in (".", ""):
                continue
            path = root / member.name
            # A symlink written earlier must not redirect a later member outside `dest`.
            if not path.parent.resolve().is_relative_to(root):
                raise UnsafeArchive(
                    f"{archive.name}: member {member.name!r} would be written through a link outside the directory"
                )
            mode = member.mode & 0o777
            if member.kind == "dir":
                path.mkdir(parents=True, exist_ok=True)
            elif member.kind == "symlink":
                path.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(member.link, path)
            elif member.kind == "hardlink":
                shutil.copyfile(root / member.link, path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                info = by_name[member.name]
                stream = source.open(info) if is_zip else source.extractfile(info)
                with stream as src, path.open("wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(path, mode | 0o600)
    return members
