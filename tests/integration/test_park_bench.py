"""The parked-replicas benchmark (tools/bench/park.py) still runs and prints its JSON, every key
of it, in its smoke form: one wake of a parked replica and one cold start of a stopped one, on the
stand-in vLLM. Its figures come from full runs (docs/performance.md); this keeps it from rotting."""

from __future__ import annotations

import json

import pytest
from bench import park

from testlib.benchjson import NUMBER, assert_shape

SHAPE = {
    "settings": {
        "machine": str,
        "engine": str,
        "engine_load_s": NUMBER,
        "engine_wake_s": NUMBER,
        "idle_s": NUMBER,
        "runs": int,
        "smoke": bool,
    },
    "parked": {
        "wake_first_token_s": NUMBER,
        "wake_overhead_s": NUMBER,
        "split": {"decision_s": NUMBER, "dispatch_s": NUMBER, "engine_wake_s": NUMBER, "after_woken_s": NUMBER},
        "runs": [NUMBER],
        "park_s": [NUMBER],
    },
    "stopped": {
        "cold_first_token_s": NUMBER,
        "cold_overhead_s": NUMBER,
        "split": {
            "decision_s": NUMBER,
            "dispatch_s": NUMBER,
            "engine_start_and_load_s": NUMBER,
            "after_ready_s": NUMBER,
        },
        "runs": [NUMBER],
    },
    "targets": {"wake_overhead_at_most_1_s": bool},
}


def test_the_park_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert park.main(["--json", "--smoke"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert_shape(result, SHAPE)
    parked, stopped = result["parked"], result["stopped"]
    assert len(parked["runs"]) == 1 and len(stopped["runs"]) == 1 and parked["park_s"]
    # The wake is the engine's (the stand-in's 0.2 s) and little else; a cold start waits for a start.
    assert parked["split"]["engine_wake_s"] >= result["settings"]["engine_wake_s"]
    assert 0 <= parked["wake_overhead_s"] < parked["wake_first_token_s"]
    assert stopped["split"]["engine_start_and_load_s"] >= result["settings"]["engine_load_s"]
