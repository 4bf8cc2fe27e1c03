"""How the release reaches a node without `--release` (nodeadd/release.py, ship.py), against an
in-process control plane on loopback serving a release directory: node add reads the plane's
SHA256SUMS over HTTPS pinned to the CA root, and the node's download script (ship.FETCH_PY, run
here by this machine's python3 as the node would run it) fetches the file, refusing a server
whose certificate is not from that CA and saying when the plane is unreachable."""

from __future__ import annotations

import hashlib
import ssl
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
import trio

from llmgw.config import ReleaseSection
from llmgw.errors import MachineError, UsageError
from llmgw.nodeadd import release, ship
from llmgw.nodeadd.release import AUTO, HTTPS, SSH, how_to_ship
from testlib.cluster import free_port
from testlib.controlplane import make_state, serve_plane

AMD = "llmgw-0.3.0-linux-amd64.pyz"
ARM = "llmgw-0.3.0-linux-arm64.pyz"


def _release_dir(root: Path) -> Path:
    root.mkdir()
    lines = []
    for name in (AMD, ARM):
        with zipfile.ZipFile(root / name, "w") as z:
            z.writestr("__main__.py", f"print({name!r})\n")
        lines.append(f"{hashlib.sha256((root / name).read_bytes()).hexdigest()}  {name}\n")
    (root / "SHA256SUMS").write_text("".join(lines))
    return root


def test_how_the_release_reaches_the_node() -> None:
    assert how_to_ship(release="", via=AUTO, plane_serves=True) == HTTPS
    assert how_to_ship(release="", via=AUTO, plane_serves=False) == SSH
    assert how_to_ship(release="", via=SSH, plane_serves=True) == SSH
    assert how_to_ship(release="/r", via=AUTO, plane_serves=True) == "given"
    assert how_to_ship(release="/r", via=SSH, plane_serves=True) == "given"
    with pytest.raises(UsageError, match="drop one of the two"):
        how_to_ship(release="/r", via=HTTPS, plane_serves=True)
    with pytest.raises(UsageError, match=r"\[release\] serve = false"):
        how_to_ship(release="", via=HTTPS, plane_serves=False)
    # A URL is downloaded by the node itself: not what a node that must be reached over SSH can do.
    with pytest.raises(UsageError, match=r"--release DIR --release-via ssh"):
        how_to_ship(release="https://example.net/llmgw/0.1.0/", via=SSH, plane_serves=True)


def test_over_ssh_the_release_directory_gives_the_nodes_architecture(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    assert release.local_release(str(d), "arm64").path == d / ARM
    assert release.local_release(str(d), "amd64").path == d / AMD


def test_over_ssh_a_development_build_without_a_release_dir_says_what_to_set() -> None:
    with pytest.raises(UsageError, match=r"not a release build.*\[release\] dir"):
        release.local_release("", "amd64")


async def _fetch(url: str, cafile: Path, dest: Path) -> tuple[int, str]:
    done = await trio.run_process(
        [sys.executable, "-I", "-c", ship.FETCH_PY, url, str(cafile), str(dest), str(ship.MAX_RELEASE_BYTES)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return done.returncode, done.stderr.decode()


@pytest.mark.trio
async def test_the_node_fetches_the_file_of_its_architecture_from_the_plane(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    ca = make_state(tmp_path / "cp")
    cafile = tmp_path / "ca.crt"
    cafile.write_bytes(ca.cert_pem())
    async with trio.open_nursery() as nursery:
        _, bound = await serve_plane(tmp_path / "cp", nursery, release=ReleaseSection(dir=str(d)))
        host, port = bound.agent_address
        for arch, name in (("arm64", ARM), ("amd64", AMD)):
            art, why = await trio.to_thread.run_sync(release.from_plane, host, port, ca.cert_pem(), arch)
            assert art is not None and why == "" and art.name == name and art.from_plane
            assert art.url == f"https://{host}:{port}/v1/release/{name}"
            assert art.sha256 == hashlib.sha256((d / name).read_bytes()).hexdigest()
            dest = tmp_path / f"got-{arch}"
            code, err = await _fetch(art.url, cafile, dest)
            assert code == 0, err
            assert dest.read_bytes() == (d / name).read_bytes()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_plane_whose_certificate_is_not_from_the_pinned_ca_is_refused(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    make_state(tmp_path / "cp")
    other = make_state(tmp_path / "other")  # the CA pinned: not the plane's
    cafile = tmp_path / "other.crt"
    cafile.write_bytes(other.cert_pem())
    async with trio.open_nursery() as nursery:
        _, bound = await serve_plane(tmp_path / "cp", nursery, release=ReleaseSection(dir=str(d)))
        host, port = bound.agent_address
        with pytest.raises(MachineError, match="is not this control plane: its certificate is not from the cluster"):
            await trio.to_thread.run_sync(release.from_plane, host, port, other.cert_pem(), "amd64")
        dest = tmp_path / "got"
        code, err = await _fetch(f"https://{host}:{port}/v1/release/{AMD}", cafile, dest)
        assert code == ship.FETCH_NOT_OURS and "certificate" in err, err
        assert not dest.exists()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_an_unreachable_plane_is_said_as_such(tmp_path: Path) -> None:
    ca = make_state(tmp_path / "cp")
    cafile = tmp_path / "ca.crt"
    cafile.write_bytes(ca.cert_pem())
    port = free_port()  # nothing listens there
    code, err = await _fetch(f"https://127.0.0.1:{port}/v1/release/{AMD}", cafile, tmp_path / "got")
    assert code == ship.FETCH_UNREACHABLE and "refused" in err.lower(), err
    with pytest.raises(MachineError, match="--release-via ssh"):
        await trio.to_thread.run_sync(release.from_plane, "127.0.0.1", port, ca.cert_pem(), "amd64")


@pytest.mark.trio
async def test_without_a_certificate_only_the_release_files_are_served(tmp_path: Path) -> None:
    d = _release_dir(tmp_path / "rel")
    ca = make_state(tmp_path / "cp")
    async with trio.open_nursery() as nursery:
        _, bound = await serve_plane(tmp_path / "cp", nursery, release=ReleaseSection(dir=str(d)))
        host, port = bound.agent_address
        ctx = ssl.create_default_context(cadata=ca.cert_pem().decode())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))

        def status(path: str) -> tuple[int, str]:
            try:
                with opener.open(f"https://{host}:{port}{path}", timeout=10) as r:
                    return r.status, ""
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        assert await trio.to_thread.run_sync(status, "/v1/release/SHA256SUMS") == (200, "")
        code, said = await trio.to_thread.run_sync(status, "/v1/artifacts/" + "0" * 64)
        assert code == 403 and "requires a node certificate" in said
        code, said = await trio.to_thread.run_sync(status, "/v1/agent")
        assert code == 403 and "requires a node certificate" in said
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_with_serving_off_a_peer_without_a_certificate_is_refused_at_the_handshake(tmp_path: Path) -> None:
    ca = make_state(tmp_path / "cp")
    async with trio.open_nursery() as nursery:
        _, bound = await serve_plane(tmp_path / "cp", nursery, release=ReleaseSection(serve=False))
        host, port = bound.agent_address
        with pytest.raises(MachineError, match="cannot read the control plane's release list"):
            await trio.to_thread.run_sync(release.from_plane, host, port, ca.cert_pem(), "amd64")
        nursery.cancel_scope.cancel()
