"""The real vulkaninfo (Debian's vulkan-tools) on lavapipe (mesa-vulkan-drivers), Mesa's software
Vulkan device, which needs no GPU: discovery finds it, marks it software, and reports the loader
without a driver as no device. tools/testenv/prepare.py installs both packages."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from agent.discovery import vulkan
from llmgw.wire import agent_link as w
from testlib import needs

LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.*.json"


@pytest.fixture
def vulkaninfo() -> str:
    found = needs.program("vulkaninfo", "vulkan-tools")
    if not glob.glob(LAVAPIPE_ICD):
        pytest.fail(needs.missing_message(f"lavapipe's driver manifest ({LAVAPIPE_ICD})", "mesa-vulkan-drivers"))
    return found


def test_the_real_vulkaninfo_lists_lavapipe_as_software(vulkaninfo: str, tmp_path: Path) -> None:
    report = vulkan.probe_vulkan(vulkaninfo, tmp_path / "no-dri", timeout_s=30)
    assert report.status == w.VULKAN_PRESENT, report.detail
    lavapipe = [d for d in report.devices if d.driver_id == "DRIVER_ID_MESA_LLVMPIPE"]
    assert len(lavapipe) == 1, report.devices
    (d,) = lavapipe
    assert d.name.startswith("llvmpipe (LLVM ") and d.type == w.VULKAN_CPU and d.software
    assert (d.vendor_id, d.driver_name) == ("0x10005", "llvmpipe")  # Mesa's own vendor id: no PCI vendor
    assert d.api_version.startswith("1.") and d.driver_info.startswith("Mesa ")
    assert d not in report.gpus
    assert f"{d.name} (software, llvmpipe, Vulkan 1." in report.detail


def test_the_real_loader_without_a_driver_is_no_device(vulkaninfo: str, tmp_path: Path) -> None:
    # The real vulkaninfo and loader, told to load a driver manifest that is not there: as on a
    # node with vulkan-tools and no mesa-vulkan-drivers.
    wrapper = tmp_path / "vulkaninfo"
    wrapper.write_text(
        f'#!/bin/sh\nVK_DRIVER_FILES={tmp_path}/none.json VK_ICD_FILENAMES={tmp_path}/none.json exec {vulkaninfo} "$@"\n'
    )
    wrapper.chmod(0o755)
    report = vulkan.probe_vulkan(str(wrapper), tmp_path / "no-dri", timeout_s=30)
    assert report.status == w.VULKAN_NONE, report.detail
    assert report.detail == f"the Vulkan loader finds no driver (vulkaninfo at {wrapper} exits 1: Found no drivers)"
