"""The chaos benchmark (tools/bench/chaos.py) still runs, prints its JSON (every key of it) and
meets its targets, in a short form: four faults on loopback nodes with fast heartbeats, then the
high-availability run's two. The published figures come from the full run
(docs/reliability.md); this only keeps the benchmark from rotting. Its parts (chaos_cluster.py,
chaos_load.py, chaos_ha.py) are modules of chaos.py, run by these two runs; the load's reading of
a stream (`chaos_load.StreamReader`) is also checked alone, on bytes."""

from __future__ import annotations

import json

import pytest
from bench import chaos
from bench.chaos_load import Load, Outcome, StreamReader, differs, expected_text, off_seam, percentile, seam, seams

from testlib.benchjson import NONE, NUMBER, MapOf, Maybe, assert_shape

# What the load saw during a fault (chaos_load.Load.between): a reason list only with failures.
LOAD = {
    "requests": int,
    "failed_requests": int,
    "requests_failures": Maybe([str]),
    "requests_slowest_s": (int, float, NONE),
    "streams": int,
    "failed_streams": int,
    "streams_failures": Maybe([str]),
    "streams_slowest_s": (int, float, NONE),
    "migrated_streams": int,
    "streams_wrong_text": int,
    "wrong_text_examples": Maybe([str]),
    "migration_stall_p99_s": (int, float, NONE),
    "migration_stall_max_s": (int, float, NONE),
    "unmoved_stall_p99_s": (int, float, NONE),
    "unmoved_stall_max_s": (int, float, NONE),
    "load_cpu_share": (int, float, NONE),
    "load_lag_max_s": (int, float, NONE),
}
FAULT = {**LOAD, "recovery_s": (int, float, NONE), "engine_restarts": int, "load_average": [NUMBER]}
# A kill's: when it was dealt, and each stream's gap across that moment.
KILL = {
    "killed_at_unix": NUMBER,
    "migration_seam_p99_s": (int, float, NONE),
    "migration_seam_max_s": (int, float, NONE),
    "migration_seam_last_token_to_kill_p99_s": (int, float, NONE),
    "migration_seam_kill_to_next_token_p99_s": (int, float, NONE),
    "migration_off_seam_p99_s": (int, float, NONE),
    "unmoved_gap_at_kill_p99_s": (int, float, NONE),
}
SETTINGS = {
    "nodes": int,
    "network_namespaces": bool,
    "replicas": int,
    "rate_per_s": NUMBER,
    "streams": int,
    "stream_tokens": int,
    "output_token_ms": int,
    "http_max_connections": int,
    "heartbeat_interval_s": NUMBER,
    "heartbeat_ttl_s": NUMBER,
    "machine": str,
}
SHAPE = {
    "settings": SETTINGS,
    "faults": {
        "engine_kill": {**FAULT, **KILL, "node": str, "replica": str},
        "agent_kill": {**FAULT, "node": str, "replicas_moved": bool},
        "rolling_update": {
            **FAULT,
            "args": [str],
            "replaced": int,
            "rollout_s": (int, float, NONE),
            "versions_before": [str],
            "versions_after": [str],
        },
        "restart": {**FAULT, "old_server_exit": (int, NONE)},
    },
    "unexpected_process_exits": [str],
    "targets_met": {
        **{
            f"{f}_{what}": bool
            for f in ("engine_kill", "agent_kill", "rolling_update", "restart")
            for what in ("no_failed_requests", "no_failed_streams", "no_wrong_text")
        },
        "rolling_update_every_replica_replaced": bool,
        "engine_kill_migration_stall_p99_within_1_5s": bool,
        "agent_kill_adopted_engines": bool,
        "agent_kill_nothing_moved": bool,
        "no_process_exits": bool,
    },
}
HA_FAULTS = ("leader_kill", "store_away")
HA_SHAPE = {
    "settings": {
        **{k: v for k, v in SETTINGS.items() if k not in ("network_namespaces", "http_max_connections")},
        "store": str,
        "control_planes": int,
        "gateways": str,
        "lease_ttl_s": NUMBER,
        "lease_renew_s": NUMBER,
        "store_away_s": NUMBER,
    },
    "faults": {
        "leader_kill": {
            **LOAD,
            "takeover_s": NUMBER,
            "recovery_s": (int, float, NONE),
            "new_leader": str,
            "acked_writes": int,
            "acked_writes_missing": int,
            "old_leader_standby_s": NUMBER,
            "old_leader_follows": bool,
            "old_leader_answer": Maybe(list),
            "engine_restarts": int,
        },
        "store_away": {
            **LOAD,
            "away_s": NUMBER,
            "control_planes_up": bool,
            "admin_write_while_away": MapOf([(int, str, NONE)]),  # [status, retry-after, error code]
            "leads_again_s": (int, float, NONE),
            "admin_write_after": (int, NONE),
            "recovery_s": (int, float, NONE),
            "engine_restarts": int,
        },
    },
    "unexpected_process_exits": [str],
    "targets_met": {
        **{
            f"{f}_{what}": bool for f in HA_FAULTS for what in ("no_failed_requests", "no_engine_restarts", "recovered")
        },
        "leader_kill_takeover_within_10s": bool,
        "leader_kill_acked_writes_kept": bool,
        "leader_kill_old_leader_follows": bool,
        "store_away_control_planes_up": bool,
        "store_away_admin_503_with_retry_after": bool,
        "store_away_admin_write_after": bool,
        "no_process_exits": bool,
    },
}


