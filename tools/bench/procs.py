"""The processes `tools/bench/gateway.py` starts and reads: the canned upstream
(`rawhttp upstream`), CPU time and RSS from /proc, and stopping them.

Every process is on loopback and is stopped by whoever started it (SIGTERM, then SIGKILL after a
deadline); every wait for one to start is bounded (it prints once it listens, or exits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench import rawhttp

from testlib.ports import free_port  # not from the ephemeral range, which the load's connections use

STOP_S = 10.0


def child_env() -> dict[str, str]:
    """This process's environment with its sys.path as PYTHONPATH, so a child imports the same code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


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


def machine_busy_s() -> float:
    """CPU time every core of this machine has spent on anything but idling, so far."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
