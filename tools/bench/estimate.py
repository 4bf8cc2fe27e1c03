"""llmgw.sizing's estimate against what a real llama-server allocates, on models made here.

    ./pants run tools/bench/estimate.py -- --json [--server PATH] [--smoke]

Makes llama-architecture GGUF models of several shapes (layers, width, heads and KV heads,
vocabulary, F32/F16/Q8_0; tests/testlib/makegguf.py), starts llama-server on each as llmgw's
llama.cpp spec launches it (at several --ctx-size values and without one, llama-server's
default), and reads what it reports at start (-lv 4): its model, KV, compute and output buffer
sizes. Then it stops it. The engine's figure is the sum of those buffers: what llama.cpp
allocates, and what a GPU must hold in full. The process's RSS is printed beside it but is not
the figure: on a CPU it counts only pages touched (the weights are mmap'd and populated, the
KV cache is cleared, the compute buffer only partly written by the warm-up), and the RSS above
the touched buffers is what the estimate's fixed overhead stands for (`rss_beyond_buffers`).

Prints one JSON object: each case (shape, file size, context, estimate parts, engine figures,
error_pct of the estimate's buffers against the engine's) and max_error_pct. Target: under 10.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.llamacpp import NoServer, default_server, free_port
from bench.procs import stop

from llmgw.sizing.estimate import LlamaSettings, estimate_gguf
from llmgw.sizing.gguf import parse_header

READY_TIMEOUT_S = 120.0
MiB = 1024 * 1024
# name, make_gguf arguments, extra llama-server arguments per run (the catalog's).
MODELS = [
    ("tiny-f32", dict(n_layer=2, n_embd=64, n_head=4, n_vocab=600, dtype="F32")),
    ("gqa-f16", dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, n_vocab=4000, dtype="F16")),
    ("wide-vocab-q8", dict(n_layer=2, n_embd=512, n_head=8, n_vocab=32000, dtype="Q8_0")),
    ("deep-gqa-q8", dict(n_layer=12, n_embd=512, n_head=8, n_head_kv=2, n_ff=1408, n_vocab=16000, dtype="Q8_0")),
    ("wide-f16", dict(n_layer=4, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=8000, dtype="F16")),
    ("mha-f32", dict(n_layer=6, n_embd=384, n_head=6, n_vocab=12000, dtype="F32", context=8192)),
]
RUNS = [[], ["--ctx-size", "512"], ["--ctx-size", "2048"], ["--ctx-size", "16384"], ["--ctx-size", "8192", "-np", "2"]]
EXTRA_RUNS = {"gqa-f16": [["--ctx-size", "4096", "-fa", "off"]]}
SMOKE_MODELS = MODELS[:1]
SMOKE_RUNS = [[], ["--ctx-size", "1024", "-np", "2"]]
LOG_FIGURES = {
    "model": r"CPU(?:_Mapped|_REPACK)? model buffer size =\s*([\d.]+) MiB",
    "kv_cache": r"KV buffer size =\s*([\d.]+) MiB",
    "compute": r"compute buffer size =\s*([\d.]+) MiB",
    "output": r"output buffer size =\s*([\d.]+) MiB",
}


def wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode} before it was ready")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise SystemExit(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s")


def rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident memory so far (its warm-up included)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no VmHWM in /proc/{pid}/status")


def engine_figures(log: str) -> dict[str, int]:
    """The buffers llama-server reports at start, in bytes (each summed over its devices); the
    log gives MiB to two decimals, so each is known to 5 KiB."""
    figures = {}
    for part, pattern in LOG_FIGURES.items():
        found = re.findall(pattern, log)
        if not found:
            raise SystemExit(f"llama-server's log has no line matching {pattern!r}; has its log changed?")
        figures[part] = round(sum(float(v) for v in found) * MiB)
    return figures


def run_case(server: str, model: Path, extra: list[str], tmp: Path) -> dict:
    """Start llama-server on `model` as llmgw's spec does, read its figures, stop it."""
    port = free_port()
    argv = [server, "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--slot-prompt-similarity", "0", "--threads", "2", "-lv", "4", *extra]
    log_path = tmp / "llama-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port)
        rss = rss_bytes(proc.pid)
    finally:
        stop(proc)
    figures = engine_figures(log_path.read_text(errors="replace"))
    return {"figures": figures, "rss": rss}


def measure(server: str, models: list, runs: list[list[str]], tmp: Path) -> list[dict]:
    from testlib.makegguf import make_gguf

    cases = []
    for name, shape in models:
        path = make_gguf(tmp / f"{name}.gguf", **shape)
        with open(path, "rb") as f:
            header = parse_header(f.read(8 * MiB))
        for extra in runs + EXTRA_RUNS.get(name, []) * (runs is RUNS):
            settings = LlamaSettings.from_args(extra)
            est = estimate_gguf(header, settings)
            got = run_case(server, path, extra, tmp)
            engine = sum(got["figures"].values())
            cases.append(
                {
                    "model": name,
                    "shape": {k: v for k, v in shape.items()},
                    "file_bytes": path.stat().st_size,
                    "args": extra,
                    "context": est.context,
                    "parallel": est.parallel,
                    "estimate": {
                        "weights": est.weights,
                        "kv_cache": est.kv_cache,
                        "compute": est.compute,
                        "output": est.output,
                        "overhead": est.overhead,
                        "total": est.total,
                    },
                    "engine": got["figures"] | {"buffers": engine},
                    "rss_bytes": got["rss"],
                    "rss_beyond_buffers": got["rss"] - engine,
                    "error_pct": round(100 * (est.buffers - engine) / engine, 2),
                    "total_vs_rss_pct": round(100 * (est.total - got["rss"]) / got["rss"], 2),
                }
            )
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the only output there is)")
    parser.add_argument("--server", help="llama-server binary (default: $LLMGW_LLAMA_SERVER, else the cached build)")
    parser.add_argument("--smoke", action="store_true", help="one tiny model at two settings (the test suite's run)")
    args = parser.parse_args(argv)
    if args.server is None:
        try:
            args.server = default_server()
        except NoServer as exc:
            parser.error(str(exc))
    if not os.access(args.server, os.X_OK):
        parser.error(f"no llama-server at {args.server!r}; pass --server")
    with tempfile.TemporaryDirectory(prefix="llmgw-estimate-") as tmp:
        models, runs = (SMOKE_MODELS, SMOKE_RUNS) if args.smoke else (MODELS, RUNS)
        cases = measure(args.server, models, runs, Path(tmp))
    version = subprocess.run([args.server, "--version"], capture_output=True, text=True, timeout=30, check=False)
    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "version": (version.stdout + version.stderr).strip().splitlines()[0],
                "machine": platform.machine(),
                "cases": cases,
                "max_error_pct": max(abs(c["error_pct"]) for c in cases),
                "max_rss_beyond_buffers": max(c["rss_beyond_buffers"] for c in cases),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
