"""The recorded hardware in tests/fixtures, and discovery `Sources` pointing at it.

Fixtures stand in for hardware only: proc-, PCI- and sysfs-shaped directories, and scripts in
place of nvidia-smi, sminfo, ip and vulkaninfo. Everything else (tool runs with timeouts, parsing, checks)
is the real code.
"""

from __future__ import annotations

from pathlib import Path

from agent.discovery.snapshot import Sources
from testlib.proc import build_root

FIXTURES = build_root() / "tests" / "fixtures"
NO_TOOL = str(FIXTURES / "no-such-tool")  # a path where nothing is installed


def nvidia_smi(card: str | None) -> str:
    """A stand-in nvidia-smi ("h100", "a100", "l4", "rtx4090", "gtx1080ti", "gb200", "failing",
    "no-devices"), or None for a node where nvidia-smi is not installed."""
    return str(FIXTURES / "nvidia-smi" / card) if card else NO_TOOL


def ib_root(case: str) -> Path:
    return FIXTURES / "ib" / case / "infiniband"


def sminfo(case: str) -> str:
    path = FIXTURES / "ib" / case / "sminfo"
    return str(path) if path.exists() else NO_TOOL


def ip(case: str) -> str:
    path = FIXTURES / "ib" / case / "ip"
    return str(path) if path.exists() else NO_TOOL


def vulkaninfo(case: str | None) -> str:
    """A stand-in vulkaninfo (tests/fixtures/vulkan: "lavapipe", "radv", "nvidia", "intel", "no-driver",
    "no-loader", "hang", "garbage", "full-fails"), or None for a node without vulkan-tools."""
    return str(FIXTURES / "vulkan" / case) if case else NO_TOOL


def sources(
    *,
    weights_dir: Path,
    proc: str = "xeon-host-vm",
    pci: str = "none",
    gpu: str | None = None,
    ib: str = "empty",
    sminfo_path: str | None = None,
    os_release: str = "debian-12",
    vulkan: str | None = None,
    dri: Path | None = None,
) -> Sources:
    return Sources(
        proc_root=FIXTURES / "proc" / proc,
        pci_root=FIXTURES / "pci" / pci,
        ib_root=ib_root(ib),
        os_release=FIXTURES / "os-release" / os_release,
        nvidia_smi=nvidia_smi(gpu),
        sminfo=sminfo_path if sminfo_path is not None else sminfo(ib),
        ip=ip(ib),
        weights_dir=weights_dir,
        vulkaninfo=vulkaninfo(vulkan),
        dri_dir=dri if dri is not None else FIXTURES / "no-such-dir",
        tool_timeout_s=10.0,
    )
