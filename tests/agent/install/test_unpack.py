"""Archives cannot write or reach outside their directory; good archives unpack with their modes and links.

Every hostile archive is built here. Each refusal is checked for what matters: the error names
the member and the archive, nothing next to the destination changed (a sentinel directory and
the files the archive was built in), /etc/passwd is untouched, and the destination (the
installer's staging directory) is gone.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
import time
import warnings
import zipfile
from pathlib import Path

import pytest

from agent.install import archive as archive_mod
from agent.install import unpack as unpack_mod
from agent.install.archive import Limits
from agent.install.errors import ArchiveTooLarge, BadArchive, UnsafeArchive
from agent.install.unpack import copy_capped, unpack
from testlib.llama import llama_server_dir

LABEL = "https://example.invalid/engine.tgz"

# -- building archives ---------------------------------------------------------------------

Entry = tuple[tarfile.TarInfo, bytes | None]


def reg(name: str, data: bytes = b"x", mode: int = 0o644) -> Entry:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def dir_(name: str, mode: int = 0o755) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    return info, None


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> Entry:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def special(name: str, kind: bytes) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, 1, 3
    return info, None


def tar_with(path: Path, *members: Entry) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def zip_with(path: Path, *members: tuple[str, int, bytes]) -> Path:
    """(name, st_mode, contents); a symlink's contents are its target, as Info-ZIP stores it."""
    with zipfile.ZipFile(path, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name, which some tests want
        for name, mode, data in members:
            info = zipfile.ZipInfo(name)
            info.create_system = 3  # Unix: external_attr's high half is st_mode
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


def zlink(name: str, target: str) -> tuple[str, int, bytes]:
    return name, stat.S_IFLNK | 0o777, target.encode()


def zreg(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[str, int, bytes]:
    return name, stat.S_IFREG | mode, data


def sparse_tar(path: Path, name: str, real_size: int) -> Path:
    """A GNU sparse (PAX 1.0) member of `real_size` bytes that holds 4: all hole but its tail."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
        info.pax_headers = {
            "GNU.sparse.major": "1",
            "GNU.sparse.minor": "0",
            "GNU.sparse.name": name,
            "GNU.sparse.realsize": str(real_size),
        }
        data = f"1\n{real_size - 4}\n4\n".encode().ljust(512, b"\0") + b"tail"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def tiny_members_tar(path: Path, count: int) -> Path:
    """`count` empty files, headers written directly: tarfile.addfile takes ~40 us a member."""
    header = bytearray(tarfile.TarInfo("f000000").tobuf(tarfile.USTAR_FORMAT))
    with path.open("wb") as out:
        for i in range(count):
            header[0:7] = b"f%06d" % i
            header[148:156] = b" " * 8
            header[148:156] = b"%06o\0 " % sum(header)
            out.write(header)
        out.write(b"\0" * 1024)
    return path


# -- what must not change ------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple]:
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            body = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            seen[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_nlink, body)
    return seen


def passwd_state() -> tuple:
    st = os.stat("/etc/passwd")
    return st.st_mtime_ns, st.st_nlink, hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()


@pytest.fixture
def place(tmp_path: Path):
    """tmp_path/sentinel/keep next to tmp_path/out; `refused(build, says)` unpacks and checks."""
    (tmp_path / "sentinel").mkdir()
    (tmp_path / "sentinel/keep").write_text("untouched")
    out = tmp_path / "out"

    def refused(archive: Path, member: str, says: str, kind: type[BadArchive] = UnsafeArchive, **kw) -> str:
        before, passwd = snapshot(tmp_path), passwd_state()
        with pytest.raises(kind) as info:
            unpack(archive, out, label=LABEL, engine="llamacpp", **kw)
        message = str(info.value)
        assert f"member {member!r}" in message or f"at member {member!r}" in message, message
        assert says in message, message
        assert LABEL in message and "[engines.llamacpp]" in message and "server.toml" in message
        assert not out.exists(), "the staging directory must be removed"
        assert snapshot(tmp_path) == before, "something outside the destination changed"
        assert passwd_state() == passwd
        return message

    return tmp_path, out, refused


# -- hostile tar archives ------------------------------------------------------------------

CHAIN = [link("a", "."), link("l1", "a/.."), reg("l1/sentinel/pwned", b"owned")]

HOSTILE_TARS = {
    "symlink chain resolving outside": ([link("a", "."), link("l1", "a/..")], "l1", "goes above the archive's root"),
    "longer symlink chain": (
        [link("a", "."), link("b", "a/a/a"), link("c", "b/a"), link("out", "c/b/..")],
        "out",
        "goes above the archive's root",
    ),
    "a link defined after the link using it": (
        [link("l1", "a/.."), reg("f"), link("a", ".")],
        "l1",
        "goes above the archive's root",
    ),
    "a file written through a symlink chain": (CHAIN, "l1/sentinel/pwned", "which is a link"),
    "a link then a file of the same name": (
        [link("x", "../sentinel/keep"), reg("x", b"owned")],
        "x",
        "given twice",
    ),
    "a chained link then a file of the same name": (
        [link("a", "."), link("l1", "a/.."), link("x", "l1/sentinel/keep"), reg("x", b"owned")],
        "x",
        "given twice",
    ),
    "a hard link to an outside file through a chain": (
        [link("a", "."), link("l2", "a/.."), link("pw", "l2/sentinel/keep", tarfile.LNKTYPE)],
        "pw",
        "not a regular file earlier in the archive",
    ),
    "an inside link then a file of the same name": ([reg("y"), link("x", "y"), reg("x", b"owned")], "x", "given twice"),
    "a dir link then a file under it": ([dir_("d"), link("e", "d"), reg("e/f", b"owned")], "e/f", "which is a link"),
    "a hard link to /etc/passwd": ([link("pw", "/etc/passwd", tarfile.LNKTYPE)], "pw", "absolute path '/etc/passwd'"),
    "a hard link outside": ([link("k", "../sentinel/keep", tarfile.LNKTYPE)], "k", "leaves the directory"),
    "a hard link to a file not in the archive": (
        [link("k", "sentinel-keep", tarfile.LNKTYPE)],
        "k",
        "not a regular file earlier in the archive",
    ),
    "a hard link before its source": (
        [link("k", "f", tarfile.LNKTYPE), reg("f")],
        "k",
        "not a regular file earlier in the archive",
    ),
    "a hard link to a symlink": (
        [link("s", "f"), reg("f"), link("k", "s", tarfile.LNKTYPE)],
        "k",
        "not a regular file earlier in the archive",
    ),
    "a hard link through a symlinked dir": (
        [reg("f"), link("d", "."), link("k", "d/f", tarfile.LNKTYPE)],
        "k",
        "not a regular file earlier in the archive",
    ),
    "an absolute symlink": ([link("bin", "/usr/bin")], "bin", "absolute path '/usr/bin'"),
    "a symlink up": ([link("a/up", "../../x")], "a/up", "goes above the archive's root"),
    "a symlink loop": ([link("p", "q"), link("q", "p/x")], "p", "loop"),
    "an absolute path": ([reg("/etc/passwd", b"owned")], "/etc/passwd", "absolute path"),
    "a ../ name": ([reg("../sentinel/pwned", b"owned")], "../sentinel/pwned", "leaves the directory"),
    "a ../ inside a name": ([reg("a/../../sentinel/pwned")], "a/../../sentinel/pwned", "leaves the directory"),
    "a harmless-looking ..": ([reg("a/../b")], "a/../b", "leaves the directory"),
    "a character device": ([special("dev/null", tarfile.CHRTYPE)], "dev/null", "is a device file"),
    "a block device": ([special("dev/sda", tarfile.BLKTYPE)], "dev/sda", "is a device file"),
    "a FIFO": ([special("pipe", tarfile.FIFOTYPE)], "pipe", "is a FIFO"),
    "a setuid file": ([reg("bin/su", b"#!/bin/sh\n", 0o4755)], "bin/su", "setuid, setgid or sticky bit (mode 4755)"),
    "a setgid dir": ([dir_("shared", 0o2775)], "shared", "setuid, setgid or sticky bit"),
    "a sticky dir": ([dir_("tmp", 0o1777)], "tmp", "setuid, setgid or sticky bit"),
    "a file then a dir of the same name": ([reg("d"), dir_("d")], "d", "given twice"),
    "a file where a dir is needed": ([reg("d"), reg("d/f")], "d/f", "which is a file"),
}


@pytest.mark.parametrize(("members", "member", "says"), HOSTILE_TARS.values(), ids=HOSTILE_TARS.keys())
def test_hostile_tars_are_refused_naming_the_member(place, members, member: str, says: str) -> None:
    tmp_path, _, refused = place
    refused(tar_with(tmp_path / "bad.tar.gz", reg("first-ok"), *members), member, says)


# Refused by the tree as a whole. With that check and tarfile's data filter switched off, the
# writer alone (no-follow descriptors, O_EXCL, hard links only to what it wrote, links
# resolved again on the real files) must still refuse each and keep everything inside.
WHOLE_TREE_CASES = [
    "symlink chain resolving outside",
    "longer symlink chain",
    "a link defined after the link using it",
    "a file written through a symlink chain",
    "a link then a file of the same name",
    "a chained link then a file of the same name",
    "a hard link to an outside file through a chain",
    "an inside link then a file of the same name",
    "a dir link then a file under it",
    "a hard link to a file not in the archive",
    "a hard link before its source",
    "a hard link to a symlink",
    "a hard link through a symlinked dir",
    "a symlink loop",
    "a file then a dir of the same name",
    "a file where a dir is needed",
]


@pytest.mark.parametrize("case", WHOLE_TREE_CASES)
def test_the_writer_alone_still_refuses_and_keeps_everything_inside(place, monkeypatch, case: str) -> None:
    monkeypatch.setattr(archive_mod, "check_tree", lambda members, blame: None)
    monkeypatch.setattr(unpack_mod, "_data_filter", None)
    tmp_path, _, refused = place
    members, member, _ = HOSTILE_TARS[case]
    refused(tar_with(tmp_path / "bad.tar.gz", reg("first-ok"), *members), member, "")


def test_tarfiles_data_filter_is_a_layer_of_its_own(place, monkeypatch) -> None:
    if unpack_mod._data_filter is None:
        pytest.skip("this Python's tarfile has no data filter")
    monkeypatch.setattr(archive_mod, "check_tree", lambda members, blame: None)
    tmp_path, _, refused = place
    archive = tar_with(tmp_path / "bad.tar.gz", link("a", "."), link("l1", "a/.."))
    refused(archive, "l1", "refused by tarfile's data filter")


def test_a_10_gb_sparse_member_is_refused_before_a_byte_is_written(place) -> None:
    tmp_path, _, refused = place
    archive = sparse_tar(tmp_path / "sparse.tar", "big", 10 << 30)
    assert archive.stat().st_size < 64 << 10
    assert tarfile.open(archive).getmembers()[0].size == 10 << 30  # tarfile does read it as 10 GB
    refused(archive, "big", "more than 8589934592 bytes", ArchiveTooLarge)  # the default cap


def test_a_header_claiming_more_than_the_cap_is_refused(place) -> None:
    tmp_path, _, refused = place
    archive = tar_with(tmp_path / "big.tar.gz", reg("small", b"x" * 1000), reg("bigger", b"y" * 5000))
    message = refused(archive, "bigger", "more than 4096 bytes", ArchiveTooLarge, limits=Limits(max_bytes=4096))
    assert "raise max_unpacked_bytes under [engines.llamacpp]" in message


def test_100k_members_are_refused_at_the_default_cap_in_seconds(place) -> None:
    tmp_path, _, refused = place
    archive = tiny_members_tar(tmp_path / "many.tar", 100_000)
    started = time.monotonic()
    message = refused(archive, "f050000", "more than 50000 members", ArchiveTooLarge)
    assert "raise max_members" in message
    assert time.monotonic() - started < 30.0


def test_a_member_longer_than_its_header_is_cut_off(place, monkeypatch) -> None:
    """Bytes are counted as written: a stream that yields more than its header said is refused."""
    tmp_path, _, refused = place
    monkeypatch.setattr(archive_mod, "open_member", lambda opened, member: io.BytesIO(b"z" * (3 << 20)))
    refused(tar_with(tmp_path / "liar.tar.gz", reg("liar", b"1")), "liar", "more bytes than its header declares (1)")


def test_the_total_cap_is_counted_as_bytes_are_written() -> None:
    out = io.BytesIO()
    assert copy_capped(io.BytesIO(b"a" * 10), out, declared=10, budget=10) == 10
    with pytest.raises(unpack_mod.OverCap):
        copy_capped(io.BytesIO(b"a" * (3 << 20)), io.BytesIO(), declared=3 << 20, budget=(2 << 20) + 1)
    with pytest.raises(unpack_mod.HeaderLied):
        copy_capped(io.BytesIO(b"a" * 11), io.BytesIO(), declared=10, budget=100)


# -- hostile zip archives ------------------------------------------------------------------

HOSTILE_ZIPS = {
    "symlink outside": ([zlink("evil", "../../../etc")], "evil", "goes above the archive's root"),
    "symlink chain": ([zlink("a", "."), zlink("l1", "a/..")], "l1", "goes above the archive's root"),
    "absolute symlink": ([zlink("etc", "/etc")], "etc", "absolute path '/etc'"),
    "a link then a file of the same name": ([zreg("y"), zlink("x", "y"), zreg("x", b"owned")], "x", "given twice"),
    "a file through a link": (
        [zlink("a", "."), zlink("l1", "a/.."), zreg("l1/sentinel/pwned")],
        "l1/sentinel/pwned",
        "a link",
    ),
    "an absolute name": ([zreg("/etc/passwd", b"owned")], "/etc/passwd", "absolute path"),
    "a ../ name": ([zreg("../sentinel/pwned", b"owned")], "../sentinel/pwned", "leaves the directory"),
    "a device": ([("dev/null", stat.S_IFCHR | 0o666, b"")], "dev/null", "is a device file"),
    "a FIFO": ([("pipe", stat.S_IFIFO | 0o644, b"")], "pipe", "is a FIFO"),
    "a setuid file": ([zreg("bin/su", b"#!/bin/sh\n", 0o4755)], "bin/su", "setuid, setgid or sticky bit"),
}


@pytest.mark.parametrize(("members", "member", "says"), HOSTILE_ZIPS.values(), ids=HOSTILE_ZIPS.keys())
def test_hostile_zips_are_refused_naming_the_member(place, members, member: str, says: str) -> None:
    tmp_path, _, refused = place
    refused(zip_with(tmp_path / "bad.zip", zreg("first-ok"), *members), member, says)


def test_zip_caps(place) -> None:
    tmp_path, _, refused = place
    many = zip_with(tmp_path / "many.zip", *(zreg(f"f{i}", b"") for i in range(1001)))
    refused(many, "f1000", "more than 1000 members", ArchiveTooLarge, limits=Limits(max_members=1000))
    bomb = zip_with(tmp_path / "bomb.zip", zreg("zeros", b"\0" * (8 << 20)))
    assert bomb.stat().st_size < 64 << 10
    refused(bomb, "zeros", "more than 1048576 bytes", ArchiveTooLarge, limits=Limits(max_bytes=1 << 20))


def test_what_is_not_an_archive_is_said(place) -> None:
    tmp_path, out, _ = place
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00not an archive" * 10)
    with pytest.raises(BadArchive) as info:
        unpack(junk, out, label=LABEL, engine="vllm")
    assert "neither a zip nor a tar archive llmgw can read" in str(info.value)
    assert "[engines.vllm]" in str(info.value)
    assert not out.exists()


def test_a_damaged_member_is_said_and_leaves_nothing(place) -> None:
    tmp_path, out, _ = place
    archive = zip_with(tmp_path / "crc.zip", zreg("ok", b"fine"), zreg("broken", b"A" * 4096))
    data = bytearray(archive.read_bytes())
    at = data.index(b"broken") + len(b"broken")
    data[at + 10] ^= 0xFF  # inside the deflated bytes of "broken"
    archive.write_bytes(bytes(data))
    with pytest.raises(BadArchive) as info:
        unpack(archive, out, label=LABEL)
    assert "cannot be read" in str(info.value) and "'broken'" in str(info.value)
    assert not out.exists()


# -- good archives -------------------------------------------------------------------------


def test_a_good_tar_unpacks_with_exec_bits_and_inner_links(tmp_path: Path) -> None:
    archive = tar_with(
        tmp_path / "good.tar.gz",
        dir_("./"),
        reg("eng/bin/server", b"#!/bin/sh\necho 1\n", 0o775),
        reg("eng/lib/libx.so.1", b"lib", 0o666),
        link("eng/lib/libx.so", "libx.so.1"),
        link("eng/bin/libx.so", "../lib/libx.so"),  # a chain of links that stays inside
        link("eng/current", "."),
        link("eng/via", "current/current/lib/libx.so.1"),
        link("eng/lib/copy.so", "eng/lib/libx.so.1", tarfile.LNKTYPE),
        dir_("eng/lib", 0o750),  # after its contents, as `tar` writes a directory it revisits
        link("eng/dangling", "not-there"),  # dangling but inside: the kernel would fail, not escape
    )
    members = unpack(archive, tmp_path / "out")
    assert len(members) == 10
    out = tmp_path / "out"
    server = out / "eng/bin/server"
    assert server.read_bytes().startswith(b"#!/bin/sh")
    assert stat.S_IMODE(server.stat().st_mode) == 0o755  # exec kept, group write dropped
    assert stat.S_IMODE((out / "eng/lib/libx.so.1").stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "eng/lib").stat().st_mode) == 0o750
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert (out / "eng/bin/libx.so").read_bytes() == b"lib"
    assert (out / "eng/via").read_bytes() == b"lib"
    assert (out / "eng/lib/copy.so").read_bytes() == b"lib"
    assert (out / "eng/lib/copy.so").stat().st_ino == (out / "eng/lib/libx.so.1").stat().st_ino


def test_a_good_zip_unpacks(tmp_path: Path) -> None:
    good = zip_with(
        tmp_path / "good.zip",
        zreg("bin/tool", b"#!/bin/sh\n", 0o755),
        zreg("lib/libx.so.1", b"lib"),
        zlink("lib/libx.so", "libx.so.1"),
    )
    with zipfile.ZipFile(good, "a") as z:
        z.writestr("README", "hi")  # no Unix mode at all, as Windows archivers write it
    unpack(good, tmp_path / "out")
    assert stat.S_IMODE((tmp_path / "out/bin/tool").stat().st_mode) == 0o755
    assert (tmp_path / "out/lib/libx.so").is_symlink() and (tmp_path / "out/lib/libx.so").read_bytes() == b"lib"
    assert (tmp_path / "out/README").read_text() == "hi"


def test_the_real_llama_server_packed_as_llamacpp_releases_are_unpacks_and_runs(tmp_path: Path) -> None:
    """llama.cpp's Linux releases: build/bin/ with the server, its shared libraries with their
    versioned soname links, and a CPU backend per variant, found beside it at run time."""
    built = llama_server_dir()
    files = sorted(built.iterdir())
    assert any(p.is_symlink() for p in files) and any(p.name.startswith("libggml-cpu-") for p in files)

    def packed(ext: str) -> Path:
        return tmp_path / f"llama-bin-ubuntu-x64.{ext}"

    with tarfile.open(packed("tar.gz"), "w:gz", compresslevel=1) as tar:
        for path in files:
            tar.add(path, f"build/bin/{path.name}")  # links stay links
    zip_with(
        packed("zip"),
        *(
            zlink(f"build/bin/{p.name}", os.readlink(p))
            if p.is_symlink()
            else zreg(f"build/bin/{p.name}", p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in files
        ),
    )
    for ext in ("tar.gz", "zip"):
        out = tmp_path / f"out-{ext}"
        unpack(packed(ext), out)
        server = out / "build/bin/llama-server"
        assert server.read_bytes() == (built / "llama-server").read_bytes()
        done = subprocess.run([str(server), "--version"], capture_output=True, timeout=60, check=False, cwd=tmp_path)
        assert done.returncode == 0 and b"version" in done.stdout + done.stderr, done
