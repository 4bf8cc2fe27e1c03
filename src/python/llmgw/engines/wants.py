"""Which engines the control plane wants on a node: a pure function of the config and the
node's inventory (spec: llama.cpp everywhere unless turned off, vLLM where an NVIDIA GPU can
run it, SGLang where a version is named, on nodes whose GPUs SGLang supports).

Whether a GPU engine can run is judged here, from the GPUs the inventory lists, by the engine's
own rule (`llmgw.engines.eligibility`): a node that cannot run it is not asked to install it,
and `gpu_verdicts` says why for the node's view.

llama.cpp's want carries its prebuilt archives for the node's architecture and, by default,
the source to build it from where none fits (`pick_archive` decides on the node); each says
whether the control plane's mirror has it."""

from __future__ import annotations

from collections.abc import Collection

from llmgw.config import EngineSource, EnginesSection, pip_requirement
from llmgw.engines.eligibility import judge_inventory
from llmgw.wire import agent_link as w

GPU_ENGINES = ("vllm", "sglang")


def _want(
    name: str, source: EngineSource, inv: w.Inventory | None, mirrored: Collection[str], max_bytes: int
) -> w.EngineWant:
    arch = inv.arch if inv else None
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
        archives=archives,
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
    )


def gpu_engines(config: EnginesSection) -> tuple[str, ...]:
    """The GPU engines server.toml asks for (vLLM unless turned off; SGLang where named)."""
    return tuple(n for n in GPU_ENGINES if (src := getattr(config, n)) is not None and src.enabled)


def gpu_verdicts(config: EnginesSection, inv: w.Inventory | None) -> tuple[w.EngineEligibility, ...]:
    """Each GPU engine server.toml asks for, judged on this node by its own rule."""
    return tuple(judge_inventory(name, inv) for name in gpu_engines(config))


def engines_for(
    config: EnginesSection, inv: w.Inventory | None, mirrored: Collection[str] = (), *, max_archive_bytes: int = 0
) -> tuple[w.EngineWant, ...]:
    """`max_archive_bytes`: [downloads].max_archive_gib in bytes (0: the agent's default)."""
    wants = []
    if config.llamacpp.enabled:
        wants.append(_want("llamacpp", config.llamacpp, inv, mirrored, max_archive_bytes))
    for verdict in gpu_verdicts(config, inv):
        if verdict.status == w.ELIGIBLE:
            source = getattr(config, verdict.engine)
            wants.append(_want(verdict.engine, source, inv, mirrored, max_archive_bytes))
    return tuple(wants)


def pick_archive(want: w.EngineWant, arch: str, has_gpu: bool) -> w.EngineArchive | None:
    """The archive for this node: CUDA where there is an NVIDIA GPU and a CUDA build, else CPU."""
    mine = [a for a in want.archives if a.arch == arch]
    if has_gpu:
        cuda = [a for a in mine if a.backend == "cuda"]
        if cuda:
            return cuda[0]
    cpu = [a for a in mine if a.backend == "cpu"]
    return cpu[0] if cpu else None
