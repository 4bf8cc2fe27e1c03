"""What a node's Vulkan devices (`Inventory.vulkan`, from agent.discovery.vulkan) amount to.

Shared by the agent (its doctor and inventory detail), the control plane's views (`ctl nodes`,
the cluster page) and, next, placement of llama.cpp's Vulkan build: one reading of a device,
so that a software device is never a GPU anywhere and a device is described one way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.wire import agent_link as w


def gpus(devices: Iterable[w.VulkanDevice]) -> tuple[w.VulkanDevice, ...]:
    """The devices that are GPUs: all but software ones (lavapipe runs on the CPU llama.cpp already uses)."""
    return tuple(d for d in devices if not d.software)


def vram_bytes(device: w.VulkanDevice) -> int:
    """The largest device-local heap (0: unknown). Not their sum: NVIDIA's driver lists the 256 MiB
    BAR window as a second device-local heap, which is the same memory seen another way."""
    return max((h.size_bytes for h in device.heaps if h.device_local), default=0)


def api_short(version: str) -> str:
    """ "1.3.230" -> "1.3": the Vulkan version, as people name it."""
    return ".".join(version.split(".")[:2]) if version else "?"


def describe(device: w.VulkanDevice) -> str:
    """ "AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB)"."""
    kind = "software" if device.software else device.type
    parts = [kind, device.driver_name or device.driver_id or "?", f"Vulkan {api_short(device.api_version)}"]
    vram = vram_bytes(device)
    if vram and not device.software:
        parts.append(f"{vram / (1 << 30):.1f} GiB")
    return f"{device.name} ({', '.join(parts)})"
