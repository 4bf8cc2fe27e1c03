"""Vulkan devices: what the Vulkan loader lists through its own tool, `vulkaninfo` (vulkan-tools).

llama.cpp's Vulkan backend runs on any GPU whose driver speaks Vulkan (AMD's RADV, Intel's
ANV, NVIDIA's own driver), so a node's Vulkan devices decide whether it gets that build. They
are read the way the loader sees them, not guessed from the PCI bus: `vulkaninfo --summary`
lists every physical device with its type, vendor, driver and API version, in well under a
second. Only when it lists a real GPU is the full text read as well, for the memory heaps
(the summary has none); a software device's heaps are the host's memory and say nothing.

A software device (Mesa's lavapipe, type "cpu") is listed, since it shows that the loader and
a driver work, and marked `software`, so placement never counts it as a GPU. Whether the node
has a GPU at all is read from /dev/dri's render nodes: a node with one and no usable Vulkan
device is a problem with a fix (`llmgw doctor`'s "vulkan" check), a node without one is not.

Parsing (`parse_summary`, `parse_heaps`) and judging (`judge`) are pure; `probe_vulkan` and
`render_nodes` do the I/O. A missing tool, a loader without a driver, a tool that fails, hangs
or prints something else: each is a status with its reason, never an exception.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs

from agent.discovery.tools import MISSING, TIMEOUT, ToolRun, run_tool
from llmgw.engines import vulkandevices
from llmgw.wire import agent_link as w

SUMMARY_ARGS = ("--summary",)
FULL_ARGS = ()  # the full text: its VkPhysicalDeviceMemoryProperties has the heaps

INSTALL = "apt-get install vulkan-tools mesa-vulkan-drivers"  # dnf: vulkan-tools mesa-vulkan-drivers too

# VkPhysicalDeviceType as vulkaninfo prints it.
TYPES = {
    "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU": w.VULKAN_DISCRETE,
    "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU": w.VULKAN_INTEGRATED,
    "PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU": w.VULKAN_VIRTUAL,
    "PHYSICAL_DEVICE_TYPE_CPU": w.VULKAN_CPU,
    "PHYSICAL_DEVICE_TYPE_OTHER": w.VULKAN_OTHER,
}

_GPU = re.compile(r"^GPU(\d+):\s*$")
_FIELD = re.compile(r"^\s+(\w+)\s*=\s*(.*?)\s*$")
_VERSION = re.compile(r"\d+(?:\.\d+)+")
_HEAP = re.compile(r"^\s+memoryHeaps\[(\d+)\]:\s*$")
_SIZE = re.compile(r"^\s+size\s*=\s*(\d+)")
# What the loader says when it finds no driver (an ICD) at all: vulkaninfo then exits non-zero.
_NO_DRIVER = ("Found no drivers", "Cannot create Vulkan instance")


class VulkanSummaryError(ValueError):
    """vulkaninfo printed something that is not its --summary."""


@attrs.frozen(kw_only=True)
class VulkanReport:
    status: str  # one of w.VULKAN_*
    detail: str  # for people
    fix: str = ""  # for a status that is a problem where the node has a GPU
    vulkaninfo: str = ""
    devices: tuple[w.VulkanDevice, ...] = ()
    render_nodes: tuple[str, ...] = ()  # /dev/dri/renderD*: the node has a GPU with a kernel driver
    dri_dir: str = "/dev/dri"  # where render nodes were looked for

    @property
    def gpus(self) -> tuple[w.VulkanDevice, ...]:
        """The devices that are GPUs: every one but software ones."""
        return vulkandevices.gpus(self.devices)


def parse_summary(text: str) -> tuple[w.VulkanDevice, ...]:
    """The devices of `vulkaninfo --summary`'s "Devices:" section, in its order."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Devices:")
    except StopIteration:
        raise VulkanSummaryError("no 'Devices:' section (is it vulkaninfo --summary?)") from None
    blocks: list[tuple[int, dict[str, str]]] = []
    for line in lines[start + 1 :]:
        if m := _GPU.match(line):
            blocks.append((int(m.group(1)), {}))
        elif blocks and (f := _FIELD.match(line)):
            blocks[-1][1].setdefault(f.group(1), f.group(2))
    return tuple(_device(index, fields) for index, fields in blocks)


def _device(index: int, f: dict[str, str]) -> w.VulkanDevice:
    missing = [k for k in ("deviceName", "deviceType", "vendorID") if not f.get(k)]
    if missing:
        raise VulkanSummaryError(f"GPU{index} has no {', '.join(missing)}")
    kind = TYPES.get(f["deviceType"], w.VULKAN_OTHER)
    api = _VERSION.search(f.get("apiVersion", ""))
    # Older vulkaninfo prints "apiVersion = 4206847 (1.3.255)": the dotted form is the one wanted.
    return w.VulkanDevice(
        index=index,
        name=f["deviceName"],
        type=kind,
        vendor_id=f["vendorID"].lower(),
        device_id=f.get("deviceID", "").lower(),
        driver_id=f.get("driverID", ""),
        driver_name=f.get("driverName", ""),
        driver_info=f.get("driverInfo", ""),
        driver_version=f.get("driverVersion", ""),
        api_version=api.group(0) if api else "",
        software=kind == w.VULKAN_CPU,
    )


