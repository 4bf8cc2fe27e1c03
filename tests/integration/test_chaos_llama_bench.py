"""The chaos benchmark on real llama-server replicas (`tools/bench/chaos.py --engine llamacpp`,
tools/bench/chaos_llama.py) still runs, prints its JSON (every key of it) and meets its targets,
in a short form: two streams on loopback nodes, one engine killed. The published figures come
from the full run (docs/reliability.md); this keeps the mode from rotting. A file of its own
beside test_chaos_bench.py (the sim's runs): about 30 s more, and llama-server built first."""

from __future__ import annotations

import json

import pytest
from bench import chaos

from testlib.benchjson import NONE, NUMBER, assert_shape
from testlib.llama import llama_server

LOAD = {
    "requests": int,
    "failed_requests": int,
    "requests_slowest_s": (int, float, NONE),
    "streams": int,
    "failed_streams": int,
    "streams_slowest_s": (int, float, NONE),
    "migrated_streams": int,
    "streams_wrong_text": int,
    "migration_stall_p99_s": (int, float, NONE),
    "migration_stall_max_s": (int, float, NONE),
    "unmoved_stall_p99_s": (int, float, NONE),
    "unmoved_stall_max_s": (int, float, NONE),
    "load_cpu_share": (int, float, NONE),
    "load_lag_max_s": (int, float, NONE),
}
KILL = {
    "killed_at_unix": NUMBER,
    "migration_seam_p99_s": (int, float, NONE),
    "migration_seam_max_s": (int, float, NONE),
    "migration_seam_last_token_to_kill_p99_s": (int, float, NONE),
    "migration_seam_kill_to_next_token_p99_s": (int, float, NONE),
    "migration_off_seam_p99_s": (int, float, NONE),
    "unmoved_gap_at_kill_p99_s": (int, float, NONE),
}
SHAPE = {
    "settings": {
        "engine": str,
        "llama_server": str,
        "model": {"n_layer": int, "n_embd": int, "n_head": int, "dtype": str, "n_vocab": int, "cycle": bool},
        "slots_per_replica": int,
        "threads_per_replica": int,
        "nodes": int,
        "network_namespaces": bool,
        "replicas": int,
        "rate_per_s": NUMBER,
        "streams": int,
        "stream_tokens": int,
        "uninterrupted_answers": int,
        "distinct_uninterrupted_answers": int,
        "uninterrupted_answer_s": NUMBER,
        "http_max_connections": int,
        "heartbeat_interval_s": NUMBER,
        "heartbeat_ttl_s": NUMBER,
        "machine": str,
        "load_average_at_start": [NUMBER],
    },
    "faults": {
        "engine_kill": {
            **LOAD,
            **KILL,
            "recovery_s": (int, float, NONE),
            "engine_restarts": int,
            "load_average": [NUMBER],
            "node": str,
            "replica": str,
        }
    },
    "unexpected_process_exits": [str],
    "targets_met": {
        "engine_kill_no_failed_requests": bool,
        "engine_kill_no_failed_streams": bool,
        "engine_kill_no_wrong_text": bool,
        "engine_kill_migration_stall_p99_within_1_5s": bool,
        "no_process_exits": bool,
    },
}


def test_the_llama_chaos_benchmark_runs_and_meets_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(
        ["--engine", "llamacpp", "--llama-server", llama_server(), "--faults", "engine_kill", "--no-netns"]
        # No other requests: the replica with the most outstanding (the one killed) is the one with streams.
        + ["--streams", "2", "--rate", "0", "--heartbeat-interval-s", "1", "--heartbeat-ttl-s", "20"]
    )
    result = json.loads(capsys.readouterr().out)
    assert "error" not in result["faults"]["engine_kill"], result
    assert_shape(result, SHAPE)
    kill = result["faults"]["engine_kill"]
    assert kill["streams"] > 0 and kill["failed_streams"] == 0 and kill["streams_wrong_text"] == 0, kill
    assert kill["migrated_streams"] >= 1, kill  # the killed replica held one or both of the streams
    assert result["settings"]["distinct_uninterrupted_answers"] == 1  # the made model's cycle, whatever the prompt
    assert result["unexpected_process_exits"] == []
    assert code == 0 and all(result["targets_met"].values()), result["targets_met"]
