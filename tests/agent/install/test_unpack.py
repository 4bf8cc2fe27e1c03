"""Archives cannot write outside their directory; good archives unpack with their modes and links."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from agent.install.errors import UnsafeArchive
from agent.install.unpack import unpack


def tar_with(path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def reg(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def test_a_good_tar_unpacks_with_exec_bits_and_inner_links(tmp_path: Path) -> None:
    archive = tar_with(
        tmp_path / "good.tar.gz",
        reg("eng/bin/server", b"#!/bin/sh\necho 1\n", 0o4755),
        reg("eng/lib/libx.so.1", b"lib"),
        link("eng/lib/libx.so", "libx.so.1"),
        link("eng/lib/copy.so", "eng/lib/libx.so.1", tarfile.LNKTYPE),
    )
    unpack(archive, tmp_path / "out")
    server = tmp_path / "out/eng/bin/server"
    assert server.read_bytes().startswith(b"#!/bin/sh")
    assert stat.S_IMODE(server.stat().st_mode) == 0o755  # setuid dropped, exec kept
    assert (tmp_path / "out/eng/lib/libx.so").resolve() == (tmp_path / "out/eng/lib/libx.so.1").resolve()
    assert (tmp_path / "out/eng/lib/copy.so").read_bytes() == b"lib"


@pytest.mark.parametrize(
    ("members", "says"),
    [
        ([reg("/etc/passwd")], "absolute path"),
        ([reg("../escape")], "leaves the directory"),
        ([reg("a/../../escape")], "leaves the directory"),
        ([link("bin", "/usr/bin")], "absolute path '/usr/bin'"),
        ([link("a/up", "../../x")], "points outside"),
        ([link("hard", "../outside", tarfile.LNKTYPE)], "leaves the directory"),
    ],
)
def test_escaping_tars_are_refused_before_anything_is_written(tmp_path: Path, members, says: str) -> None:
    archive = tar_with(tmp_path / "bad.tar.gz", reg("first-ok"), *members)
    with pytest.raises(UnsafeArchive) as info:
        unpack(archive, tmp_path / "out")
    assert says in str(info.value)
    assert not (tmp_path / "out").exists()  # checked whole before the first byte


def test_devices_are_refused(tmp_path: Path) -> None:
    dev = tarfile.TarInfo("dev/sda")
    dev.type = tarfile.CHRTYPE
    archive = tar_with(tmp_path / "dev.tar.gz", (dev, None))
    with pytest.raises(UnsafeArchive) as info:
        unpack(archive, tmp_path / "out")
    assert "device, FIFO or other special file" in str(info.value)


def test_zip_with_symlink_outside_is_refused_and_a_good_zip_unpacks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as z:
        info = zipfile.ZipInfo("evil")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "../../../etc")
    with pytest.raises(UnsafeArchive):
        unpack(bad, tmp_path / "out-bad")
    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as z:
        info = zipfile.ZipInfo("bin/tool")
        info.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(info, "#!/bin/sh\n")
        z.writestr("README", "hi")
    unpack(good, tmp_path / "out")
    assert stat.S_IMODE((tmp_path / "out/bin/tool").stat().st_mode) == 0o755


def test_what_is_not_an_archive_is_said(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00not an archive" * 10)
    with pytest.raises(UnsafeArchive) as info:
        unpack(junk, tmp_path / "out")
    assert "neither a zip nor a tar" in str(info.value)
