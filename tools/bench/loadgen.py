"""The load generators of `tools/bench/gateway.py`: wrk (Debian's `wrk`, C and epoll) where it
is installed, else `rawhttp load` processes (Python, epoll over raw sockets). Both are closed
loops: C keep-alive connections, each sending the next chat request as soon as the last answer
is in, for a whole number of seconds (wrk's unit); both say how many answers came (200s), how
many failed, over how long, with how much CPU of their own, and optionally every answer's
latency as a histogram ([microseconds, count] pairs, ascending), so blocks of runs can be merged
before percentiles are taken. Both are bounded: wrk by its duration and a process timeout, rawhttp
also by a request count.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench import rawhttp
from bench.procs import child_env

MAX_RUN_REQUESTS = 2_000_000  # rawhttp's bound on one run's requests (wrk's is its duration)
SLACK_S = 30.0  # beyond a run's own duration and drain, before the process is given up on
WRK_TIMEOUT = "10s"  # an answer slower than this is wrk's `timeout` error
MARK = "BENCH-JSON "

# The request and, once wrk has joined its threads, the figures as one JSON line (after wrk's own
# summary). `latency(i)` is the i-th distinct latency in microseconds and how many answers took it.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = [==[Bearer {token}]==]

function done(summary, latency, requests)
  local parts = {{}}
  if {want_latency} then
    for i = 1, #latency do
      local value, count = latency(i)
      parts[#parts + 1] = string.format("[%.0f,%.0f]", value, count)
    end
  end
  local e = summary.errors
  io.write(string.format(
    '\\n{mark}{{"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,"connect":%.0f,"read":%.0f,'
      .. '"write":%.0f,"status":%.0f,"timeout":%.0f,"latency_us":[%s]}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    table.concat(parts, ",")))
end
"""


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Wrk:
    name = "wrk"

    def __init__(self, path: str, tmp: Path) -> None:
        self.path, self.tmp = path, tmp
        # `wrk -v` prints "wrk 4.1.0 [epoll] Copyright ..." (and exits 1: no URL).
        done = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=10, check=False)
        self.version = (done.stdout + done.stderr).strip().split(" [")[0] or "wrk"

    def run(self, port: int, token: str, *, connections: int, seconds: int, latencies: bool = False) -> dict:
        script = self.tmp / "bench.lua"
        body = rawhttp.chat_body(stream=False).decode()
        script.write_text(WRK_SCRIPT.format(body=body, token=token, want_latency=str(latencies).lower(), mark=MARK))
        argv = [self.path, "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--timeout", WRK_TIMEOUT]
        argv += ["-s", str(script), f"http://127.0.0.1:{port}/v1/chat/completions"]
        # wrk is the only child reaped meanwhile: the difference is its CPU time.
        before = children_cpu_s()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + SLACK_S, check=False)
        cpu = children_cpu_s() - before
        found = [line[len(MARK) :] for line in done.stdout.splitlines() if line.startswith(MARK)]
        if done.returncode != 0 or not found:
            raise SystemExit(
                f"wrk exited {done.returncode} without its figures:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        r = json.loads(found[-1])
        errors = {k: r[k] for k in ("connect", "read", "write", "status", "timeout") if r[k]}
        out = {
            "requests": r["requests"] - r["status"],  # wrk counts non-2xx answers among its requests
            "failed": sum(errors.values()),
            "seconds": r["duration_us"] / 1e6,
            "cpu_s": cpu,
        }
        if errors:
            out["first_failure"] = f"wrk's errors: {errors}"
        if latencies:
            out["latency_us"] = [tuple(pair) for pair in r["latency_us"]]
        return out


class RawHttp:
    name = "rawhttp"
    version = "tools/bench/rawhttp.py load"

    def __init__(self, processes: int = 2) -> None:
        self.processes = processes

    def run(self, port: int, token: str, *, connections: int, seconds: int, latencies: bool = False) -> dict:
        return generate(
            port, token, connections=connections, seconds=seconds, processes=self.processes, latencies=latencies
        )


def generator(choice: str, tmp: Path) -> Wrk | RawHttp:
    """`auto`: wrk where it is on PATH, else rawhttp."""
    path = shutil.which("wrk")
    if choice == "wrk" or (choice == "auto" and path):
        if not path:
            raise SystemExit("--generator wrk: no wrk on PATH; install it (apt-get install wrk) or use rawhttp")
        return Wrk(path, tmp)
    return RawHttp()


def generate(
    port: int,
    token: str,
    *,
    connections: int,
    seconds: float,
    processes: int,
    max_requests: int = MAX_RUN_REQUESTS,
    stream: bool = False,
    latencies: bool = False,
    drain_s: float = rawhttp.DRAIN_S,
) -> dict:
    """`rawhttp load` from `processes` processes at once, `connections` and `max_requests` shared
    among them: their figures summed (latencies merged; `seconds` the longest)."""
    procs = []
    for i in range(processes):
        share = connections // processes + (i < connections % processes)
        most = max_requests // processes + (i < max_requests % processes)
        if not share or not most:
            continue
        argv = [sys.executable, "-m", rawhttp.__name__, "load", "--port", str(port), "--token", token]
        argv += ["--connections", str(share), "--seconds", str(seconds), "--max-requests", str(most)]
        argv += ["--drain-s", str(drain_s)] + ["--stream"] * stream + ["--latencies"] * latencies
        procs.append(
            subprocess.Popen(
                argv,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + drain_s + SLACK_S)
            if proc.returncode != 0:
                raise SystemExit(f"the load generator failed ({proc.returncode}): {err[-2000:]}")
            results.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    merged = {
        "requests": sum(r["requests"] for r in results),
        "failed": sum(r["failed"] for r in results),
        "seconds": max(r["seconds"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "events": sum(r["events"] for r in results),
    }
    failures = [r["first_failure"] for r in results if "first_failure" in r]
    if failures:
        merged["first_failure"] = failures[0]
    if latencies:
        merged["latency_us"] = merge([r["latency_us"] for r in results])
    return merged


def merge(histograms: list[list]) -> list[tuple[int, int]]:
    total: Counter[int] = Counter()
    for histogram in histograms:
        for value, count in histogram:
            total[int(value)] += int(count)
    return sorted(total.items())


def percentile_ms(histogram: list[tuple[int, int]], q: float) -> float:
    """The `q` quantile (0..1) of a [microseconds, count] histogram, in ms: the value of the
    answer at rank int(q * n) of n in ascending order."""
    n = sum(count for _, count in histogram)
    if not n:
        raise ValueError("an empty histogram has no percentiles")
    rank, seen = min(n - 1, int(q * n)), 0
    for value, count in histogram:
        seen += count
        if seen > rank:
            return value / 1000
    raise AssertionError("unreachable: the ranks are within the counts")