def test_a_stream_as_its_client_reads_it() -> None:
    """Events torn anywhere, the opening role-only delta, a migration's comment line, the gap
    between two tokens as they arrived, [DONE]; an error event; the expected text's check."""
    reader = StreamReader()
    reader.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\ndata: {"choices":[{"del', 1.0)
    reader.feed(b'ta":{"content":"one"}}]}\n', 1.1)
    reader.feed(b'\ndata: {"choices":[{"delta":{"content":" two"}}]}\n\n', 1.2)
    reader.feed(b'data: {"choices":[{"delta":{"content":" three"}}]}\n\n: llmgw migrated 1\n\ndata: [DONE]\n\n', 2.0)
    assert (reader.text, reader.moved, reader.done, reader.error) == ("one two three", 1, True, "")
    assert reader.gap_s == pytest.approx(0.8)  # " two" came at 1.2 (with its first half at 1.0), " three" at 2.0
    completion = StreamReader()
    completion.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"cut"}}\n\n', 5.0)
    assert (completion.text, completion.gap_s, completion.done, completion.error) == (
        "a",
        None,
        False,
        "error event: cut",
    )

    load = Load("127.0.0.1", 1, "key", model="chat", rate=1, streams=2, stream_tokens=12)
    chat_path, chat = load.stream_body(0, 7)
    text_path, text = load.stream_body(1, 7)
    assert (chat_path, text_path) == ("/v1/chat/completions", "/v1/completions")
    want = expected_text("chat", chat_path, chat)
    assert len(want.split()) == 12 and want != expected_text("chat", text_path, text)
    assert differs(want, want) == ""
    assert "first different at word 3" in differs(" ".join(want.split()[:3]), want)
    assert percentile([0.1] * 98 + [1.0, 2.0], 99) == 1.0


def test_the_gap_a_kill_cost_each_stream() -> None:
    """A kill at 10.0: a moved stream's gap across it (its last token before, the next after) is
    the stall the move cost, apart from its other gaps; a stream with no token on one side of
    the kill has no such gap; the survivor's own streams' gaps across it are kept apart."""
    times = (9.0, 9.5, 9.9, 11.2, 11.3, 12.0)
    assert seam(times, 10.0) == pytest.approx((0.1, 1.2))
    assert off_seam(times, 10.0) == pytest.approx(0.7)  # 11.3 to 12.0; 9.9 to 11.2 is the seam
    assert seam((10.5, 10.6), 10.0) is None and seam((9.0, 9.1), 10.0) is None
    assert off_seam((9.9, 10.1), 10.0) is None
    # A token the killed engine wrote just before it died comes a moment after the kill: the
    # stall is from it to the survivor's first.
    late = (9.8, 10.001, 11.4, 11.5)
    assert seam(late, 10.0) == pytest.approx((0.0, 1.399)) and off_seam(late, 10.0) == pytest.approx(0.201)

    def stream(times: tuple[float, ...], moved: int) -> Outcome:
        return Outcome(kind="stream", started=8.0, ended=13.0, ok=True, moved=moved, times=times)

    out = seams([stream(times, 1), stream((9.95, 10.4, 10.5), 1)], [stream((9.8, 10.1), 0)], 10.0)
    assert out == {
        "migration_seam_p99_s": pytest.approx(1.3),
        "migration_seam_max_s": pytest.approx(1.3),
        "migration_seam_last_token_to_kill_p99_s": pytest.approx(0.1),
        "migration_seam_kill_to_next_token_p99_s": pytest.approx(1.2),
        "migration_off_seam_p99_s": pytest.approx(0.7),
        "unmoved_gap_at_kill_p99_s": pytest.approx(0.3),
    }


def test_the_chaos_benchmark_runs_and_meets_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(
        ["--faults", "engine_kill,agent_kill,rolling_update,restart", "--no-netns", "--rate", "10"]
        + ["--streams", "4", "--stream-tokens", "100"]  # 1 s each: the killed engine is in the middle of some
        + ["--heartbeat-interval-s", "1", "--heartbeat-ttl-s", "20"]  # well above an agent restart under load
    )
    result = json.loads(capsys.readouterr().out)
    for name, fault in result["faults"].items():
        assert "error" not in fault, (name, fault, result)  # e.g. never back at full capacity before it
    assert_shape(result, SHAPE)
    for name, fault in result["faults"].items():
        assert fault["requests"] > 0 and fault["failed_requests"] == 0, (name, fault)
        assert fault["failed_streams"] == 0 and fault["streams_wrong_text"] == 0, (name, fault)
    kill = result["faults"]["engine_kill"]
    assert kill["migrated_streams"] >= 1 and kill["migration_stall_max_s"] is not None, kill  # continued elsewhere
    assert result["faults"]["agent_kill"]["engine_restarts"] == 0  # adopted, not started again
    update = result["faults"]["rolling_update"]
    assert update["replaced"] == 2 and update["engine_restarts"] == 2, update  # one new engine per replica
    assert len(update["versions_after"]) == 1 and update["versions_after"] != update["versions_before"], update
    assert update["rollout_s"] is not None and update["rollout_s"] > 0, update  # its rollout_done logged
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
    for name, fault in result["faults"].items():
        assert "error" not in fault, (name, fault, result)
    assert_shape(result, HA_SHAPE)
    for name, fault in result["faults"].items():
        assert fault["requests"] > 0 and fault["failed_requests"] == 0, (name, fault)
    kill = result["faults"]["leader_kill"]
    assert kill["takeover_s"] < 10 and kill["acked_writes"] > 0 and kill["acked_writes_missing"] == 0, kill
    assert result["faults"]["store_away"]["control_planes_up"] is True
    assert result["unexpected_process_exits"] == []
    assert code == 0 and all(result["targets_met"].values()), result["targets_met"]
