"""The processes `tools/bench/gateway.py` starts and reads: the canned upstream
(`rawhttp upstream`), CPU time and RSS from /proc, and stopping them.

Every process is on loopback and is stopped by whoever started it (SIGTERM, then SIGKILL after a
deadline); every wait for one to start is bounded (it prints once it listens, or exits).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

from bench import rawhttp

from testlib.ports import free_port  # not from the ephemeral range, which the load's connections use

STOP_S = 10.0


def child_env(python: str | None = None) -> dict[str, str]:
    """This process's environment with its sys.path as PYTHONPATH, so a child imports the same
    code; for a child run by another interpreter (`python`, of this one's version) that path
    without this interpreter's standard library, which the other has its own of."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if python is not None and python != sys.executable:
        stdlib = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
        paths = [p for p in paths if p not in stdlib and not p.endswith((".zip", "lib-dynload"))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# The search path of a systemd unit's processes (systemd's default): where the zipapp's
# `#!/usr/bin/env python3` finds its interpreter when a node's service runs it.
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def gateway_python(choice: str) -> tuple[str, str]:
    """The interpreter the gateway processes run under, and its version. `auto`: the `python3`
    a node's service runs the zipapp with (on `SERVICE_PATH`, not this shell's PATH, which may
    hold pyenv's shims or a virtualenv), so the figures are the shipped gateway's, when it is
    this interpreter's major.minor, whose packages it then shares; else this interpreter.
    `current`: this interpreter. Else a path or a name on PATH, which must be this
    interpreter's major.minor."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if choice == "current":
        return sys.executable, platform.python_version()
    path = shutil.which("python3", path=SERVICE_PATH) if choice == "auto" else shutil.which(choice)
    version = _version_of(path) if path else None
    if version is not None and version.rpartition(".")[0] == mine:
        return path, version
    if choice == "auto":
        return sys.executable, platform.python_version()
    found = f"Python {version}" if version else "nothing that runs"
    raise SystemExit(f"--python {choice}: found {found}; the gateway needs Python {mine}, as this bench runs on")


def _version_of(path: str) -> str | None:
    try:
        done = subprocess.run(
            [path, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_s(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)


class CannedUpstream:
    """`rawhttp upstream`: a non-streamed request answered at once with one fixed chat
    completion; a streamed one with `events` events, `gap_ms` apart."""

    # What the gateway's table names it by (`testlib.gatewaytable.route`) and the runner's spec.
    name, model, host, key = "canned", "chat", "127.0.0.1", "canned"

    def __init__(self, processes: int = 1, *, events: int = 16, gap_ms: float = 0.0) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", rawhttp.__name__, "upstream", "--port", str(self.port)]
            + ["--processes", str(processes), "--events", str(events), "--event-gap-ms", str(gap_ms)],
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: it prints once every process listens, or exits
        if not line:
            raise SystemExit(f"the canned upstream exited with {self.proc.wait(STOP_S)} before listening")
        self.pids = json.loads(line)["pids"]

    def endpoint(self) -> dict:
        """As `gateway_runner`'s spec names an endpoint."""
        return {"replica_id": self.name, "model": self.model, "host": self.host, "port": self.port, "api_key": self.key}

    def cpu_s(self) -> float:
        return sum(cpu_s(pid) for pid in self.pids)


def machine_steal_s() -> float:
    """CPU time the hypervisor has given this machine's cores to others while they had work,
    so far, over every core (0 on bare metal): a run with much of it measured a busy host."""
    return int(Path("/proc/stat").read_text().split()[8]) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU time every core of this machine has spent on anything but idling, so far."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
