"""Which engines the control plane wants on a node: a pure function of the config and the
node's inventory (spec: llama.cpp everywhere unless turned off, vLLM where an NVIDIA GPU can
run it, SGLang where a version is named, on nodes whose GPUs SGLang supports).

Whether a GPU engine can run is judged here, from the GPUs the inventory lists, by the engine's
own rule (`llmgw.engines.eligibility`): a node that cannot run it is not asked to install it,
and `gpu_verdicts` says why for the node's view.

llama.cpp's want carries its prebuilt archives for the node's architecture, then the control
plane's own release archive of its version for that architecture (`release`, where
[engines.llamacpp] release is on), and by default the source to build it from; the node picks
(`pick_archive` for configured archives, `release_archive`, agent.engines for the order). Each
says whether the control plane's mirror has it."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from llmgw.config import EngineSource, EnginesSection, pip_requirement
from llmgw.engines.eligibility import judge_inventory
from llmgw.wire import agent_link as w

GPU_ENGINES = ("vllm", "sglang")


@attrs.frozen(kw_only=True)
class ReleaseArchive:
    """A llama.cpp archive of the control plane's release (llmgw.server.nodes.releases)."""

    name: str  # its file name, as RELEASE_PREFIX + name serves it
    version: str  # llama.cpp's, e.g. "b11434"
    arch: str  # as `uname -m` prints it
    sha256: str
    binary: str  # llama-server's path inside it
    size: int = 0
    backend: str = "cpu"  # or "vulkan": the CPU build's files and llama.cpp's Vulkan backend


def release_for(source: EngineSource, release: Sequence[ReleaseArchive]) -> tuple[ReleaseArchive, ...]:
    """The release archives llama.cpp's `source` takes: its version's, where `release` is on."""
    if not getattr(source, "release", False) or not source.version:
        return ()
    return tuple(r for r in release if r.version == source.version)


def _want(
    name: str,
    source: EngineSource,
    inv: w.Inventory | None,
    mirrored: Collection[str],
    max_bytes: int,
    release: Sequence[ReleaseArchive] = (),
) -> w.EngineWant:
    arch = inv.arch if inv else None
    released = tuple(
        w.EngineArchive(
            arch=r.arch,
            backend=r.backend,
            url="",
            sha256=r.sha256,
            binary=r.binary,
            size=r.size,
            max_bytes=max_bytes,
            release=r.name,
        )
        for r in release_for(source, release)
        if arch is None or r.arch == arch
    )
    archives = tuple(
        w.EngineArchive(
            arch=a.arch,
            backend=a.backend,
            url=a.url,
            sha256=a.sha256,
            binary=a.binary,
            mirrored=a.sha256 in mirrored,
            size=a.size,
            max_bytes=max_bytes,
        )
        for a in source.archives
        if arch is None or a.arch == arch
    )
    build = getattr(source, "build", None)  # llama.cpp's only
    return w.EngineWant(
        name=name,
        version=source.version,
        archives=archives + released,
        pip=pip_requirement(name, source),
        index_url=source.index_url,
        extra_index_urls=source.extra_index_url,
        max_unpacked_bytes=source.max_unpacked_bytes,
        max_members=source.max_members,
        build=None
        if build is None or not source.version
        else w.EngineBuild(
            url=build.url,
            sha256=build.sha256,
            mirrored=build.sha256 in mirrored,
            size=build.size,
            max_bytes=max_bytes,
            jobs=build.jobs,
            timeout_s=build.timeout_s,
        ),
        measure_speed=getattr(source, "measure_speed", True),  # llama.cpp's only
    )


def gpu_engines(config: EnginesSection) -> tuple[str, ...]:
    """The GPU engines server.toml asks for (vLLM unless turned off; SGLang where named)."""
    return tuple(n for n in GPU_ENGINES if (src := getattr(config, n)) is not None and src.enabled)


def gpu_verdicts(config: EnginesSection, inv: w.Inventory | None) -> tuple[w.EngineEligibility, ...]:
    """Each GPU engine server.toml asks for, judged on this node by its own rule."""
    return tuple(judge_inventory(name, inv) for name in gpu_engines(config))


