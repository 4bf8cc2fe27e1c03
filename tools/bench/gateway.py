"""What the gateway costs: the same load straight to a sim engine and through the gateway, in one run.

    PYTHONPATH=src/python:tests:tools python3 tools/bench/gateway.py [--requests N] [--streams S]
        [--workers N] [--workers-seconds S] [--workers-rounds R] [--workers-only]

Loopback only. In phases 1-4 the gateway runs in a process of its own
(`tools/bench/gateway_runner.py`: one process, where `llmgw gateway` has a parent and a worker),
so its CPU time and memory are its own (read from /proc/PID/stat and /proc/PID/status); the
engines are `llmgw engine sim` processes; the load comes from this process (trio + h11, keep-alive
connections). Phases, each with a fixed number of requests (or seconds) and a deadline:

1. latency at concurrency 1: N non-streamed requests one after another, direct and through the
   gateway in alternating blocks; the added latency is the difference of the percentiles;
2. throughput at concurrency 64: the same N requests over 64 connections, direct then gateway;
3. SSE relay: streamed requests of 256 tokens at concurrency 16; events relayed per second of the
   gateway's CPU time (user + system);
4. open streams: S streams held open at once through a fresh gateway to an engine with a slow
   `--output-token-ms`; the gateway's RSS before and with all of them open; a stream refused
   is counted (`streams_failed`, the first such answer in `streams_first_failure`), not waited on;
5. workers: the product's own gateway, `llmgw gateway --table-file TABLE --workers 1` and then
   `--workers N` (a parent and its worker processes sharing one port with SO_REUSEPORT), in
   front of a canned-response upstream, loaded by generator processes (`tools/bench/rawhttp.py`:
   raw-socket epoll loops, so the gateway is what is measured and not the engine or the client)
   on 32 keep-alive connections per worker for S seconds, R times each in turn: the throughput
   with N workers over 1 (`workers_scaling`) and the CPU per request (user + system of the
   parent and every process under it, over the measured window) with 1 and with N, each the
   median of its R runs.

Prints one JSON object: the settings, the figures and whether each meets its target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h11
import trio
from bench import gateway_runner, rawhttp

from llmgw.gateway.keys import token_hash
from llmgw.wire.gateway_link import GatewayKey
from testlib.gatewaytable import write_table_file
from testlib.ports import free_port  # not from the ephemeral range, which the load's connections use

MAX_REQUESTS = 20_000
MAX_STREAMS = 8_000
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 40.0  # `llmgw gateway`'s stop: its workers' drain (nothing in flight by then) and exit
PHASE_TIMEOUT_S = 180.0
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
TARGETS = {
    "added_latency_p50_ms": 1.0,
    "throughput_ratio": 0.5,
    "sse_chunks_per_cpu_second": 50_000,
    "rss_mib": 1024,
    "workers_scaling": 1.3,  # throughput with 2 workers over 1
    "workers_cpu_per_request_ratio": 1.10,  # CPU per request with 2 workers over 1: no shared bottleneck
}
MAX_WORKERS = 8
# Closed loop, the same load on each worker with 1 as with N (so what differs is only how many
# there are): enough connections for a worker always to have requests waiting.
CONNECTIONS_PER_WORKER = 32
LOAD_PROCESSES = 2  # the generator's processes (it is cheap, but one core's loop must never be the limit)
WARMUP_S = 1.0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class Sim:
    def __init__(self, name: str, *flags: str) -> None:
        self.name, self.port, self.key = name, free_port(), f"key-{name}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "engine", "sim", "--model", "chat", "--port", str(self.port)]
            + ["--api-key", self.key, *flags],
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def endpoint(self) -> dict:
        return {"replica_id": self.name, "model": "chat", "host": "127.0.0.1", "port": self.port, "api_key": self.key}


def cpu_s(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class GatewayProc:
    def __init__(self, tmp: Path, name: str, upstreams: list) -> None:
        """A gateway runner in front of `upstreams` (each with `endpoint()`), on a free port."""
        spec = tmp / f"{name}.json"
        spec.write_text(json.dumps({"endpoints": [u.endpoint() for u in upstreams]}))
        log = tmp / f"{name}.log"
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", gateway_runner.__name__, str(spec)],
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the runner prints once it listens, or exits
        if not line:
            tail = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the gateway runner exited with {self.proc.wait(10)} before listening:\n{tail}")
        info = json.loads(line)
        self.port, self.token, self.pid = info["port"], info["token"], self.proc.pid

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Client:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.stream: trio.SocketStream | None = None
        self.conn = h11.Connection(h11.CLIENT)

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        headers = [
            ("host", "bench"),
            ("content-type", "application/json"),
            ("authorization", f"Bearer {self.token}"),
            ("content-length", str(len(body))),
        ]
        conn = self.conn
        out = conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
        await self.stream.send_all(out + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, data = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise RuntimeError(f"unexpected {event!r}")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return status, bytes(data)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
        self.stream, self.conn = None, h11.Connection(h11.CLIENT)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(port: int, token: str, count: int, body: bytes) -> list[float]:
    client, times = Client(port, token), []
    try:
        for _ in range(count):
            started = time.perf_counter()
            status, data = await client.post(body)
            times.append(time.perf_counter() - started)
            if status != 200:
                raise SystemExit(f"answer {status}: {data[:200]!r}")
    finally:
        await client.aclose()
    return times


async def concurrent(port: int, token: str, count: int, concurrency: int, body: bytes) -> tuple[float, int]:
    """(wall seconds, SSE events received) for `count` requests over `concurrency` connections."""
    remaining, events = [count], [0]

    async def worker() -> None:
        client = Client(port, token)
        try:
            while remaining[0] > 0:
                remaining[0] -= 1
                status, data = await client.post(body)
                if status != 200:
                    raise SystemExit(f"answer {status}: {data[:200]!r}")
                events[0] += data.count(b"\n\n")
        finally:
            await client.aclose()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - started, events[0]


def stream_answer(got: bytes) -> bool | None:
    """Whether the answer begun in `got` is an open stream: True once a 200 head and its first
    event are in, False once another head is (a 503, say, whose connection stays open: waiting
    for an event there would wait forever), None while it cannot tell yet."""
    head, sep, rest = got.partition(b"\r\n\r\n")
    if not sep:
        return None
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        return False
    return True if b"data: " in rest else None


async def hold_streams(gw: GatewayProc, count: int) -> dict:
    """Open `count` streams through the gateway, measure its RSS with all open (or refused: a
    failure is counted, with the first one's answer, and does not hold the phase), then close
    them."""
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 64}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {gw.token}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    opened, failed = [0], []
    all_answered = trio.Event()
    connecting = trio.Semaphore(200)  # below the listen backlog

    def answered() -> None:
        if opened[0] + len(failed) == count:
            all_answered.set()

    async def one() -> None:
        async with connecting:
            stream = await trio.open_tcp_stream("127.0.0.1", gw.port)
            await stream.send_all(request)
            got, state = b"", None
            while state is None:
                data = await stream.receive_some(65536)
                if not data:
                    break
                got += data
                state = stream_answer(got)
        if not state:
            failed.append(got[:300].decode(errors="replace"))
            stream.socket.close()
            answered()
            return
        opened[0] += 1
        answered()
        try:
            await trio.sleep_forever()
        finally:
            stream.socket.close()

    rss_before = gw.rss_mib()
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
        await all_answered.wait()
        open_s = time.perf_counter() - started
        await trio.sleep(1.0)  # let the last streams' buffers settle before reading RSS
        rss = gw.rss_mib()
        nursery.cancel_scope.cancel()
    return {
        "streams_open": opened[0],
        "streams_failed": len(failed),
        **({"streams_first_failure": failed[0]} if failed else {}),
        "streams_open_s": round(open_s, 1),
        "rss_idle_mib": round(rss_before, 1),
        "rss_mib": round(rss, 1),
    }


async def bench(args: argparse.Namespace, tmp: Path) -> dict:
    fast = Sim("fast")
    sims = [fast]
    gateways: list[GatewayProc] = []
    try:
        gw = GatewayProc(tmp, "gw", [fast])
        gateways.append(gw)
        body = json.dumps(CHAT).encode()
        with trio.fail_after(READY_TIMEOUT_S):
            while True:  # the engine is up once it answers
                try:
                    await sequential(fast.port, fast.key, 1, body)
                    break
                except (OSError, SystemExit):
                    await trio.sleep(0.1)
        out: dict = {}
        n = args.requests
        with trio.fail_after(PHASE_TIMEOUT_S):
            await sequential(fast.port, fast.key, 200, body)  # warm-up
            await sequential(gw.port, gw.token, 200, body)
            direct, through = [], []
            for _ in range(10):
                direct += await sequential(fast.port, fast.key, n // 10, body)
                through += await sequential(gw.port, gw.token, n // 10, body)
            for name, times in (("direct", direct), ("gateway", through)):
                out[f"{name}_latency_p50_ms"] = round(pct(times, 0.5) * 1000, 3)
                out[f"{name}_latency_p99_ms"] = round(pct(times, 0.99) * 1000, 3)
            out["added_latency_p50_ms"] = round(out["gateway_latency_p50_ms"] - out["direct_latency_p50_ms"], 3)
            out["added_latency_p99_ms"] = round(out["gateway_latency_p99_ms"] - out["direct_latency_p99_ms"], 3)

        with trio.fail_after(PHASE_TIMEOUT_S):
            direct_s, _ = await concurrent(fast.port, fast.key, n, 64, body)
            through_s, _ = await concurrent(gw.port, gw.token, n, 64, body)
        out["direct_rps_c64"] = round(n / direct_s)
        out["gateway_rps_c64"] = round(n / through_s)
        out["throughput_ratio"] = round(direct_s / through_s, 3)

        streamed = json.dumps({**CHAT, "stream": True, "max_tokens": 256, "ignore_eos": True}).encode()
        with trio.fail_after(PHASE_TIMEOUT_S):
            cpu0, wall0 = gw.cpu_s(), time.perf_counter()
            _, events = await concurrent(gw.port, gw.token, args.sse_requests, 16, streamed)
            cpu, wall = gw.cpu_s() - cpu0, time.perf_counter() - wall0
        out["sse_events"] = events
        out["sse_gateway_cpu_s"] = round(cpu, 2)
        out["sse_wall_s"] = round(wall, 2)
        out["sse_chunks_per_wall_second"] = round(events / wall)
        out["sse_chunks_per_cpu_second"] = round(events / cpu) if cpu else None

        if args.streams:
            slow = Sim("slow", "--output-token-ms", "2000")
            sims.append(slow)
            gw2 = GatewayProc(tmp, "gw-streams", [slow])
            gateways.append(gw2)
            with trio.fail_after(READY_TIMEOUT_S):
                while True:
                    try:
                        await sequential(slow.port, slow.key, 1, json.dumps({**CHAT, "max_tokens": 1}).encode())
                        break
                    except (OSError, SystemExit):
                        await trio.sleep(0.1)
            with trio.fail_after(PHASE_TIMEOUT_S):
                held = await hold_streams(gw2, args.streams)
            out.update({k if k.startswith("streams") else f"streams_{k}": v for k, v in held.items()})
            out[f"streams_{args.streams}_rss_mib"] = held["rss_mib"]
        return out
    finally:
        for g in gateways:
            stop(g.proc)
        for s in sims:
            stop(s.proc)


class CannedUpstream:
    """`rawhttp upstream`: every request answered at once with one fixed chat completion."""

    def __init__(self, processes: int = 1) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", rawhttp.__name__, "upstream", "--port", str(self.port)]
            + ["--processes", str(processes)],
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: it prints once every process listens, or exits
        if not line:
            raise SystemExit(f"the canned upstream exited with {self.proc.wait(10)} before listening")
        self.pids = json.loads(line)["pids"]

    # What the gateway's table names it by (`testlib.gatewaytable.route`).
    name, model, host, key = "canned", "chat", "127.0.0.1", "canned"

    def cpu_s(self) -> float:
        return sum(cpu_s(pid) for pid in self.pids)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` now (its children, theirs, ...), from /proc/PID/task/TID/children."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue  # the thread (or the process) ended meanwhile
            found += children
            todo += children
    return found


class ProductGateway:
    """`llmgw gateway --table-file TABLE --workers N` on 127.0.0.1:`port` in front of `upstream`,
    taking the API key `token`: the product's parent process, which starts its workers (the same
    llmgw again, `llmgw.selfexec`) and says their pids in its `gateway_ready` event once every
    one serves. Its log (JSON lines, the workers' too) is `name`.log in `tmp`."""

    def __init__(self, tmp: Path, name: str, upstream: CannedUpstream, *, workers: int, port: int, token: str) -> None:
        table = write_table_file(
            tmp / f"{name}.json", [upstream], keys=(GatewayKey(name="bench", token_sha256=token_hash(token)),)
        )
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "--log-format", "json", "gateway", "--table-file", str(table)]
                + ["--listen", f"127.0.0.1:{port}", "--workers", str(workers), "--name", name],
                env=child_env(),
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


