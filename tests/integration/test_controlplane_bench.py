"""The control-plane benchmark (tools/bench/controlplane.py) still runs and prints its JSON, every
key of it, at tiny sizes; and what it measures is what it says: every replica of the catalog
placed (it fits), a plan of the placed cluster changing nothing, a reconcile pass placing all
and the next one nothing. Its figures come from full runs (docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench import controlplane

from testlib.benchjson import NUMBER, assert_shape


def test_the_control_plane_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = controlplane.main(
        ["--nodes", "40", "--replicas", "300", "--reconcile-nodes", "20", "--reconcile-replicas", "60", "--rounds", "2"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(
        result,
        {
            "python": str,
            "machine": str,
            "cpus": int,
            "nodes": int,
            "replicas": int,
            "rounds": int,
            "placement_ms_300": NUMBER,
            "placement_started": int,
            "placement_pending": int,
            "replan_ms": NUMBER,
            "reconcile_nodes": int,
            "reconcile_replicas": int,
            "reconcile_placed": int,
            "reconcile_nodes_changed": int,
            "reconcile_first_ms": NUMBER,
            "reconcile_ms": NUMBER,
            "list_nodes_ms": NUMBER,
            "list_nodes_bytes": int,
            "targets": {
                "placement_ms_10k": NUMBER,
                "list_nodes_ms": NUMBER,
                **{
                    f"agents_{n}": {
                        "join_s": NUMBER,
                        "cpu_pct_steady": NUMBER,
                        "rss_mib": NUMBER,
                        "reconnect_storm_s": NUMBER,
                    }
                    for n in (1000, 5000)
                },
            },
            "ok": {},  # the targets are for the full sizes only
        },
    )
    assert result["placement_started"] == 300 and result["placement_pending"] == 0
    assert result["reconcile_placed"] == 60 and result["reconcile_nodes_changed"] == 20
    assert result["list_nodes_bytes"] > 20 * 500  # every node's view, with its inventory


def test_the_catalog_is_the_mix_it_says_and_fits_the_nodes() -> None:
    models = controlplane.catalog(10_000)
    assert sum(m.replicas for m in models) == 10_000
    gpus = sum(m.replicas * m.gpus_per_replica * m.nodes_per_replica for m in models)
    assert gpus <= 1000 * controlplane.GPUS  # 1,000 nodes hold it: nothing pending by lack of room
    assert sum(m.replicas for m in models if m.nodes_per_replica == 2) == 1000
    assert sum(m.replicas for m in models if m.gpus_per_replica == 0) == 5000


def test_the_agents_phase_joins_simulated_agents_to_a_real_control_plane_and_cuts_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--nodes", "10", "--replicas", "20", "--reconcile-nodes", "5", "--reconcile-replicas", "10"]
    args += ["--rounds", "1", "--agents", "12", "--agent-processes", "2", "--steady-seconds", "1", "--gateways", "1"]
    assert controlplane.main([*args, "--cache-dir", str(tmp_path / "cache")]) == 0
    result = json.loads(capsys.readouterr().out)
    for key, kind in (("agents", int), ("agent_processes", int), ("join_s", NUMBER), ("steady_seconds", NUMBER)):
        assert isinstance(result[key], kind), (key, result)
    for key in ("cpu_pct_steady", "rss_mib", "reconnect_storm_s"):  # 12 agents for 1 s: may be 0 ticks of CPU
        assert isinstance(result[key], NUMBER) and result[key] >= 0, (key, result)
    assert result["reconnect_storm_s"] > 0
    assert isinstance(result["storm_dials_failed"], int) and result["storm_dials_failed"] >= 0  # each dialled again
    assert result["loop_lag_p99_ms"] is None or result["loop_lag_p99_ms"] > 0  # a histogram's bound
    # 12 agents for 1 s at a 5 s interval: a few heartbeats or none; counted ones have a p99.
    assert isinstance(result["heartbeats_steady"], int) and result["heartbeats_steady"] >= 0
    assert (result["heartbeat_p99_ms"] is None) == (result["heartbeats_steady"] == 0), result
    assert result["heartbeat_p99_ms"] is None or result["heartbeat_p99_ms"] > 0
    assert result["agents"] == 12 and result["agent_processes"] == 2 and result["gateways"] == 1
    # A replica a node, ready: the gateway routed to all 12 before the cut and lost none in the
    # storm (the agents' hellos say what they run; their nodes stayed within their TTL).
    assert result["ready_routed"] == 12 and result["storm_ready_routed_min"] == 12, result
    assert result["rss_mib"] > 20  # the control plane's own process, not this one's
    # The 12 replicas were placed as the agents joined, some together: spread before steady.
    assert isinstance(result["settle_s"], NUMBER) and result["settle_s"] >= 0
    assert isinstance(result["replica_moves"], int) and result["replica_moves"] >= 0
    # The certificates are kept: a second run issues none (its CA is the same).
    certs = sorted(p.name for p in (tmp_path / "cache" / "certs").iterdir())
    assert certs == ["ca.crt", *(f"node-{i:05d}" for i in range(12))]
    keys = [(tmp_path / "cache" / "certs" / f"node-{i:05d}" / "node.key").stat().st_mode & 0o777 for i in range(12)]
    assert set(keys) == {0o600}