def parse_heaps(text: str) -> dict[int, tuple[w.VulkanHeap, ...]]:
    """Each device's memory heaps from vulkaninfo's full text, by GPU number. Lenient: a device
    whose heaps cannot be read is left out, and its heaps stay unknown."""
    heaps: dict[int, list[w.VulkanHeap]] = {}
    gpu: int | None = None
    in_memory = False
    size: int | None = None
    local = False

    def flush() -> None:
        nonlocal size, local
        if gpu is not None and size is not None:
            heaps.setdefault(gpu, []).append(w.VulkanHeap(size_bytes=size, device_local=local))
        size, local = None, False

    for line in text.splitlines():
        if m := _GPU.match(line):
            flush()
            gpu, in_memory = int(m.group(1)), False
        elif line.startswith("VkPhysicalDeviceMemoryProperties"):
            flush()
            in_memory = True
        elif not in_memory:
            continue
        elif _HEAP.match(line):
            flush()
        elif line.lstrip().startswith("memoryTypes"):
            flush()
            in_memory = False
        elif s := _SIZE.match(line):
            size = int(s.group(1))
        elif "MEMORY_HEAP_DEVICE_LOCAL_BIT" in line:
            local = True
    flush()
    return {k: tuple(v) for k, v in heaps.items()}


def render_nodes(dri_dir: Path) -> tuple[str, ...]:
    """/dev/dri/renderD*: one per GPU whose kernel driver is loaded (amdgpu, i915, xe, nouveau, nvidia-drm)."""
    try:
        names = os.listdir(dri_dir)
    except OSError:
        return ()
    return tuple(str(dri_dir / n) for n in sorted(names) if n.startswith("renderD"))


def _no_driver(run: ToolRun) -> bool:
    said = run.stderr + run.stdout
    return any(s in said for s in _NO_DRIVER)


def judge(
    summary: ToolRun, full: ToolRun | None, vulkaninfo: str, nodes: tuple[str, ...] = (), dri_dir: str = "/dev/dri"
) -> VulkanReport:
    """What one `vulkaninfo --summary` run (and the full text, if it was read) say, on a node with
    these render nodes (in `dri_dir`)."""
    gpu_here = f"; the node has a GPU ({', '.join(nodes)})" if nodes else ""

    def say(status: str, detail: str, fix: str = "", devices: tuple[w.VulkanDevice, ...] = ()) -> VulkanReport:
        return VulkanReport(
            status=status,
            detail=detail,
            fix=fix,
            vulkaninfo=vulkaninfo,
            devices=devices,
            render_nodes=nodes,
            dri_dir=dri_dir,
        )

    if summary.outcome == MISSING:
        return say(
            w.VULKAN_MISSING,
            f"no vulkaninfo at {vulkaninfo} (vulkan-tools is not installed){gpu_here}",
            f"`{INSTALL}` (vulkaninfo is how the agent finds Vulkan devices)",
        )
    if summary.outcome == TIMEOUT:
        return say(
            w.VULKAN_FAILED,
            f"vulkaninfo at {vulkaninfo} hangs: {summary.problem()}{gpu_here}",
            "a GPU driver that hangs its Vulkan probe: check `dmesg` for GPU errors; try "
            f"`VK_LOADER_DEBUG=error,warn {vulkaninfo} --summary` to see which driver it stops in",
        )
    if not summary.ok:
        if _no_driver(summary):
            return say(
                w.VULKAN_NONE,
                f"the Vulkan loader finds no driver (vulkaninfo at {vulkaninfo} exits {summary.returncode}: "
                f"Found no drivers){gpu_here}",
                f"install the GPU's Vulkan driver: `{INSTALL}` for AMD, Intel and the software device; "
                "NVIDIA's Vulkan driver comes with its driver package (libnvidia-gl)",
            )
        return say(
            w.VULKAN_FAILED,
            f"vulkaninfo at {vulkaninfo} fails: it {summary.problem()}{gpu_here}",
            f"reinstall the loader and tools (`apt-get install --reinstall libvulkan1 vulkan-tools`), then run "
            f"`{vulkaninfo} --summary` to see why",
        )
    try:
        devices = parse_summary(summary.stdout)
    except VulkanSummaryError as exc:
        return say(
            w.VULKAN_FAILED,
            f"vulkaninfo at {vulkaninfo} printed what is not its --summary: {exc}",
            "check that the path is Vulkan's vulkaninfo (vulkan-tools 1.2.189 or newer has --summary)",
        )
    if not devices:
        return say(
            w.VULKAN_NONE,
            f"the Vulkan loader lists no device{gpu_here}",
            f"install the GPU's Vulkan driver: `{INSTALL}`",
        )
    unread = ""
    if full is not None and full.ok:
        heaps = parse_heaps(full.stdout)
        devices = tuple(attrs.evolve(d, heaps=heaps.get(d.index, ())) for d in devices)
    elif full is not None:
        unread = f"; memory unknown: vulkaninfo's full text {full.problem()}"
    detail = "; ".join(vulkandevices.describe(d) for d in devices) + unread
    if not vulkandevices.gpus(devices):
        detail += ": software only, not counted as a GPU"
    return say(w.VULKAN_PRESENT, detail, devices=devices)


def probe_vulkan(vulkaninfo: str, dri_dir: Path, *, timeout_s: float) -> VulkanReport:
    nodes = render_nodes(dri_dir)
    summary = run_tool([vulkaninfo, *SUMMARY_ARGS], timeout_s=timeout_s)
    full = None
    if summary.ok:
        try:
            real_gpu = bool(vulkandevices.gpus(parse_summary(summary.stdout)))
        except VulkanSummaryError:
            real_gpu = False
        if real_gpu:  # heaps only matter for a GPU; the full text takes as long again
            full = run_tool([vulkaninfo, *FULL_ARGS], timeout_s=timeout_s)
    return judge(summary, full, vulkaninfo, nodes, str(dri_dir))
