"""Tokens per second of a real llama-server, asked directly (no gateway), started through llmgw's
llama.cpp spec.

    ./pants run tools/bench/llamacpp.py -- [--server PATH] [--model GGUF]
        [--requests N] [--concurrency C] [--max-tokens T] [--threads N] [--parallel N]

Without --model it makes the tests' tiny model (tests/testlib/tinygguf.py: 2 layers, 64 wide,
seeded), which measures llama-server's own overhead per token rather than arithmetic. Without
--server it uses $LLMGW_LLAMA_SERVER, or the llama-server tools/llama/build-llama-server keeps
in its cache (the release's portable build, as `./pants test` made it).

Runs one warm-up request, then a single stream (requests one after another) and then
`--concurrency` clients sharing `--requests` requests, every request generating exactly
`--max-tokens` tokens (`ignore_eos`). Prints one JSON object: the settings, and for each phase
the wall time, tokens/s over the wall time, requests/s and latency percentiles. Everything is
bounded: a fixed number of requests, each with a timeout, and the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmgw_release import llamabuild

from llmgw.config import Secret
from llmgw.engines import ReplicaLaunch, build_command
from llmgw.llamarecipe import RecipeError

MAX_REQUESTS = 10_000
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0


class NoServer(Exception):
    """No llama-server to measure; the message says where it was looked for and what builds one."""


def default_server() -> str:
    """$LLMGW_LLAMA_SERVER, else this machine's llama-server in the portable build's cache, where
    `./pants test` (and tools/llama/build-llama-server) leave it. Asked of llamabuild itself, as
    build-llama-server --cached asks it, not of a script beside this file: `./pants run` runs a
    copy of the bench in a sandbox of its own, with no checkout around it."""
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    if given:
        return given
    root = llamabuild.cache_root()
    try:
        server = llamabuild.cached_server(llamabuild.pinned_source(), root)
    except (llamabuild.LlamaBuildError, RecipeError) as exc:
        raise NoServer(f"cannot tell which llama-server is this machine's: {exc}") from None
    if server is None:
        raise NoServer(
            f"no llama-server built in {root}: `./pants test` builds it (or tools/llama/build-llama-server); "
            "or pass --server"
        )
    return str(server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, key: str, body: dict) -> tuple[float, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        started = time.perf_counter()
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        data = json.loads(resp.read())
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    if resp.status != 200:
        raise SystemExit(f"llama-server answered {resp.status}: {data}")
    return elapsed, data


def wait_ready(proc: subprocess.Popen, port: int) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode} before it was ready")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - started
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.01)
    raise SystemExit(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s")


def phase(port: int, key: str, body: dict, requests: int, concurrency: int) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda _: post(port, key, body), range(requests)))
    wall = time.perf_counter() - started
    tokens = sum(r[1]["usage"]["completion_tokens"] for r in results)
    latencies = sorted(r[0] for r in results)
    engine_rates = [r[1]["timings"]["predicted_per_second"] for r in results if "timings" in r[1]]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
        "latency_p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))], 1),
        # llama-server's own figure: decoding speed of one request, excluding HTTP and queueing.
        "engine_decode_tokens_per_s_median": round(statistics.median(engine_rates), 1) if engine_rates else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--server", help="llama-server binary (default: $LLMGW_LLAMA_SERVER, else the cached build)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the tests' tiny model, made now)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--parallel", type=int, default=4, help="llama-server slots (-np)")
    parser.add_argument("--ctx-size", type=int, default=4096)
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS or args.concurrency < 1:
        parser.error(f"--requests must be 1..{MAX_REQUESTS} and --concurrency at least 1")
    if args.server is None:
        try:
            args.server = default_server()  # asked only when not given: it asks the compilers their versions
        except NoServer as exc:
            parser.error(str(exc))
    if not os.access(args.server, os.X_OK):
        parser.error(f"no llama-server at {args.server!r}; pass --server")

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        model = args.model
        if model is None:
            from testlib.tinygguf import write_tiny_llama

            model = write_tiny_llama(Path(tmp) / "tiny.gguf", seed=0)
        key = secrets.token_urlsafe(24)
        port = free_port()
        launch = ReplicaLaunch(
            engine="llamacpp",
            model_path=str(model),
            served_name="bench",
            host="127.0.0.1",
            port=port,
            api_key=Secret(key),
            context=args.ctx_size,
            # -lv 2: warnings only; at the default every request logs several lines.
            extra_args=("--threads", str(args.threads), "--parallel", str(args.parallel), "-lv", "2"),
            private_dir=tmp,  # the key file goes there (mkdtemp makes it 0700)
        )
        cmd = build_command(launch, args.server)
        for f in cmd.files:
            fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(f.content.reveal())
        with open(Path(tmp) / "llama-server.log", "wb") as log:
            proc = subprocess.Popen(
                cmd.argv,
                env=cmd.environment(os.environ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            ready_s = wait_ready(proc, port)
            body = {"model": "bench", "prompt": "hello model", "max_tokens": args.max_tokens}
            body |= {"temperature": 0, "ignore_eos": True}
            post(port, key, body)  # warm-up
            single = phase(port, key, body, min(args.requests, 64), 1)
            concurrent = phase(port, key, body, args.requests, args.concurrency)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    version = subprocess.run([args.server, "--version"], capture_output=True, text=True, timeout=30, check=False)
    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "version": (version.stdout + version.stderr).strip().splitlines()[0],
                "model": "tinygguf seed 0 (2 layers, 64 wide, F32)" if args.model is None else str(args.model),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "command": cmd.for_log()["argv"],
                "max_tokens": args.max_tokens,
                "start_to_health_s": round(ready_s, 3),
                "single_stream": single,
                "concurrent": concurrent,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
