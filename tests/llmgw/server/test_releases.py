"""The release files the control plane serves (llmgw.server.nodes.releases): which files are in the
catalog for each source, and the route on memory streams: only catalog names are served, whatever
the path says; other methods, names and a full house are refused with what to do."""

from __future__ import annotations

import hashlib
import zipfile
from functools import partial
from pathlib import Path

import pytest

from llmgw.releasefiles import Running, pick
from llmgw.server.nodes import releases
from llmgw.server.nodes.releases import Releases, build_catalog
from testlib.httpexchange import exchange

AMD = "llmgw-0.3.0-linux-amd64.pyz"
ARM = "llmgw-0.3.0-linux-arm64.pyz"


def _pyz(path: Path, text: str = "hi") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("__main__.py", f"print({text!r})\n")
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _release_dir(root: Path, *extra_lines: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    amd, arm = _pyz(root / AMD, "amd"), _pyz(root / ARM, "arm")
    (root / "notes.txt").write_text("not a release file\n")
    (root / "SHA256SUMS").write_text(
        "".join(f"{_digest(p)}  {p.name}\n" for p in (amd, arm)) + "".join(line + "\n" for line in extra_lines)
    )
    return root


# -- the catalog ---------------------------------------------------------------------------


def test_a_release_directory_serves_what_its_sums_list_and_is_beside_it(tmp_path: Path) -> None:
    d = _release_dir(
        tmp_path / "rel",
        f"{'1' * 64}  notes.txt",  # listed but not a release file
        f"{'2' * 64}  ../../etc/passwd",  # a name that would leave the directory
        f"{'3' * 64}  llmgw-0.2.0-linux-arm64.pyz",  # listed, not downloaded
    )
    catalog, _ = build_catalog(d, None, {})
    assert sorted(catalog.files) == [AMD, ARM]
    assert catalog.files[ARM].path == d / ARM and catalog.files[ARM].sha256 == _digest(d / ARM)
    assert catalog.sums().decode().splitlines() == [f"{_digest(d / AMD)}  {AMD}", f"{_digest(d / ARM)}  {ARM}"]


def test_a_file_damaged_on_disk_keeps_the_listed_digest(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    listed = _digest(d / AMD)
    (d / AMD).write_bytes((d / AMD).read_bytes() + b"tampered")
    catalog, _ = build_catalog(d, None, {})
    assert catalog.files[AMD].sha256 == listed  # the node's check then refuses what it gets


def test_the_running_release_serves_its_directory_when_its_sums_list_it(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    link = tmp_path / "bin" / "llmgw"
    link.parent.mkdir()
    link.symlink_to(d / AMD)
    me = Running(path=link.resolve(), version="0.3.0", arch="amd64")
    catalog, _ = build_catalog(None, me, {})
    assert sorted(catalog.files) == [AMD, ARM]  # an amd64 plane holding both adds an arm64 node
    assert str(d) in catalog.source


def test_the_running_release_alone_is_served_under_its_release_name(tmp_path: Path) -> None:
    installed = _pyz(tmp_path / "llmgw")  # installed by copy: no SHA256SUMS beside it
    me = Running(path=installed, version="0.3.0", arch="arm64")
    catalog, hashes = build_catalog(None, me, {})
    assert list(catalog.files) == [ARM] and catalog.files[ARM].sha256 == _digest(installed)
    assert list(hashes.values()) == [_digest(installed)]
    again, _ = build_catalog(None, me, {k: "f" * 64 for k in hashes})  # unchanged file: the hash is reused
    assert again.files[ARM].sha256 == "f" * 64


def test_a_development_build_serves_none_and_says_what_to_set(tmp_path: Path) -> None:
    catalog, _ = build_catalog(None, None, {})
    assert catalog.files == {} and "[release] dir" in catalog.missing
    catalog, _ = build_catalog(tmp_path, None, {})
    assert catalog.files == {} and "SHA256SUMS" in catalog.missing


def test_the_file_for_the_nodes_architecture_is_picked(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    catalog, _ = build_catalog(d, None, {})
    sums = {e.name: e.sha256 for e in catalog.files.values()}
    assert pick(sums, "arm64", "x")[0] == ARM and pick(sums, "amd64", "x")[0] == AMD


LLAMA_AMD = "llama.cpp-b11434-linux-amd64.tar.gz"
LLAMA_ARM = "llama.cpp-b11434-linux-arm64.tar.gz"


def test_the_releases_llama_cpp_archives_are_served_and_named_for_the_nodes(tmp_path: Path) -> None:
    d = tmp_path / "rel"
    d.mkdir()
    for name in (LLAMA_AMD, LLAMA_ARM, "llama.cpp-b11434-linux-riscv64.tar.gz", "llama.cpp-latest-linux-amd64.tar.gz"):
        (d / name).write_bytes(name.encode())
    _release_dir(d, *(f"{_digest(d / n)}  {n}" for n in sorted(p.name for p in d.glob("llama*"))))
    catalog, _ = build_catalog(d, None, {})
    # Only the release's own names: an architecture it does not build, a version not b<number>, are not its.
    assert sorted(catalog.files) == sorted([AMD, ARM, LLAMA_AMD, LLAMA_ARM])
    amd, arm = catalog.llama_archives()
    assert (amd.name, amd.version, amd.arch, amd.sha256, amd.size) == (
        LLAMA_AMD,
        "b11434",
        "x86_64",
        _digest(d / LLAMA_AMD),
        len(LLAMA_AMD),
    )
    assert amd.binary == "llama.cpp-b11434-linux-amd64/llama-server" and arm.arch == "aarch64"
    # node add still picks the zipapp among them.
    assert pick({e.name: e.sha256 for e in catalog.files.values()}, "amd64", "x")[0] == AMD


@pytest.mark.trio
async def test_the_latest_catalog_is_what_the_nodes_are_told_and_a_llama_archive_is_served(tmp_path: Path) -> None:
    d = tmp_path / "rel"
    d.mkdir()
    (d / LLAMA_AMD).write_bytes(b"llama" * 1000)
    _release_dir(d, f"{_digest(d / LLAMA_AMD)}  {LLAMA_AMD}")
    rel = Releases(directory=d, running=None)
    assert rel.llama_archives() == ()  # nothing read yet
    status, _, body = await _get(rel, b"/v1/release/" + LLAMA_AMD.encode())
    assert status == 200 and body == b"llama" * 1000
    assert [a.name for a in rel.llama_archives()] == [LLAMA_AMD]
    off = Releases(directory=d, running=None, serve=False)
    await off.catalog()
    assert off.llama_archives() == ()  # a control plane that serves no release offers none


# -- the route -----------------------------------------------------------------------------


async def _get(
    rel: Releases, target: bytes, method: bytes = b"GET", extra: bytes = b""
) -> tuple[int, dict[bytes, bytes], bytes]:
    """`method target` of the releases' handler on the shared HTTP server, over memory streams."""
    request = method + b" " + target + b" HTTP/1.1\r\nhost: cp\r\n" + extra + b"\r\n"
    answered = await exchange(partial(releases.handle, releases=rel, peer="127.0.0.9"), request)
    return answered.status, answered.headers, answered.body


@pytest.mark.trio
async def test_the_files_are_served_by_exact_name_only(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    (tmp_path / "secret").write_text("private")
    rel = Releases(directory=d, running=None)
    status, _, body = await _get(rel, b"/v1/release/SHA256SUMS")
    assert status == 200 and body.decode().splitlines()[1].endswith(ARM)
    status, headers, body = await _get(rel, b"/v1/release/" + ARM.encode())
    assert status == 200 and body == (d / ARM).read_bytes() and headers[b"content-length"] == str(len(body)).encode()
    for target in (
        b"/v1/release/../secret",
        b"/v1/release/%2e%2e/secret",
        b"/v1/release/notes.txt",
        b"/v1/release/" + ARM.encode() + b"/../../secret",
        b"/v1/release/" + ARM.encode() + b"?x=1",
        b"/v1/release/llmgw-0.2.0-linux-arm64.pyz",  # a release name this plane does not hold
        b"/v1/release/",
    ):
        status, _, body = await _get(rel, target)
        assert status == 404 and b"private" not in body, (target, status, body)
    status, headers, _ = await _get(rel, b"/v1/release/" + ARM.encode(), method=b"POST")
    assert status == 405 and headers[b"allow"] == b"GET, HEAD"
    status, headers, body = await _get(rel, b"/v1/release/" + ARM.encode(), method=b"HEAD")
    assert status == 200 and body == b"" and headers[b"content-length"] == str((d / ARM).stat().st_size).encode()
    assert rel.slots.value == releases.MAX_DOWNLOADS  # a HEAD's slot given back too


@pytest.mark.trio
async def test_serving_off_or_nothing_held_is_a_404_that_says_why(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    status, _, body = await _get(Releases(directory=d, running=None, serve=False), b"/v1/release/SHA256SUMS")
    assert status == 404 and b"[release] serve = false" in body
    status, _, body = await _get(Releases(directory=None, running=None), b"/v1/release/" + AMD.encode())
    assert status == 404 and b"not a release build" in body


@pytest.mark.trio
async def test_downloads_at_once_are_bounded(tmp_path: Path) -> None:
    rel = Releases(directory=_release_dir(tmp_path / "rel"), running=None)
    for _ in range(releases.MAX_DOWNLOADS):
        rel.slots.acquire_nowait()  # as many downloads in flight as allowed
    status, _, body = await _get(rel, b"/v1/release/" + AMD.encode())
    assert status == 503 and b"try again" in body
    status, _, _ = await _get(rel, b"/v1/release/SHA256SUMS")  # the list is not a download
    assert status == 200
    rel.slots.release()
    status, _, _ = await _get(rel, b"/v1/release/" + AMD.encode())
    assert status == 200 and rel.slots.value == 1  # its slot given back


@pytest.mark.trio
async def test_a_range_is_ignored_and_a_long_name_cut_short_in_the_refusal(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    rel = Releases(directory=d, running=None)
    for range_header in (b"bytes=" + b"9" * 5000 + b"-", b"bytes=5-", b"bytes=\xb2-"):
        status, headers, body = await _get(
            rel, b"/v1/release/" + ARM.encode(), extra=b"range: " + range_header + b"\r\n"
        )
        assert status == 200 and body == (d / ARM).read_bytes() and b"content-range" not in headers
    long_name = b"llmgw-" + b"9" * 10000 + b"-linux-arm64.pyz"  # a release name by its form, not held
    status, _, body = await _get(rel, b"/v1/release/" + long_name)
    assert status == 404 and b"(10022 characters)" in body and len(body) < 400
