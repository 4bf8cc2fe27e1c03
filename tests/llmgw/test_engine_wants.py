"""Which engines a node is told to have (pure), and by which engine's rule a GPU node may run it."""

from __future__ import annotations

import attrs
import pytest

from llmgw.config import (
    DEFAULT_VLLM_VERSION,
    EngineArchive,
    EngineSource,
    EnginesSection,
    LlamacppSource,
    VllmSource,
)
from llmgw.engines import eligibility
from llmgw.engines.wants import (
    ReleaseArchive,
    engines_for,
    gpu_verdicts,
    llama_backend,
    may_build,
    pick_archive,
    release_archive,
    vulkan_device,
    vulkan_devices_env,
)
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


def gpu(name: str = "NVIDIA L4", cc: str = "8.9", driver: str = "550.54.15") -> w.Gpu:
    return w.Gpu(
        index=0,
        name=name,
        uuid="u",
        memory_total_mib=1,
        memory_free_mib=1,
        driver_version=driver,
        compute_capability=cc,
        pci_bus_id="0",
    )


def node(*, vllm: str = w.UNKNOWN, arch: str = "x86_64", gpus: int = 0, card: w.Gpu | None = None) -> w.Inventory:
    """`vllm`: the agent's own verdict, which the control plane does not follow (it judges the GPUs)."""
    return w.Inventory(
        hostname="n",
        os="linux",
        arch=arch,
        python="3.11",
        cpu_model="c",
        cpu_cores=1,
        gpus=(card or gpu(),) * gpus,
        gpu_status=w.GPUS_PRESENT if gpus else w.GPUS_NONE,
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
    new_driver = gpu(driver="580.82.07")
    assert [e.name for e in engines_for(named, node(gpus=1, card=new_driver))] == ["llamacpp", "vllm", "sglang"]
    pascal = gpu("NVIDIA GeForce GTX 1080 Ti", cc="6.1", driver="580.82.07")
    assert [e.name for e in engines_for(named, node(vllm=w.ELIGIBLE, gpus=1, card=pascal))] == ["llamacpp"]


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
    no_vllm = EnginesSection(llamacpp=CONFIG.llamacpp, vllm=VllmSource(enabled=False))
    assert [e.name for e in engines_for(no_vllm, node(gpus=1))] == ["llamacpp"]
    assert gpu_verdicts(no_vllm, node(gpus=1)) == ()


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


def test_vllm_is_wanted_by_default_pinned_and_from_pip() -> None:
    [_, vllm] = engines_for(EnginesSection(), node(gpus=1))
    assert (vllm.name, vllm.version, vllm.pip) == ("vllm", DEFAULT_VLLM_VERSION, f"vllm=={DEFAULT_VLLM_VERSION}")
    assert (vllm.index_url, vllm.extra_index_urls) == ("", ())


def test_a_configured_index_reaches_the_want() -> None:
    config = EnginesSection(
        vllm=VllmSource(index_url="https://mirror.example/simple", extra_index_url=("https://torch.example/cu129",))
    )
    [_, vllm] = engines_for(config, node(gpus=1))
    assert vllm.version == DEFAULT_VLLM_VERSION and vllm.index_url == "https://mirror.example/simple"
    assert vllm.extra_index_urls == ("https://torch.example/cu129",)
    sglang = EngineSource(version="0.5.23", index_url="https://mirror.example/simple")
    [*_, want] = engines_for(EnginesSection(sglang=sglang), node(gpus=1, card=gpu(driver="580.82.07")))
    assert (want.name, want.pip, want.index_url) == ("sglang", "sglang==0.5.23", "https://mirror.example/simple")


@pytest.mark.parametrize(
    ("card", "vllm", "sglang"),
    [
        (gpu("NVIDIA H100 80GB HBM3", "9.0", "580.82.07"), w.ELIGIBLE, w.ELIGIBLE),
        # The driver: vLLM's CUDA 12 wheels run on 550, SGLang's CUDA 13 ones do not.
        (gpu("NVIDIA L4", "8.9", "550.54.15"), w.ELIGIBLE, w.INELIGIBLE),
        (gpu("Tesla T4", "7.5", "580.82.07"), w.ELIGIBLE, w.ELIGIBLE),
        # Volta: below both engines' floor of 7.5.
        (gpu("Tesla V100-SXM2-32GB", "7.0", "580.82.07"), w.INELIGIBLE, w.INELIGIBLE),
        (gpu("NVIDIA GeForce GTX 1080 Ti", "6.1", "535.183.01"), w.INELIGIBLE, w.INELIGIBLE),
        (gpu("Tesla T4", "7.5", "470.182.03"), w.INELIGIBLE, w.INELIGIBLE),
    ],
)
def test_each_gpu_engine_is_judged_by_its_own_rule(card: w.Gpu, vllm: str, sglang: str) -> None:
    config = EnginesSection(sglang=EngineSource(version="0.5.23"))
    verdicts = {v.engine: v.status for v in gpu_verdicts(config, node(gpus=1, card=card))}
    assert verdicts == {"vllm": vllm, "sglang": sglang}
    wanted = [e.name for e in engines_for(config, node(gpus=1, card=card))]
    assert wanted == ["llamacpp"] + [n for n, s in (("vllm", vllm), ("sglang", sglang)) if s == w.ELIGIBLE]


def test_the_reasons_name_what_falls_short() -> None:
    old_driver = eligibility.judge_inventory("vllm", node(gpus=1, card=gpu("Tesla T4", "7.5", "470.182.03")))
    assert old_driver.reason.startswith("NVIDIA driver 470.182.03 is older than 525.60.13, the oldest vLLM's CUDA 12")
    volta = eligibility.judge_inventory("sglang", node(gpus=1, card=gpu("Tesla V100-SXM2-32GB", "7.0", "580.82.07")))
    assert volta.reason == "SGLang needs compute capability 7.5 or newer; Tesla V100-SXM2-32GB (7.0) is older"
    cpu = eligibility.judge_inventory("vllm", node())
    assert cpu.status == w.NOT_APPLICABLE and cpu.reason.startswith("no NVIDIA GPU")
    unread = w.Inventory(
        hostname="n", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1,
        gpu_status=w.GPUS_FAILED, gpu_detail="nvidia-smi fails",
    )  # fmt: skip
    assert eligibility.judge_inventory("vllm", unread).status == w.UNKNOWN
    assert eligibility.judge_inventory("vllm", None).status == w.UNKNOWN
    assert [e.name for e in engines_for(EnginesSection(), unread)] == ["llamacpp"]


def test_a_node_with_one_old_and_one_new_gpu_is_eligible_and_says_which_is_not_usable() -> None:
    inv = w.Inventory(
        hostname="n", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1,
        gpus=(gpu("NVIDIA L4"), gpu("Tesla V100-SXM2-32GB", "7.0")), gpu_status=w.GPUS_PRESENT,
    )  # fmt: skip
    verdict = eligibility.judge_inventory("vllm", inv)
    assert verdict.status == w.ELIGIBLE and verdict.reason.endswith("not usable by vLLM: Tesla V100-SXM2-32GB (7.0)")


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


RELEASE = (
    ReleaseArchive(
        name="llama.cpp-b11434-linux-amd64.tar.gz",
        version="b11434",
        arch="x86_64",
        sha256="e" * 64,
        binary="llama.cpp-b11434-linux-amd64/llama-server",
        size=1234,
    ),
    ReleaseArchive(
        name="llama.cpp-b11434-linux-arm64.tar.gz",
        version="b11434",
        arch="aarch64",
        sha256="f" * 64,
        binary="llama.cpp-b11434-linux-arm64/llama-server",
    ),
)


def test_the_default_llamacpp_takes_the_releases_archive_for_the_nodes_architecture() -> None:
    [want] = engines_for(EnginesSection(), node(vllm=w.INELIGIBLE), max_archive_bytes=9, release=RELEASE)
    [archive] = want.archives
    assert archive == w.EngineArchive(
        arch="x86_64",
        backend="cpu",
        url="",
        sha256="e" * 64,
        binary="llama.cpp-b11434-linux-amd64/llama-server",
        size=1234,
        max_bytes=9,
        release="llama.cpp-b11434-linux-amd64.tar.gz",
    )
    assert want.build is not None  # the source stays, for what the archive does not cover (CUDA)
    assert pick_archive(want, "x86_64", has_gpu=False) is None  # not a configured archive
    assert release_archive(want, "x86_64") == archive and release_archive(want, "riscv64") is None
    [arm] = engines_for(EnginesSection(), node(vllm=w.INELIGIBLE, arch="aarch64"), release=RELEASE)
    assert [a.release for a in arm.archives] == ["llama.cpp-b11434-linux-arm64.tar.gz"]


def test_explicit_archives_build_version_or_release_false_keep_to_what_they_name() -> None:
    from llmgw import config

    def want_for(table: dict) -> w.EngineWant:
        cfg = config.server_config_from_dict({"engines": {"llamacpp": table}})
        return engines_for(cfg.engines, node(vllm=w.INELIGIBLE), release=RELEASE)[0]

    archive = {"arch": "x86_64", "url": "https://x/cpu.tgz", "sha256": "a" * 64, "binary": "bin/llama-server"}
    assert [a.url for a in want_for({"archives": [archive]}).archives] == ["https://x/cpu.tgz"]
    own_source = {"url": "https://mirror.example/llama.tar.gz", "sha256": "b" * 64}
    assert want_for({"build": own_source}).archives == ()
    assert want_for({"version": "b11500", "build": own_source}).archives == ()  # the release carries b11434
    assert want_for({"release": False}).archives == ()
    assert want_for({"version": ""}).archives == ()  # the operator's llama-server
    # Asked for, the release fills in where the named archives do not reach.
    both = want_for({"archives": [archive], "release": True})
    assert [a.release for a in both.archives] == ["", "llama.cpp-b11434-linux-amd64.tar.gz"]
    assert pick_archive(both, "x86_64", has_gpu=False).url == "https://x/cpu.tgz"  # the named one wins


def test_a_node_may_build_where_nothing_prebuilt_covers_it_or_for_cuda() -> None:
    default = EnginesSection()
    assert not may_build(default, node(), RELEASE)
    assert may_build(default, node(), ())  # no release archive: the build, as before
    assert may_build(default, node(arch="riscv64"), RELEASE)
    assert may_build(default, node(gpus=1), RELEASE)  # a CUDA build, where it has nvcc
    cuda = EnginesSection(llamacpp=LlamacppSource(archives=(CUDA_ARCHIVE,)))
    assert not may_build(cuda, node(gpus=1), ())
    assert not may_build(EnginesSection(llamacpp=LlamacppSource(version="")), node(arch="riscv64"), ())


def test_llamacpps_measure_speed_reaches_its_want_only() -> None:
    [llama, vllm] = engines_for(EnginesSection(), node(gpus=1))
    assert llama.measure_speed and vllm.measure_speed  # the default: the node measures once installed
    quiet = EnginesSection(llamacpp=LlamacppSource(measure_speed=False))
    [llama] = engines_for(quiet, node(vllm=w.NOT_APPLICABLE))
    assert (llama.name, llama.measure_speed) == ("llamacpp", False)


# -- which llama.cpp build a node takes from the release --------------------------------------

LAVAPIPE = w.VulkanDevice(
    index=0, name="llvmpipe (LLVM 15.0.6, 256 bits)", type=w.VULKAN_CPU, vendor_id="0x10005", software=True
)
RADEON = w.VulkanDevice(
    index=1, name="AMD Radeon RX 7900 XTX (RADV NAVI31)", type=w.VULKAN_DISCRETE, vendor_id="0x1002"
)


def with_vulkan(*devices: w.VulkanDevice, status: str = w.VULKAN_PRESENT) -> w.Inventory:
    return attrs.evolve(node(), vulkan=devices, vulkan_status=status)


def test_auto_takes_vulkan_on_a_hardware_device_and_the_cpu_build_on_lavapipe_alone() -> None:
    assert llama_backend("auto", with_vulkan(LAVAPIPE, RADEON)) == "vulkan"
    assert vulkan_device(with_vulkan(LAVAPIPE, RADEON)) == RADEON
    assert llama_backend("auto", with_vulkan(LAVAPIPE)) == "cpu"  # software: slower than the CPU build
    assert llama_backend("auto", node()) == "cpu"  # vulkaninfo not asked (an older agent)
    assert llama_backend("auto", with_vulkan(RADEON, status=w.VULKAN_FAILED)) == "cpu"  # the loader did not answer


def test_the_operator_forces_either_build() -> None:
    assert llama_backend("vulkan", with_vulkan(LAVAPIPE)) == "vulkan"
    assert llama_backend("cpu", with_vulkan(RADEON)) == "cpu"


def test_the_releases_vulkan_archive_is_wanted_with_its_backend_and_picked_by_it() -> None:
    cpu = ReleaseArchive(
        name="llama.cpp-b1-linux-amd64.tar.gz", version="b1", arch="x86_64", sha256="c" * 64, binary="b"
    )
    vk = ReleaseArchive(
        name="llama.cpp-b1-linux-amd64-vulkan.tar.gz",
        version="b1",
        arch="x86_64",
        sha256="v" * 64,
        binary="b",
        backend="vulkan",
    )
    config = EnginesSection(llamacpp=LlamacppSource(version="b1", release=True))
    [want] = engines_for(config, node(), release=(cpu, vk))
    assert [(a.backend, a.release) for a in want.archives] == [("cpu", cpu.name), ("vulkan", vk.name)]
    assert release_archive(want, "x86_64").release == cpu.name
    assert release_archive(want, "x86_64", "vulkan").release == vk.name
    assert release_archive(want, "aarch64", "vulkan") is None


def test_a_node_forced_to_vulkan_on_software_devices_alone_names_them_to_llama_cpp() -> None:
    assert vulkan_devices_env("vulkan", with_vulkan(LAVAPIPE)) == {"GGML_VK_VISIBLE_DEVICES": "0"}
    two = attrs.evolve(LAVAPIPE, index=1)
    assert vulkan_devices_env("vulkan", with_vulkan(LAVAPIPE, two)) == {"GGML_VK_VISIBLE_DEVICES": "0,1"}
    # A hardware device: llama.cpp's own choice (every GPU, no software device); not forced: nothing.
    assert vulkan_devices_env("vulkan", with_vulkan(LAVAPIPE, RADEON)) == {}
    assert vulkan_devices_env("auto", with_vulkan(LAVAPIPE)) == vulkan_devices_env("cpu", with_vulkan(LAVAPIPE)) == {}
    assert vulkan_devices_env("vulkan", with_vulkan(LAVAPIPE, status=w.VULKAN_FAILED)) == {}
