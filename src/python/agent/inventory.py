"""What this machine is, as the agent reports it in `hello`: host, OS, CPU, memory.

Reads /proc and `platform`; paths are parameters so tests can point them at fixtures.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

from llmgw.wire.agent_link import Inventory


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, int, tuple[str, ...]]:
    """(model name, logical cores, flags) from /proc/cpuinfo; flags of the first processor."""
    model, flags, cores = "", (), 0
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or "unknown", os.cpu_count() or 0, ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cores += 1
        elif key in ("model name", "Model", "cpu model") and not model:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = tuple(sorted(value.split()))
    return model or "unknown", cores or (os.cpu_count() or 0), flags


def memory_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def os_name(os_release: Path = Path("/etc/os-release")) -> str:
    try:
        for line in os_release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}"


def collect() -> Inventory:
    model, cores, flags = cpu_info()
    return Inventory(
        hostname=socket.gethostname(),
        os=os_name(),
        arch=platform.machine(),
        python=platform.python_version(),
        cpu_model=model,
        cpu_cores=cores,
        cpu_flags=flags,
        memory_total_bytes=memory_total_bytes(),
    )