def machine_busy_s() -> float:
    """CPU time every core of this machine has spent on anything but idling, so far."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def generate(port: int, token: str, *, connections: int, seconds: float, processes: int) -> dict:
    """`rawhttp load` from `processes` processes at once, `connections` in all: their figures summed."""
    share = [connections // processes + (i < connections % processes) for i in range(processes)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", rawhttp.__name__, "load", "--port", str(port), "--token", token]
            + ["--connections", str(n), "--seconds", str(seconds)],
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in share
        if n
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + rawhttp.DRAIN_S + READY_TIMEOUT_S)
        if proc.returncode != 0:
            raise SystemExit(f"the load generator failed ({proc.returncode}): {err[-2000:]}")
        results.append(json.loads(out))
    return {
        "requests": sum(r["requests"] for r in results),
        "failed": sum(r["failed"] for r in results),
        "seconds": max(r["seconds"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
    }


def measure_workers(tmp: Path, upstream: CannedUpstream, workers: int, seconds: float, connections: int) -> dict:
    """Throughput and CPU per request of `llmgw gateway --workers {workers}`."""
    port, token = free_port(), f"llmgw-bench-{secrets.token_urlsafe(16)}"
    gateway = ProductGateway(tmp, f"workers-{workers}-{port}", upstream, workers=workers, port=port, token=token)
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


def workers_phase(tmp: Path, workers: int, seconds: float, rounds: int) -> dict:
    """Phase 5: 1 worker, then `workers`, `rounds` times in turn (so a change in the machine's
    other load falls on both), against one canned upstream. Each figure is the median of its
    rounds; the per-round figures are kept beside it."""
    upstream = CannedUpstream()
    runs: dict[int, list[dict]] = {1: [], workers: []}
    try:
        for _ in range(rounds):
            for n in runs:
                runs[n].append(measure_workers(tmp, upstream, n, seconds, CONNECTIONS_PER_WORKER * n))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=4000, help="requests per phase 1 and 2 (default: 4000)")
    parser.add_argument("--sse-requests", type=int, default=400, help="streamed requests in phase 3 (default: 400)")
    parser.add_argument("--streams", type=int, default=5000, help="streams held open in phase 4; 0 skips it")
    parser.add_argument("--workers", type=int, default=2, help="phase 5: 1 worker, then this many; 0 skips it")
    parser.add_argument("--workers-seconds", type=float, default=10.0, help="phase 5's window per run (default: 10)")
    parser.add_argument("--workers-rounds", type=int, default=3, help="phase 5's runs of each, in turn (default: 3)")
    parser.add_argument("--workers-only", action="store_true", help="run phase 5 alone")
    args = parser.parse_args(argv)
    if not 10 <= args.requests <= MAX_REQUESTS or not 1 <= args.sse_requests <= MAX_REQUESTS:
        parser.error(f"--requests must be 10..{MAX_REQUESTS}, --sse-requests 1..{MAX_REQUESTS}")
    if not 0 <= args.streams <= MAX_STREAMS:
        parser.error(f"--streams must be 0..{MAX_STREAMS}")
    if args.workers != 0 and not 2 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers must be 2..{MAX_WORKERS} (measured against 1), or 0 to skip phase 5")
    if not 0.1 <= args.workers_seconds <= 120:
        parser.error("--workers-seconds must be 0.1..120")
    if not 1 <= args.workers_rounds <= 20:
        parser.error("--workers-rounds must be 1..20")
    if args.workers_only and not args.workers:
        parser.error("--workers-only runs phase 5, which --workers 0 skips")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * args.streams + 1024  # the gateway holds two sockets per stream; children inherit this
    if hard < needed:
        parser.error(f"--streams {args.streams} needs {needed} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    ok: dict = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        if not args.workers_only:
            figures = trio.run(bench, args, Path(tmp))
            result |= {
                "requests": args.requests,
                "sse_requests": args.sse_requests,
                "sse_max_tokens": 256,
                "streams": args.streams,
                "sim_flags": "zero delays; --output-token-ms 2000 for the open streams",
                **figures,
            }
            ok |= {
                "added_latency_p50": figures["added_latency_p50_ms"] <= TARGETS["added_latency_p50_ms"],
                "throughput_ratio": figures["throughput_ratio"] >= TARGETS["throughput_ratio"],
                "sse_chunks_per_cpu_second": (figures["sse_chunks_per_cpu_second"] or 0)
                >= TARGETS["sse_chunks_per_cpu_second"],
            }
            if args.streams:
                ok["streams_rss"] = figures[f"streams_{args.streams}_rss_mib"] < TARGETS["rss_mib"]
                ok["streams_all_open"] = figures["streams_failed"] == 0
        if args.workers:
            workers = workers_phase(Path(tmp), args.workers, args.workers_seconds, args.workers_rounds)
            result |= workers
            ok["workers_scaling"] = workers["workers_scaling"] >= TARGETS["workers_scaling"]
            ok["workers_cpu_per_request"] = (
                workers["workers_cpu_per_request_ratio"] <= TARGETS["workers_cpu_per_request_ratio"]
            )
    result["targets"] = TARGETS
    result["ok"] = ok
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
