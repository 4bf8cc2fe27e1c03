"""The sizing benchmark (tools/bench/estimate.py) still runs and prints its JSON, every key of it,
in its smoke form: the llama-server `./pants test` builds (testlib.llama) on one tiny model at
two settings. Its figures come from full runs (docs/engines.md); this keeps the benchmark from
rotting, and the estimate from drifting away from what llama-server allocates."""

from __future__ import annotations

import json

import pytest
from bench import estimate

from testlib.benchjson import NUMBER, MapOf, assert_shape
from testlib.llama import llama_server

PARTS = {"weights": int, "kv_cache": int, "compute": int, "output": int, "overhead": int, "total": int}
ENGINE = {"model": int, "kv_cache": int, "compute": int, "output": int, "buffers": int}
CASE = {
    "model": str,
    "shape": MapOf((int, str)),
    "file_bytes": int,
    "args": [str],
    "context": int,
    "parallel": int,
    "estimate": PARTS,
    "engine": ENGINE,
    "rss_bytes": int,
    "rss_beyond_buffers": int,
    "error_pct": NUMBER,
    "total_vs_rss_pct": NUMBER,
}
SHAPE = {
    "engine": str,
    "version": str,
    "machine": str,
    "cases": [CASE],
    "max_error_pct": NUMBER,
    "max_rss_beyond_buffers": int,
}


def test_the_estimate_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = estimate.main(["--json", "--smoke", "--server", llama_server()])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(result, SHAPE)
    assert len(result["cases"]) == 2
    default, split = result["cases"]
    assert (default["context"], default["parallel"]) == (4096, 4)  # the model's context; -np auto
    assert (split["context"], split["parallel"]) == (1024, 2)
    assert result["max_error_pct"] < 10, result
    # The fixed overhead covers what the process holds beyond its buffers.
    assert result["max_rss_beyond_buffers"] < default["estimate"]["overhead"], result
