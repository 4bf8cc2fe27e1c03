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
from agent.install.errors import NoSourceForNode
from agent.install.installer import ArchiveSource, BuildSource
from agent.install.toolchain import BuildTools
from agent.main import run_agent
from llmgw.config import AgentConfig, EngineArchive, EngineSource, EnginesSection
from llmgw.errors import LlmgwError
from llmgw.pki.files import issue_to_dir, node_paths
from llmgw.wire import agent_link as w
from testlib.controlplane import make_state, serve_plane
from testlib.proc import build_root
from testlib.waiting import await_true

HELP = build_root() / "tests" / "fixtures" / "help" / "llama-server.txt"


def fake_engine(version: str, *, works: bool) -> bytes:
    """A llama-server that prints its version and, for `--help`, llama.cpp's recorded help (which
    the agent checks against llmgw's flags before it offers a llama.cpp archive)."""
    script = (
        f'#!/bin/sh\ncase "$1" in --help) cat "$(dirname "$0")/help.txt";; *) echo \'version: {version}\';; esac\n'
        if works
        else "#!/bin/sh\necho 'illegal instruction (needs AVX2)' >&2\nexit 132\n"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data, mode in (
            ("build/bin/llama-server", script.encode(), 0o755),
            ("build/bin/help.txt", HELP.read_bytes(), 0o644),
        ):
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
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
    await await_true(installed, "the install's outcome reported", changed=plane.changes.nodes.next)
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


RELEASED = w.EngineArchive(
    arch="x86_64",
    backend="cpu",
    url="",
    sha256="e" * 64,
    binary="llama.cpp-b11434-linux-amd64/llama-server",
    size=99,
    release="llama.cpp-b11434-linux-amd64.tar.gz",
)
SOURCE = w.EngineBuild(url="https://x/src.tgz", sha256="b" * 64)
ALL_TOOLS = BuildTools(nvcc="/usr/local/cuda/bin/nvcc")
BASE = "https://10.0.0.1:7443"


def test_the_releases_archive_is_fetched_from_the_control_plane_and_help_checked() -> None:
    want = w.EngineWant(name="llamacpp", version="b11434", archives=(RELEASED,), build=SOURCE)
    plan = wanted_from(want, AgentConfig(server="wss://x:1"), "x86_64", False, tools=ALL_TOOLS, release_base=BASE)
    assert isinstance(plan.source, ArchiveSource)
    assert plan.source.url == f"{BASE}/v1/release/llama.cpp-b11434-linux-amd64.tar.gz"
    assert (plan.source.sha256, plan.source.binary, plan.source.size) == (RELEASED.sha256, RELEASED.binary, 99)
    assert plan.flags_of == "llamacpp" and plan.check_args == ("--version",)
    # Another architecture: nothing prebuilt, so the build, as before.
    other = wanted_from(want, AgentConfig(server="wss://x:1"), "aarch64", False, tools=ALL_TOOLS, release_base=BASE)
    assert isinstance(other.source, BuildSource)


def test_a_gpu_node_builds_for_cuda_where_it_can_and_else_runs_the_releases_cpu_build() -> None:
    want = w.EngineWant(name="llamacpp", version="b11434", archives=(RELEASED,), build=SOURCE)
    config = AgentConfig(server="wss://x:1")
    cuda = wanted_from(want, config, "x86_64", True, tools=ALL_TOOLS, release_base=BASE).source
    assert isinstance(cuda, BuildSource) and cuda.gpu
    no_cmake = BuildTools(missing=("cmake",), nvcc="/usr/local/cuda/bin/nvcc")
    cpu = wanted_from(want, config, "x86_64", True, tools=no_cmake, release_base=BASE).source
    assert isinstance(cpu, ArchiveSource) and cpu.url.endswith(RELEASED.release)
    no_nvcc = wanted_from(want, config, "x86_64", True, tools=BuildTools(), release_base=BASE).source
    assert isinstance(no_nvcc, ArchiveSource)  # no CUDA build to make: the release's CPU build
    # A configured archive that fits wins over both; without any source the node has none.
    named = w.EngineArchive(arch="x86_64", backend="cpu", url="https://x/cpu.tgz", sha256="a" * 64, binary="b")
    mine = attrs.evolve(want, archives=(named, RELEASED))
    assert wanted_from(mine, config, "x86_64", True, tools=ALL_TOOLS).source.url == "https://x/cpu.tgz"
    with pytest.raises(NoSourceForNode) as info:
        wanted_from(attrs.evolve(want, build=None), config, "aarch64", False)
    assert "offers llamacpp b11434 for x86_64/cpu, not for this node (aarch64)" in str(info.value)


VULKAN_RELEASED = attrs.evolve(
    RELEASED,
    backend="vulkan",
    sha256="f" * 64,
    binary="llama.cpp-b11434-linux-amd64-vulkan/llama-server",
    release="llama.cpp-b11434-linux-amd64-vulkan.tar.gz",
)


def test_the_vulkan_backend_takes_the_releases_vulkan_build_installed_beside_the_cpu_one() -> None:
    want = w.EngineWant(name="llamacpp", version="b11434", archives=(RELEASED, VULKAN_RELEASED), build=SOURCE)
    config = AgentConfig(server="wss://x:1")
    plan = wanted_from(want, config, "x86_64", False, release_base=BASE, backend="vulkan")
    assert isinstance(plan.source, ArchiveSource)
    assert plan.source.url == f"{BASE}/v1/release/llama.cpp-b11434-linux-amd64-vulkan.tar.gz"
    assert (plan.source.sha256, plan.source.binary) == (VULKAN_RELEASED.sha256, VULKAN_RELEASED.binary)
    assert (plan.flavor, plan.slot, plan.flags_of) == ("vulkan", "b11434-vulkan", "llamacpp")
    cpu = wanted_from(want, config, "x86_64", False, release_base=BASE)
    assert cpu.source.url.endswith(RELEASED.release) and (cpu.flavor, cpu.slot) == ("", "b11434")
    # A release without a Vulkan build: its CPU build rather than nothing.
    only_cpu = wanted_from(attrs.evolve(want, archives=(RELEASED,)), config, "x86_64", False, backend="vulkan")
    assert only_cpu.source.sha256 == RELEASED.sha256 and only_cpu.flavor == ""


def test_agent_toml_names_the_llama_backend_or_leaves_it_to_the_node() -> None:
    assert AgentConfig(server="wss://x:1").llamacpp_backend == "auto"
    from llmgw.config.checks import check_agent

    assert check_agent(AgentConfig(server="wss://x:1", llamacpp_backend="vulkan")) == []
    assert check_agent(AgentConfig(server="wss://x:1", llamacpp_backend="rocm")) == [
        "expected one of auto, cpu, vulkan, got 'rocm' @ $.llamacpp_backend"
    ]


@pytest.mark.trio
async def test_a_release_archive_damaged_on_the_control_plane_is_refused_before_it_is_unpacked(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The digest comes from the release's SHA256SUMS, through the control plane: an archive changed
    on its disk after the release was made is fetched, refused by the node's sha256 check, and
    nothing of it is unpacked or offered."""
    from llmgw.config import ReleaseSection
    from llmgw.releasefiles import ARCHES
    from testlib.llamarelease import release_dir

    stand_in = tmp_path / "llama-server"
    stand_in.write_text("#!/bin/sh\necho 'version: b11434'\n")
    stand_in.chmod(0o755)
    release = release_dir(tmp_path / "release", (ARCHES[platform.machine()],), server=str(stand_in))
    [archive] = release.glob("llama.cpp-*.tar.gz")
    archive.write_bytes(archive.read_bytes() + b"tampered")
    state = tmp_path / "cp"
    ca = make_state(state, sans=["127.0.0.1"], days=3)
    plane, bound = await serve_plane(
        state, nursery, engines=EnginesSection(), release=ReleaseSection(dir=str(release)), heartbeat_interval_s=0.2
    )
    node_dir = tmp_path / "node"
    issue_to_dir(ca, "node-a", node_paths(node_dir).dir, validity_days=3)
    await nursery.start(
        run_agent,
        AgentConfig(server=f"wss://127.0.0.1:{bound.agent_address[1]}", node_id="node-a", state_dir=str(node_dir)),
    )

    def llama():
        node = plane.registry.nodes.get("node-a")
        status = next((e for e in node.engines if e.name == "llamacpp"), None) if node else None
        return status if status is not None and status.state != w.ENGINE_INSTALLING else None

    await await_true(llama, "the release archive refused", changed=plane.changes.nodes.next)
    status = llama()
    assert not status.ok and status.state == w.ENGINE_FAILED
    assert f"/v1/release/{archive.name} has sha256 " in status.detail
    assert "but the control plane's release (its SHA256SUMS) says" in status.detail
    assert not (node_dir / "engines" / "llamacpp" / "current").exists()
    assert list((node_dir / "engines" / ".downloads").iterdir()) == []  # nor kept for a later try
