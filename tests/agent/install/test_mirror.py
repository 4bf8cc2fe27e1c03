"""The control plane as mirror: an archive in its artifacts directory reaches agents over the
mTLS agent port, with resume, and only for nodes whose certificate is good."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent.install.errors import DownloadError
from llmgw.config import EngineBuild, EnginesSection, LlamacppSource, ServerConfig, ServerSection
from llmgw.download import archive_cap, fetch
from llmgw.engines.wants import engines_for
from llmgw.pki.ca import cert_info
from llmgw.pki.files import issue_to_dir, load_cert
from llmgw.pki.tls import client_ssl_context
from llmgw.server.app import ControlPlane
from llmgw.server.nodes.mirror import fill_mirror
from llmgw.wire import agent_link as w
from testlib.controlplane import make_state, serve_plane
from testlib.fileserver import serve_files
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

GPU = w.Gpu(
    index=0,
    name="NVIDIA L4",
    uuid="u",
    memory_total_mib=1,
    memory_free_mib=1,
    driver_version="550.54.15",
    compute_capability="8.9",
    pci_bus_id="0",
)


@pytest.fixture
async def mirror(tmp_path: Path, nursery: trio.Nursery):
    state = tmp_path / "cp"
    ca = make_state(state, sans=["127.0.0.1"], days=3)
    plane, bound = await serve_plane(state, nursery)  # llama.cpp the operator's: no source to mirror but the test's
    node = issue_to_dir(ca, "node-a", tmp_path / "node", validity_days=3)
    ctx = client_ssl_context(node.ca_cert, node.cert, node.key)
    base = f"https://127.0.0.1:{bound.agent_address[1]}/v1/artifacts"
    return plane, state, ctx, base, node


async def test_an_archive_dropped_in_by_the_operator_is_served_and_resumed(mirror, tmp_path: Path) -> None:
    plane, state, ctx, base, _ = mirror
    data = os.urandom(2 << 20)
    digest = hashlib.sha256(data).hexdigest()
    (state / "artifacts").mkdir()
    (state / "artifacts" / "llama-b4000-bin-ubuntu-x64.tar.gz").write_bytes(data)  # any name will do
    dest = tmp_path / "got"
    (tmp_path / "got.part").write_bytes(data[:12345])
    await fetch(f"{base}/{digest}", dest, sha256=digest, ssl_context=ctx, cap=archive_cap(0, 0))
    assert dest.read_bytes() == data
    assert digest in plane.agent_port.artifacts.available()


async def test_unknown_artifacts_are_404(mirror, tmp_path: Path) -> None:
    _, _, ctx, base, _ = mirror
    with pytest.raises(DownloadError) as info:
        await fetch(f"{base}/{'0' * 64}", tmp_path / "x", sha256="0" * 64, ssl_context=ctx, cap=archive_cap(0, 0))
    assert "HTTP 404" in str(info.value)


async def test_a_revoked_node_gets_nothing(mirror, tmp_path: Path) -> None:
    plane, state, ctx, base, node = mirror
    data = b"engine"
    digest = hashlib.sha256(data).hexdigest()
    (state / "artifacts").mkdir()
    (state / "artifacts" / digest).write_bytes(data)
    await plane.store.revoke_serial(cert_info(load_cert(node.cert)).serial, "node-a")
    with pytest.raises(DownloadError):
        await fetch(f"{base}/{digest}", tmp_path / "x", sha256=digest, ssl_context=ctx, cap=archive_cap(0, 0))
    assert not (tmp_path / "x").exists()


async def test_the_control_plane_fetches_configured_archives_once(tmp_path: Path, nursery: trio.Nursery) -> None:
    from llmgw.config import EngineArchive, EngineSource, EnginesSection

    data = os.urandom(100_000)
    digest = hashlib.sha256(data).hexdigest()
    files, origin = await serve_files(nursery)
    files.content["/llama.tgz"] = data
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    engines = EnginesSection(
        llamacpp=EngineSource(
            version="b1",
            archives=(EngineArchive(arch="x86_64", url=f"{origin}/llama.tgz", sha256=digest, binary="bin/x"),),
        )
    )
    config = ServerConfig(server=ServerSection(state_dir=str(state)), engines=engines)
    plane = ControlPlane.open(config, state)
    with trio.fail_after(10):
        await fill_mirror(lambda: plane.config, plane.agent_port.artifacts, plane.push_all)
        await fill_mirror(lambda: plane.config, plane.agent_port.artifacts, plane.push_all)  # there: no second download
    assert (state / "artifacts" / digest).read_bytes() == data
    assert files.gets == ["/llama.tgz"]
    assert digest in plane.agent_port.artifacts.available()


async def test_llamacpps_source_to_build_from_is_mirrored_once_and_the_want_says_so(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    data = os.urandom(50_000)
    digest = hashlib.sha256(data).hexdigest()
    files, origin = await serve_files(nursery)
    files.content["/llama-src.tar.gz"] = data
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    source = EngineBuild(url=f"{origin}/llama-src.tar.gz", sha256=digest, size=len(data))
    engines = EnginesSection(llamacpp=LlamacppSource(build=source))
    plane = ControlPlane.open(ServerConfig(server=ServerSection(state_dir=str(state)), engines=engines), state)
    [before] = engines_for(engines, None, plane.agent_port.artifacts.available())
    assert before.build is not None and not before.build.mirrored
    with trio.fail_after(10):
        await fill_mirror(lambda: plane.config, plane.agent_port.artifacts, plane.push_all)
        await fill_mirror(lambda: plane.config, plane.agent_port.artifacts, plane.push_all)  # there: no second download
    assert files.gets == ["/llama-src.tar.gz"]
    [after] = engines_for(engines, None, plane.agent_port.artifacts.available())
    assert after.build is not None and after.build.mirrored and after.build.sha256 == digest


async def test_llamacpp_off_or_the_operators_own_has_no_source_to_mirror(tmp_path: Path) -> None:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    for llamacpp in (LlamacppSource(enabled=False), LlamacppSource(version="")):
        config = ServerConfig(server=ServerSection(state_dir=str(state)), engines=EnginesSection(llamacpp=llamacpp))
        plane = ControlPlane.open(config, state)
        with trio.fail_after(5):  # nothing to fetch: returns at once, touching no network
            await fill_mirror(lambda config=config: config, plane.agent_port.artifacts, plane.push_all)
        assert not (state / "artifacts").exists()


async def test_the_source_is_fetched_once_a_node_is_known_not_before(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A control plane with no node yet downloads nothing for llama.cpp; the first node it knows
    starts the fetch (the node then builds from the mirror)."""

    data = os.urandom(20_000)
    files, origin = await serve_files(nursery)
    files.content["/src.tar.gz"] = data
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    source = EngineBuild(url=f"{origin}/src.tar.gz", sha256=hashlib.sha256(data).hexdigest())
    plane, _ = await serve_plane(state, nursery, engines=EnginesSection(llamacpp=LlamacppSource(build=source)))
    # The plane runs, its mirror fill too: with no node, the fill waits for one (it and the
    # reconciler are who wait on `changes.nodes`) and fetched nothing.
    await trio.testing.wait_all_tasks_blocked()
    assert plane.changes.nodes.next().statistics().tasks_waiting == 2
    assert files.gets == [] and source.sha256 not in plane.agent_port.artifacts.available()
    plane.registry.know("node-a", address="127.0.0.2", cordoned=False, draining=False)
    plane.changes.node_changed()
    with trio.fail_after(10):
        while source.sha256 not in plane.agent_port.artifacts.available():
            await trio.sleep(0.05)
    assert files.gets == ["/src.tar.gz"]


