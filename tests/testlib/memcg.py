"""A memory cgroup with a limit, for a test's node whose memory must be less than its machine's:
a node's agent started inside it (`enter`: a command prefix), its engines with it (children stay
in their parent's cgroup), as an operator's container or a systemd unit with MemoryMax= confines
them. The agent reports the limit as its node's memory (agent.discovery.system.read_memory).

cgroup v2 where the unified hierarchy at /sys/fs/cgroup has the memory controller (memory.max,
swap off with memory.swap.max = 0); else cgroup v1's memory controller at /sys/fs/cgroup/memory
(memory.limit_in_bytes), as on a host with systemd's hybrid layout. `stop()` (the context's exit)
kills what is left inside and removes the cgroup, bounded. Needs root (`preflight`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
STOP_TIMEOUT_S = 10.0


def _v2_has_memory() -> bool:
    try:
        return "memory" in (ROOT / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def preflight() -> str:
    """Why a memory cgroup cannot be made here, or "" when it can (a test fails with it: never a skip)."""
    if os.geteuid() != 0:
        return "memory cgroups need root: run the suite as root (CI does)"
    if not _v2_has_memory() and not (ROOT / "memory" / "memory.limit_in_bytes").is_file():
        return f"no cgroup memory controller under {ROOT} (neither v2's memory.max nor v1's memory/)"
    return ""


class MemoryCgroup:
    def __init__(self, name: str, limit_bytes: int) -> None:
        self.v2 = _v2_has_memory()
        base = ROOT if self.v2 else ROOT / "memory"
        self.path = base / f"llmgw-test-{os.getpid()}-{name}"
        self.limit_bytes = limit_bytes

    def __enter__(self) -> MemoryCgroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.v2:
            control = ROOT / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        self.path.mkdir()
        try:
            if self.v2:
                (self.path / "memory.max").write_text(str(self.limit_bytes))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        except BaseException:
            self.stop()
            raise

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def enter(self) -> list[str]:
        """A command prefix that moves the command into this cgroup, then execs it (its pid stays)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs)]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except OSError:
            return []

    def usage_bytes(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit (`oom_kill` of v2's memory.events,
        of v1's memory.oom_control)."""
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill(self) -> None:
        """SIGKILL everything inside (a machine's power cut), until none is left or the bound passes."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def stop(self) -> None:
        self.kill()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.path.exists() and time.monotonic() < deadline:
            try:
                self.path.rmdir()
            except OSError:
                time.sleep(0.05)  # the last process is still being reaped
