"""The processes a test's node left, found by the marker its agent carries in its environment
(`MARKER_ENV`, set by `testlib.cluster.Cluster` and inherited by the agent's engines and tool
runs): every marked process, the engines among them, and their process groups killed as a dead
machine's would be. The product never reads the marker.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from pathlib import Path

MARKER_ENV = "LLMGW_TESTLIB_NODE"


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment has `MARKER_ENV=marker` (an agent and its engines)."""
    want = f"{MARKER_ENV}={marker}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if want in environ.split(b"\0"):
            out.append(int(entry.name))
    return sorted(out)


def marked_engines(marker: str) -> list[int]:
    """The marked processes that are engines: those given a port to serve (`--port`). An agent's
    short-lived tool runs carry the marker too (`nvidia-smi`, `llmgw engine sim --version` at
    each start), and a poll that counted them would see an engine start that never happened."""
    out = []
    for pid in marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"--port" in argv:
            out.append(pid)
    return out


def kill_groups(pids: Iterable[int]) -> None:
    """SIGKILL the process group of each pid (an engine leads its own), and the pid itself. An
    agent and its short-lived tool runs share the test's own group: that one is left alone."""
    for pid in pids:
        try:
            group = os.getpgid(pid)
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
