"""Start-up time of a release zipapp: `llmgw version`, cold (first run, which unpacks) and warm.

    ./pants run tools/bench/startup.py -- dist/release/llmgw-X-linux-amd64.pyz [--python PY ...] [--runs N]

Prints one JSON object per Python: the cold time once, then the median, min and max of N warm
runs (each run a fresh process, wall clock from spawn to exit). Every run unpacks into a
temporary SHIV_ROOT, removed afterwards, and gets no PYTHONPATH. The target is a warm start
under 1 s; `warm_ok` says whether the median meets it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_RUNS = 50
RUN_TIMEOUT_S = 60
WARM_TARGET_S = 1.0


def timed_run(python: str, artifact: Path, args: list[str], root: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PEX", "SHIV_"))}
    env["SHIV_ROOT"] = str(root)
    started = time.perf_counter()
    done = subprocess.run(
        [python, str(artifact), *args], capture_output=True, timeout=RUN_TIMEOUT_S, env=env, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{python} {artifact} {' '.join(args)} exited {done.returncode}:\n{done.stderr.decode()}")
    return elapsed


def python_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True)
    return out.stdout.decode().strip()


def bench(python: str, artifact: Path, args: list[str], runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        root = Path(tmp)
        cold = timed_run(python, artifact, args, root)
        warm = [timed_run(python, artifact, args, root) for _ in range(runs)]
    median = statistics.median(warm)
    return {
        "artifact": artifact.name,
        "size_mb": round(artifact.stat().st_size / 1e6, 1),
        "python": python_version(python),
        "machine": platform.machine(),
        "command": "llmgw " + " ".join(args),
        "cold_s": round(cold, 3),
        "warm_median_s": round(median, 3),
        "warm_min_s": round(min(warm), 3),
        "warm_max_s": round(max(warm), 3),
        "warm_runs": runs,
        "warm_ok": median < WARM_TARGET_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--python", action="append", help="interpreter to run it with (repeatable; default: this one)")
    parser.add_argument("--runs", type=int, default=10, help=f"warm runs, 1-{MAX_RUNS} (default: 10)")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= MAX_RUNS:
        parser.error(f"--runs must be between 1 and {MAX_RUNS}")
    for python in args.python or [sys.executable]:
        print(json.dumps(bench(python, args.artifact.resolve(), ["version"], args.runs)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
