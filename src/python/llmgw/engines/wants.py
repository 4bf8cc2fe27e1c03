"""Which engines the control plane wants on a node: a pure function of the config and the
node's inventory (spec: llama.cpp everywhere unless turned off, vLLM where an NVIDIA GPU can
run it, SGLang where a version is named, on nodes with an NVIDIA GPU).

llama.cpp's want carries its prebuilt archives for the node's architecture and, by default,
the source to build it from where none fits (`pick_archive` decides on the node); each says
whether the control plane's mirror has it."""

from __future__ import annotations

from collections.abc import Collection

from llmgw.config import EngineSource, EnginesSection
from llmgw.wire import agent_link as w


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
        pip=source.pip,
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


def _gpu_eligible(inv: w.Inventory | None, engine: str) -> bool:
    if inv is None:
        return False
    verdict = next((e for e in inv.engine_eligibility if e.engine == engine), None)
    if verdict is not None:
        return verdict.status == w.ELIGIBLE
    return bool(inv.gpus)


def engines_for(
    config: EnginesSection, inv: w.Inventory | None, mirrored: Collection[str] = (), *, max_archive_bytes: int = 0
) -> tuple[w.EngineWant, ...]:
    """`max_archive_bytes`: [downloads].max_archive_gib in bytes (0: the agent's default)."""
    wants = []
    if config.llamacpp.enabled:
        wants.append(_want("llamacpp", config.llamacpp, inv, mirrored, max_archive_bytes))
    if config.vllm is not None and config.vllm.enabled and _gpu_eligible(inv, "vllm"):
        wants.append(_want("vllm", config.vllm, inv, mirrored, max_archive_bytes))
    # SGLang: the same hardware bar as vLLM, an NVIDIA GPU.
    if config.sglang is not None and config.sglang.enabled and _gpu_eligible(inv, "vllm"):
        wants.append(_want("sglang", config.sglang, inv, mirrored, max_archive_bytes))
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
