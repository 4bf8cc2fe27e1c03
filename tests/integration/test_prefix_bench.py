"""The prefix routing benchmark (tools/bench/prefix.py) still runs and prints its JSON, every key
of it, in a short form: two real llama-servers (the build `./pants test` makes, testlib.llama) of a
one-layer model, two conversations of two turns under each policy. Its figures come from full runs
(docs/performance.md); this keeps the benchmark from rotting, and checks what holds at any size:
every request answered, by prefix the turns of a conversation on one replica."""

from __future__ import annotations

import json

import pytest
from bench import prefix

from testlib.benchjson import NUMBER, MapOf, assert_shape
from testlib.llama import llama_server

POLICY = {
    "ttft_p50_ms": NUMBER,
    "ttft_p99_ms": NUMBER,
    "throughput_rps": NUMBER,
    "load_imbalance": NUMBER,
    "prompt_cached_share": NUMBER,
    "requests": int,
    "requests_per_replica": [int],
    "routes": MapOf(int),
    "wall_s": NUMBER,
}
SHAPE = {
    "machine": str,
    "cpus": int,
    "python": str,
    "settings": MapOf(NUMBER),
    "model_mib": NUMBER,
    "tokens_per_word": NUMBER,
    "least_outstanding": POLICY,
    "prefix": POLICY,
    "ttft_p50_ratio": NUMBER,
    "ttft_p99_ratio": NUMBER,
    "router_chains": int,
    "router_decision_p50_us": NUMBER,
    "router_decision_p99_us": NUMBER,
    "router_prompt_p99_us": NUMBER,
    "targets_met": MapOf(bool),
}


def test_the_prefix_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = prefix.main(
        ["--json", "--server", llama_server(), "--conversations", "2", "--turns", "2", "--systems", "1"]
        + ["--system-tokens", "300", "--first-tokens", "10", "--turn-tokens", "5", "--max-tokens", "2"]
        + ["--concurrency", "2", "--slots", "1", "--context", "1024", "--layers", "1", "--width", "64"]
        + ["--router-chains", "200"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(result, SHAPE)
    for policy in ("least_outstanding", "prefix"):
        assert result[policy]["requests"] == 4 and sum(result[policy]["requests_per_replica"]) == 4
    assert result["least_outstanding"]["routes"] == {"none": 4}  # no x-llmgw-route without prefix routing
    # By prefix each conversation's second turn found its first on the replica that took it.
    assert result["prefix"]["routes"] == {"hash": 2, "hit": 2}, result["prefix"]
    assert result["router_chains"] >= 200 and set(result["targets_met"]) == {
        "router_decision_p99_us",
        "ttft_p50_ratio",
        "ttft_p99_no_worse",
        "load_imbalance",
    }
