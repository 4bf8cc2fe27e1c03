"""Engines end to end in one process: the control plane names a llama.cpp version whose archive
it mirrors; a real agent link installs it from the mirror, checks it runs, and the control
plane sees it offered. A version whose binary does not run is reported with its own words."""

from __future__ import annotations

import hashlib
import io
import platform
import tarfile
from pathlib import Path

import attrs
import pytest
import trio

from agent.engines import wanted_from
from agent.install.installer import ArchiveSource, BuildSource
from agent.main import run_agent
from llmgw.config import AgentConfig, EngineArchive, EngineSource, EnginesSection
from llmgw.errors import LlmgwError
from llmgw.pki.files import issue_to_dir, node_paths
from llmgw.wire import agent_link as w
from testlib.controlplane import make_state, serve_plane
from testlib.waiting import wait_until


def fake_engine(version: str, *, works: bool) -> bytes:
    script = (
        f"#!/bin/sh\necho 'version: {version}'\n"
        if works
        else "#!/bin/sh\necho 'illegal instruction (needs AVX2)' >&2\nexit 132\n"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("build/bin/llama-server")
        info.mode = 0o755
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script.encode()))
    return buf.getvalue()


@pytest.mark.trio
@pytest.mark.parametrize("works", [True, False])
async def test_an_engine_is_installed_from_the_mirror_checked_and_offered(
    tmp_path: Path, nursery: trio.Nursery, works: bool
) -> None:
    state = tmp_path / "cp"
    ca = make_state(state, sans=["127.0.0.1"], days=3)
    archive = fake_engine("b4242", works=works)
    digest = hashlib.sha256(archive).hexdigest()
    (state / "artifacts").mkdir()
    (state / "artifacts" / "llama-b4242.tgz").write_bytes(archive)
    engines = EnginesSection(
        llamacpp=EngineSource(
            version="b4242",
            archives=(
                EngineArchive(
                    arch=platform.machine(),
                    url="https://unreachable.invalid/llama-b4242.tgz",  # only the mirror can serve it
                    sha256=digest,
                    binary="build/bin/llama-server",
                ),
            ),
        )
    )
    plane, bound = await serve_plane(state, nursery, engines=engines, heartbeat_interval_s=0.2)
    node_dir = tmp_path / "node"
    files = node_paths(node_dir)
    issue_to_dir(ca, "node-a", files.dir, validity_days=3)
    agent_config = AgentConfig(
        server=f"wss://127.0.0.1:{bound.agent_address[1]}", node_id="node-a", state_dir=str(node_dir)
    )
    await nursery.start(run_agent, agent_config)

    def llama():
        node = plane.registry.nodes.get("node-a")
        return next((e for e in node.engines if e.name == "llamacpp"), None) if node else None

    # Its install's progress comes first ("installing", phase fetch...), then the outcome.
    installed = lambda: llama() is not None and llama().state != w.ENGINE_INSTALLING  # noqa: E731
    await wait_until(installed, "the install's outcome reported", changed=plane.changes.nodes.next)
    status = llama()
    if works:
        assert status.ok and status.version == "b4242"
        assert (node_dir / "engines/llamacpp/current").resolve().name == "b4242"
    else:
        assert not status.ok
        assert "illegal instruction (needs AVX2)" in status.detail  # the engine's own message
        assert not (node_dir / "engines/llamacpp/current").exists()  # never offered, never current
    view = plane.views.node_view("node-a")
    assert {e["name"]: e["ok"] for e in view["engines"]}["llamacpp"] is works


def test_an_operator_install_and_a_missing_archive() -> None:
    config = AgentConfig(server="wss://x:1", llamacpp_bin="/opt/llama/llama-server")
    plan = wanted_from(w.EngineWant(name="llamacpp", version=""), config, "x86_64", False)
    assert plan.binary == "/opt/llama/llama-server" and plan.source is None
    want = w.EngineWant(
        name="llamacpp",
        version="b1",
        archives=(w.EngineArchive(arch="aarch64", backend="cpu", url="https://x", sha256="a" * 64, binary="b"),),
    )
    # The node's own llama-server wins over what server.toml pins for every node.
    assert wanted_from(want, config, "x86_64", False).binary == "/opt/llama/llama-server"
    with pytest.raises(LlmgwError) as info:
        wanted_from(want, AgentConfig(server="wss://x:1"), "x86_64", False)
    assert "offers llamacpp b1 for aarch64/cpu, not for this node (x86_64)" in str(info.value)


def test_with_no_archive_for_the_node_the_build_source_is_the_plan_with_the_nodes_own_jobs() -> None:
    build = w.EngineBuild(url="https://x/src.tgz", sha256="b" * 64, size=10, jobs=4, timeout_s=99.0, mirrored=True)
    arm = w.EngineArchive(arch="aarch64", backend="cpu", url="https://x", sha256="a" * 64, binary="b")
    want = w.EngineWant(name="llamacpp", version="b1", archives=(arm,), build=build, max_members=7)
    config = AgentConfig(server="wss://x:1", build_cache="/var/cache/llama")
    source = wanted_from(want, config, "x86_64", True).source
    assert isinstance(source, BuildSource)
    assert (source.url, source.sha256, source.size, source.jobs, source.timeout_s) == (
        build.url,
        build.sha256,
        10,
        4,
        99.0,
    )
    assert source.gpu and source.cache_dir == "/var/cache/llama" and source.max_members == 7
    assert wanted_from(want, attrs.evolve(config, build_jobs=1), "x86_64", False).source.jobs == 1
    # An archive that fits the node wins over building.
    assert isinstance(wanted_from(want, config, "aarch64", False).source, ArchiveSource)


def test_an_archive_plan_carries_the_unpack_caps() -> None:
    config = AgentConfig(server="wss://x:1")
    want = w.EngineWant(
        name="llamacpp",
        version="b1",
        archives=(w.EngineArchive(arch="x86_64", backend="cpu", url="https://x", sha256="a" * 64, binary="b"),),
        max_unpacked_bytes=123,
        max_members=45,
    )
    source = wanted_from(want, config, "x86_64", False).source
    assert (source.max_unpacked_bytes, source.max_members) == (123, 45)
