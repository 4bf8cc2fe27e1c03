"""The control-plane benchmark (tools/bench/controlplane.py) still runs and prints its JSON, every
key of it, at tiny sizes; and what it measures is what it says: every replica of the catalog
placed (it fits), a plan of the placed cluster changing nothing, a reconcile pass placing all
and the next one nothing. Its figures come from full runs (docs/performance.md)."""

from __future__ import annotations

import json

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
            "targets": {"placement_ms_10k": NUMBER, "list_nodes_ms": NUMBER},
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
