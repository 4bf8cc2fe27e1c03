"""The bodies benchmark (tools/bench/bodies.py) still runs and prints its JSON, in a short form:
the corpus at two small sizes, one parsed on the loop and one in the JSON worker. Its figures
come from the full run (docs/reliability.md); this only keeps the benchmark from rotting."""

from __future__ import annotations

import json

import pytest
from bench import bodies


def test_the_bodies_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bodies.main(["--sizes", "4096,70000"])
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"bodies", "max_step_ms", "tiny_requests", "tiny_request_p100_ms", "targets_met"}
    assert len(result["bodies"]) == 2 * 12
    for body in result["bodies"]:
        assert set(body) == {"name", "bytes", "status", "seconds", "max_step_ms"}
        assert body["status"] in (200, 400), body  # answered, never a 500
    assert result["tiny_requests"] > 0 and "max_step_ms_le_20" in result["targets_met"]
