"""The rest of the machine: OS, memory (bounded by the cgroup limit the agent runs under), free
disk where weights go, the clock, loaded kernel
modules and running daemons. Each reader takes its path as a parameter and returns None (or
an "unknown" value) when it cannot tell, so a check can say "could not check" instead of
passing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import time
from pathlib import Path

import attrs

# adjtimex(2) returns TIME_ERROR when the kernel's clock is not synchronized (STA_UNSYNC).
_TIME_ERROR = 5


@attrs.frozen(kw_only=True)
class MemInfo:
    total_bytes: int
    available_bytes: int
    # The cgroup whose limit bounds these ("/system.slice/llmgw-agent.service", v2 or v1's
    # memory controller), "" when /proc/meminfo's figures stand.
    cgroup: str = ""


@attrs.frozen(kw_only=True)
class CgroupMemory:
    """The memory limit this process lives under: the least limit of its cgroup and the cgroups
    above it (a slice's MemoryMax= bounds its units), and the least room left under one of them."""

    path: str  # the cgroup whose limit is the least, as /proc/self/cgroup names it
    limit_bytes: int
    free_bytes: int


@attrs.frozen(kw_only=True)
class DiskInfo:
    path: str  # where weights go
    measured_at: str  # the nearest existing directory, on the same filesystem once created
    free_bytes: int
    total_bytes: int


@attrs.frozen(kw_only=True)
class ClockInfo:
    now: float  # unix time
    synchronized: bool | None  # None: the kernel cannot be asked (not Linux)


def os_name(os_release: Path) -> str:
    try:
        for line in os_release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}"


def os_family(os_release: Path) -> str:
    """Which package manager a fix should name: "debian" (apt), "rhel" (dnf) or "" (either)."""
    try:
        text = os_release.read_text()
    except OSError:
        return ""
    ids = " ".join(
        line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith(("ID=", "ID_LIKE="))
    ).split()
    if {"debian", "ubuntu"} & set(ids):
        return "debian"
    if {"rhel", "fedora", "centos", "rocky", "almalinux"} & set(ids):
        return "rhel"
    return ""


def parse_meminfo(text: str) -> MemInfo | None:
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * 1024  # the kernel writes kB, meaning KiB
    if "MemTotal" not in values:
        return None
    return MemInfo(total_bytes=values["MemTotal"], available_bytes=values.get("MemAvailable", values.get("MemFree", 0)))


def read_meminfo(proc_root: Path) -> MemInfo | None:
    try:
        return parse_meminfo((proc_root / "meminfo").read_text())
    except OSError:
        return None


def read_memory(proc_root: Path, cgroup_root: Path) -> MemInfo | None:
    """The machine's memory (`/proc/meminfo`) bounded by the cgroup limit this process runs under
    (`read_cgroup_memory`): in a container or a systemd unit with MemoryMax=, what the agent and
    its engines may use is the limit, not the machine."""
    mem = read_meminfo(proc_root)
    if mem is None:
        return None
    cg = read_cgroup_memory(proc_root, cgroup_root)
    if cg is None or cg.limit_bytes >= mem.total_bytes:
        return mem
    return MemInfo(
        total_bytes=cg.limit_bytes,
        available_bytes=max(0, min(mem.available_bytes, cg.free_bytes)),
        cgroup=cg.path,
    )


# Per hierarchy: the file of the limit, the file of what is in use, and what "no limit" reads as.
# cgroup v2 writes "max"; v1's memory controller a number near 2**63 (min() with MemTotal sees to it).
_V2 = ("memory.max", "memory.current")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def read_cgroup_memory(proc_root: Path, cgroup_root: Path) -> CgroupMemory | None:
    """The memory limit over this process (`proc_root`/self/cgroup), read under `cgroup_root`
    (/sys/fs/cgroup): cgroup v2's memory.max and memory.current where the unified hierarchy
    (`0::PATH`) has the memory controller, else v1's memory controller (`N:memory:PATH`, mounted at
    `cgroup_root`/memory) with memory.limit_in_bytes and memory.usage_in_bytes. The cgroup's
    directory and each one above it up to the root count; a path that is not there (a container
    whose cgroup is mounted as the root, without a cgroup namespace) is read at the root alone.
    None: no limit, or nothing readable."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = v1 = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if line.startswith("0::"):
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    found = None
    if v2 is not None:
        found = _limit_on_path(cgroup_root, v2, _V2) or _limit_on_path(cgroup_root / "unified", v2, _V2)
    if found is None and v1 is not None:
        found = _limit_on_path(cgroup_root / "memory", v1, _V1)
    return found


def _limit_on_path(root: Path, path: str, files: tuple[str, str]) -> CgroupMemory | None:
    parts = [p for p in path.split("/") if p]
    here = root.joinpath(*parts)
    if not here.is_dir():
        parts = []
    limit_name, current_name = files
    best: CgroupMemory | None = None
    for depth in range(len(parts), -1, -1):
        directory = root.joinpath(*parts[:depth])
        try:
            raw = (directory / limit_name).read_text().strip()
        except OSError:
            continue  # the root of a v2 hierarchy has no memory.max; a hierarchy without the controller none
        if raw == "max" or not raw.isdigit():
            continue
        limit = int(raw)
        try:
            current = int((directory / current_name).read_text().strip())
        except (OSError, ValueError):
            current = 0
        named = "/" + "/".join(parts[:depth])
        if best is None or limit < best.limit_bytes:
            best = CgroupMemory(path=named, limit_bytes=limit, free_bytes=max(0, limit - current))
        else:
            best = attrs.evolve(best, free_bytes=min(best.free_bytes, max(0, limit - current)))
    return best


def disk_free(weights_dir: Path) -> DiskInfo | None:
    # The weights directory need not exist before the agent first runs; its nearest existing
    # parent is on the filesystem it will be created on (unless a mount is made in between).
    here = weights_dir
    while not here.is_dir() and here != here.parent:
        here = here.parent
    try:
        usage = shutil.disk_usage(here)
    except OSError:
        return None
    return DiskInfo(path=str(weights_dir), measured_at=str(here), free_bytes=usage.free, total_bytes=usage.total)


def kernel_clock_synchronized() -> bool | None:
    try:
        adjtimex = ctypes.CDLL(None, use_errno=True).adjtimex
    except (OSError, AttributeError):
        return None
    # struct timex is about 200 bytes; zeroed, its first field (modes = 0) makes this a read.
    buf = ctypes.create_string_buffer(1024)
    state = adjtimex(buf)
    if state < 0:
        return None
    return state != _TIME_ERROR


def read_clock() -> ClockInfo:
    return ClockInfo(now=time.time(), synchronized=kernel_clock_synchronized())


def loaded_modules(proc_root: Path) -> frozenset[str] | None:
    try:
        text = (proc_root / "modules").read_text()
    except OSError:
        return None
    return frozenset(line.split()[0] for line in text.splitlines() if line.strip())


def running_commands(proc_root: Path) -> frozenset[str] | None:
    """The command names (/proc/PID/comm, at most 15 characters) of every process we can see."""
    try:
        entries = list(os.scandir(proc_root))
    except OSError:
        return None
    names = set()
    for entry in entries:
        if entry.name.isdigit():
            try:
                names.add(Path(entry.path, "comm").read_text().strip())
            except OSError:
                continue  # exited while we looked
    return frozenset(names)


def machine() -> str:
    """`uname -m`: the architecture releases are built for."""
    return os.uname().machine
