"""Phase 5 of `tools/bench/gateway.py`: the product's own gateway, `llmgw gateway --table-file
TABLE --workers N`, against 1 worker, in front of the canned upstream (`rawhttp upstream`),
loaded by `rawhttp load` processes (docs/performance.md, Workers).

A run is refused, not counted short, when a process of the gateway came or went during its
window (a process that ended took its CPU time with it). Every wait is bounded: the gateway's
start (READY_TIMEOUT_S), its stop (STOP_TIMEOUT_S, then SIGKILL to it and every process under
it), each load run (its window, its drain and a slack).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.loadgen import generate
from bench.procs import CannedUpstream, child_env, cpu_s, machine_busy_s, stop

from llmgw.gateway.keys import token_hash
from llmgw.wire.gateway_link import GatewayKey
from testlib.gatewaytable import write_table_file
from testlib.ports import free_port
from testlib.procfs import descendants

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 40.0  # `llmgw gateway`'s stop: its workers' drain (nothing in flight by then) and exit
MAX_WORKERS = 8
# Closed loop, the same load on each worker with 1 as with N (so what differs is only how many
# there are): enough connections for a worker always to have requests waiting.
CONNECTIONS_PER_WORKER = 32
LOAD_PROCESSES = 2  # the generator's processes (it is cheap, but one core's loop must never be the limit)
WARMUP_S = 1.0


class ProductGateway:
    """`llmgw gateway --table-file TABLE --workers N` on 127.0.0.1:`port` in front of `upstream`,
    taking the API key `token`: the product's parent process, which starts its workers (the same
    llmgw again, `llmgw.selfexec`) and says their pids in its `gateway_ready` event once every
    one serves. Its log (JSON lines, the workers' too) is `name`.log in `tmp`."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        upstream: CannedUpstream,
        *,
        workers: int,
        port: int,
        token: str,
        python: str = sys.executable,
    ) -> None:
        table = write_table_file(
            tmp / f"{name}.json", [upstream], keys=(GatewayKey(name="bench", token_sha256=token_hash(token)),)
        )
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [python, "-m", "llmgw", "--log-format", "json", "gateway", "--table-file", str(table)]
                + ["--listen", f"127.0.0.1:{port}", "--workers", str(workers), "--name", name],
                env=child_env(python),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # a terminal's Ctrl-C goes to the bench, which stops it
            )
        self.pid = self.proc.pid
        try:
            self.worker_pids = self._ready(workers)
        except BaseException:
            self.kill()
            raise

    def _ready(self, workers: int) -> list[int]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for event in self.events("gateway_ready"):
                pids = [int(p) for p in event["pids"].split(",")]
                children = set(descendants(self.pid))
                if len(pids) != workers or not children.issuperset(pids):
                    raise SystemExit(f"gateway_ready names workers {pids}, its processes are {sorted(children)}")
                return pids
            if self.proc.poll() is not None:
                raise SystemExit(f"llmgw gateway exited {self.proc.returncode} before it served:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"llmgw gateway did not serve within {READY_TIMEOUT_S:g} s:\n{self.tail()}")
            time.sleep(0.05)

    def events(self, event: str) -> list[dict]:
        """Its JSON log lines of `event` so far."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line still being written
                if record.get("event") == event:
                    out.append(record)
        return out

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def cpu_s(self) -> dict[int, float]:
        """User + system CPU time so far of the parent and every process under it, by pid."""
        return {pid: cpu_s(pid) for pid in [self.pid, *descendants(self.pid)]}

    def stop(self) -> None:
        """SIGTERM: the parent stops its workers (each drains what is in flight, nothing once the
        load has ended) and exits once they have; SIGKILL to all if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL to the parent and every process under it (workers lead sessions of their own,
        so its process group alone would miss them)."""
        for pid in [*descendants(self.pid), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(STOP_TIMEOUT_S)


def measure_workers(
    tmp: Path, upstream: CannedUpstream, workers: int, seconds: float, connections: int, python: str = sys.executable
) -> dict:
    """Throughput and CPU per request of `llmgw gateway --workers {workers}`, run by `python`."""
    port, token = free_port(), f"llmgw-bench-{secrets.token_urlsafe(16)}"
    gateway = ProductGateway(
        tmp, f"workers-{workers}-{port}", upstream, workers=workers, port=port, token=token, python=python
    )
    try:
        # Every worker's code paths warm and its upstream connections open before the window.
        generate(port, token, connections=connections, seconds=min(WARMUP_S, seconds), processes=LOAD_PROCESSES)
        before = gateway.cpu_s()
        upstream_before, machine_before, wall_before = upstream.cpu_s(), machine_busy_s(), time.monotonic()
        load = generate(port, token, connections=connections, seconds=seconds, processes=LOAD_PROCESSES)
        after = gateway.cpu_s()
        upstream_spent = upstream.cpu_s() - upstream_before
        machine_spent, wall = machine_busy_s() - machine_before, time.monotonic() - wall_before
    finally:
        gateway.stop()
    if after.keys() != before.keys():
        # A process that ended in the window took its CPU time with it: the figure would be low.
        raise SystemExit(
            f"{workers} worker(s): the gateway's processes changed during the window ({sorted(before)} -> "
            f"{sorted(after)}; a worker restarted?):\n{gateway.tail()}"
        )
    if load["failed"] or not load["requests"]:
        raise SystemExit(f"{workers} worker(s): {load['failed']} failed requests, {load['requests']} answered")
    spent = {pid: after[pid] - before[pid] for pid in before}
    gateway_spent = sum(spent.values())
    return {
        "rps": round(load["requests"] / load["seconds"]),
        "requests": load["requests"],
        "cpu_per_request_ms": round(gateway_spent / load["requests"] * 1000, 4),
        "worker_cpu_s": [round(spent[pid], 2) for pid in gateway.worker_pids],  # how evenly the kernel spread them
        "parent_cpu_s": round(spent[gateway.pid], 3),
        "processes": len(spent),  # the parent, its workers and anything they started
        "load_cpu_share": round(load["cpu_s"] / load["seconds"], 3),  # cores the generator took
        "upstream_cpu_share": round(upstream_spent / load["seconds"], 3),
        # Cores busy with anything else meanwhile (other processes, the kernel's own work): a
        # run where this is large measured a shared machine, not the gateway.
        "others_cpu_share": round(max(0.0, machine_spent - gateway_spent - upstream_spent - load["cpu_s"]) / wall, 3),
    }


def workers_phase(tmp: Path, workers: int, seconds: float, rounds: int, python: str = sys.executable) -> dict:
    """Phase 5: 1 worker, then `workers`, `rounds` times in turn (so a change in the machine's
    other load falls on both), against one canned upstream. Each figure is the median of its
    rounds; the per-round figures are kept beside it."""
    upstream = CannedUpstream()
    runs: dict[int, list[dict]] = {1: [], workers: []}
    try:
        for _ in range(rounds):
            for n in runs:
                runs[n].append(measure_workers(tmp, upstream, n, seconds, CONNECTIONS_PER_WORKER * n, python))
    finally:
        stop(upstream.proc)
    out: dict = {"workers": workers, "workers_seconds": seconds, "workers_rounds": rounds}
    out["workers_connections_per_worker"] = CONNECTIONS_PER_WORKER
    for n, figures in runs.items():
        for k in ("rps", "cpu_per_request_ms", "load_cpu_share", "upstream_cpu_share", "others_cpu_share"):
            out[f"workers_{n}_{k}"] = statistics.median(f[k] for f in figures)
        out[f"workers_{n}_requests"] = sum(f["requests"] for f in figures)
        out[f"workers_{n}_rps_rounds"] = [f["rps"] for f in figures]
        out[f"workers_{n}_cpu_per_request_ms_rounds"] = [f["cpu_per_request_ms"] for f in figures]
        out[f"workers_{n}_others_cpu_share_rounds"] = [f["others_cpu_share"] for f in figures]
        out[f"workers_{n}_worker_cpu_s"] = figures[-1]["worker_cpu_s"]  # the last round's spread
        out[f"workers_{n}_parent_cpu_s"] = figures[-1]["parent_cpu_s"]
        out[f"workers_{n}_processes"] = figures[-1]["processes"]
    one, many = out["workers_1_rps"], out[f"workers_{workers}_rps"]
    out["workers_scaling"] = round(many / one, 3)
    cpu_one, cpu_many = out["workers_1_cpu_per_request_ms"], out[f"workers_{workers}_cpu_per_request_ms"]
    out["workers_cpu_per_request_ratio"] = round(cpu_many / cpu_one, 3)
    return out
