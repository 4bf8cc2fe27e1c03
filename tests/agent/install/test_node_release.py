"""llama.cpp from the release `llmgw node add --release` installed on this node (STATE/release):
read by its SHA256SUMS, chosen ahead of the control plane's release archive and of a build where
the control plane wants that version, and installed from where it is once its sha256 is the
listed one; a damaged file is refused before anything of it is unpacked."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
import trio

from agent.engines import wanted_from
from agent.install import noderelease
from agent.install.errors import DownloadError
from agent.install.installer import ArchiveSource, BuildSource, EngineStore, Wanted
from agent.install.toolchain import BuildTools
from llmgw.config import AgentConfig
from llmgw.wire import agent_link as w
from testlib.proc import build_root

HELP = build_root() / "tests" / "fixtures" / "help" / "llama-server.txt"
AMD = "llama.cpp-b11434-linux-amd64.tar.gz"
ARM = "llama.cpp-b11434-linux-arm64.tar.gz"
CONFIG = AgentConfig(server="wss://x:1")
BASE = "https://10.0.0.1:7443"
RELEASED = w.EngineArchive(
    arch="x86_64",
    backend="cpu",
    url="",
    sha256="e" * 64,
    binary="llama.cpp-b11434-linux-amd64/llama-server",
    release=AMD,
)
SOURCE = w.EngineBuild(url="https://x/src.tgz", sha256="b" * 64)
ALL_TOOLS = BuildTools(nvcc="/usr/local/cuda/bin/nvcc")


def llama_archive(stem: str) -> bytes:
    """A release-shaped llama.cpp archive: `stem/llama-server`, printing its version and, for
    --help, llama.cpp's recorded help (checked against llmgw's flags before it is offered)."""
    script = '#!/bin/sh\ncase "$1" in --help) cat "$(dirname "$0")/help.txt";; *) echo \'version: 11434\';; esac\n'
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data, mode in (
            (f"{stem}/llama-server", script.encode(), 0o755),
            (f"{stem}/help.txt", HELP.read_bytes(), 0o644),
        ):
            info = tarfile.TarInfo(name)
            info.mode, info.size = mode, len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def placed(state: Path, files: dict[str, bytes], listed: dict[str, bytes] | None = None) -> Path:
    """STATE/release as node add leaves it: `files`, and a SHA256SUMS of `listed` (default: them)."""
    directory = state / "release"
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    lines = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in (listed or files).items())
    (directory / "SHA256SUMS").write_text(lines)
    return directory


def test_the_release_there_is_read_by_its_list_and_only_llama_archives_beside_it(tmp_path: Path) -> None:
    amd = llama_archive("llama.cpp-b11434-linux-amd64")
    placed(tmp_path, {AMD: amd, "notes.txt": b"x"}, {AMD: amd, ARM: b"not here", "notes.txt": b"x"})
    here = noderelease.read(tmp_path)
    [archive] = here.archives  # the arm64 one is listed, not there; notes.txt is no release name
    assert (archive.name, archive.version, archive.arch) == (AMD, "b11434", "x86_64")
    assert (archive.sha256, archive.size) == (hashlib.sha256(amd).hexdigest(), len(amd))
    assert archive.binary == "llama.cpp-b11434-linux-amd64/llama-server"
    assert here.archive("b11434", "x86_64") == archive
    assert here.archive("b11434", "aarch64") is None and here.archive("b1", "x86_64") is None
    assert here.path(archive) == tmp_path / "release" / AMD


def test_a_vulkan_build_beside_is_read_with_its_backend_and_the_cpu_build_stays_the_nodes(tmp_path: Path) -> None:
    amd, vk = llama_archive("llama.cpp-b11434-linux-amd64"), llama_archive("llama.cpp-b11434-linux-amd64-vulkan")
    vk_name = "llama.cpp-b11434-linux-amd64-vulkan.tar.gz"
    placed(tmp_path, {AMD: amd, vk_name: vk})
    here = noderelease.read(tmp_path)
    assert sorted((a.name, a.backend) for a in here.archives) == [(vk_name, "vulkan"), (AMD, "cpu")]
    assert here.archive("b11434", "x86_64").name == AMD
    # A node that takes the Vulkan build takes the control plane's, not the CPU build placed here.
    released_vk = w.EngineArchive(arch="x86_64", backend="vulkan", url="", sha256="f" * 64, binary="b", release=vk_name)
    want = w.EngineWant(name="llamacpp", version="b11434", archives=(RELEASED, released_vk), build=SOURCE)
    plan = wanted_from(want, CONFIG, "x86_64", False, release_base=BASE, node_release=here, backend="vulkan")
    assert plan.source.url == f"{BASE}/v1/release/{vk_name}" and plan.flavor == "vulkan"
    cpu = wanted_from(want, CONFIG, "x86_64", False, release_base=BASE, node_release=here)
    assert cpu.source.local and cpu.source.url == str(tmp_path / "release" / AMD)


def test_no_release_or_a_bad_list_gives_nothing(tmp_path: Path) -> None:
    assert noderelease.read(tmp_path).archives == ()
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "SHA256SUMS").write_text("this is not a list\n")
    assert noderelease.read(tmp_path).archives == ()


def test_the_release_node_add_installed_comes_before_the_control_planes_and_a_build(tmp_path: Path) -> None:
    amd = llama_archive("llama.cpp-b11434-linux-amd64")
    placed(tmp_path, {AMD: amd})
    here = noderelease.read(tmp_path)
    want = w.EngineWant(name="llamacpp", version="b11434", archives=(RELEASED,), build=SOURCE)
    plan = wanted_from(want, CONFIG, "x86_64", False, tools=ALL_TOOLS, release_base=BASE, node_release=here)
    source = plan.source
    assert isinstance(source, ArchiveSource) and source.local
    assert (source.url, source.sha256) == (str(tmp_path / "release" / AMD), hashlib.sha256(amd).hexdigest())
    assert source.sha256_from == "the release node add installed (its SHA256SUMS)"
    assert plan.flags_of == "llamacpp" and not source.mirrored
    # Without the control plane's release: the same, where the build was the plan before.
    alone = wanted_from(
        w.EngineWant(name="llamacpp", version="b11434", build=SOURCE), CONFIG, "x86_64", False, node_release=here
    )
    assert isinstance(alone.source, ArchiveSource) and alone.source.local
    # Another version wanted, or another architecture: what the control plane offers, as before.
    other = w.EngineWant(name="llamacpp", version="b12000", build=SOURCE)
    assert isinstance(wanted_from(other, CONFIG, "x86_64", False, node_release=here).source, BuildSource)
    arm = wanted_from(want, CONFIG, "aarch64", False, tools=ALL_TOOLS, node_release=here)
    assert isinstance(arm.source, BuildSource)
    # An archive server.toml names for the node still wins, and a GPU node that can build for CUDA does.
    named = w.EngineArchive(arch="x86_64", backend="cpu", url="https://x/cpu.tgz", sha256="a" * 64, binary="b")
    mine = w.EngineWant(name="llamacpp", version="b11434", archives=(named,), build=SOURCE)
    assert wanted_from(mine, CONFIG, "x86_64", False, node_release=here).source.url == "https://x/cpu.tgz"
    cuda = wanted_from(want, CONFIG, "x86_64", True, tools=ALL_TOOLS, node_release=here).source
    assert isinstance(cuda, BuildSource) and cuda.gpu
    no_cmake = BuildTools(missing=("cmake",), nvcc="/usr/local/cuda/bin/nvcc")
    cpu = wanted_from(w.EngineWant(name="llamacpp", version="b11434", build=SOURCE), CONFIG, "x86_64", True,
                      tools=no_cmake, node_release=here).source  # fmt: skip
    assert isinstance(cpu, ArchiveSource) and cpu.local  # no CUDA build to make: the release's CPU build


def _local(path: Path, data: bytes) -> ArchiveSource:
    return ArchiveSource(
        url=str(path),
        local=True,
        sha256=hashlib.sha256(data).hexdigest(),
        binary="llama.cpp-b11434-linux-amd64/llama-server",
        sha256_from=noderelease.SHA256_FROM,
    )


def test_it_is_installed_from_where_it_is_and_checked(tmp_path: Path) -> None:
    amd = llama_archive("llama.cpp-b11434-linux-amd64")
    directory = placed(tmp_path / "state", {AMD: amd})
    store = EngineStore(tmp_path / "state" / "engines")
    phases: list[str] = []
    wanted = Wanted(name="llamacpp", version="b11434", source=_local(directory / AMD, amd), flags_of="llamacpp")
    installed = trio.run(lambda: store.ensure(wanted, on_progress=lambda phase, _: phases.append(phase)))
    assert installed.executable == str(
        tmp_path / "state/engines/llamacpp/b11434/llama.cpp-b11434-linux-amd64/llama-server"
    )
    assert os.readlink(tmp_path / "state/engines/llamacpp/current") == "b11434"
    assert "fetch" not in phases and "build" not in phases and phases[:1] == ["unpack"]
    assert not (tmp_path / "state/engines/.downloads").exists()  # nothing fetched, nor copied
    assert (directory / AMD).read_bytes() == amd  # left where it is, for a reinstall


def test_a_file_changed_on_the_node_is_refused_before_anything_is_unpacked(tmp_path: Path) -> None:
    amd = llama_archive("llama.cpp-b11434-linux-amd64")
    directory = placed(tmp_path / "state", {AMD: amd})
    (directory / AMD).write_bytes(amd + b"tampered")
    store = EngineStore(tmp_path / "state" / "engines")
    wanted = Wanted(name="llamacpp", version="b11434", source=_local(directory / AMD, amd))
    with pytest.raises(DownloadError) as info:
        trio.run(store.ensure, wanted)
    text = str(info.value)
    assert f"{directory / AMD} has sha256 " in text
    assert f"but the release node add installed (its SHA256SUMS) says {hashlib.sha256(amd).hexdigest()}" in text
    assert not (tmp_path / "state/engines/llamacpp").exists()


def test_another_flavor_of_the_version_in_use_is_installed_beside_it_and_switched_to(tmp_path: Path) -> None:
    """A node whose choice moves from the CPU build to the Vulkan build of one version installs anew
    (a directory of its own), not taking the version in use for it; and back the same way."""
    amd = llama_archive("llama.cpp-b11434-linux-amd64")
    directory = placed(tmp_path / "state", {AMD: amd})
    store = EngineStore(tmp_path / "state" / "engines")
    cpu = Wanted(name="llamacpp", version="b11434", source=_local(directory / AMD, amd))
    vulkan = Wanted(name="llamacpp", version="b11434", source=_local(directory / AMD, amd), flavor="vulkan")
    current = tmp_path / "state/engines/llamacpp/current"
    assert trio.run(store.ensure, cpu).flavor == ""
    installed = trio.run(store.ensure, vulkan)
    assert (installed.version, installed.flavor, os.readlink(current)) == ("b11434", "vulkan", "b11434-vulkan")
    assert installed.executable.startswith(str(tmp_path / "state/engines/llamacpp/b11434-vulkan/"))
    assert store.current("llamacpp").flavor == "vulkan"
    assert trio.run(store.ensure, vulkan).executable == installed.executable  # in use: nothing again
    trio.run(store.ensure, cpu)
    assert os.readlink(current) == "b11434" and store.current("llamacpp").flavor == ""
