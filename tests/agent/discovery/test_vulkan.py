"""vulkaninfo's summary and heaps from a recorded lavapipe and written AMD, NVIDIA and Intel cards;
vulkaninfo missing, without a driver, failing, hanging or printing something else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.discovery import vulkan
from agent.discovery.tools import ToolRun, run_tool
from llmgw.engines import vulkandevices
from llmgw.wire import agent_link as w
from testlib.hardware import FIXTURES, NO_TOOL, vulkaninfo

GIB = 1 << 30
NO_DRI = FIXTURES / "no-such-dir"


def probe(case: str | None, dri: Path = NO_DRI, timeout_s: float = 10) -> vulkan.VulkanReport:
    return vulkan.probe_vulkan(vulkaninfo(case), dri, timeout_s=timeout_s)


def dri_with_gpu(tmp_path: Path) -> Path:
    dri = tmp_path / "dri"
    dri.mkdir()
    for name in ("card0", "renderD128", "by-path"):
        (dri / name).touch()
    return dri


def test_lavapipe_recorded_here_is_one_software_device() -> None:
    (d,) = vulkan.parse_summary((FIXTURES / "vulkan" / "lavapipe.summary").read_text())
    assert d == w.VulkanDevice(
        index=0,
        name="llvmpipe (LLVM 15.0.6, 256 bits)",
        type=w.VULKAN_CPU,
        vendor_id="0x10005",
        device_id="0x0000",
        driver_id="DRIVER_ID_MESA_LLVMPIPE",
        driver_name="llvmpipe",
        driver_info="Mesa 22.3.6 (LLVM 15.0.6)",
        driver_version="0.0.1",
        api_version="1.3.230",
        software=True,
    )


def test_lavapipe_alone_is_present_but_no_gpu_and_its_heaps_are_not_read() -> None:
    report = probe("lavapipe")
    assert report.status == w.VULKAN_PRESENT and report.gpus == ()
    assert report.detail == (
        "llvmpipe (LLVM 15.0.6, 256 bits) (software, llvmpipe, Vulkan 1.3): software only, not counted as a GPU"
    )
    assert report.devices[0].heaps == ()  # the full text is asked for only when there is a GPU


def test_the_recorded_full_text_has_lavapipes_heap() -> None:
    heaps = vulkan.parse_heaps((FIXTURES / "vulkan" / "lavapipe.full").read_text())
    assert heaps == {0: (w.VulkanHeap(size_bytes=2 * GIB, device_local=True),)}


@pytest.mark.parametrize(
    ("case", "name", "kind", "vendor", "driver", "api", "vram", "detail"),
    [
        (
            "radv",
            "AMD Radeon RX 7900 XTX (RADV NAVI31)",
            w.VULKAN_DISCRETE,
            "0x1002",
            "radv",
            "1.3.230",
            25753026560,
            "AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB); "
            "llvmpipe (LLVM 15.0.6, 256 bits) (software, llvmpipe, Vulkan 1.3)",
        ),
        (
            "nvidia",
            "NVIDIA GeForce RTX 4090",
            w.VULKAN_DISCRETE,
            "0x10de",
            "NVIDIA",
            "1.3.277",
            25757220864,
            "NVIDIA GeForce RTX 4090 (discrete, NVIDIA, Vulkan 1.3, 24.0 GiB)",
        ),
        (
            "intel",
            "Intel(R) UHD Graphics 770 (ADL-S GT1)",
            w.VULKAN_INTEGRATED,
            "0x8086",
            "Intel open-source Mesa driver",
            "1.3.230",
            25139363840,
            "Intel(R) UHD Graphics 770 (ADL-S GT1) (integrated, Intel open-source Mesa driver, Vulkan 1.3, 23.4 GiB); "
            "llvmpipe (LLVM 15.0.6, 256 bits) (software, llvmpipe, Vulkan 1.3)",
        ),
    ],
)
def test_written_cards(
    case: str, name: str, kind: str, vendor: str, driver: str, api: str, vram: int, detail: str
) -> None:
    report = probe(case)
    assert report.status == w.VULKAN_PRESENT, report.detail
    (gpu,) = report.gpus
    assert (gpu.index, gpu.name, gpu.type, gpu.vendor_id, gpu.driver_name, gpu.api_version) == (
        0,
        name,
        kind,
        vendor,
        driver,
        api,
    )
    assert not gpu.software and vulkandevices.vram_bytes(gpu) == vram
    assert report.detail == detail
    # lavapipe beside a GPU is listed, last, and is still not a GPU
    assert [d.software for d in report.devices] == [False] + [True] * (len(report.devices) - 1)


def test_nvidias_bar_window_is_not_counted_twice() -> None:
    (gpu,) = probe("nvidia").devices
    assert [h.device_local for h in gpu.heaps] == [True, False, True]
    assert vulkandevices.vram_bytes(gpu) == 25757220864  # the largest device-local heap, not 24 GiB + 246 MiB


def test_an_older_vulkaninfos_api_version_with_its_number_first() -> None:
    text = "Devices:\n========\nGPU0:\n\tapiVersion = 4206847 (1.3.255)\n\tvendorID = 0x1002\n"
    text += "\tdeviceType = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU\n\tdeviceName = AMD Radeon PRO W7900\n"
    (d,) = vulkan.parse_summary(text)
    assert d.api_version == "1.3.255"


def test_an_unknown_device_type_is_other_not_a_crash() -> None:
    text = "Devices:\n========\nGPU0:\n\tvendorID = 0x1af4\n\tdeviceType = PHYSICAL_DEVICE_TYPE_NEW_KIND\n"
    text += "\tdeviceName = Some GPU\n"
    (d,) = vulkan.parse_summary(text)
    assert d.type == w.VULKAN_OTHER and not d.software


def test_no_vulkaninfo_says_which_packages() -> None:
    report = probe(None)
    assert report.status == w.VULKAN_MISSING
    assert report.detail == f"no vulkaninfo at {NO_TOOL} (vulkan-tools is not installed)"
    assert "apt-get install vulkan-tools mesa-vulkan-drivers" in report.fix


def test_no_vulkaninfo_on_a_node_with_a_gpu_names_its_render_node(tmp_path: Path) -> None:
    report = probe(None, dri_with_gpu(tmp_path))
    assert report.render_nodes == (str(tmp_path / "dri" / "renderD128"),)
    assert report.detail.endswith(f"; the node has a GPU ({tmp_path / 'dri' / 'renderD128'})")


def test_a_loader_without_a_driver_is_no_device_with_the_fix() -> None:
    report = probe("no-driver")
    assert report.status == w.VULKAN_NONE and report.devices == ()
    assert (
        report.detail
        == f"the Vulkan loader finds no driver (vulkaninfo at {vulkaninfo('no-driver')} exits 1: Found no drivers)"
    )
    assert "mesa-vulkan-drivers" in report.fix


def test_a_summary_without_devices_is_none() -> None:
    ran = ToolRun(argv=("vulkaninfo",), outcome="ok", returncode=0, stdout="Devices:\n========\n")
    report = vulkan.judge(ran, None, "vulkaninfo")
    assert report.status == w.VULKAN_NONE and report.detail == "the Vulkan loader lists no device"


def test_a_loader_library_gone_is_a_failure_with_the_linkers_words() -> None:
    report = probe("no-loader")
    assert report.status == w.VULKAN_FAILED
    assert "exits 127: vulkaninfo: error while loading shared libraries: libvulkan.so.1" in report.detail
    assert "libvulkan1" in report.fix


def test_garbage_is_a_failure_not_a_crash() -> None:
    report = probe("garbage")
    assert report.status == w.VULKAN_FAILED
    assert report.detail.endswith(
        "printed what is not its --summary: no 'Devices:' section (is it vulkaninfo --summary?)"
    )


def test_a_gpu_block_without_a_name_is_a_failure() -> None:
    ran = ToolRun(
        argv=("vulkaninfo",), outcome="ok", returncode=0, stdout="Devices:\n========\nGPU0:\n\tvendorID = 0x1002\n"
    )
    report = vulkan.judge(ran, None, "vulkaninfo")
    assert report.status == w.VULKAN_FAILED and "GPU0 has no deviceName, deviceType" in report.detail


def test_a_hung_vulkaninfo_is_killed_at_the_bound_and_reported() -> None:
    started = time.monotonic()
    report = probe("hang", timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert report.status == w.VULKAN_FAILED
    assert report.detail == f"vulkaninfo at {vulkaninfo('hang')} hangs: no answer in 0.3 s (killed)"
    assert "dmesg" in report.fix


def test_the_full_text_failing_keeps_the_devices_without_heaps() -> None:
    report = probe("full-fails")
    assert report.status == w.VULKAN_PRESENT and len(report.gpus) == 1
    assert all(d.heaps == () for d in report.devices)
    assert report.detail.endswith("; memory unknown: vulkaninfo's full text exits 139: Segmentation fault")


def test_render_nodes_only_render_nodes(tmp_path: Path) -> None:
    assert vulkan.render_nodes(dri_with_gpu(tmp_path)) == (str(tmp_path / "dri" / "renderD128"),)
    assert vulkan.render_nodes(tmp_path / "absent") == ()


def test_the_stand_in_refuses_another_question() -> None:
    run = run_tool([vulkaninfo("radv"), "--json"], timeout_s=10)
    assert not run.ok and "Unrecognized option: --json" in run.stderr
