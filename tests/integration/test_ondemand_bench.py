"""The models-on-demand benchmark (tools/bench/ondemand.py) still runs and prints its JSON, every
key of it, in its smoke form: the llama-server `./pants test` builds (testlib.llama), one small
made model started cold twice (from zero replicas, back to zero when idle, and from zero again:
scale to zero and back on a real llama-server), and a short step too small to add a replica. Its figures come from
full runs (docs/performance.md); this keeps the benchmark from rotting."""

from __future__ import annotations

import json

import pytest
from bench import ondemand

from testlib.benchjson import NUMBER, MapOf, Maybe, assert_shape
from testlib.llama import llama_server

COLD = {
    "model_bytes": int,
    "model_load_s": NUMBER,
    "cold_first_token_s": NUMBER,
    "cold_overhead_s": NUMBER,
    "split": {
        "decision_s": NUMBER,
        "dispatch_s": NUMBER,
        "engine_start_and_load_s": NUMBER,
        "after_ready_s": NUMBER,
    },
    "runs": [NUMBER],
}
SHAPE = {
    "settings": {
        "machine": str,
        "models": MapOf(int),
        "llama_args": [str],
        "runs": int,
        "step_clients": int,
        "step_s": NUMBER,
        "smoke": bool,
    },
    "cold": MapOf(COLD),
    "step": {
        "requests": int,
        "failed_requests": int,
        "scale_up_decision_s": Maybe(NUMBER),
        "up_decisions": int,
        "down_decisions": int,
        "queue_wait_p50_ms": Maybe(NUMBER),
        "queue_wait_p99_ms": Maybe(NUMBER),
        "first_token_p50_ms": Maybe(NUMBER),
        "first_token_p99_ms": Maybe(NUMBER),
        "replica_seconds": NUMBER,
        "fixed_max_replica_seconds": NUMBER,
        "trace_s": NUMBER,
        "max_replicas_seen": int,
    },
    "targets": {
        "cold_overhead_at_most_2_s": bool,
        "scale_up_decision_at_most_10_s": bool,
        "no_failed_requests": bool,
    },
}


def test_the_ondemand_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = ondemand.main(
        [
            "--json",
            "--smoke",
            "--server",
            llama_server(),
            "--runs",
            "2",
            "--step-clients",
            "2",
            "--step-s",
            "2",
            "--base-s",
            "1",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(result, SHAPE)
    [cold] = result["cold"].values()
    assert len(cold["runs"]) == 2  # at zero, started, back to zero (idle), started again
    assert 0 < cold["split"]["decision_s"] < cold["cold_first_token_s"]
    assert cold["model_load_s"] > 0
    assert result["step"]["requests"] > 0 and result["step"]["failed_requests"] == 0
