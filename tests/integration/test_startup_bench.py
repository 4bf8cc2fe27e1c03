"""The start-up benchmark (tools/bench/startup.py) still runs and prints its JSON, every key of
it, in a short form: a release zipapp built from this checkout as `release:build` builds it
(testlib.nodeadd.build_release), one cold run and one warm. Its figures come from full runs
(docs/install.md); this only keeps the benchmark from rotting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench import startup

from testlib.benchjson import NUMBER, assert_shape
from testlib.nodeadd import VERSION, build_release

SHAPE = {
    "artifact": str,
    "size_mb": NUMBER,
    "python": str,
    "machine": str,
    "command": str,
    "cold_s": NUMBER,
    "warm_median_s": NUMBER,
    "warm_min_s": NUMBER,
    "warm_max_s": NUMBER,
    "warm_runs": int,
    "warm_ok": bool,
}


def test_the_startup_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    release = build_release(tmp_path / "release", VERSION)
    (artifact,) = release.glob(f"llmgw-{VERSION}-linux-*.pyz")
    assert startup.main([str(artifact), "--runs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines  # one JSON object per Python: this one
    result = json.loads(lines[0])
    assert_shape(result, SHAPE)
    assert result["artifact"] == artifact.name and result["command"] == "llmgw version" and result["warm_runs"] == 1
    assert 0 < result["warm_min_s"] <= result["warm_median_s"] <= result["warm_max_s"] and result["cold_s"] > 0
