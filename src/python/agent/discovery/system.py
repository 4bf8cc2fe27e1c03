"""The rest of the machine: OS, memory, free disk where weights go, the clock, loaded kernel
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