def engines_for(
    config: EnginesSection,
    inv: w.Inventory | None,
    mirrored: Collection[str] = (),
    *,
    max_archive_bytes: int = 0,
    release: Sequence[ReleaseArchive] = (),
) -> tuple[w.EngineWant, ...]:
    """`max_archive_bytes`: [downloads].max_archive_gib in bytes (0: the agent's default);
    `release`: the llama.cpp archives the control plane's release holds."""
    wants = []
    if config.llamacpp.enabled:
        wants.append(_want("llamacpp", config.llamacpp, inv, mirrored, max_archive_bytes, release))
    for verdict in gpu_verdicts(config, inv):
        if verdict.status == w.ELIGIBLE:
            source = getattr(config, verdict.engine)
            wants.append(_want(verdict.engine, source, inv, mirrored, max_archive_bytes))
    return tuple(wants)


def pick_archive(want: w.EngineWant, arch: str, has_gpu: bool) -> w.EngineArchive | None:
    """The configured archive for this node: CUDA where there is an NVIDIA GPU and a CUDA build,
    else CPU. The release's archives are not among them (`release_archive`)."""
    mine = [a for a in want.archives if a.arch == arch and not a.release]
    if has_gpu:
        cuda = [a for a in mine if a.backend == "cuda"]
        if cuda:
            return cuda[0]
    cpu = [a for a in mine if a.backend == "cpu"]
    return cpu[0] if cpu else None


def release_archive(want: w.EngineWant, arch: str, backend: str = "cpu") -> w.EngineArchive | None:
    """The control plane's release archive of the wanted version for this architecture and backend."""
    return next((a for a in want.archives if a.release and a.arch == arch and a.backend == backend), None)


def vulkan_device(inv: w.Inventory) -> w.VulkanDevice | None:
    """The node's first Vulkan device that is hardware (not a software rasterizer like Mesa's
    lavapipe), where the loader found it (vulkaninfo ran: the loader llama.cpp's Vulkan build needs is there)."""
    if inv.vulkan_status != w.VULKAN_PRESENT:
        return None
    return next((d for d in inv.vulkan if not d.software and d.type != w.VULKAN_CPU), None)


# llama.cpp's Vulkan backend uses the devices this names (the loader's numbers, vulkaninfo's GPU
# numbers); without it, every hardware device and never a software one.
VULKAN_DEVICES_ENV = "GGML_VK_VISIBLE_DEVICES"


def vulkan_devices_env(choice: str, inv: w.Inventory) -> dict[str, str]:
    """What the engines' environment needs for llama.cpp's Vulkan build to use this node's Vulkan
    devices: where agent.toml forces "vulkan" and the node has software devices alone (lavapipe),
    GGML_VK_VISIBLE_DEVICES naming them, as llama.cpp passes over them otherwise; else nothing."""
    if choice != "vulkan" or inv.vulkan_status != w.VULKAN_PRESENT or vulkan_device(inv) is not None:
        return {}
    software = [str(d.index) for d in inv.vulkan]
    return {VULKAN_DEVICES_ENV: ",".join(software)} if software else {}


def llama_backend(choice: str, inv: w.Inventory) -> str:
    """The llama.cpp build a node takes from the release: agent.toml's `llamacpp_backend` ("cpu",
    "vulkan"), or for "auto" Vulkan where the node has a hardware Vulkan device, else the CPU's."""
    if choice != "auto":
        return choice
    return "vulkan" if vulkan_device(inv) is not None else "cpu"


def may_build(config: EnginesSection, inv: w.Inventory, release: Sequence[ReleaseArchive]) -> bool:
    """Whether this node may build llama.cpp from [engines.llamacpp]'s source: no configured or
    release archive fits it, or it has an NVIDIA GPU (a CUDA build where it has nvcc)."""
    source = config.llamacpp
    if not source.enabled or not source.version or getattr(source, "build", None) is None:
        return False
    if inv.gpus:
        return not any(a.arch == inv.arch and a.backend == "cuda" for a in source.archives)
    covered = {a.arch for a in source.archives if a.backend == "cpu"} | {r.arch for r in release_for(source, release)}
    return inv.arch not in covered