async def test_with_the_releases_llama_cpp_the_source_waits_for_a_node_that_needs_it(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A control plane whose release holds llama.cpp for x86_64 fetches no source for a CPU node of
    that architecture (an air-gapped site sees no failed download); a GPU node, which may build
    for CUDA, starts the fetch."""
    from llmgw.config import ReleaseSection
    from testlib.controlplane import hello
    from testlib.llamarelease import release_dir

    data = os.urandom(20_000)
    files, origin = await serve_files(nursery)
    files.content["/src.tar.gz"] = data
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    stand_in = tmp_path / "llama-server"
    stand_in.write_text("#!/bin/sh\n")
    release = release_dir(tmp_path / "release", ("amd64",), server=str(stand_in))
    source = EngineBuild(url=f"{origin}/src.tar.gz", sha256=hashlib.sha256(data).hexdigest())
    engines = EnginesSection(llamacpp=LlamacppSource(build=source, release=True))
    plane, _ = await serve_plane(state, nursery, engines=engines, release=ReleaseSection(dir=str(release)))
    cpu = plane.registry.know("node-cpu", address="127.0.0.2")
    cpu.inventory = hello("node-cpu").inventory  # x86_64, no GPU
    caplog.set_level("DEBUG", logger="llmgw.server")
    looks = lambda: [r for r in caplog.records if r.getMessage() == "mirror_source_not_needed"]  # noqa: E731
    before = len(looks())
    plane.operations.certificate_recorded()
    # The mirror's wait looks again at the change (and at the CPU node): it logs that no node needs
    # the source, or, wrongly, returns and the fill fetches it.
    await await_true(lambda: len(looks()) > before or files.gets, "the mirror's look at the CPU node")
    assert files.gets == [] and source.sha256 not in plane.agent_port.artifacts.available()
    gpu = plane.registry.know("node-gpu", address="127.0.0.3")
    gpu.inventory = attrs.evolve(cpu.inventory, gpus=(GPU,), gpu_status="present")
    plane.changes.node_changed()
    with trio.fail_after(10):
        while source.sha256 not in plane.agent_port.artifacts.available():
            await trio.sleep(0.05)
    assert files.gets == ["/src.tar.gz"]
