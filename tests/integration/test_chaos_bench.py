"""The chaos benchmark (tools/bench/chaos.py) still runs and meets its targets, in a short form:
three faults on loopback nodes with fast heartbeats. The published figures come from the full
run (docs/reliability.md); this only keeps the benchmark from rotting."""

from __future__ import annotations

import json

import pytest
from bench import chaos


def test_the_chaos_benchmark_runs_and_meets_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(
        ["--faults", "engine_kill,agent_kill,restart", "--no-netns", "--rate", "10", "--streams", "2"]
        + ["--heartbeat-interval-s", "1", "--heartbeat-ttl-s", "20"]  # well above an agent restart under load
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result["faults"]) == {"engine_kill", "agent_kill", "restart"}, result
    for name, fault in result["faults"].items():
        assert "error" not in fault, (name, fault, result)  # e.g. never back at full capacity before it
        assert fault["requests"] > 0 and fault["failed_requests"] == 0, (name, fault)
    assert result["faults"]["agent_kill"]["engine_restarts"] == 0  # adopted, not started again
    assert result["unexpected_process_exits"] == []
    assert code == 0 and all(result["targets_met"].values()), result["targets_met"]


def test_the_high_availability_run_meets_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    """`--store postgresql`: two control planes on a PostgreSQL cluster the bench starts, the
    leader killed, then PostgreSQL stopped a few seconds (the published run: 30)."""
    code = chaos.main(
        ["--store", "postgresql", "--rate", "5", "--streams", "1", "--store-away-s", "8"]
        + ["--lease-ttl-s", "3", "--lease-renew-s", "0.5", "--heartbeat-interval-s", "1", "--heartbeat-ttl-s", "20"]
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result["faults"]) == {"leader_kill", "store_away"}, result
    for name, fault in result["faults"].items():
        assert "error" not in fault, (name, fault, result)
        assert fault["requests"] > 0 and fault["failed_requests"] == 0, (name, fault)
    kill = result["faults"]["leader_kill"]
    assert kill["takeover_s"] < 10 and kill["acked_writes"] > 0 and kill["acked_writes_missing"] == 0, kill
    assert result["faults"]["store_away"]["control_planes_up"] is True
    assert result["unexpected_process_exits"] == []
    assert code == 0 and all(result["targets_met"].values()), result["targets_met"]
