"""One look at the node: `discover(Sources) -> Snapshot`.

`Sources` says where to look. Every path is a parameter, defaulting to the usual place, so
that tests (and `llmgw doctor --ib-root ...`) point discovery at recorded fixtures: a proc-
shaped directory, a sysfs-shaped tree, scripts standing in for nvidia-smi, sminfo, ip and vulkaninfo.

`discover` is blocking (file reads and a few bounded tool runs, see `tools`); the agent runs it
with `trio.to_thread.run_sync`. A `Snapshot` is plain data: doctor's checks and the hello's
inventory are both pure functions of it.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from pathlib import Path

import attrs

from agent.discovery import cpu, gpus, infiniband, system, vulkan
from agent.discovery.tools import DEFAULT_TIMEOUT_S
from agent.install import toolchain
from llmgw import config

DEFAULT_PROC_ROOT = "/proc"
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
DEFAULT_PCI_ROOT = "/sys/bus/pci/devices"
DEFAULT_IP = "/usr/sbin/ip"
DEFAULT_OS_RELEASE = "/etc/os-release"
# Present exactly when systemd is the init: sd_booted(3) decides by it.
DEFAULT_SYSTEMD_DIR = "/run/systemd/system"
DEFAULT_VULKANINFO = "/usr/bin/vulkaninfo"  # vulkan-tools, on Debian/Ubuntu and RHEL alike
DEFAULT_DRI_DIR = "/dev/dri"  # renderD* there: a GPU with its kernel driver loaded


@attrs.frozen(kw_only=True)
class Sources:
    proc_root: Path = Path(DEFAULT_PROC_ROOT)
    cgroup_root: Path = Path(DEFAULT_CGROUP_ROOT)
    pci_root: Path = Path(DEFAULT_PCI_ROOT)
    ib_root: Path = Path(config.DEFAULT_IB_ROOT)
    os_release: Path = Path(DEFAULT_OS_RELEASE)
    systemd_dir: Path = Path(DEFAULT_SYSTEMD_DIR)
    nvidia_smi: str = config.DEFAULT_NVIDIA_SMI
    sminfo: str = config.DEFAULT_SMINFO
    ip: str = DEFAULT_IP
    vulkaninfo: str = DEFAULT_VULKANINFO
    dri_dir: Path = Path(DEFAULT_DRI_DIR)
    weights_dir: Path = Path(config.DEFAULT_AGENT_STATE_DIR) / "weights"
    tool_timeout_s: float = DEFAULT_TIMEOUT_S
    path: str | None = None  # where to look for build tools; None: this process's PATH


def sources_from_config(cfg: config.AgentConfig, **overrides: object) -> Sources:
    """Where agent.toml says to look; keyword arguments (a command's flags) win over it."""
    base = Sources(
        ib_root=Path(cfg.ib_root),
        nvidia_smi=cfg.nvidia_smi,
        sminfo=cfg.sminfo,
        weights_dir=Path(config.weights_dir_of(cfg)),
    )
    return attrs.evolve(base, **{k: v for k, v in overrides.items() if v is not None})


@attrs.frozen(kw_only=True)
class Snapshot:
    hostname: str
    os: str
    os_family: str  # "debian", "rhel" or "": which package manager fixes name
    kernel: str
    arch: str  # uname -m
    python: tuple[int, int, int]
    cpu: cpu.CpuInfo | None  # None: /proc/cpuinfo unreadable
    memory: system.MemInfo | None
    disk: system.DiskInfo | None
    clock: system.ClockInfo
    systemd: bool  # systemd is the init (`systemd_dir` exists)
    pci: gpus.NvidiaPci | None  # None: the PCI bus could not be read
    gpus: gpus.GpuReport
    ib: infiniband.IbReport
    vulkan: vulkan.VulkanReport
    modules: frozenset[str] | None  # None: /proc/modules unreadable
    commands: frozenset[str] | None  # running processes' names; None: /proc unreadable
    # What a build of llama.cpp would need and is not on PATH (empty: all there), and nvcc.
    build_missing: tuple[str, ...] = ()
    nvcc: str = ""


def discover(src: Sources) -> Snapshot:
    pci = gpus.read_nvidia_pci(src.pci_root)
    tools = toolchain.probe_tools(
        toolchain.which_on(src.path if src.path is not None else os.environ.get("PATH", os.defpath))
    )
    return Snapshot(
        hostname=socket.gethostname(),
        os=system.os_name(src.os_release),
        os_family=system.os_family(src.os_release),
        kernel=platform.release(),
        arch=system.machine(),
        python=tuple(sys.version_info[:3]),  # type: ignore[arg-type]
        cpu=cpu.read_cpuinfo(src.proc_root),
        memory=system.read_memory(src.proc_root, src.cgroup_root),
        disk=system.disk_free(src.weights_dir),
        clock=system.read_clock(),
        systemd=src.systemd_dir.is_dir(),
        pci=pci,
        gpus=gpus.probe_gpus(src.nvidia_smi, pci, timeout_s=src.tool_timeout_s),
        ib=infiniband.probe_infiniband(src.ib_root, sminfo=src.sminfo, ip=src.ip, timeout_s=src.tool_timeout_s),
        vulkan=vulkan.probe_vulkan(src.vulkaninfo, src.dri_dir, timeout_s=src.tool_timeout_s),
        modules=system.loaded_modules(src.proc_root),
        commands=system.running_commands(src.proc_root),
        build_missing=tools.missing,
        nvcc=tools.nvcc,
    )
