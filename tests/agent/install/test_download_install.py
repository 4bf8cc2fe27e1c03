"""Downloads resume and are verified; installs are checked before `current` switches.

A real HTTP server on loopback (llmgw's own HTTP server) serves the files, with Range support
that the tests can switch off.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
import trio

from agent.install.errors import ArchiveTooLarge, DownloadError, EngineCheckFailed, UnsafeArchive
from agent.install.installer import ArchiveSource, EngineStore, Wanted
from llmgw.download import archive_cap, fetch
from testlib.fileserver import Files, serve_files

pytestmark = pytest.mark.trio
CAP = archive_cap(0, 0)  # the default maximum; these files announce their Content-Length anyway


@pytest.fixture
async def files(nursery: trio.Nursery) -> tuple[Files, str]:
    return await serve_files(nursery)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_download_resumes_a_part_with_a_range_request(files, tmp_path: Path) -> None:
    server, base = files
    data = os.urandom(3 << 20)
    server.content["/w.bin"] = data
    (tmp_path / "w.bin.part").write_bytes(data[: 1 << 20])
    await fetch(f"{base}/w.bin", tmp_path / "w.bin", sha256=sha(data), cap=CAP)
    assert (tmp_path / "w.bin").read_bytes() == data
    assert server.ranges_seen == [f"bytes={1 << 20}-"]
    assert not (tmp_path / "w.bin.part").exists()


async def test_a_server_without_range_support_restarts_the_download(files, tmp_path: Path) -> None:
    server, base = files
    server.honour_range = False
    data = b"abc" * 1000
    server.content["/w.bin"] = data
    (tmp_path / "w.bin.part").write_bytes(b"garbage-that-must-not-survive")
    await fetch(f"{base}/w.bin", tmp_path / "w.bin", sha256=sha(data), cap=CAP)
    assert (tmp_path / "w.bin").read_bytes() == data


async def test_a_wrong_checksum_installs_nothing_and_drops_the_part(files, tmp_path: Path) -> None:
    server, base = files
    server.content["/w.bin"] = b"tampered"
    with pytest.raises(DownloadError) as info:
        await fetch(f"{base}/w.bin", tmp_path / "w.bin", sha256=sha(b"original"), cap=CAP)
    assert f"has sha256 {sha(b'tampered')}, but server.toml says {sha(b'original')}" in str(info.value)
    assert not (tmp_path / "w.bin").exists() and not (tmp_path / "w.bin.part").exists()


async def test_http_errors_name_the_url(files, tmp_path: Path) -> None:
    _, base = files
    with pytest.raises(DownloadError) as info:
        await fetch(f"{base}/missing", tmp_path / "x", sha256=sha(b""), cap=CAP)
    assert "/missing answered HTTP 404" in str(info.value)


def engine_archive(version: str, *, works: bool = True) -> bytes:
    script = (
        f"#!/bin/sh\necho fake-engine {version}\n"
        if works
        else "#!/bin/sh\necho 'error: libcuda.so.1 not found' >&2\nexit 127\n"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("pkg/bin/fake-engine")
        info.mode = 0o755
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script.encode()))
    return buf.getvalue()


async def test_install_checks_then_switches_and_a_broken_upgrade_keeps_the_old(files, tmp_path: Path) -> None:
    server, base = files
    store = EngineStore(tmp_path / "engines")
    for version, works in (("v1", True), ("v2", False), ("v3", True)):
        server.content[f"/{version}.tgz"] = engine_archive(version, works=works)

    def wanted(version: str) -> Wanted:
        data = server.content[f"/{version}.tgz"]
        return Wanted(
            name="fake",
            version=version,
            source=ArchiveSource(url=f"{base}/{version}.tgz", sha256=sha(data), binary="pkg/bin/fake-engine"),
        )

    v1 = await store.ensure(wanted("v1"))
    assert v1.version == "v1" and os.readlink(tmp_path / "engines/fake/current") == "v1"

    with pytest.raises(EngineCheckFailed) as info:
        await store.ensure(wanted("v2"))
    assert "libcuda.so.1 not found" in str(info.value)  # the engine's own words
    assert os.readlink(tmp_path / "engines/fake/current") == "v1"  # the old one keeps serving
    assert not (tmp_path / "engines/fake/v2").exists()

    await store.ensure(wanted("v3"))
    assert os.readlink(tmp_path / "engines/fake/current") == "v3"
    assert sorted(p.name for p in (tmp_path / "engines/fake").iterdir()) == ["current", "v1", "v3"]
    assert store.current("fake").executable.endswith("v3/pkg/bin/fake-engine")


async def test_an_operator_installed_engine_is_only_checked(tmp_path: Path) -> None:
    binary = tmp_path / "my-llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 4242 (abc)'\n")
    binary.chmod(0o755)
    store = EngineStore(tmp_path / "engines")
    installed = await store.ensure(Wanted(name="llamacpp", version="", binary=str(binary)))
    assert installed.executable == str(binary) and "4242" in installed.version
    with pytest.raises(EngineCheckFailed) as info:
        await store.ensure(Wanted(name="llamacpp", version="", binary=str(tmp_path / "absent")))
    assert "cannot be run" in str(info.value)


async def test_an_archive_over_its_caps_or_unsafe_is_refused_and_leaves_no_staging(files, tmp_path: Path) -> None:
    server, base = files
    store = EngineStore(tmp_path / "engines")
    good = engine_archive("v1")
    server.content["/v1.tgz"] = good
    source = ArchiveSource(url=f"{base}/v1.tgz", sha256=sha(good), binary="pkg/bin/fake-engine")
    await store.ensure(Wanted(name="fake", version="v1", source=source))

    capped = ArchiveSource(url=f"{base}/v1.tgz", sha256=sha(good), binary="pkg/bin/fake-engine", max_unpacked_bytes=8)
    with pytest.raises(ArchiveTooLarge) as info:
        await store.ensure(Wanted(name="fake", version="v2", source=capped))
    assert f"archive {base}/v1.tgz has more than 8 bytes unpacked (at member 'pkg/bin/fake-engine')" in str(info.value)
    assert "max_unpacked_bytes under [engines.fake]" in str(info.value)
    capped = ArchiveSource(url=f"{base}/v1.tgz", sha256=sha(good), binary="pkg/bin/fake-engine", max_members=0)
    with pytest.raises(ArchiveTooLarge):
        await store.ensure(Wanted(name="fake", version="v2", source=capped))

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, target in (("a", "."), ("l1", "a/..")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    server.content["/evil.tgz"] = buf.getvalue()
    evil = ArchiveSource(url=f"{base}/evil.tgz", sha256=sha(buf.getvalue()), binary="pkg/bin/fake-engine")
    with pytest.raises(UnsafeArchive) as info:
        await store.ensure(Wanted(name="fake", version="v3", source=evil))
    assert "member 'l1'" in str(info.value) and f"{base}/evil.tgz" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "engines/fake").iterdir()) == ["current", "v1"]  # no staging left
    assert os.readlink(tmp_path / "engines/fake/current") == "v1"


async def test_an_archive_install_reports_its_phases_and_download_percentages(files, tmp_path: Path) -> None:
    server, base = files
    archive = engine_archive("v1") + os.urandom(3 << 20)  # gzip ignores what follows: a big enough download
    server.content["/v1.tgz"] = archive
    seen: list[tuple[str, int | None]] = []
    wanted = Wanted(
        name="fake",
        version="v1",
        source=ArchiveSource(
            url=f"{base}/v1.tgz", sha256=sha(archive), binary="pkg/bin/fake-engine", size=len(archive)
        ),
    )
    await EngineStore(tmp_path / "engines").ensure(wanted, on_progress=lambda phase, pct: seen.append((phase, pct)))
    phases = [phase for phase, _ in seen]
    assert phases[0] == "fetch" and phases[-2:] == ["unpack", "check"]
    fetched = [pct for phase, pct in seen if phase == "fetch"]
    assert fetched[0] == 0 and fetched[-1] == 100 and fetched == sorted(set(fetched))  # each change once, rising
    assert len(seen) == len(set(seen))
    # Already current: checked, but nothing is installing, so nothing is reported (a node's
    # engines would read "installing" at every reconcile otherwise).
    again: list[tuple[str, int | None]] = []
    await EngineStore(tmp_path / "engines").ensure(wanted, on_progress=lambda phase, pct: again.append((phase, pct)))
    assert again == []
