"""Which engines a node is told to have (pure)."""

from __future__ import annotations

from llmgw.config import EngineArchive, EngineSource, EnginesSection
from llmgw.engines.wants import engines_for, pick_archive
from llmgw.wire import agent_link as w

CPU_ARCHIVE = EngineArchive(arch="x86_64", url="https://x/cpu.tgz", sha256="a" * 64, binary="bin/llama-server")
CUDA_ARCHIVE = EngineArchive(
    arch="x86_64", backend="cuda", url="https://x/cuda.tgz", sha256="b" * 64, binary="bin/llama-server"
)
ARM_ARCHIVE = EngineArchive(arch="aarch64", url="https://x/arm.tgz", sha256="c" * 64, binary="bin/llama-server")
CONFIG = EnginesSection(
    llamacpp=EngineSource(version="b1", archives=(CPU_ARCHIVE, CUDA_ARCHIVE, ARM_ARCHIVE)),
    vllm=EngineSource(version="0.11.0", pip="vllm==0.11.0"),
)


def node(*, vllm: str, arch: str = "x86_64", gpus: int = 0) -> w.Inventory:
    gpu = w.Gpu(
        index=0,
        name="NVIDIA L4",
        uuid="u",
        memory_total_mib=1,
        memory_free_mib=1,
        driver_version="550",
        compute_capability="8.9",
        pci_bus_id="0",
    )
    return w.Inventory(
        hostname="n",
        os="linux",
        arch=arch,
        python="3.11",
        cpu_model="c",
        cpu_cores=1,
        gpus=(gpu,) * gpus,
        engine_eligibility=(w.EngineEligibility(engine="vllm", status=vllm, reason="r"),),
    )


def test_a_cpu_node_gets_llamacpp_for_its_arch_and_no_vllm() -> None:
    [llama] = engines_for(CONFIG, node(vllm=w.NOT_APPLICABLE))
    assert llama.name == "llamacpp" and llama.version == "b1"
    assert [a.url for a in llama.archives] == ["https://x/cpu.tgz", "https://x/cuda.tgz"]
    arm = engines_for(CONFIG, node(vllm=w.NOT_APPLICABLE, arch="aarch64"))[0]
    assert [a.url for a in arm.archives] == ["https://x/arm.tgz"]


def test_a_gpu_node_that_can_run_vllm_gets_it_and_sglang_only_when_named() -> None:
    names = [e.name for e in engines_for(CONFIG, node(vllm=w.ELIGIBLE, gpus=1))]
    assert names == ["llamacpp", "vllm"]
    named = EnginesSection(llamacpp=CONFIG.llamacpp, vllm=CONFIG.vllm, sglang=EngineSource(version=""))
    assert [e.name for e in engines_for(named, node(vllm=w.ELIGIBLE, gpus=1))] == ["llamacpp", "vllm", "sglang"]
    assert [e.name for e in engines_for(named, node(vllm=w.INELIGIBLE, gpus=1))] == ["llamacpp"]


def test_archives_the_control_plane_has_are_marked_mirrored() -> None:
    [llama] = engines_for(CONFIG, node(vllm=w.NOT_APPLICABLE), mirrored={"a" * 64})
    assert [a.mirrored for a in llama.archives] == [True, False]


def test_pick_archive_prefers_cuda_on_gpu_nodes_and_falls_back_to_cpu() -> None:
    llama = engines_for(CONFIG, node(vllm=w.ELIGIBLE, gpus=1))[0]
    assert pick_archive(llama, "x86_64", has_gpu=True).backend == "cuda"
    assert pick_archive(llama, "x86_64", has_gpu=False).backend == "cpu"
    cpu_only = w.EngineWant(name="llamacpp", version="b1", archives=(llama.archives[0],))
    assert pick_archive(cpu_only, "x86_64", has_gpu=True).backend == "cpu"
    assert pick_archive(cpu_only, "riscv64", has_gpu=False) is None


def test_an_engine_turned_off_is_not_asked_of_any_node() -> None:
    off = EnginesSection(llamacpp=EngineSource(enabled=False), vllm=CONFIG.vllm)
    assert [e.name for e in engines_for(off, node(vllm=w.NOT_APPLICABLE))] == []
    assert [e.name for e in engines_for(off, node(vllm=w.ELIGIBLE, gpus=1))] == ["vllm"]


def test_unpack_caps_reach_the_want() -> None:
    capped = EnginesSection(
        llamacpp=EngineSource(version="b1", archives=(CPU_ARCHIVE,), max_unpacked_bytes=5, max_members=6)
    )
    [llama] = engines_for(capped, node(vllm=w.NOT_APPLICABLE))
    assert (llama.max_unpacked_bytes, llama.max_members) == (5, 6)


def test_each_archive_carries_its_size_and_the_maximum_for_the_download() -> None:
    sized = EngineArchive(arch="x86_64", url="https://x/s.tgz", sha256="d" * 64, binary="b", size=123456)
    config = EnginesSection(llamacpp=EngineSource(version="b1", archives=(sized, CUDA_ARCHIVE)))
    [llama] = engines_for(config, node(vllm=w.NOT_APPLICABLE), max_archive_bytes=4 << 30)
    assert [(a.size, a.max_bytes) for a in llama.archives] == [(123456, 4 << 30), (0, 4 << 30)]


def test_the_default_llamacpp_want_carries_the_source_to_build_and_whether_it_is_mirrored() -> None:
    from llmgw import pins
    from llmgw.config import LlamacppSource

    default = EnginesSection()
    [want] = engines_for(default, node(vllm=w.INELIGIBLE), max_archive_bytes=7 << 30)
    assert want.name == "llamacpp" and want.version == pins.LLAMACPP_VERSION and want.archives == ()
    assert want.build == w.EngineBuild(
        url=pins.LLAMACPP_SDIST_URL,
        sha256=pins.LLAMACPP_SDIST_SHA256,
        size=pins.LLAMACPP_SDIST_SIZE,
        max_bytes=7 << 30,
        mirrored=False,
    )
    [mirrored] = engines_for(default, node(vllm=w.INELIGIBLE), {pins.LLAMACPP_SDIST_SHA256})
    assert mirrored.build is not None and mirrored.build.mirrored
    # The operator's own llama-server (version ""), or no build: nothing to build in the want.
    for source in (LlamacppSource(version=""), LlamacppSource(archives=(CPU_ARCHIVE,), build=None)):
        [want] = engines_for(EnginesSection(llamacpp=source), node(vllm=w.INELIGIBLE))
        assert want.build is None
