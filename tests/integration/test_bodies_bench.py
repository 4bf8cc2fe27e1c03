"""The bodies benchmark (tools/bench/bodies.py) still runs and prints its JSON, every key of it,
in a short form: the corpus at two small sizes, one parsed on the loop and one in the JSON
worker. Its figures come from the full run (docs/reliability.md); this only keeps the benchmark
from rotting."""

from __future__ import annotations

import json

import pytest
from bench import bodies

from testlib.benchjson import NUMBER, assert_shape

SHAPE = {
    "bodies": [{"name": str, "bytes": int, "status": int, "seconds": NUMBER, "max_step_ms": NUMBER}],
    "max_step_ms": NUMBER,
    "tiny_requests": int,
    "tiny_request_p100_ms": NUMBER,
    "targets_met": {"max_step_ms_le_20": bool},
}


def test_the_bodies_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bodies.main(["--sizes", "4096,70000"])
    result = json.loads(capsys.readouterr().out)
    assert_shape(result, SHAPE)
    assert len(result["bodies"]) == 2 * 12
    for body in result["bodies"]:
        assert body["status"] in (200, 400), body  # answered, never a 500
    assert result["tiny_requests"] > 0
